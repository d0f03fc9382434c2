"""The cause a DP engine reports for a rank's failure: a peer's death first, even when
the failing rank's report (a broken collective) arrives before the peer can be reaped."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import pytest
from dp_helpers import FakeRankProcess

from wavecore.engine.config import EngineConfig
from wavecore.engine.dp import client as dp_client
from wavecore.engine.dp.client import DPClient
from wavecore.engine.errors import EngineDeadError

pytestmark = pytest.mark.anyio
HANG_GUARD = 30  # seconds; only ever reached if root_cause hangs
FAILURE = EngineDeadError("rank 0 (pid 1) failed: RuntimeError: Connection reset by peer")


@dataclass
class _Wiring:
    processes: dict[str, FakeRankProcess] = field(
        default_factory=lambda: {"rank 0": FakeRankProcess(), "rank 1": FakeRankProcess()}
    )
    members: list[int] = field(default_factory=lambda: [0, 1])


def _client() -> DPClient:
    return DPClient(EngineConfig(executor="null", dp_size=2), None, _Wiring())  # type: ignore[arg-type]


async def test_a_collective_failure_waits_for_the_peer_exit_that_caused_it() -> None:
    client = _client()
    found: list[EngineDeadError] = []

    async def report() -> None:
        found.append(await client.root_cause(FAILURE, in_collective=True))

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            await anyio.wait_all_tasks_blocked()
            assert not found, "the peer is not reaped yet: nothing to report"
            client.wiring.processes["rank 1"].exitcode = -9
            client.process_exited("rank 1", "killed by SIGKILL")
    assert str(found[0]).startswith("rank 1 died (killed by SIGKILL); rank 0 (pid 1) failed")
    assert found[0].__cause__ is FAILURE


async def test_a_failure_outside_a_collective_is_its_own_cause() -> None:
    with anyio.fail_after(HANG_GUARD):
        assert await _client().root_cause(FAILURE) is FAILURE


async def test_a_collective_failure_with_no_peer_exit_is_reported_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dp_client, "_PEER_EXIT_GRACE", 0.01)
    with anyio.fail_after(HANG_GUARD):
        assert await _client().root_cause(FAILURE, in_collective=True) is FAILURE
