"""The front end's receiving side: the tasks that read the ranks' outputs and the
coordinator's state, the outbox sender, and what each kind of output does."""

from __future__ import annotations

from typing import Any

import anyio

from wavecore.engine import messages as m
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.executors.batch import SampledToken
from wavecore.engine.scheduler import RequestUpdate
from wavecore.engine.weight_messages import RankReply
from wavecore.statemachines import FinishReason


class OutputReceivers:
    """`FrontEnd`'s receiving tasks and handlers; a part of `FrontEnd`, whose fields
    they read and change."""

    __slots__ = ()

    # -- receivers ---------------------------------------------------------------------

    async def receive_outputs(self) -> None:
        handlers = {
            m.StepOutputs: self._on_step_outputs,
            m.UtilityResult: self._on_utility_result,
            m.RequestsHeld: self._on_held,
            RankReply: self._weights.on_reply,
        }
        async for message in self._core.outputs():
            if isinstance(message, m.RankFailed):
                await self._on_rank_failed(message)
                continue
            handler = handlers.get(type(message))
            if handler is not None:
                handler(message)
        if not self._closed:
            self.die(EngineDeadError("every rank closed its output channel"))

    async def receive_state(self) -> None:
        async for state in self._core.coordinator_states():
            self._wave = state.wave
            self._engines_running = state.engines_running
            size = self._balancer.dp_size  # smaller while a scale down drains
            if len(state.waiting) >= size:  # fewer: no coordinator of this engine sent it
                self._balancer.update(
                    state.waiting[:size], state.running[:size], state.kv_usage[:size]
                )
            if len(state.waiting) != self._published_size:
                self._published_size = len(state.waiting)
                self._published.set()
                self._published = anyio.Event()

    async def send_outbox(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = anyio.Event()
            async with self._send_lock:
                await self._send_posted()

    async def _send(self, rank: int, message: Any) -> None:
        async with self._send_lock:
            await self._send_posted()
            await self._core.send(rank, message)

    async def _send_posted(self) -> None:
        while self._outbox:
            rank, message = self._outbox.popleft()
            await self._core.send(rank, message)

    def _post(self, rank: int, message: Any) -> None:
        self._outbox.append((rank, message))
        self._outbox_ready.set()

    def _on_step_outputs(self, message: m.StepOutputs) -> None:
        if message.iterations:
            self._iterations.add(message.rank, message.iterations)
        logprobs = {entry.request_id: entry.entries for entry in message.logprobs}
        finished = message.finished
        errors = message.errors
        token_ids = message.token_ids
        version = self._weights.version_of(message.rank)
        position = 0
        for request_id, count in zip(message.request_ids, message.token_counts, strict=True):
            new_tokens = token_ids[position : position + count]
            position += count
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if self._held:
                self._held.pop(request_id, None)
            error = errors.get(request_id)
            if error is not None:  # its grammar failed on the rank
                stream.end_with_error(error)
                self._finished(request_id)
                continue
            update = _request_update(
                stream.request_id,  # the caller's (a request sent again travels under another)
                new_tokens,
                finished.get(request_id),
                logprobs.get(request_id, ()),
            )
            if stream.process(update, version):
                self._post(self._owner[request_id], m.StopRequests(request_ids=(request_id,)))
            if stream.finished:
                self._finished(request_id)

    def _on_utility_result(self, message: m.UtilityResult) -> None:
        call = self._calls.get(message.call_id)
        if call is None:
            return
        call.pending -= 1
        call.answered.add(message.rank)
        if message.error is not None:
            call.errors.append(f"rank {message.rank}: {message.error}")
        if message.stats is not None:
            call.stats.append(message.stats)
        if call.pending <= 0:
            del self._calls[message.call_id]
            call.done.set()

    def _on_held(self, message: m.RequestsHeld) -> None:
        for request_id in message.request_ids:
            if request_id in self._streams:
                self._held[request_id] = f"rank {message.rank} is {message.reason}"

    async def _on_rank_failed(self, message: m.RankFailed) -> None:
        error = EngineDeadError(message.error)
        self.die(await self._core.root_cause(error, in_collective=message.in_collective))


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
