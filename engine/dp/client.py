"""The data-parallel client: the `AsyncEngine` API over N rank processes.

Theory of operation:

1. `open_dp_engine` loads only the tokenizer here, starts the processes
   (`launcher`), and serves the client's tasks in one task group for the block's
   lifetime: the output receiver (rank frames: token updates, utility replies, held
   requests, failures), the coordinator-state receiver (wave view and loads), and the
   outbox (aborts and stop-string finishes raised where no await is possible).
2. `generate` validates and tokenizes in the caller (`InputProcessor`), picks a rank
   (`LoadBalancer`, or the caller's `dp_rank`), sends `AddRequest` stamped with the
   client's view of the wave, and, in lockstep mode while that view says the engines
   are idle, `FirstRequest` to the coordinator. Token ids come back one frame per
   rank step and are detokenized here (each request's `RequestStream`).
3. Utility calls (pause, resume, sleep, wake_up, reset_prefix_cache, stats) go to every
   rank and complete when every rank replied; a rank defers its pause reply until the
   pause really holds.
4. `scale(n)` changes the number of ranks while serving (`scaling` explains how; the
   launcher's handshake socket stays open for the ranks it adds).
5. A process that exits, or a rank that reports a failure, kills the engine: every
   request in flight fails with `EngineDeadError` naming the rank, every later call
   raises it at once, and the launcher still reaps every process on exit.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from wavecore.engine.batch import SampledToken
from wavecore.engine.config import EngineConfig
from wavecore.engine.core import EngineCore
from wavecore.engine.dp import messages as m
from wavecore.engine.dp.launcher import DPWiring, open_dp_processes
from wavecore.engine.dp.load_balancer import LoadBalancer
from wavecore.engine.dp.rank_process import BuildCore
from wavecore.engine.dp.scaling import Scaler
from wavecore.engine.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    PauseInProgressError,
    UnknownRequestError,
)
from wavecore.engine.input_processor import InputProcessor, Prompt, PromptTokenizer
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.request_stream import RequestStream
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import RequestUpdate
from wavecore.statemachines.rank import PauseMode
from wavecore.statemachines.request import FinishReason

_request_numbers = itertools.count()


class RankCallError(EngineError):
    """A utility call was refused by one or more ranks; the message names them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DPStats:
    """Per-rank figures, the coordinator's wave view, and requests waiting and why."""

    ranks: tuple[m.RankStatsReport, ...]
    wave: int
    engines_running: bool
    held: Mapping[str, str]
    requests_per_rank: tuple[int, ...]


@dataclass(slots=True)
class _Call:
    waiting_for: set[int]
    done: anyio.Event = field(default_factory=anyio.Event)
    errors: list[str] = field(default_factory=list)
    stats: list[m.RankStatsReport] = field(default_factory=list)


