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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread

from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.exit_status import describe_exit
from wavecore.engine.dp.launcher import DPWiring, open_dp_processes
from wavecore.engine.dp.process_state import is_stopped
from wavecore.engine.dp.rank_process import BuildCore
from wavecore.engine.dp.scaler import Scaler
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.frontend.core_client import ScaleHost
from wavecore.engine.request import PromptTokenizer
from wavecore.engine.weight_messages import RankReply

_OUTPUTS = (m.StepOutputs, m.UtilityResult, m.RequestsHeld, m.RankFailed, RankReply)
# Weight chunks stay well below the channels' 64 MiB frame limit, and the time one
# chunk holds a channel stays short.
_MAX_CHUNK_BYTES = 16 * 2**20
# How long a failure out of a collective waits for a peer's exit to be seen: the exit
# follows the closing of the peer's sockets by microseconds to milliseconds.
_PEER_EXIT_GRACE = 2.0


class DPClient:
    """A `CoreClient` over rank processes; see the module docstring."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, wiring: DPWiring) -> None:
        self.config = config
        self.wiring = wiring
        self._tokenizer = tokenizer
        self._on_death: Callable[[EngineDeadError], None] | None = None
        self._exited = anyio.Event()
        self._closed = False
        self.scaler = Scaler(config, wiring)

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

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._on_death = callback

    def process_exited(self, name: str, exitcode: int | None) -> None:
        self._exited.set()
        self._exited = anyio.Event()
        if not self._closed and self._on_death is not None:
            self._on_death(EngineDeadError(f"{name} died ({describe_exit(exitcode)})"))

    async def root_cause(
        self, error: EngineDeadError, *, in_collective: bool = False
    ) -> EngineDeadError:
        """The first cause behind a rank's failure: a process that died, else one that
        is stopped (its peers gave up waiting for it in a collective). A peer's closed
        sockets reach the other ranks a moment before the kernel lets its process be
        reaped, so a failure out of a collective waits, briefly, for an exit to show."""
        cause = self._first_cause(error)
        if cause is error and in_collective:
            with anyio.move_on_after(_PEER_EXIT_GRACE):
                while (cause := self._first_cause(error)) is error:
                    await self._exited.wait()
        return cause

    def _first_cause(self, error: EngineDeadError) -> EngineDeadError:
        current = [
            (name, process)
            for name, process in list(self.wiring.processes.items())
            if "retired" not in name and process.pid is not None
        ]
        for name, process in current:
            if not process.is_alive():
                return _caused(f"{name} died ({describe_exit(process.exitcode)})", error)
        for name, process in current:
            if process.pid is not None and is_stopped(process.pid):
                timeout = self.config.collective_timeout
                return _caused(
                    f"{name} is stopped (SIGSTOP or a debugger) and did not join a "
                    f"collective within collective_timeout ({timeout:g} s)",
                    error,
                )
        return error

    async def send(self, rank: int, message: Any) -> None:
        await self.wiring.to_ranks[rank].send(message)

    async def send_coordinator(self, message: Any) -> None:
        await self.wiring.to_coordinator.send(message)

    async def outputs(self) -> AsyncIterator[Any]:
        invalid = self.wiring.invalid_frames[0]
        try:
            async for message in self.wiring.outputs:
                if isinstance(message, _OUTPUTS):
                    yield message
                else:
                    invalid.unexpected(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    async def coordinator_states(self) -> AsyncIterator[Any]:
        try:
            async for state in self.wiring.coordinator_state:
                if type(state) is m.EndsExpected:
                    self.scaler.on_ends_expected(state.token)
                elif type(state) is m.CoordinatorState:
                    yield state
                else:
                    self.wiring.invalid_frames[1].unexpected(state)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        await self.scaler.scale(host, new_dp_size, drain_timeout)

    def close(self) -> None:
        self._closed = True


def _caused(cause: str, error: EngineDeadError) -> EngineDeadError:
    named = EngineDeadError(f"{cause}; {error}")
    named.__cause__ = error
    return named


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

    def on_exit(name: str, exitcode: int | None) -> None:
        for client in holder:
            client.process_exited(name, exitcode)

    async with open_dp_processes(
        config,
        build_core=build_core,
        on_exit=on_exit,
        rank_configs=rank_configs,
        master=master,
        local_ranks=local_ranks,
        on_listening=on_listening,
    ) as wiring:
        client = DPClient(config, tokenizer, wiring)
        holder.append(client)
        async with anyio.create_task_group() as tg:
            await tg.start(client.scaler.serve)
            try:
                yield client
            finally:
                client.close()
                tg.cancel_scope.cancel()
