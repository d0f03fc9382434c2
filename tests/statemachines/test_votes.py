"""Rank rules 2, 5 and 7 on one machine: pipelined votes, the confirming vote at a
wave's end, and a pause that drains the vote still open."""

from __future__ import annotations

import pytest

from wavecore.statemachines import (
    AwaitVote,
    DrainVote,
    Idle,
    NotifyWaveComplete,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    RankMachine,
    RankPhase,
    RequestArrived,
    RunDummyBatch,
    StartVote,
    StepDone,
    SyncDone,
)

IDLE_VOTE = SyncDone(any_unfinished=False, pausing_ranks=0)
BUSY_VOTE = SyncDone(any_unfinished=True, pausing_ranks=0)


def _running(sync_interval: int = 1) -> RankMachine:
    machine = RankMachine(0, 2, sync_interval=sync_interval)
    machine.handle(RequestArrived(request_id="r", wave=0))
    return machine


def _kinds(actions: tuple[object, ...]) -> list[str]:
    return [type(action).__name__ for action in actions]


def test_each_forward_starts_a_vote_and_reads_the_previous_one() -> None:
    machine = _running()
    first = machine.handle(StepDone(executed=True, has_unfinished=True, has_admitted=True))
    assert first == (StartVote(has_unfinished=True, pending_pause=False, wave=0, step_counter=1),)
    assert machine.phase is RankPhase.RUNNING  # nothing to read yet: no wait
    second = machine.handle(StepDone(executed=True, has_unfinished=True, has_admitted=True))
    assert _kinds(second) == ["StartVote", "AwaitVote"]
    assert machine.phase is RankPhase.SYNCING
    assert machine.handle(BUSY_VOTE) == ()
    assert machine.phase is RankPhase.RUNNING


def test_an_idle_vote_is_confirmed_by_the_newest_before_the_wave_ends() -> None:
    machine = _running()
    machine.handle(StepDone(executed=True, has_unfinished=False, has_admitted=False))
    machine.handle(StepDone(executed=False, has_unfinished=False, has_admitted=False))
    assert machine.handle(IDLE_VOTE) == (AwaitVote(),)  # the newest vote decides
    assert machine.phase is RankPhase.SYNCING
    assert machine.handle(IDLE_VOTE) == (NotifyWaveComplete(wave=0), Idle())
    assert (machine.phase, machine.wave, machine.step_counter) == (RankPhase.IDLE, 1, 0)


def test_work_in_the_confirming_vote_keeps_the_wave_running() -> None:
    machine = _running()
    machine.handle(StepDone(executed=True, has_unfinished=False, has_admitted=False))
    machine.handle(StepDone(executed=False, has_unfinished=False, has_admitted=False))
    machine.handle(IDLE_VOTE)
    assert machine.handle(BUSY_VOTE) == ()
    assert machine.running and machine.wave == 0
    # No vote is open any more: the next forward starts one without waiting.
    assert _kinds(
        machine.handle(StepDone(executed=False, has_unfinished=False, has_admitted=False))
    ) == [
        "RunDummyBatch",
        "StartVote",
    ]


def test_a_pause_agreed_by_every_rank_drains_the_open_vote_first() -> None:
    machine = _running()
    machine.handle(StepDone(executed=True, has_unfinished=False, has_admitted=False))
    assert machine.handle(PauseRequested(mode=PauseMode.KEEP)) == (
        PauseScheduler(mode=PauseMode.KEEP),
    )
    machine.handle(StepDone(executed=False, has_unfinished=False, has_admitted=False))
    actions = machine.handle(SyncDone(any_unfinished=False, pausing_ranks=2))
    assert actions == (DrainVote(), NotifyWaveComplete(wave=0), PauseComplete(), Idle())


def test_votes_fall_on_steps_one_and_two_then_every_interval() -> None:
    machine = _running(sync_interval=3)
    started = []
    for step in range(1, 10):
        actions = machine.handle(StepDone(executed=False, has_unfinished=True, has_admitted=True))
        assert actions[0] == RunDummyBatch()
        if any(isinstance(action, StartVote) for action in actions):
            started.append(step)
        if machine.phase is RankPhase.SYNCING:
            machine.handle(BUSY_VOTE)
    assert started == [1, 2, 3, 6, 9]


def test_a_wait_pausing_rank_votes_work_while_an_admitted_request_stalls() -> None:
    # Rule 6: a step that ran nothing is not the end of a WAIT pause's drain while a
    # request it admitted (preempted, waiting for a prefill step) is unfinished.
    machine = _running()
    machine.handle(PauseRequested(mode=PauseMode.WAIT))
    stalled = StepDone(executed=False, has_unfinished=True, has_admitted=True)
    vote = next(a for a in machine.handle(stalled) if isinstance(a, StartVote))
    assert (vote.has_unfinished, vote.pending_pause) == (True, False)
    held_only = StepDone(executed=False, has_unfinished=True, has_admitted=False)
    vote = next(a for a in machine.handle(held_only) if isinstance(a, StartVote))
    assert (vote.has_unfinished, vote.pending_pause) == (True, True)


def test_a_step_cannot_hold_admitted_work_without_unfinished_work() -> None:
    with pytest.raises(ValueError, match="has_admitted without has_unfinished"):
        StepDone(executed=True, has_unfinished=False, has_admitted=True)
