"""The in-process async engine: `async with open_engine(config) as engine`.

Theory of operation:

1. One task, the *loop*, owns the `EngineCore`. It runs inside the engine's task
   group, which `open_engine` opens and closes, so no task outlives the block.
2. The loop repeats: apply what callers asked for (adds, aborts, pauses), schedule
   one step, await it on the `ModelThread`, apply what callers asked for while it
   ran, turn the step's token updates into text deltas, hand each to its stream.
3. Callers never touch the core while a step runs: every change a caller makes is
   queued as a *command* and applied by the loop between steps. Aborts that arrive
   during a step are applied before that step's outputs are processed, so an aborted
   request never receives another token.
4. When there is nothing to schedule the loop sleeps on an event that every command
   sets; it never polls.
5. Bad input is refused on the caller's own call (`generate` raises before the
   request is queued); it never reaches the loop, so it cannot hurt other requests.
6. If a step raises, the engine is dead: every request in flight fails with
   `EngineDeadError` carrying the cause, and every later call raises it at once.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from wavecore.engine.config import EngineConfig
from wavecore.engine.core import EngineCore, EngineStats
from wavecore.engine.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    PauseInProgressError,
    UnknownRequestError,
)
from wavecore.engine.input_processor import Prompt
from wavecore.engine.model_thread import ModelThread
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.request_stream import RequestStream
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import RequestUpdate
from wavecore.statemachines import PauseMode

_request_numbers = itertools.count()


class AsyncEngine:
    """Use through `open_engine`; every method is safe to call from any task."""

    def __init__(self, core: EngineCore, model_thread: ModelThread) -> None:
        self._core = core
        self._model_thread = model_thread
        self._streams: dict[str, RequestStream] = {}
        self._commands: deque[Callable[[], Awaitable[None] | None]] = deque()
        self._wake = anyio.Event()
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._pause_done: anyio.Event | None = None
        self._pausing: PauseMode | None = None
        self._waiting_callers: dict[anyio.Event, list[tuple[bool, Any]]] = {}

    # -- calls -----------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream one request's output. Leaving the loop early aborts the request.

        `prompt` is text (sent as is), a list of chat messages (`{"role", "content"}`,
        rendered with the model's chat template), or a list of token ids.
        """
        self._check_open()
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(_request_numbers)}"
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        request = self._core.inputs.prepare(request_id, prompt, params)
        stream = RequestStream(request, self._core.tokenizer)
        self._streams[request_id] = stream
        try:
            # Through the loop, so a refusal (or a dead engine) reaches this caller.
            await self._between_steps(lambda: self._core.add_request(request))
            async for delta in stream.deltas():
                yield delta
        finally:
            if not stream.finished:
                self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        """Finish a request as aborted; its stream ends with finish reason "abort"."""
        self._check_open()
        if request_id not in self._streams:
            raise UnknownRequestError(f"no request {request_id!r} in flight")
        self._command(lambda: self._deliver(self._core.abort_requests([request_id])))

    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """Stop scheduling; return once the pause holds (see `PauseMode`).

        `ABORT` finishes every request as aborted; `WAIT` lets running requests end;
        `KEEP` freezes everything. Requests that arrive while paused are queued.
        """
        self._check_open()
        self._core.check_pause_mode(mode)
        if self._pausing is not None and self._pausing is not mode:
            raise PauseInProgressError(f"a {self._pausing.name} pause is still completing")
        if self._pause_done is None:
            self._pausing = mode
            self._pause_done = anyio.Event()
            self._command(lambda: self._deliver(self._core.pause(mode)))
        await self._wait_for_pause()

    async def resume(self) -> None:
        self._check_open()
        if self._pausing is not None:
            raise PauseInProgressError(f"a {self._pausing.name} pause is still completing")
        await self._between_steps(self._core.resume)

    async def sleep(self, level: int = 1) -> None:
        """Pause (keeping requests) and free memory: level 1 offloads the weights and
        drops the KV cache, level 2 drops both. Requests wait until `wake_up`."""
        self._check_open()
        self._core.check_sleep_level(level)
        await self.pause(PauseMode.KEEP)

        async def fall_asleep() -> None:
            self._core.prepare_sleep(level)
            await self._model_thread.run(self._core.executor.sleep, level)

        await self._between_steps(fall_asleep)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `tags` names ("weights", "kv_cache", "scheduling"; all if None)."""
        self._check_open()
        wanted = self._core.check_wake_tags(tags)

        async def wake() -> None:
            executor_tags = self._core.wake_executor_tags(wanted)
            if executor_tags:
                await self._model_thread.run(self._core.executor.wake_up, executor_tags)
            self._core.finish_wake_up(wanted)

        await self._between_steps(wake)

    async def reset_prefix_cache(self) -> None:
        self._check_open()
        await self._between_steps(self._core.reset_prefix_cache)

    async def stats(self) -> EngineStats:
        """Statistics that reflect every call made before this one."""
        self._check_open()
        return await self._between_steps(self._core.stats)

    # -- the loop ----------------------------------------------------------------

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        try:
            while True:
                await self._run_commands()
                step = self._core.schedule()
                if step is None:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                output = await self._model_thread.run(self._core.execute, step)
                await self._run_commands()
                self._deliver(self._core.update(step, output))
        except Exception as error:
            self._die(error)

    async def _run_commands(self) -> None:
        while self._commands:
            result = self._commands.popleft()()
            if inspect.isawaitable(result):
                await result
        self._check_pause()

    def _check_pause(self) -> None:
        if self._pause_done is not None and self._core.pause_complete():
            self._pause_done.set()
            self._pause_done = None
            self._pausing = None

    def _deliver(self, updates: Sequence[RequestUpdate]) -> None:
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue
            if stream.process(update):
                self._core.finish_stopped(update.request_id)
            if stream.finished:
                del self._streams[update.request_id]
        self._check_pause()

    def _forget(self, request_id: str) -> None:
        """The consumer left early: abort the request and drop its stream."""
        self._streams.pop(request_id, None)
        if self._dead is None and not self._closed:
            self._command(lambda: self._core.abort_requests([request_id]))

    # -- helpers -----------------------------------------------------------------

    def _command(self, command: Callable[[], Awaitable[None] | None]) -> None:
        self._commands.append(command)
        self._wake.set()

    async def _between_steps(self, action: Callable[[], Awaitable[Any] | Any]) -> Any:
        """Have the loop run `action` between two steps, in order with other commands,
        and return its result (or raise its error) to this caller."""
        self._check_open()
        done = anyio.Event()
        outcome: list[tuple[bool, Any]] = []

        async def command() -> None:
            try:
                result = action()
                if inspect.isawaitable(result):
                    result = await result
                outcome.append((True, result))
            except Exception as error:  # the caller's error, not the loop's
                outcome.append((False, error))
            finally:
                self._waiting_callers.pop(done, None)
                done.set()

        # If the engine stops before the loop gets here, `_fail_all` answers instead.
        self._waiting_callers[done] = outcome
        self._command(command)
        await done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    async def _wait_for_pause(self) -> None:
        done = self._pause_done
        if done is not None:
            await done.wait()
        if self._dead is not None:
            raise self._dead

    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine's `async with` block has ended")

    def _die(self, error: Exception) -> None:
        self._dead = EngineDeadError(f"engine step failed: {error!r}")
        self._dead.__cause__ = error
        self._fail_all(self._dead)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        for done, outcome in self._waiting_callers.items():
            outcome.append((False, error))
            done.set()
        self._waiting_callers.clear()
        if self._pause_done is not None:
            self._pause_done.set()

    def _close(self) -> None:
        self._closed = True
        self._fail_all(EngineClosedError("the engine was closed while the request ran"))


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None, **overrides: Any
) -> AsyncIterator[AsyncEngine]:
    """Build an engine for the block's lifetime: `open_engine(EngineConfig(...))` or
    `open_engine(executor="null", max_num_seqs=8)`. The model loads off the event loop."""
    if config is not None and overrides:
        raise TypeError("give open_engine an EngineConfig or keyword settings, not both")
    config = config if config is not None else EngineConfig(**overrides)
    if config.dp_size > 1:
        # Data parallelism: rank processes behind a client with this same API.
        from wavecore.engine.dp.client import open_dp_engine

        async with open_dp_engine(config) as dp_engine:
            yield dp_engine  # type: ignore[misc]
        return
    async with open_engine_core(functools.partial(EngineCore.from_config, config)) as engine:
        yield engine


@asynccontextmanager
async def open_engine_core(build_core: Callable[[], EngineCore]) -> AsyncIterator[AsyncEngine]:
    """Serve the `EngineCore` that `build_core()` returns (called on the model thread),
    for embedding a core with an executor of one's own."""
    with ModelThread() as model_thread:
        core = await model_thread.run(build_core)
        try:
            async with anyio.create_task_group() as tg:
                engine = AsyncEngine(core, model_thread)
                await tg.start(engine._serve)
                try:
                    yield engine
                finally:
                    engine._close()
                    tg.cancel_scope.cancel()
        finally:
            await model_thread.run(core.close)
