"""In-process checks of the DP building blocks: the all-reduce layout and drift
detection (two threads, one gloo group), and the load balancer's score."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist
from dp_helpers import in_two_ranks

from wavecore.engine.dp.collective import CollectiveMismatchError, DPGroup, GroupAbortedError
from wavecore.engine.frontend.load_balancer import LoadBalancer
from wavecore.statemachines.errors import LockstepDriftError
from wavecore.statemachines.rank import RankMachine
from wavecore.statemachines.rank_events import RequestArrived, StepDone, SyncDone


def _in_two_ranks(calls: list[Any], timeout_s: float = 20) -> list[Any]:
    """Run `calls[r](group)` in a thread per rank of a fresh two-rank group."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    return in_two_ranks(calls, port=store.port, prefix="unit", timeout_s=timeout_s)


def test_a_vote_reduces_work_pauses_and_spans_in_the_background() -> None:
    def vote(rank: int) -> Any:
        def run(group: DPGroup) -> Any:
            group.start_vote(has_unfinished=False, pending_pause=True, wave=3, step_counter=3)
            # Returns at once: a second vote is started before the first is read.
            group.start_vote(
                has_unfinished=rank == 1, pending_pause=rank == 0, wave=3, step_counter=4 + rank
            )
            first = group.await_vote()
            assert first.pausing_ranks == 2 and not first.any_unfinished
            return group.await_vote()

        return run

    first, second = _in_two_ranks([vote(0), vote(1)])
    assert first == second
    assert first.any_unfinished is True
    assert first.pausing_ranks == 1
    assert first.wave_span == (3, 3)
    assert first.step_counter_span == (4, 5)


def test_drift_becomes_a_lockstep_drift_error_naming_the_counters() -> None:
    machine = RankMachine(0, 2, sync_interval=4)
    machine.handle(RequestArrived(request_id="r", wave=0))
    machine.handle(
        StepDone(executed=True, has_unfinished=True, has_admitted=True)
    )  # step 1: vote 1
    machine.handle(
        StepDone(executed=True, has_unfinished=True, has_admitted=True)
    )  # step 2: read vote 1
    with pytest.raises(LockstepDriftError, match=r"step_counter 1 here, 1\.\.2"):
        machine.handle(
            SyncDone(
                any_unfinished=True, pausing_ranks=0, wave_span=(0, 0), step_counter_span=(1, 2)
            )
        )


def test_a_vote_meeting_a_barrier_is_detected() -> None:
    def vote(group: DPGroup) -> Any:
        group.start_vote(has_unfinished=False, pending_pause=False, wave=0, step_counter=1)
        return group.await_vote()

    def barrier(group: DPGroup) -> Any:
        return group.barrier(has_unfinished=False)

    results = _in_two_ranks([vote, barrier])
    assert all(isinstance(result, CollectiveMismatchError) for result in results)


def test_aborting_the_group_ends_a_vote_waiting_for_a_peer_that_never_comes() -> None:
    """gloo's own abort wakes no waiter: `DPGroup.abort`, from another thread, must still
    end a wait (within one wait slice) for a peer that joined the group but not the vote
    (it stays until rank 0 is done: its leaving would break the vote another way)."""
    started, done = threading.Event(), threading.Event()
    waiting: list[DPGroup] = []

    def wait_in_a_vote(group: DPGroup) -> Any:
        waiting.append(group)
        group.start_vote(has_unfinished=True, pending_pause=False, wave=0, step_counter=1)
        started.set()
        try:
            return group.await_vote()
        finally:
            done.set()

    def abort_it(group: DPGroup) -> None:
        started.wait(10)
        waiting[0].abort()
        done.wait(10)

    # A timeout far beyond the slice, short enough that tearing the group down (which
    # waits for the vote gloo still runs) stays quick.
    results = _in_two_ranks([wait_in_a_vote, abort_it], timeout_s=5)
    assert isinstance(results[0], GroupAbortedError), results[0]
    assert "rank 0 left its DP group while waiting in a vote" in str(results[0])


def test_balancer_prefers_the_least_loaded_and_spreads_a_burst() -> None:
    balancer = LoadBalancer(3)
    assert [balancer.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    balancer.update([0, 0, 0], [5, 0, 2], [0.0, 0.0, 0.0])
    assert balancer.pick() == 1


def test_balancer_penalises_kv_pressure_only_when_requests_wait() -> None:
    balancer = LoadBalancer(2)
    balancer.update([2, 2], [0, 0], [0.9, 0.5])
    assert balancer.score(0) == pytest.approx(2 + 2 * 6 * 0.4)
    assert balancer.score(1) == 2
    assert balancer.pick() == 1
    balancer.update([0, 0], [3, 3], [1.0, 0.0])
    assert balancer.score(0) == balancer.score(1) == 3
