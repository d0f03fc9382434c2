"""`FairAdmission`'s turns, without a server: who gets each slot as slots free."""

from __future__ import annotations

import anyio
import pytest

from wavecore.engine.serve.errors import APIError
from wavecore.engine.serve.fairness import AdmissionClosedError, FairAdmission

pytestmark = pytest.mark.anyio


async def test_slots_go_round_robin_newcomers_first_each_client_in_order() -> None:
    """One slot. X holds it while A (3 requests), B (2) and C (1) queue, in that
    order; then each request, once granted, records itself and frees the slot."""
    fair = FairAdmission(lambda: 1, per_client=1, queue_per_client=8)
    granted: list[str] = []
    release_x = anyio.Event()

    async def request(client: str, name: str, hold: anyio.Event | None = None) -> None:
        async with fair.slot(client):
            granted.append(name)
            if hold is not None:
                await hold.wait()

    async with anyio.create_task_group() as tg:
        fair.reserve("X", 2)
        tg.start_soon(request, "X", "x1", release_x)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(request, "X", "x2")
        await anyio.wait_all_tasks_blocked()
        for client, count in (("A", 3), ("B", 2), ("C", 1)):
            fair.reserve(client, count)
            for number in range(1, count + 1):
                tg.start_soon(request, client, f"{client.lower()}{number}")
                await anyio.wait_all_tasks_blocked()
        assert granted == ["x1"] and fair.queued == 7
        release_x.set()
    # Newcomers in order of arrival, then the round, least recently served first.
    assert granted == ["x1", "a1", "b1", "c1", "x2", "a2", "b2", "a3"]
    assert fair.in_flight == 0 and fair.queued == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_the_bounds_hold() -> None:
    fair = FairAdmission(lambda: 4, per_client=None, queue_per_client=1)
    assert fair.per_client == 3  # 3/4 of the capacity by default
    fair.reserve("A", 4)
    with pytest.raises(APIError) as refused:
        fair.reserve("A", 1)
    assert refused.value.status == 429
    with pytest.raises(APIError) as too_big:
        fair.reserve("B", 5)
    assert too_big.value.status == 400
    hold = anyio.Event()

    async def request() -> None:
        async with fair.slot("A"):
            await hold.wait()

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        assert (fair.in_flight, fair.queued) == (3, 1)
        tg.cancel_scope.cancel()
    assert (fair.in_flight, fair.queued) == (0, 0)
    fair.reserve("A", 4)  # nothing of the cancelled calls is still counted


async def test_closing_ends_what_waits_and_what_comes_not_what_runs() -> None:
    fair = FairAdmission(lambda: 1, per_client=1, queue_per_client=8)
    hold = anyio.Event()
    outcomes: list[str] = []

    async def request(name: str) -> None:
        try:
            async with fair.slot("A"):
                await hold.wait()
                outcomes.append(f"{name} ran")
        except AdmissionClosedError:
            outcomes.append(f"{name} refused")

    fair.reserve("A", 3)
    async with anyio.create_task_group() as tg:
        for name in ("first", "queued"):
            tg.start_soon(request, name)
            await anyio.wait_all_tasks_blocked()
        fair.close()  # the shutdown timeout: what runs is aborted on the engine
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(request, "late")
        await anyio.wait_all_tasks_blocked()
        hold.set()
    assert outcomes == ["queued refused", "late refused", "first ran"]
    assert (fair.in_flight, fair.queued) == (0, 0)
