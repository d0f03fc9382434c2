"""The in-process core client: one rank in this process, its model on a thread.

The rank runs the same `RankRunner` and `RankMachine` as a rank process; only the
transport differs: messages travel as objects on two unbounded memory streams
instead of nng channels, so nothing is encoded and the runner never waits for the
front end. One rank has no peers to keep in step, so it runs the machine's
independent mode (no votes, no dummy forwards) whatever `dp_mode` says; there is no
coordinator, and the rank's own counters are the wave view.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelThread
from wavecore.engine.core.rank_runner import RankRunner
from wavecore.engine.errors import EngineDeadError, ScalingRefusedError
from wavecore.engine.frontend.core_client import ScaleHost
from wavecore.engine.request import PromptTokenizer
from wavecore.statemachines import RankMachine

_log = logging.getLogger(__name__)


class _StreamSink:
    """A `rank_runner.Sink` onto a memory stream: objects, not frames."""

    def __init__(self, stream: MemoryObjectSendStream[Any]) -> None:
        self._stream = stream

    async def send(self, item: Any) -> None:
        # Unbounded, so it never blocks; no checkpoint either: the rank's next await
        # (its forward on the model thread) lets the front end take the message.
        self._stream.send_nowait(item)

    async def flush(self) -> None:
        pass


class InProcessClient:
    """A `CoreClient` for one rank in this process; see the module docstring."""

    def __init__(
        self,
        core: EngineCore,
        to_rank: MemoryObjectSendStream[Any],
        from_rank: MemoryObjectReceiveStream[Any],
    ) -> None:
        self._core = core
        self._to_rank = to_rank
        self._from_rank = from_rank

    @property
    def core(self) -> EngineCore:
        """The rank's core (for benchmarks that time its parts where they run)."""
        return self._core

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def lockstep(self) -> bool:
        return False

    @property
    def max_model_len(self) -> int:
        return self._core.executor.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._core.tokenizer

    @property
    def has_coordinator(self) -> bool:
        return False

    @property
    def dropped_frames(self) -> dict[str, int]:
        return {}  # no frames: objects on memory streams

    @property
    def max_chunk_bytes(self) -> int | None:
        return None  # objects on a memory stream: a tensor travels whole, uncopied

    def rank_node(self, rank: int) -> str:
        return "this process"

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """The rank reports its own failure (`RankFailed`); nothing else can die here."""

    def attach(self, host: ScaleHost) -> None:
        """One rank has no peers to shrink around: its failure is the engine's."""

    async def root_cause(
        self, error: EngineDeadError, *, in_collective: bool = False
    ) -> EngineDeadError:
        return error  # one rank: its failure is its own

    async def send(self, rank: int, message: Any) -> None:
        self._to_rank.send_nowait(message)  # unbounded: never blocks

    async def send_coordinator(self, message: Any) -> None:
        pass

    async def outputs(self) -> AsyncIterator[Any]:
        async for message in self._from_rank:
            yield message

    async def coordinator_states(self) -> AsyncIterator[Any]:
        return
        yield

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        raise ScalingRefusedError(
            "a one-rank engine in this process has no ranks to add or remove; "
            "open it with dp_size >= 2 to scale"
        )


@asynccontextmanager
async def open_in_process(build_core: Callable[[], EngineCore]) -> AsyncIterator[InProcessClient]:
    """Build the core (on the model thread) and run its rank for the block's lifetime."""
    with ModelThread() as model_thread:
        core = await model_thread.run(build_core)
        try:
            to_rank, rank_inbox = anyio.create_memory_object_stream[Any](math.inf)
            rank_outbox, from_rank = anyio.create_memory_object_stream[Any](math.inf)
            runner = RankRunner(
                core=core,
                machine=RankMachine(0, 1, lockstep=False),
                model_thread=model_thread,
                group=None,
                outputs=_StreamSink(rank_outbox),
                coordinator=None,
                on_invalid=lambda item: _log.warning("rank 0 ignored %r", item),
            )
            # The streams outlive the rank's task: whatever it sends before its
            # cancellation lands (a send has no checkpoint) finds them open.
            async with to_rank, from_rank, anyio.create_task_group() as tg:
                tg.start_soon(_run_rank, runner, rank_inbox, rank_outbox)
                try:
                    yield InProcessClient(core, to_rank, from_rank)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            await model_thread.run(core.close)


async def _run_rank(
    runner: RankRunner,
    inbox: MemoryObjectReceiveStream[Any],
    outbox: MemoryObjectSendStream[Any],
) -> None:
    async with inbox, outbox:
        await runner.run(inbox)
