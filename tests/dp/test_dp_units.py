"""In-process checks of the DP building blocks: the all-reduce layout and drift
detection (two threads, one gloo group), and the load balancer's score."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from wavecore.engine.dp.collective import CollectiveMismatchError, DPGroup
from wavecore.engine.frontend.load_balancer import LoadBalancer
from wavecore.statemachines.errors import LockstepDriftError
from wavecore.statemachines.rank import RankMachine, RequestArrived, StepDone, SyncDone


def _in_two_ranks(calls: list[Any]) -> list[Any]:
    """Run `calls[r](group)` in a thread per rank of a fresh two-rank group."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    results: list[Any] = [None, None]

    def rank_thread(rank: int) -> None:
        group = DPGroup.join(
            host="127.0.0.1", port=store.port, prefix="unit", rank=rank, size=2, timeout_s=20
        )
        try:
            results[rank] = calls[rank](group)
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


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
    machine.handle(StepDone(executed=True, has_unfinished=True))  # step 1: vote 1
    machine.handle(StepDone(executed=True, has_unfinished=True))  # step 2: read vote 1
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
