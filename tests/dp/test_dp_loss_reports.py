"""A survivor's report of a broken collective that arrives as a shrink starts is that
shrink's doing (client rule 4): it must not be taken, after the shrink, for a new
failure with no cause, which ends the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from dp_helpers import FakeRankProcess

from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp import client as dp_client
from wavecore.engine.dp.client import DPClient
from wavecore.engine.errors import EngineDeadError
from wavecore.statemachines import ScaleRequested

pytestmark = pytest.mark.anyio
HANG_GUARD = 30  # seconds; only ever reached if the client hangs


@dataclass
class _Wiring:
    """Processes by name ("rank N", N the current number) and members by number."""

    members: list[int] = field(default_factory=lambda: [0, 1, 2])
    by_member: dict[int, FakeRankProcess] = field(
        default_factory=lambda: {r: FakeRankProcess() for r in range(3)}
    )

    @property
    def processes(self) -> dict[str, FakeRankProcess]:
        return {f"rank {n}": self.by_member[member] for n, member in enumerate(self.members)}

    @property
    def dp_size(self) -> int:
        return len(self.members)

    def member_of(self, process: FakeRankProcess) -> int | None:
        return next((m for m in self.members if self.by_member[m] is process), None)

    def number_of(self, member: int) -> int | None:
        return self.members.index(member) if member in self.members else None


class _Scaler:
    """Takes a loss as `Scaler.shrink` does (at once, then `started`), and drops the
    lost rank from the wiring and renumbers the survivors as `DropRanks` does; the shrink ends when told."""

    def __init__(self, wiring: _Wiring) -> None:
        self.wiring = wiring
        self.active = False
        self.finish = anyio.Event()

    @property
    def shrinking(self) -> bool:
        return self.active

    losing_ranks = shrinking

    async def shrink(self, host: object, member: int, cause: str, *, resend: bool, task_status):  # type: ignore[no-untyped-def]
        self.active = True
        task_status.started()
        self.wiring.members.remove(member)  # the survivors renumbered
        await self.finish.wait()
        self.active = False


class _Host:
    dp_size = 3

    def shrink_refused(self) -> str | None:
        return None


def _client(wiring: _Wiring) -> tuple[DPClient, list[EngineDeadError]]:
    """A shrinking client over `wiring`, attached, and the deaths it reports."""
    config = EngineConfig(executor="null", dp_size=3, on_rank_failure="shrink")
    client = DPClient(config, None, wiring)  # type: ignore[arg-type]
    deaths: list[EngineDeadError] = []
    client.on_death(deaths.append)
    client.attach(_Host())  # type: ignore[arg-type]
    return client, deaths


async def _serve_then_kill_rank_1(
    tg: anyio.abc.TaskGroup, client: DPClient, wiring: _Wiring
) -> None:
    """Start taking losses, then have the watcher see rank 1 killed."""
    tg.start_soon(client.serve_losses)
    await anyio.wait_all_tasks_blocked()
    wiring.by_member[1].exitcode = -9
    client.process_exited("rank 1", "killed by SIGKILL")


_REPORT = m.RankFailed(
    rank=2,
    error="rank 2 (pid 1) left its broken DP group: Connection reset by peer",
    in_collective=True,
    member=2,
)


# The gap between the loss being taken and the shrink task's first run is a matter of
# the event loop's queue, which asyncio keeps in order; trio shuffles it.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_report_arriving_as_the_shrink_starts_is_explained_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dp_client, "_PEER_EXIT_GRACE", 0.05)
    wiring = _Wiring()
    client, deaths = _client(wiring)
    scaler = client.scaler = _Scaler(wiring)  # type: ignore[assignment]
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            await _serve_then_kill_rank_1(tg, client, wiring)
            await anyio.lowlevel.checkpoint()  # the loss is taken; its shrink has not run
            assert not scaler.shrinking
            client._rank_failed(_REPORT)
            await anyio.wait_all_tasks_blocked()
            assert scaler.shrinking
            scaler.finish.set()
            # What looking for the report's cause would take, and more.
            await anyio.sleep(10 * dp_client._PEER_EXIT_GRACE)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert wiring.members == [0, 2]
    assert deaths == []


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_report_arriving_as_a_scale_takes_a_loss_is_explained_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """During a scale, a loss goes to the scaler (`take_loss`), which consumes it at its
    next checkpoint and drops the rank. A survivor's report arriving between the two is
    that loss's doing: once the lost rank is gone from the wiring, no culprit is left
    to find, and taking the report as new ended the engine (a 3 -> 2 scale, rank 1
    killed while rank 2 drained)."""
    monkeypatch.setattr(dp_client, "_PEER_EXIT_GRACE", 0.05)
    wiring = _Wiring()
    client, deaths = _client(wiring)
    scaler = client.scaler
    scaler._machine.handle(ScaleRequested(old_dp_size=3, dp_size=2))
    assert scaler.active
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            await _serve_then_kill_rank_1(tg, client, wiring)
            await anyio.wait_all_tasks_blocked()  # handed to the scale, not consumed yet
            assert scaler.losing_ranks and not scaler.shrinking
            client._rank_failed(_REPORT)
            # The scale consumes the loss and drops the rank (`DropRanks`) before the
            # report is looked at.
            assert scaler._take_losses(_Host())  # type: ignore[arg-type]
            wiring.members.remove(1)
            assert scaler.shrinking
            # What looking for the report's cause would take, and more.
            await anyio.sleep(10 * dp_client._PEER_EXIT_GRACE)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert deaths == []
