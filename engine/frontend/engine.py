"""The front end: the one implementation of `interface.Engine`, over any core client.

Theory of operation:

1. `FrontEnd` owns everything a caller touches: request ids, input processing
   (validated and tokenized in the caller's own call, so a bad request raises there and
   never reaches a rank), one `RequestStream` per request (detokenized here), routing
   (`LoadBalancer`, or the caller's `dp_rank`), call guards, and the closed and dead
   states. Below it, a `CoreClient` carries messages to and from the ranks.
2. Its tasks live in the task group of `serving`: the output receiver (token updates,
   call replies, held requests, failures), the coordinator-state receiver (wave view
   and loads) and the outbox (aborts and stop-string finishes raised where no await is
   possible).
3. Calls (pause, resume, sleep, wake_up, reset_prefix_cache, stats) go to every rank and
   complete when every rank answered; a rank answers a pause when it holds, a sleep
   once its memory is free. The guards, the same for every engine: a second pause of
   another mode, or a resume or sleep while a pause or sleep completes, raise
   `PauseInProgressError`; a resume while asleep `EngineAsleepError`; any of them while
   a scale runs `ScalingInProgressError`; bad arguments `InvalidRequestError`.
4. A failure report from a rank, or the death of a process, kills the engine: every
   request in flight and every call waiting fails with `EngineDeadError` naming the
   cause, and every later call raises it at once. After the `async with` block, every
   call raises `EngineClosedError`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import (
    DuplicateRequestError,
    EngineAsleepError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    PauseInProgressError,
    ProfilerStateError,
    RankCallError,
    ScalingInProgressError,
    UnknownRequestError,
    WeightUpdateInProgressError,
    WeightUpdateRefusedError,
)
from wavecore.engine.frontend.call_checks import (
    check_params_text,
    check_prompt,
    check_request_id,
    timeout_seconds,
)
from wavecore.engine.frontend.core_client import CoreClient
from wavecore.engine.frontend.input_processor import InputProcessor
from wavecore.engine.frontend.iteration_stats import IterationStats
from wavecore.engine.frontend.load_balancer import LoadBalancer
from wavecore.engine.frontend.lora_calls import LoRACalls
from wavecore.engine.frontend.output_receivers import OutputReceivers
from wavecore.engine.frontend.request_stream import RequestStream
from wavecore.engine.frontend.scale_host import ScaleHostPart
from wavecore.engine.frontend.weight_calls import WeightCalls
from wavecore.engine.interface import (
    DEFAULT_SHARD_SIZE,
    EngineStats,
    PauseModeName,
    RankStats,
)
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.request import Prompt
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import SLEEP_TAGS, PauseMode, sleep_tags

_request_numbers = itertools.count()


@dataclass(slots=True)
class _Call:
    """A call to ranks, awaiting one answer from each. Counted, not matched by number: a
    shrink renumbers the survivors (`lose_ranks`), and a survivor answers under its old
    number until its own renumbering reaches it, so a number cannot say who answered."""

    ranks: set[int]  # the ranks called, in the current numbering
    pending: int  # answers still to come
    answered: set[int] = field(default_factory=set)  # the numbers answers came under
    done: anyio.Event = field(default_factory=anyio.Event)
    errors: list[str] = field(default_factory=list)
    stats: list[RankStats] = field(default_factory=list)


def pause_mode(mode: object) -> PauseMode:
    """A `PauseMode`, or its name; anything else is refused by name."""
    if isinstance(mode, PauseMode):
        return mode
    if isinstance(mode, str) and mode in {m.value for m in PauseMode}:
        return PauseMode(mode)
    raise InvalidRequestError(
        f"pause mode must be 'abort', 'wait', 'keep' or a PauseMode, got {mode!r}"
    )


def sleep_level(level: object) -> int:
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise InvalidRequestError(f"sleep level must be 0, 1 or 2, got {level!r}")
    return level  # type: ignore[return-value]


def wake_tags(tags: Sequence[str] | None) -> frozenset[str]:
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        raise InvalidRequestError(f"wake_up takes a list of tags, not the string {tags!r}")
    try:
        unknown = set(tags) - SLEEP_TAGS
    except TypeError:  # not iterable, or unhashable items
        raise InvalidRequestError(f"wake_up takes a list of tags, got {tags!r}") from None
    if unknown:
        raise InvalidRequestError(
            f"unknown wake_up tag(s) {sorted(unknown)}; known: {sorted(SLEEP_TAGS)}"
        )
    return frozenset(tags)


class FrontEnd(ScaleHostPart, OutputReceivers):
    """Use through `open_engine`; every method is safe to call from any task."""

    def __init__(self, core: CoreClient, config: EngineConfig | None = None) -> None:
        self._core = core
        self._inputs = InputProcessor(core.tokenizer, max_model_len=core.max_model_len)
        self._tokenizer = core.tokenizer
        self._balancer = LoadBalancer(core.dp_size)
        self._dp_size = core.dp_size
        self._streams: dict[str, RequestStream] = {}
        self._owner: dict[str, int] = {}
        # A request sent again after its rank was lost travels under a new id (the
        # caller's id -> it): the lost rank's last outputs may still be on their way.
        self._resent_as: dict[str, str] = {}
        self._held: dict[str, str] = {}
        # Structured-output requests accepted, per kind (`EngineStats`, /metrics).
        self._structured_requests: Counter[str] = Counter()
        # The ranks' iteration details (`log_iteration_details`), logged and counted.
        self._iterations = IterationStats()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._outbox: deque[tuple[int, Any]] = deque()
        self._outbox_ready = anyio.Event()
        # Sends go out in the order they were made, posted ones included (an abort of a
        # stream left early must reach its rank before a later call does).
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._request_done = anyio.Event()
        self._published = anyio.Event()
        self._wave = 0
        self._engines_running = False
        self._published_size = core.dp_size
        self._requests_per_rank = [0] * core.dp_size
        # The protocol's state as the caller sees it (the ranks' machines hold the truth).
        self._pausing: PauseMode | None = None
        self._pause_call: _Call | None = None
        self._sleeping = False
        self._paused = False
        self._asleep: frozenset[str] = frozenset()
        self._scaling = False
        # Whether the ranks run the torch profiler (`start_profile`).
        self._profiling = False
        # A level-2 sleep dropped the weights: they come back from the model file.
        self._weights_dropped = False
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._weights = WeightCalls(
            send=self._send,
            call_ids=self._call_ids,
            max_chunk_bytes=core.max_chunk_bytes,
            check_open=self._check_open,
        )
        self._loras = LoRACalls(
            self._weights,
            enabled=config is not None and config.enable_lora,
            max_loras=config.max_loras if config is not None else 1,
        )

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def core_client(self) -> CoreClient:
        """The core client below, for tools and tests that inspect what serves."""
        return self._core

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        dp_rank: int | None = None,
        lora: str | LoRARequest | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream one request's output; see `interface.Engine.generate`."""
        self._check_open()
        if isinstance(lora, LoRARequest):
            if lora.name not in self._loras.adapters:
                await self.add_lora(lora)  # loaded on first use, as upstream does
            elif self._loras.adapters[lora.name].path != lora.path:
                await self.add_lora(lora)  # refused: another adapter holds the name
            lora = lora.name
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Before the checks below: nothing waits between them and the send.
            await self._inputs.check_structured_outputs(params.structured_outputs)
            self._check_open()
            self._structured_requests[params.structured_outputs.kind] += 1
        request_id = request_id if request_id is not None else f"req-{next(_request_numbers)}"
        check_request_id(request_id)
        check_prompt(prompt)
        check_params_text(params)
        if request_id in self._streams or request_id in self._resent_as:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        routable = self._balancer.dp_size  # smaller while a scale down drains
        if dp_rank is not None and (
            isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < routable
        ):
            raise InvalidRequestError(f"dp_rank must be an int in [0, {routable}), got {dp_rank!r}")
        request = self._inputs.prepare(request_id, prompt, params)
        if lora is not None:
            # Checked and counted with no await before the send: a remove_lora cannot
            # come between.
            self._loras.check_request(lora)  # type: ignore[arg-type]
            request = dataclasses.replace(request, lora=lora)
            self._loras.in_flight[lora] += 1  # type: ignore[index]
        if dp_rank is None:
            rank = self._balancer.pick()
        else:
            rank = dp_rank
            self._balancer.assigned(rank)
        stream = RequestStream(request, self._tokenizer)  # type: ignore[arg-type]
        self._streams[request_id] = stream
        self._owner[request_id] = rank
        self._requests_per_rank[rank] += 1
        wave = self._wave
        try:
            await self._send(
                rank,
                m.AddRequest(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=params,
                    wave=wave,
                    lora=request.lora,
                ),
            )
            if self._core.lockstep and not self._engines_running:
                await self._core.send_coordinator(m.FirstRequest(rank=rank, wave=wave))
            # Closed here, not by the garbage collector (trio warns of the latter) when
            # the caller leaves early.
            async with aclosing(stream.deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if not stream.finished:
                self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        self._check_open()
        check_request_id(request_id)
        sent_as = self._resent_as.get(request_id, request_id)
        rank = self._owner.get(sent_as)
        if rank is None:
            raise UnknownRequestError(f"no request {request_id!r} in flight")
        await self._send(rank, m.AbortRequests(request_ids=(sent_as,)))

    # -- pause, sleep, wake ------------------------------------------------------------

    async def pause(
        self, mode: PauseMode | PauseModeName = PauseMode.KEEP, *, clear_cache: bool = True
    ) -> None:
        self._check_open()
        mode = pause_mode(mode)
        self._check_not_scaling("pause")
        if self._sleeping or (self._pausing is not None and self._pausing is not mode):
            raise PauseInProgressError(self._in_progress())
        if self._pause_call is None:
            self._pausing = mode
            self._pause_call = await self._start_call(
                range(self._dp_size), lambda cid: _utility(cid, "pause", pause_mode=mode.value)
            )
        call = self._pause_call
        try:
            await self._finish_call(call)
        finally:
            if self._pause_call is call:
                self._pause_call = None
                self._pausing = None
        self._paused = True
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume(self) -> None:
        self._check_open()
        self._check_not_scaling("resume")
        self._check_not_updating("resume")
        if self._pausing is not None or self._sleeping:
            raise PauseInProgressError(self._in_progress())
        if self._asleep:
            raise EngineAsleepError(
                f"cannot resume while asleep ({', '.join(sorted(self._asleep))}); "
                "call wake_up first"
            )
        await self._call_all(lambda cid: _utility(cid, "resume"))
        self._paused = False

    async def sleep(self, level: int = 1, *, mode: PauseMode | PauseModeName = "abort") -> None:
        self._check_open()
        level = sleep_level(level)
        mode = pause_mode(mode)
        self._check_not_scaling("sleep")
        self._check_not_updating("sleep")
        if self._sleeping or self._pausing is not None:
            raise PauseInProgressError(self._in_progress())
        self._sleeping = True
        try:
            await self._call_all(
                lambda cid: _utility(cid, "sleep", sleep_level=level, pause_mode=mode.value)
            )
        finally:
            self._sleeping = False
        self._paused = True
        self._asleep |= sleep_tags(level)
        self._weights_dropped |= level == 2

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        wanted = wake_tags(tags)
        self._check_not_scaling("wake_up")
        self._check_not_updating("wake_up")
        if self._sleeping:
            raise PauseInProgressError(self._in_progress())
        if self._weights_dropped and "weights" in wanted:
            # Relabelled while nothing runs, so no token of the reloaded weights can
            # carry the version of the weights that were dropped.
            await self._weights.reloaded(range(self._dp_size))
            self._weights_dropped = False
        await self._call_all(lambda cid: _utility(cid, "wake_up", wake_tags=tuple(sorted(wanted))))
        was_asleep, self._asleep = self._asleep, self._asleep - wanted
        if was_asleep and not self._asleep:
            self._paused = False  # the ranks resume once nothing is asleep any more

    async def is_sleeping(self) -> bool:
        self._check_open()
        return bool(self._asleep)

    async def is_paused(self) -> bool:
        self._check_open()
        return self._paused

    async def reset_prefix_cache(self) -> None:
        self._check_open()
        await self._call_all(lambda cid: _utility(cid, "reset_prefix_cache"))

    async def stats(self) -> EngineStats:
        """Every rank's figures, taken after every call made before this one."""
        self._check_open()
        call = await self._call_all(lambda cid: _utility(cid, "stats"))
        ranks = tuple(
            replace(report, node=self._core.rank_node(report.rank))
            for report in sorted(call.stats, key=lambda report: report.rank)
        )
        wave, running = self._wave, self._engines_running
        if not self._core.has_coordinator:
            wave = max(rank.counters.wave for rank in ranks)
            running = any(rank.counters.running for rank in ranks)
        dropped = dict(self._core.dropped_frames)
        for report in ranks:
            dropped.update(report.dropped_frames)
        return EngineStats(
            dropped_frames=dropped,
            ranks=ranks,
            wave=wave,
            engines_running=running,
            held=dict(self._held),
            requests_per_rank=tuple(self._requests_per_rank),
            structured_requests=dict(self._structured_requests),
            iterations=self._iterations.snapshot(),
        )

    # -- LoRA adapters (`LoRACalls`) ------------------------------------------------------

    async def add_lora(self, request: LoRARequest) -> None:
        self._check_open()
        self._check_not_scaling("add_lora")
        await self._loras.add(range(self._dp_size), request)

    async def remove_lora(self, name: str) -> None:
        self._check_open()
        self._check_not_scaling("remove_lora")
        await self._loras.remove(range(self._dp_size), name)

    async def pin_lora(self, name: str) -> None:
        self._check_open()
        self._check_not_scaling("pin_lora")
        await self._loras.pin(range(self._dp_size), name)

    async def list_loras(self) -> list[LoRARequest]:
        self._check_open()
        return [self._loras.adapters[name] for name in self._loras.names()]

    def lora_names(self) -> list[str]:
        """The adapters loaded, without a call (for the server's `model` field)."""
        return self._loras.names()

    # -- weights ---------------------------------------------------------------------

    @property
    def weight_version(self) -> str | None:
        return self._weights.version

    async def update_weights(
        self,
        source: str | os.PathLike[str] | Mapping[str, Any],
        *,
        version: str | None = None,
        partial: bool = False,
    ) -> None:
        """See `interface.Engine.update_weights`; the two phases are `WeightCalls`'."""
        self._check_open()
        _check_version(version)
        if not isinstance(partial, bool):
            raise InvalidRequestError(f"partial must be a bool, got {partial!r}")
        self._check_not_scaling("update_weights")
        if self._sleeping or self._pausing is not None:
            raise PauseInProgressError(self._in_progress())
        if not self._paused:
            raise WeightUpdateRefusedError(
                "the engine is serving: call pause('keep') or pause('abort') "
                "(or sleep, then wake_up(['weights'])) before update_weights"
            )
        if "weights" in self._asleep:
            raise WeightUpdateRefusedError(
                "the weights are asleep: call wake_up(['weights']) before update_weights"
            )
        await self._weights.update_weights(
            range(self._dp_size), source, version=version, partial=partial
        )

    async def set_weight_version(self, version: str | None) -> None:
        self._check_open()
        _check_version(version)
        self._check_not_scaling("set_weight_version")
        await self._weights.set_weight_version(range(self._dp_size), version)

    async def save_weights(
        self, directory: str | os.PathLike[str], *, max_shard_size: int = DEFAULT_SHARD_SIZE
    ) -> None:
        """See `interface.Engine.save_weights`: the first rank writes (`WeightCalls`)."""
        self._check_open()
        if not isinstance(directory, str | os.PathLike):
            raise InvalidRequestError(
                f"save_weights takes a directory path, got a {type(directory).__name__}"
            )
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int):
            raise InvalidRequestError(f"max_shard_size must be an int, got {max_shard_size!r}")
        if max_shard_size < 1:
            raise InvalidRequestError(f"max_shard_size must be positive, got {max_shard_size}")
        self._check_not_scaling("save_weights")
        self._check_not_updating("save_weights")
        if "weights" in self._asleep:
            raise WeightUpdateRefusedError(
                "the weights are asleep: call wake_up(['weights']) before save_weights"
            )
        await self._weights.save_weights(0, directory, max_shard_size=max_shard_size)

    async def start_profile(self, directory: str | os.PathLike[str]) -> None:
        """See `interface.Engine.start_profile`."""
        self._check_open()
        if not isinstance(directory, str | os.PathLike):
            raise InvalidRequestError(
                f"start_profile takes a directory path, got a {type(directory).__name__}"
            )
        self._check_not_scaling("start_profile")
        if self._profiling:
            raise ProfilerStateError("the profiler already runs: call stop_profile first")
        self._profiling = True
        try:
            await self._weights.profile(range(self._dp_size), "start", directory)
        except BaseException:
            # The ranks that did start must not keep profiling.
            with anyio.CancelScope(shield=True):
                await self._stop_profile_quietly()
            raise

    async def _stop_profile_quietly(self) -> None:
        try:
            await self._weights.profile(range(self._dp_size), "stop", None)
        except EngineError:
            pass  # the ranks that never started refuse, which is all this says
        finally:
            self._profiling = False

    async def stop_profile(self) -> list[str]:
        """See `interface.Engine.stop_profile`."""
        self._check_open()
        if not self._profiling:
            raise ProfilerStateError("the profiler is not running: call start_profile first")
        try:
            return await self._weights.profile(range(self._dp_size), "stop", None)
        finally:
            self._profiling = False

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the upstream API's name for it)
    ) -> list[Any]:
        self._check_open()
        if not isinstance(method, str) or not method:
            raise InvalidRequestError(f"method must be a non-empty str, got {method!r}")
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise InvalidRequestError(f"args must be a list or tuple, got {args!r}")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise InvalidRequestError(f"kwargs must be a mapping or None, got {kwargs!r}")
        if timeout is not None and not timeout_seconds(timeout, "timeout") > 0:  # type: ignore[operator]
            raise InvalidRequestError(f"timeout must be > 0 or None, got {timeout!r}")
        self._check_not_scaling("collective_rpc")
        return await self._weights.collective_rpc(
            range(self._dp_size), method, args, kwargs or {}, timeout
        )

    # -- calls -------------------------------------------------------------------------

    def _check_not_scaling(self, what: str) -> None:
        if self._scaling:
            raise ScalingInProgressError(f"{what} refused: a scale is still in progress")

    def _check_not_updating(self, what: str) -> None:
        # A resume between the phases would let a rank switch weights mid-serving.
        if self._weights.updating:
            raise WeightUpdateInProgressError(f"{what} refused: update_weights is still running")

    def _in_progress(self) -> str:
        if self._sleeping:
            return "a sleep is still completing"
        mode = self._pausing.name if self._pausing is not None else "?"
        return f"a {mode} pause is still completing"

    async def _call_all(self, message: Callable[[int], Any]) -> _Call:
        call = await self._start_call(range(self._dp_size), message)
        await self._finish_call(call)
        return call

    async def _start_call(self, ranks: Collection[int], message: Callable[[int], Any]) -> _Call:
        call_id = next(self._call_ids)
        called = set(ranks)
        call = _Call(ranks=called, pending=len(called))
        self._calls[call_id] = call
        built = message(call_id)
        for rank in ranks:
            await self._send(rank, built)
        return call

    async def _finish_call(self, call: _Call) -> None:
        await call.done.wait()
        self._check_open()
        if call.errors:
            raise RankCallError("; ".join(call.errors))

    # -- bookkeeping -------------------------------------------------------------------

    def _finished(self, request_id: str) -> None:
        stream = self._streams.pop(request_id)
        self._lora_done(stream)
        self._resent_as.pop(stream.request_id, None)
        self._held.pop(request_id, None)
        self._count_finished(self._owner.pop(request_id))

    def _count_finished(self, rank: int) -> None:
        if rank < self._balancer.dp_size:  # a leaving rank is no longer balanced
            self._balancer.finished(rank)
        self._request_done.set()
        self._request_done = anyio.Event()

    def _forget(self, request_id: str) -> None:
        """The consumer left early: abort the request on its rank."""
        request_id = self._resent_as.pop(request_id, request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._lora_done(stream)
        self._held.pop(request_id, None)
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._count_finished(rank)
            if self._dead is None and not self._closed:
                self._post(rank, m.AbortRequests(request_ids=(request_id,)))

    def _lora_done(self, stream: RequestStream) -> None:
        name = stream.request.lora
        if name is not None:
            self._loras.in_flight[name] -= 1

    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the engine's `async with` block has ended")

    def die(self, error: EngineDeadError) -> None:
        """The engine cannot go on: fail everything in flight with `error`."""
        if self._dead is not None or self._closed:
            return
        self._dead = error
        self._fail_all(error)

    def _fail_all(self, error: EngineError) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self._loras.in_flight.clear()
        self._owner.clear()
        self._resent_as.clear()
        for call in self._calls.values():
            call.done.set()
        self._calls.clear()
        self._weights.fail_all()
        self._request_done.set()
        self._published.set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(EngineClosedError("the engine was closed while the request ran"))


def _check_version(version: object) -> None:
    if version is not None and not isinstance(version, str):
        raise InvalidRequestError(f"a weight version is a str or None, got {version!r}")


def _utility(call_id: int, method: str, **arguments: Any) -> m.UtilityCall:
    return m.UtilityCall(call_id=call_id, method=method, **arguments)


@asynccontextmanager
async def serving(core: CoreClient, config: EngineConfig | None = None) -> AsyncIterator[FrontEnd]:
    """The front end over `core`, its tasks running for the block's lifetime; with
    `config`, its LoRA settings, and its `lora_modules` loaded on every rank first."""
    front = FrontEnd(core, config)
    core.on_death(front.die)
    core.attach(front)
    async with anyio.create_task_group() as tg:
        tg.start_soon(front.receive_outputs)
        tg.start_soon(front.receive_state)
        tg.start_soon(front.send_outbox)
        try:
            for module in config.lora_modules if config is not None else ():
                await front.add_lora(module)
            yield front
        finally:
            front.close()
            tg.cancel_scope.cancel()
