"""Aborted scales (scaling rule 8) and the rank loop's rule 7 that their rollback
needs: a resume reaching a rank whose pause is still pending waits for the pause, with
the inputs after it, instead of being refused (which left the rank paused for good).
Each rule is run against the broken variant that drops it, which must be caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
from guarded import assert_guarded

from wavecore.statemachines import (
    Collective,
    DrainVote,
    PauseMode,
    PauseRequested,
    PauseState,
    RankMachine,
    ResumeBarrier,
    ResumeRequested,
    StepDone,
    SyncDone,
)
from wavecore.statemachines.harness.explore import abort_configs, abort_drain_config, explore
from wavecore.statemachines.rank_loop import Call, NewRequest, RankLoop


class _Effects:
    """Records the loop's replies and requests; everything else does nothing."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, str | None]] = []
        self.added: list[str] = []

    def add_request(self, request_id: str, payload: object) -> None:
        self.added.append(request_id)

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        self.replies.append((call_id, error))

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


def test_a_resume_during_a_pending_pause_waits_for_the_pause_with_what_follows() -> None:
    loop = RankLoop(RankMachine(0, 2))
    effects = _Effects()
    loop.start(effects)  # type: ignore[arg-type]
    loop.deliver(Call(call_id=1, request=PauseRequested(mode=PauseMode.KEEP)), effects)  # type: ignore[arg-type]
    loop.deliver(Call(call_id=2, request=ResumeRequested()), effects)  # type: ignore[arg-type]
    loop.deliver(NewRequest(request_id="r", wave=0), effects)  # type: ignore[arg-type]
    assert effects.replies == [] and effects.added == []  # both wait, nothing refused
    idle = StepDone(executed=False, has_unfinished=False, has_admitted=False)
    loop.complete(idle, effects)  # type: ignore[arg-type]  # step 1: vote 1
    loop.complete(None, effects)  # type: ignore[arg-type]  # its dummy forward
    loop.complete(idle, effects)  # type: ignore[arg-type]  # step 2: vote 2, read vote 1
    loop.complete(None, effects)  # type: ignore[arg-type]
    assert loop.machine.pause_state is PauseState.PENDING
    loop.complete(SyncDone(any_unfinished=False, pausing_ranks=2), effects)  # type: ignore[arg-type]
    assert loop.pending == Collective(action=DrainVote())
    loop.complete(SyncDone(any_unfinished=False, pausing_ranks=2), effects)  # type: ignore[arg-type]
    # Paused and answered; then the resume was taken (the barrier) and the request
    # after it waits behind the barrier, in order.
    assert effects.replies == [(1, None)]
    assert loop.pending == Collective(action=ResumeBarrier(has_unfinished=False))
    assert effects.added == []


def test_a_resume_with_no_pause_pending_is_taken_at_once() -> None:
    loop = RankLoop(RankMachine(0, 2))
    effects = _Effects()
    loop.start(effects)  # type: ignore[arg-type]
    loop.deliver(Call(call_id=1, request=ResumeRequested()), effects)  # type: ignore[arg-type]
    assert effects.replies == [(1, None)] and not loop.snapshot()[1].deferred


@pytest.mark.parametrize("dp_size", [2, 3])
@pytest.mark.parametrize("sync_interval", [1, 2, 3])
def test_every_interleaving_of_an_aborted_scale_holds(dp_size: int, sync_interval: int) -> None:
    for name, config in abort_configs(dp_size):
        world = replace(config.world, sync_interval=sync_interval)
        result = explore(replace(config, world=world), 60)
        assert result.violation is None, result.violation.report() if result.violation else ""
        assert result.complete, f"{name} stopped at depth {result.depth}"


@pytest.mark.parametrize(
    ("scale", "variant", "rule"),
    [
        ("scale-up-3-abort", "resume_never_waits", "protocol_error"),
        ("scale-down-1-abort", "resume_never_waits", "protocol_error"),
        ("scale-down-1-abort", "abort_keeps_narrow_routing", "routing"),
        ("scale-up-3-abort", "second_scale_restarts", "second_scale"),
    ],
)
def test_a_broken_rollback_is_caught(scale: str, variant: str, rule: str) -> None:
    assert_guarded(dict(abort_configs(2))[scale], variant, {rule}, depth=30)


def test_a_scale_down_aborted_while_its_leaving_rank_drains_a_request() -> None:
    # Bounded: without the reduction the whole space is about 240,000 states.
    result = explore(abort_drain_config(2), 12)
    assert result.violation is None, result.violation.report() if result.violation else ""
    assert result.states > 3000, "explored suspiciously little"