class DPClient:
    """Use through `open_engine(EngineConfig(dp_size=N, ...))`; safe from any task."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, wiring: DPWiring) -> None:
        self.config = config
        self.dp_size = config.dp_size
        self.wiring = wiring
        self._lockstep = config.dp_mode == "lockstep"
        self._inputs = InputProcessor(tokenizer, max_model_len=wiring.max_model_len)
        self._tokenizer = tokenizer
        self._balancer = LoadBalancer(config.dp_size)
        self._streams: dict[str, RequestStream] = {}
        self._owner: dict[str, int] = {}
        self._held: dict[str, str] = {}
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._outbox: deque[tuple[int, Any]] = deque()
        self._outbox_ready = anyio.Event()
        self._wave = 0
        self._engines_running = False
        self._pausing: PauseMode | None = None
        self._pause_call: _Call | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self.requests_per_rank = [0] * config.dp_size
        # Elastic scaling: set on every finished request (a scale down waits on it), and
        # whether the user paused the engine (a scale is then refused).
        self.request_done = anyio.Event()
        self.user_paused = False
        self.scaler = Scaler(self)

    # -- calls -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        dp_rank: int | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream one request's output; `dp_rank` pins it to that rank."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(_request_numbers)}"
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if dp_rank is not None and (
            isinstance(dp_rank, bool)
            or not isinstance(dp_rank, int)
            or not 0 <= dp_rank < self._balancer.dp_size
        ):
            # The balancer's size: during a scale down the leaving ranks take no more.
            raise InvalidRequestError(
                f"dp_rank must be an int in [0, {self._balancer.dp_size}), got {dp_rank!r}"
            )
        request = self._inputs.prepare(request_id, prompt, params)
        if dp_rank is None:
            rank = self._balancer.pick()
        else:
            rank = dp_rank
            self._balancer.assigned(rank)
        stream = RequestStream(request, self._tokenizer)  # type: ignore[arg-type]
        self._streams[request_id] = stream
        self._owner[request_id] = rank
        self.requests_per_rank[rank] += 1
        wave = self._wave
        await self.wiring.to_ranks[rank].send(
            m.AddRequest(
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=params,
                wave=wave,
            )
        )
        if self._lockstep and not self._engines_running:
            await self.wiring.to_coordinator.send(m.FirstRequest(rank=rank, wave=wave))
        try:
            async for delta in stream.deltas():
                yield delta
        finally:
            if not stream.finished:
                self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        """Finish a request as aborted on the rank that holds it."""
        self._check_open()
        rank = self._owner.get(request_id)
        if rank is None:
            raise UnknownRequestError(f"no request {request_id!r} in flight")
        await self.wiring.to_ranks[rank].send(m.AbortRequests(request_ids=(request_id,)))

    async def pause(self, mode: PauseMode = PauseMode.KEEP) -> None:
        """Pause every rank (two-phase, see the protocol); return once it holds."""
        self._check_open()
        EngineCore.check_pause_mode(mode)
        if self._pausing is not None and self._pausing is not mode:
            raise PauseInProgressError(f"a {self._pausing.name} pause is still completing")
        if self._pause_call is None:
            self._pausing = mode
            self._pause_call = await self._start_call("pause", pause_mode=mode.value)
        call = self._pause_call
        try:
            await self._finish_call(call)
            self.user_paused = True
        finally:
            if self._pause_call is call:
                self._pause_call = None
                self._pausing = None

    async def resume(self) -> None:
        self._check_open()
        if self._pausing is not None:
            raise PauseInProgressError(f"a {self._pausing.name} pause is still completing")
        await self._call_all("resume")
        self.user_paused = False

    async def scale(self, new_dp_size: int, *, drain_timeout: float | None = None) -> None:
        """Change the number of ranks while serving; see `wavecore.engine.dp.scaling`."""
        self._check_open()
        await self.scaler.scale(new_dp_size, drain_timeout=drain_timeout)

    @property
    def owners(self) -> Mapping[str, int]:
        """Which rank serves each request in flight."""
        return self._owner

    def resize_tables(self, dp_size: int) -> None:
        """A scale's commit: the client's per-rank tables take the new size."""
        self.dp_size = dp_size
        self.requests_per_rank = (self.requests_per_rank + [0] * dp_size)[:dp_size]
        self.route_to(dp_size)

    def route_to(self, dp_size: int) -> None:
        """New requests go to ranks [0, dp_size) only; in-flight counts are kept."""
        balancer = LoadBalancer(dp_size)
        kept = min(dp_size, self._balancer.dp_size)
        balancer.inflight[:kept] = self._balancer.inflight[:kept]
        self._balancer = balancer

    async def send_to_rank(self, rank: int, message: Any) -> None:
        await self.wiring.to_ranks[rank].send(message)

    def start_switch(self, dp_size: int) -> tuple[int, _Call]:
        """A call that completes when ranks [0, dp_size) answered (see `scaling`)."""
        call_id = next(self._call_ids)
        call = _Call(waiting_for=set(range(dp_size)))
        self._calls[call_id] = call
        return call_id, call

    async def finish_call(self, call: _Call) -> None:
        await self._finish_call(call)

    async def sleep(self, level: int = 1) -> None:
        """Pause (aborting running requests: their KV cache goes) and free memory."""
        self._check_open()
        EngineCore.check_sleep_level(level)
        await self._call_all("sleep", sleep_level=level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        wanted = EngineCore.check_wake_tags(tags)
        await self._call_all("wake_up", wake_tags=tuple(sorted(wanted)))

    async def reset_prefix_cache(self) -> None:
        self._check_open()
        await self._call_all("reset_prefix_cache")

    async def stats(self) -> DPStats:
        """Every rank's figures, taken after every call made before this one."""
        self._check_open()
        call = await self._call_all("stats")
        return DPStats(
            ranks=tuple(sorted(call.stats, key=lambda report: report.rank)),
            wave=self._wave,
            engines_running=self._engines_running,
            held=dict(self._held),
            requests_per_rank=tuple(self.requests_per_rank),
        )

    # -- utility calls -------------------------------------------------------------------

    async def _call_all(self, method: str, **arguments: Any) -> _Call:
        call = await self._start_call(method, **arguments)
        await self._finish_call(call)
        return call

    async def _start_call(self, method: str, **arguments: Any) -> _Call:
        call_id = next(self._call_ids)
        call = _Call(waiting_for=set(range(self.dp_size)))
        self._calls[call_id] = call
        message = m.UtilityCall(call_id=call_id, method=method, **arguments)
        for sender in self.wiring.to_ranks:
            await sender.send(message)
        return call

    async def _finish_call(self, call: _Call) -> None:
        await call.done.wait()
        if self._dead is not None:
            raise self._dead
        if call.errors:
            raise RankCallError("; ".join(call.errors))

    # -- receivers -----------------------------------------------------------------------

    async def receive_outputs(self) -> None:
        handlers = {
            m.StepOutputs: self._on_step_outputs,
            m.UtilityResult: self._on_utility_result,
            m.RequestsHeld: self._on_held,
            m.RankFailed: self._on_rank_failed,
        }
        invalid = self.wiring.invalid_frames[0]
        try:
            async for message in self.wiring.outputs:
                handler = handlers.get(type(message))
                if handler is None:
                    invalid.unexpected(message)
                else:
                    handler(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass
        if not self._closed:
            self._die(EngineDeadError("every rank closed its output channel"))

    async def receive_state(self) -> None:
        try:
            async for state in self.wiring.coordinator_state:
                if type(state) is m.EndsExpected:
                    self.scaler.on_ends_expected(state.token)
                    continue
                if type(state) is not m.CoordinatorState or len(state.waiting) != self.dp_size:
                    self.wiring.invalid_frames[1].unexpected(state)
                    continue
                self._wave = state.wave
                self._engines_running = state.engines_running
                size = self._balancer.dp_size  # smaller while a scale down drains
                self._balancer.update(
                    state.waiting[:size], state.running[:size], state.kv_usage[:size]
                )
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass

    async def send_outbox(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = anyio.Event()
            while self._outbox:
                rank, message = self._outbox.popleft()
                await self.wiring.to_ranks[rank].send(message)

    def _post(self, rank: int, message: Any) -> None:
        self._outbox.append((rank, message))
        self._outbox_ready.set()

    def _on_step_outputs(self, message: m.StepOutputs) -> None:
        logprobs = {entry.request_id: entry.entries for entry in message.logprobs}
        finished = message.finished
        token_ids = message.token_ids
        position = 0
        for request_id, count in zip(message.request_ids, message.token_counts, strict=True):
            new_tokens = token_ids[position : position + count]
            position += count
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            rank = self._owner[request_id]
            if self._held:
                self._held.pop(request_id, None)
            update = _request_update(
                request_id, new_tokens, finished.get(request_id), logprobs.get(request_id, ())
            )
            if stream.process(update):
                self._post(rank, m.StopRequests(request_ids=(request_id,)))
            if stream.finished:
                self._finished(request_id)

    def _on_utility_result(self, message: m.UtilityResult) -> None:
        call = self._calls.get(message.call_id)
        if call is None:
            return
        call.waiting_for.discard(message.rank)
        if message.error is not None:
            call.errors.append(f"rank {message.rank}: {message.error}")
        if message.stats is not None:
            call.stats.append(message.stats)
        if not call.waiting_for:
            del self._calls[message.call_id]
            call.done.set()

    def _on_held(self, message: m.RequestsHeld) -> None:
        for request_id in message.request_ids:
            if request_id in self._streams:
                self._held[request_id] = f"rank {message.rank} is {message.reason}"

    def _on_rank_failed(self, message: m.RankFailed) -> None:
        self._die(EngineDeadError(message.error))

    def on_process_exit(self, name: str, exitcode: int | None) -> None:
        if not self._closed:
            self._die(EngineDeadError(f"{name} died (exit code {exitcode})"))

    # -- bookkeeping ---------------------------------------------------------------------

    def _finished(self, request_id: str) -> None:
        del self._streams[request_id]
        self._held.pop(request_id, None)
        self._count_finished(self._owner.pop(request_id))

    def _count_finished(self, rank: int) -> None:
        if rank < self._balancer.dp_size:  # a leaving rank is no longer balanced
            self._balancer.finished(rank)
        self.request_done.set()
        self.request_done = anyio.Event()

    def _forget(self, request_id: str) -> None:
        """The consumer left early: abort the request on its rank."""
        self._streams.pop(request_id, None)
        self._held.pop(request_id, None)
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._count_finished(rank)
            if self._dead is None and not self._closed:
                self._post(rank, m.AbortRequests(request_ids=(request_id,)))

    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine's `async with` block has ended")

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._owner.clear()
        for call in self._calls.values():
            call.done.set()
        self._calls.clear()

    def close(self) -> None:
        self._closed = True
        self._fail_all(EngineClosedError("the engine was closed while the request ran"))


def _request_update(
    request_id: str,
    new_tokens: tuple[int, ...],
    finish_reason: str | None,
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...],
) -> RequestUpdate:
    sampled = (
        tuple(
            SampledToken(request_id=request_id, token_id=token, logprob=logprob, top_logprobs=top)
            for token, logprob, top in logprobs
        )
        if logprobs
        else ()
    )
    return RequestUpdate(
        request_id=request_id,
        new_token_ids=new_tokens,
        sampled=sampled,
        finish_reason=None if finish_reason is None else FinishReason(finish_reason),
    )


@asynccontextmanager
async def open_dp_engine(
    config: EngineConfig,
    *,
    build_core: BuildCore = EngineCore.from_config,
    rank_configs: Mapping[int, EngineConfig] | None = None,
    master: str | None = None,
    local_ranks: Collection[int] | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> AsyncIterator[DPClient]:
    """Start a data-parallel engine for the block's lifetime (see the module docstring).

    `build_core(config)` runs in each rank process (a picklable, module-level callable);
    `rank_configs` gives chosen ranks a configuration of their own, which the startup
    handshake refuses unless it equals `config`. `master`, `local_ranks` and
    `on_listening` let ranks run elsewhere (`wavecore rank`); see `open_dp_processes`.
    """
    tokenizer = await anyio.to_thread.run_sync(EngineCore.tokenizer_from_config, config)
    holder: list[DPClient] = []

    def on_exit(name: str, exitcode: int | None) -> None:
        for client in holder:
            client.on_process_exit(name, exitcode)

    try:
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
                tg.start_soon(client.receive_outputs)
                tg.start_soon(client.receive_state)
                tg.start_soon(client.send_outbox)
                await tg.start(client.scaler.serve)
                try:
                    yield client
                finally:
                    client.close()
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The channels' task groups wrap whatever crosses them; one error is raised bare.
        sole = _sole_exception(group)
        if sole is None:
            raise
        raise sole from None


def _sole_exception(group: BaseExceptionGroup) -> BaseException | None:
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        item = pending.pop()
        if isinstance(item, BaseExceptionGroup):
            pending.extend(item.exceptions)
        else:
            leaves.append(item)
    return leaves[0] if len(leaves) == 1 else None
