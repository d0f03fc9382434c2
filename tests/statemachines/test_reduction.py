"""The explorer's partial-order reduction (``harness/por.py``) hides no violation.

On configurations small enough to explore to their end, a survey (a search that goes on
past violations) with the reduction meets the same broken rules and the same terminal
states as one without, for the real machines and the broken variants. The guarded
regressions (test_failure_modes, test_regressions) run with the reduction on, since it
is the default: each broken variant there is still caught at the depth it uses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wavecore.statemachines.harness.explore import ExploreConfig, default_configs, explore
from wavecore.statemachines.harness.toy import ToyRank
from wavecore.statemachines.harness.variants import VARIANTS
from wavecore.statemachines.sim import main

SMALL = dict(default_configs(2))
# The variants a request alone breaks; the pause scenarios are cheap enough for all.
BROKEN_BY_A_REQUEST = (
    "stale_wave_complete",
    "step_counter_drift",
    "no_self_wake",
    "coordinator_latches",
    "equal_wave_no_wake",
)
CASES = [
    *(("request", variant) for variant in (None, *BROKEN_BY_A_REQUEST)),
    *((name, variant) for name in ("pause-resume", "pause-modes") for variant in (None, *VARIANTS)),
]


def _without_forwards(end: object) -> object:
    """A terminal state's key with the forward counters left out: states that differ
    only in them share a key while a wave runs (``reduction``), so which count a
    terminal state ends with depends on which of them a search met first."""
    (world, position) = end  # type: ignore[misc]
    toys = tuple(replace(toy, forwards=0, forwards_wave=0) for toy in world[1])
    assert all(isinstance(toy, ToyRank) for toy in toys)
    return (world[0], toys, *world[2:]), position


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_a_survey_meets_the_same_violations_and_ends_with_and_without_reduction(
    name: str, variant: str | None
) -> None:
    config = SMALL[name] if variant is None else SMALL[name].broken(variant)
    full = explore(replace(config, reduction="none"), 40, survey=True)
    reduced = explore(replace(config, reduction="por"), 40, survey=True)
    # Every search here closes, but drifting step counters grow without bound (unless
    # every path meets a violation first).
    assert full.complete == (variant != "step_counter_drift")
    assert reduced.complete or not full.complete
    assert full.survey is not None and reduced.survey is not None
    assert reduced.survey.rules == full.survey.rules
    # A reordered pause arrival may make a slow pause come sooner (por rule 2c), which
    # ends the paths after it: where a pause is slow, fewer terminal states are met.
    ends = {_without_forwards(end) for end in reduced.survey.ends}
    full_ends = {_without_forwards(end) for end in full.survey.ends}
    assert ends <= full_ends and (ends == full_ends or "slow_pause" in full.survey.rules)
    assert reduced.states <= full.states
    # Only a broken rule the reduction relies on turns it off (por rule 5; see below).
    assert reduced.reduction == "por" or variant == "stale_wave_complete"


def test_the_reduction_is_on_by_default_and_explores_fewer_states() -> None:
    assert ExploreConfig().reduction == "por"
    config = SMALL["request"]
    full = explore(replace(config, reduction="none"), 40)
    reduced = explore(config, 40)
    assert full.complete and reduced.complete and reduced.reduction == "por"
    assert reduced.states < 0.75 * full.states, (reduced.states, full.states)


def test_a_machine_that_breaks_a_premise_is_explored_without_the_reduction() -> None:
    # Accepting a stale completion lets the coordinator leave "running" in the same
    # wave, so a start_wave it had no reason to act on may become fresh again.
    result = explore(SMALL["request"].broken("stale_wave_complete"), 40)
    assert result.reduction == "none"
    assert result.violation is not None and result.violation.rule == "coordinator_wave"


def test_command_line_turns_the_reduction_off(capsys: pytest.CaptureFixture[str]) -> None:
    for reduction in ("none", "por"):
        assert main(["--dp", "2", "--scenario", "request", "--reduction", reduction]) == 0
    out = capsys.readouterr().out.splitlines()
    states = [int(line.split("states explored: ")[1].split()[0]) for line in out[::2]]
    assert "reduction=none" in out[0] and "reduction=por" in out[2]
    assert states[1] < states[0]
