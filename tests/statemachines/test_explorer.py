"""The exhaustive explorer at dp 2 and 3, and its command line.

The configurations whose state spaces are large (a request with a pause or a sleep,
a request during a scale) run here at a smaller depth than `make check-protocol`
uses; test_failure_modes and test_regressions run each broken variant at the depth
that finds it."""

from __future__ import annotations

import pytest
from guarded import explored

from wavecore.statemachines.harness.explore import (
    death_configs,
    default_configs,
    explore,
    repause_configs,
)
from wavecore.statemachines.sim import main

LARGE = (
    "request-and-pause",
    "request-and-pause-abort",
    "request-and-pause-wait",
    "sleep-keep-wake",
    "request-and-death",
)
# Scenarios of issue 29 that take seconds each at dp 2 and minutes at dp 3: make test
# explores a few of them at dp 2 (below and in test_regressions), make check-protocol
# every one at dp 2 and 3 with votes every 1, 2 and 3 steps.
HEAVY = (
    "request-stalls-and-pause-wait",
    "requests-3",
    "requests-2-and-pause-wait",
    *(name for name, _ in repause_configs(2)),
)


# The small configurations' requests take one step, so their waves end before the vote
# interval matters: the sweep is cheap at dp 2, and test_simulation sweeps it with
# longer requests at dp 2 and 3.
@pytest.mark.parametrize(("dp_size", "sync_interval"), [(2, 1), (2, 2), (2, 3), (3, 1)])
def test_every_interleaving_of_the_small_configurations_holds(
    dp_size: int, sync_interval: int
) -> None:
    for name, config in default_configs(dp_size, sync_interval):
        if name in LARGE or name in HEAVY or name.startswith("scale"):
            continue  # the tests below, test_regressions and test_scale_aborts cover these
        result = explore(config, 40)
        assert result.violation is None, result.violation.report() if result.violation else ""
        assert result.states > 30, f"{name} explored suspiciously little"
        assert result.complete, f"{name} stopped at depth {result.depth}, not at its end"


# A rank's death at dp 2 is explored to the end (about 3 s for both); at dp 3 to a
# depth that keeps each under 10 s (the command line explores them to the end).
@pytest.mark.parametrize(("dp_size", "depths"), [(2, (60, 60)), (3, (11, 26))])
def test_every_interleaving_of_a_rank_death_holds(dp_size: int, depths: tuple[int, int]) -> None:
    for (name, config), depth in zip(death_configs(dp_size), depths, strict=True):
        result = explored(config, depth)
        assert result.violation is None, result.violation.report() if result.violation else ""
        assert result.complete or result.depth == depth, f"{name} stopped at {result.depth}"
        assert result.complete == (dp_size == 2), f"{name}: complete={result.complete}"


# With the reduction, a request with pauses, a sleep or a scale ends at dp 2 within a few
# seconds (dp 3, about four minutes in all, is left to make check-protocol).
@pytest.mark.parametrize(
    "name",
    [
        *(name for name in LARGE if name != "request-and-death"),
        "scale-up-3-request",
        "scale-down-1-request",
    ],
)
def test_a_request_with_pauses_a_sleep_or_a_scale_is_explored_to_its_end(name: str) -> None:
    result = explore(dict(default_configs(2))[name], 60)
    assert result.violation is None, result.violation.report() if result.violation else ""
    assert result.complete and result.depth >= 30, (result.depth, result.states)


# Votes every 2 steps, where a draining rank's vote meets a second request (the
# stalled request's search to its end at interval 1 is test_regressions'). Three run
# in `make soak` only; `make check-protocol` explores every scenario at interval 2.
@pytest.mark.parametrize(
    ("name", "depth", "complete"),
    [
        ("request-stalls-and-pause-wait", 60, True),
        pytest.param("requests-3", 60, True, marks=pytest.mark.soak),
        ("requests-2-and-pause-wait", 18, False),
        pytest.param("request-pause-keep-then-sleep-wait", 60, True, marks=pytest.mark.soak),
        pytest.param("request-pause-wait-then-pause-abort", 60, True, marks=pytest.mark.soak),
    ],
)
def test_the_scenarios_of_issue_29_hold_at_interval_2(
    name: str, depth: int, complete: bool
) -> None:
    result = explore(dict(default_configs(2, 2))[name], depth)
    assert result.violation is None, result.violation.report() if result.violation else ""
    assert result.complete == complete, (result.depth, result.states)


def test_a_request_with_a_pause_and_a_duplicate_resume_holds_to_depth_16() -> None:
    # The same search guards failure mode 7 in test_failure_modes: it runs once.
    result = explored(dict(default_configs(2))["request-and-pause"], 16)
    assert result.violation is None, result.violation.report() if result.violation else ""
    assert result.depth == 16


def test_command_line_reports_no_violation_and_exit_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    others = [
        name
        for name, _ in default_configs(2)
        if not name.startswith("request-and-") and name not in HEAVY
    ]
    argv = ["--dp", "2", "--depth", "12"]
    assert main([*argv, *(arg for name in others for arg in ("--scenario", name))]) == 0
    out = capsys.readouterr().out
    assert "no violation" in out
    assert "sleep-keep-wake: dp=2 sync_interval=1 reduction=por depth=12 states explored" in out
    assert "stopped at the depth bound)" in out


def test_command_line_explores_only_the_scenarios_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--dp", "3", "--depth", "40", "--scenario", "pause-resume"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pause-resume: dp=3 sync_interval=1 reduction=por depth=")
    assert lines[0].endswith("every state)"), "pause-resume is explored to its end"
    assert len(lines) == 2


def test_command_line_refuses_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--dp", "3", "--scenario", "scale-down-1"])  # a scenario of dp 2 only
    assert "unknown scenario scale-down-1 at dp 3" in capsys.readouterr().err


def test_command_line_shows_the_trace_of_a_broken_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dp", "2", "--depth", "30", "--break", "no_self_wake"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    assert "client submits request 0" in out


def test_command_line_names_every_broken_variant_its_scenarios_miss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Requests alone (no pause, no scale) miss the pause and scaling rules; make
    # check-protocol runs every scenario, where each variant must be caught.
    argv = ["--dp", "2", "--depth", "25", "--every-variant", "--scenario", "request"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "no_self_wake: caught by request at depth" in out
    assert "early_pause_reply: NOT caught by any scenario at depth 25" in out
    assert "broken variants escaped:" in out
