"""The data-parallel core client: N rank processes and a coordinator behind the front end.

Theory of operation:

1. `open_dp_client` loads only the tokenizer here, starts the processes (`launcher`)
   and yields a `DPClient`, the `CoreClient` the front end talks through: messages to
   a rank go on its nng PUSH channel, every rank's messages come back on one PULL
   channel, and the coordinator's publications on a SUB channel.
2. A process that exits (the launcher's watcher sees it at once) is reported to the
   front end as the engine's death, naming the process and how it ended: its exit
   code, or the signal that killed it ("rank 1 died (killed by SIGKILL)").
3. `scale` hands the front end to the `Scaler`, which performs `ScalingMachine`'s
   script (`scaler` explains how); the launcher's handshake socket stays open for the
   ranks it adds.
4. With `on_rank_failure="shrink"` a rank's loss is not the engine's death: a rank
   process that exits, a rank whose loop failed, or the rank that a survivor's broken
   collective points at (`root_cause`: dead, else stopped) is lost, and the scaler
   shrinks the group around it (`Scaler.shrink`). A loss names the rank's member id
   (`DPWiring.members`), which a shrink's renumbering keeps, and which a headless
   rank, with no process here, has too. Losses are taken one at a time by one task
   (`serve_losses`); a survivor's report of a broken collective that a shrink started
   since explains is dropped, and so is one whose cause turns out to be a member lost
   meanwhile: a headless peer's death shows only as its silence (rule 5), so a report
   waits for it up to `heartbeat_timeout`, not the moments a local exit takes. A loss
   while a scale or a shrink runs goes to that reconfiguration, which goes on without
   the rank (`Scaler.take_loss`). The engine still dies where a shrink cannot help:
   the coordinator's death, the last rank's, an unexplained broken collective, a loss
   while paused, asleep or updating weights, or a reconfiguration that leaves nothing
   to serve.
5. Heartbeats (`heartbeat`): every message from a rank shows it alive; a rank silent
   for `heartbeat_timeout` (stopped, hung, unreachable: no exit to see) is lost as a
   dead one is, through rule 4 or the engine's death. No rank is judged while a scale
   or a shrink renumbers them.
6. A dropped rank spawned here is killed; a headless one cannot be, and may come back
   (stopped, then continued) to report its broken group under its old number, which
   names a survivor now. Beats and failures carry the sender's member id, and those of
   a dropped member are ignored; the dropped rank reads the end of its input and
   exits, or exits when its front end falls silent.
7. With `restart_ranks`, a shrink that succeeded is followed by a scale back to the
   size before it: replacement ranks start as the first ones did (here, or wherever
   the Ray cluster has room with `dp_backend="ray"`), through the scale up a caller's
   `scale` performs (the same checks, the same rollback). A restart that is refused or
   fails leaves the engine serving at the smaller size, and says why in the log.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.exit_status import describe_end
from wavecore.engine.dp.frame_checks import member_problem, state_problem, step_outputs_problem
from wavecore.engine.dp.heartbeat import RankHeartbeats
from wavecore.engine.dp.invalid_frames import counts as invalid_frame_counts
from wavecore.engine.dp.launcher import COORDINATOR, DPWiring, open_dp_processes, process_name
from wavecore.engine.dp.process_state import process_is_stopped
from wavecore.engine.dp.rank_process import BuildCore
from wavecore.engine.dp.rank_starter import LocalRanks, RankStarter, node_of
from wavecore.engine.dp.scaler import Scaler
from wavecore.engine.errors import EngineDeadError, EngineError, ScalingFailedError
from wavecore.engine.frontend.core_client import ScaleHost
from wavecore.engine.request import PromptTokenizer
from wavecore.engine.weight_messages import RankReply

logger = logging.getLogger("wavecore.engine.dp")

_OUTPUTS = (m.StepOutputs, m.UtilityResult, m.RequestsHeld, m.RankFailed, RankReply)
_SIGNS_OF_LIFE = (*_OUTPUTS, m.RankAlive)
# Weight chunks stay well below the channels' 64 MiB frame limit, and the time one
# chunk holds a channel stays short.
_MAX_CHUNK_BYTES = 16 * 2**20
# How long a failure out of a collective waits for a peer's exit to be seen: the exit
# follows the closing of the peer's sockets by microseconds to milliseconds.
_PEER_EXIT_GRACE = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Loss:
    """A rank that is gone (`member`, `DPWiring.members`), or a survivor's broken
    collective (`report`, received when `shrinks` shrinks had started) whose cause is to
    be found."""

    cause: str
    member: int | None = None
    report: m.RankFailed | None = None
    shrinks: int = 0
    # Its requests without output go to a survivor, unless the rank's own loop failed:
    # one of them may be what broke it.
    resend: bool = True


class DPClient:
    """A `CoreClient` over rank processes; see the module docstring."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, wiring: DPWiring) -> None:
        self.config = config
        self.wiring = wiring
        self._tokenizer = tokenizer
        self._on_death: Callable[[EngineDeadError], None] | None = None
        self._news = anyio.Event()
        self._closed = False
        self.scaler = Scaler(config, wiring)
        self._host: ScaleHost | None = None
        self._losses: deque[_Loss] = deque()
        self._loss_arrived = anyio.Event()
        self._shrinks = 0
        # Seconds from each rank's loss being seen to the engine serving without it;
        # `shrunk` is set (and replaced) as each shrink ends.
        self.shrink_seconds: list[float] = []
        self.shrunk = anyio.Event()
        # With `restart_ranks`: each restart's outcome; `restarted` is set (and
        # replaced) as each ends.
        self.restarts: list[str] = []
        self.restarted = anyio.Event()
        self.heartbeats = RankHeartbeats(config.heartbeat_interval, config.heartbeat_timeout)
        self._coordinator_dropped = 0

    @property
    def dp_size(self) -> int:
        return self.wiring.dp_size

    @property
    def lockstep(self) -> bool:
        return self.config.dp_mode == "lockstep"

    @property
    def max_model_len(self) -> int:
        return self.wiring.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    @property
    def has_coordinator(self) -> bool:
        return True

    @property
    def max_chunk_bytes(self) -> int | None:
        return _MAX_CHUNK_BYTES

    @property
    def dropped_frames(self) -> dict[str, int]:
        """What this process's channels dropped, and the coordinator's input as of its
        last state (each rank's comes with its stats)."""
        return {
            **invalid_frame_counts(self.wiring.invalid_frames),
            "coordinator input": self._coordinator_dropped,
        }

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._on_death = callback

    def attach(self, host: ScaleHost) -> None:
        self._host = host

    @property
    def shrinks(self) -> bool:
        return self.config.on_rank_failure == "shrink"

    def process_exited(self, name: str, how: str) -> None:
        """The watcher saw process `name` end; `how` it ended (`describe_end`)."""
        self._tell_news()
        cause = f"{name} died ({how})"
        if self.shrinks and name != COORDINATOR:
            process = self.wiring.processes.get(name)
            if process is not None and not process.is_alive():  # not lost already
                member = self.wiring.member_of(process)
                if member is not None:
                    self._lose(_Loss(cause=cause, member=member))
            return
        self._die(EngineDeadError(cause))

    def rank_silent(self, rank: int, seconds: float) -> None:
        """Rule 5: a rank that sent nothing for `seconds` is lost as a dead one."""
        cause = f"rank {rank} sent no heartbeat for {seconds:.1f} s (stopped, hung, or unreachable)"
        if self.shrinks:
            self._lose(_Loss(cause=cause, member=self.wiring.members[rank]))
            return
        self._die(EngineDeadError(cause))

    def _lose(self, loss: _Loss) -> None:
        self._losses.append(loss)
        self._loss_arrived.set()
        self._tell_news()

    def _tell_news(self) -> None:
        """A process exited or a loss arrived: what a cause is looked for in changed."""
        self._news.set()
        self._news = anyio.Event()

    def _die(self, error: EngineDeadError) -> None:
        if not self._closed and self._on_death is not None:
            self._on_death(error)

    async def serve_losses(self) -> None:
        """Rule 4: take the losses one at a time, for the engine's lifetime; a shrink
        runs in a task of its own, so that a later loss can cut into it."""
        async with anyio.create_task_group() as shrinks:
            while True:
                while not self._losses:
                    await self._loss_arrived.wait()
                    self._loss_arrived = anyio.Event()
                loss = self._losses.popleft()
                found = await self._lost_member(loss)
                if found is None:
                    continue
                member, cause = found
                if self.scaler.active:
                    self._shrinks += 1
                    self.scaler.take_loss(member, cause, resend=loss.resend)
                    continue
                host = self._host
                refused = "one rank left" if self.dp_size == 1 else None
                refused = refused or (host.shrink_refused() if host is not None else "no front end")
                if host is None or refused is not None:
                    self._die(EngineDeadError(f"{cause} (the group cannot shrink: {refused})"))
                    continue
                await shrinks.start(self._shrink, host, member, cause, loss.resend)

    async def _shrink(
        self,
        host: ScaleHost,
        member: int,
        cause: str,
        resend: bool,
        *,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        seen = anyio.current_time()
        size = host.dp_size
        # Counted here, in the same tick as the scaler takes the loss (it is `shrinking`
        # from then on): a survivor's report that arrives before this task first runs
        # then counts as older than this shrink, which explains it (counted before
        # `start`, such a report looked newer, found its cause gone, and ended the engine).
        self._shrinks += 1
        try:
            with self.heartbeats.suspended():
                await self.scaler.shrink(
                    host, member, cause, resend=resend, task_status=task_status
                )
        except ScalingFailedError as error:
            self._die(EngineDeadError(str(error)))
            return
        self.shrink_seconds.append(anyio.current_time() - seen)
        self.shrunk.set()
        self.shrunk = anyio.Event()
        if self.config.restart_ranks:
            await self._restart_ranks(host, size)

    async def _restart_ranks(self, host: ScaleHost, size: int) -> None:
        """Rule 7: scale back to `size`, as a caller's `scale` would; what keeps it from
        happening is logged (`restarts` keeps each outcome, `restarted` is set after)."""
        try:
            await host.scale(size)
        except EngineError as error:  # refused, a scale running, failed, or the end
            outcome = f"no restart to {size} ranks: {error}"
            logger.warning("%s", outcome)
        else:
            outcome = f"restarted to {size} ranks"
        self.restarts.append(outcome)
        self.restarted.set()
        self.restarted = anyio.Event()

    async def _lost_member(self, loss: _Loss) -> tuple[int, str] | None:
        """The member a loss names, and why it is lost; None when it is no member now
        (lost already), or when a survivor's report is explained otherwise: by a shrink
        started since, or by a loss that arrived while its cause was looked for."""
        if loss.report is None:
            member = loss.member
            if member is None or self.wiring.number_of(member) is None:
                return None
            return member, loss.cause
        if self._shrinks > loss.shrinks:
            return None
        culprit = None
        with anyio.move_on_after(self._cause_grace()):
            while (culprit := self._culprit()) is None and not self._member_lost():
                await self._news.wait()
        if culprit is None:
            if not self._member_lost():
                self._die(EngineDeadError(loss.report.error))
            return None
        name, cause = culprit
        member = self.wiring.member_of(self.wiring.processes[name])
        return None if member is None else (member, cause)

    def _member_lost(self) -> bool:
        return any(loss.member is not None for loss in self._losses)

    def _cause_grace(self) -> float:
        """How long a broken collective's cause may take to show: a local peer's exit
        shows within moments; a headless peer's death only as its silence."""
        processes = self.wiring.processes
        if all(process_name(rank) in processes for rank in range(len(self.wiring.members))):
            return _PEER_EXIT_GRACE
        return self.config.heartbeat_timeout + 2 * self.config.heartbeat_interval

    async def root_cause(
        self, error: EngineDeadError, *, in_collective: bool = False
    ) -> EngineDeadError:
        """The first cause behind a rank's failure: a process that died, else one that
        is stopped (its peers gave up waiting for it in a collective). A peer's closed
        sockets reach the other ranks a moment before the kernel lets its process be
        reaped, so a failure out of a collective waits, briefly, for an exit to show."""
        cause = self._first_cause(error)
        if cause is error and in_collective:
            with anyio.move_on_after(self._cause_grace()):
                while (cause := self._first_cause(error)) is error:
                    await self._news.wait()
        return cause

    def _first_cause(self, error: EngineDeadError) -> EngineDeadError:
        culprit = self._culprit()
        return error if culprit is None else _caused(culprit[1], error)

    def _culprit(self) -> tuple[str, str] | None:
        """The process behind a broken collective and what happened to it: one that
        died, else one that is stopped."""
        current = [
            (name, process)
            for name, process in list(self.wiring.processes.items())
            if "retired" not in name and process.pid is not None
        ]
        for name, process in current:
            if not process.is_alive():
                return name, f"{name} died ({describe_end(process)})"
        for name, process in current:
            if process_is_stopped(process):
                timeout = self.config.collective_timeout
                return name, (
                    f"{name} is stopped (SIGSTOP or a debugger) and did not join a "
                    f"collective within collective_timeout ({timeout:g} s)"
                )
        return None

    def rank_node(self, rank: int) -> str:
        return node_of(self.wiring.processes.get(process_name(rank)))

    async def send(self, rank: int, message: Any) -> None:
        await self.wiring.to_ranks[rank].send(message)

    async def send_coordinator(self, message: Any) -> None:
        await self.wiring.to_coordinator.send(message)

    async def outputs(self) -> AsyncIterator[Any]:
        invalid = self.wiring.invalid_frames[0]
        try:
            async for message in self.wiring.outputs:
                problem = self._output_problem(message)
                if problem is not None:
                    invalid.unexpected(message, problem)
                    continue
                if isinstance(message, m.RankAlive | m.RankFailed) and not self._from_member(
                    message
                ):
                    continue
                if isinstance(message, _SIGNS_OF_LIFE):
                    self.heartbeats.heard(message.rank)
                    if type(message) is m.RankAlive:
                        continue
                if self.shrinks and isinstance(message, m.RankFailed):
                    self._rank_failed(message)
                elif isinstance(message, _OUTPUTS):
                    yield message
                else:
                    invalid.unexpected(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    def _output_problem(self, message: Any) -> str | None:
        """Why a well-formed message cannot be from a rank of this engine (`frame_checks`)."""
        if type(message) is m.StepOutputs:
            return step_outputs_problem(message, self._tokenizer.vocab_size)
        if isinstance(message, m.RankAlive | m.RankFailed):
            return member_problem(message.member, self.wiring.members_issued)
        return None

    def _from_member(self, message: m.RankAlive | m.RankFailed) -> bool:
        """Rule 6: whether the rank that sent this was not dropped (a headless rank the
        group dropped may still run: stopped, then continued, it reports its broken
        group under its old number, which names a survivor now)."""
        return message.member not in self.wiring.dropped

    def _rank_failed(self, message: m.RankFailed) -> None:
        """Rule 4: a rank whose loop failed is lost; a survivor's broken collective is
        dropped while a reconfiguration has a loss in hand (a shrink runs, or a scale
        took a loss it has not consumed yet: the report is that loss's doing, and the
        lost rank may be gone from the wiring before a cause is looked for), else its
        cause is found and lost (or, during a scale, the engine dies as it always did)."""
        if not message.in_collective:
            # A new rank a scale still starts is no member yet: `_lost_member` and the
            # scaler's joining set leave it to the scale.
            self._lose(_Loss(cause=message.error, member=message.member, resend=False))
        elif not self.scaler.losing_ranks:
            self._lose(_Loss(cause=message.error, report=message, shrinks=self._shrinks))

    async def coordinator_states(self) -> AsyncIterator[Any]:
        try:
            async for state in self.wiring.coordinator_state:
                if type(state) is m.EndsExpected:
                    self.scaler.on_ends_expected(state.token)
                elif type(state) is m.CoordinatorState:
                    problem = state_problem(state)
                    if problem is None:
                        self._coordinator_dropped = state.dropped_frames
                        yield state
                    else:
                        self.wiring.invalid_frames[1].unexpected(state, problem)
                else:
                    self.wiring.invalid_frames[1].unexpected(state)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        try:
            with self.heartbeats.suspended():
                await self.scaler.scale(host, new_dp_size, drain_timeout)
        except ScalingFailedError as error:
            if self.scaler.engine_lost:
                self._die(EngineDeadError(str(error)))
            raise

    def close(self) -> None:
        self._closed = True


def _caused(cause: str, error: EngineDeadError) -> EngineDeadError:
    named = EngineDeadError(f"{cause}; {error}")
    named.__cause__ = error
    return named


@asynccontextmanager
async def open_rank_starter(config: EngineConfig) -> AsyncIterator[RankStarter]:
    """The starter `config.dp_backend` names, for the block's lifetime (Ray is imported
    only when asked for)."""
    if config.dp_backend == "ray":
        from wavecore.engine.dp.ray_launcher import open_ray_ranks

        async with open_ray_ranks(config) as ranks:
            yield ranks
    else:
        yield LocalRanks()


@asynccontextmanager
async def open_dp_client(
    config: EngineConfig,
    *,
    build_core: BuildCore = EngineCore.from_config,
    rank_configs: Mapping[int, EngineConfig] | None = None,
    master: str | None = None,
    local_ranks: Collection[int] | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> AsyncIterator[DPClient]:
    """Start a data-parallel deployment for the block's lifetime.

    `build_core(config)` runs in each rank process (a picklable, module-level callable);
    `rank_configs` gives chosen ranks a configuration of their own, which the startup
    handshake refuses unless it equals `config`. `master`, `local_ranks` and
    `on_listening` let ranks run elsewhere (`wavecore rank`); see `open_dp_processes`.
    """
    tokenizer = await anyio.to_thread.run_sync(EngineCore.tokenizer_from_config, config)
    holder: list[DPClient] = []

    def on_exit(name: str, how: str) -> None:
        for client in holder:
            client.process_exited(name, how)

    async with (
        open_rank_starter(config) as starter,
        open_dp_processes(
            config,
            build_core=build_core,
            on_exit=on_exit,
            rank_configs=rank_configs,
            master=master,
            local_ranks=local_ranks,
            on_listening=on_listening,
            starter=starter,
        ) as wiring,
    ):
        client = DPClient(config, tokenizer, wiring)
        holder.append(client)
        async with anyio.create_task_group() as tg:
            await tg.start(client.scaler.serve)
            tg.start_soon(client.serve_losses)
            tg.start_soon(client.heartbeats.run, lambda: wiring.to_ranks, client.rank_silent)
            try:
                yield client
            finally:
                client.close()
                tg.cancel_scope.cancel()
