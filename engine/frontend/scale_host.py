"""The front end's part in elastic scaling: `scale` and what a scale asks of the front
end (`core_client.ScaleHost`): routing, tables, draining, calls to ranks, shrinking."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

from wavecore.engine import messages as m
from wavecore.engine.errors import (
    InvalidRequestError,
    ScalingRefusedError,
)
from wavecore.engine.frontend.call_checks import timeout_seconds
from wavecore.engine.frontend.load_balancer import LoadBalancer


class ScaleHostPart:
    """`FrontEnd`'s scaling methods; a part of `FrontEnd`, whose fields they read and change."""

    __slots__ = ()

    async def scale(self, new_dp_size: int, *, drain_timeout: float | None = None) -> None:
        self._check_open()
        if isinstance(new_dp_size, bool) or not isinstance(new_dp_size, int) or new_dp_size < 1:
            raise ScalingRefusedError(f"new_dp_size must be an int >= 1, got {new_dp_size!r}")
        try:
            drain_timeout = timeout_seconds(drain_timeout, "drain_timeout")
        except InvalidRequestError as error:
            raise ScalingRefusedError(str(error)) from None
        self._check_not_scaling("scale")
        if self._paused or self._pausing is not None or self._sleeping:
            raise ScalingRefusedError(
                "the engine is paused or asleep: resume or wake it before scaling"
            )
        if new_dp_size == self._dp_size:
            return
        if self._profiling:
            raise ScalingRefusedError("the profiler runs: call stop_profile before scaling")
        if self._weights.updated:
            raise ScalingRefusedError(
                "the ranks serve weights given to update_weights (version "
                f"{self._weights.version!r}); a new rank would load the model file instead"
            )
        self._scaling = True
        try:
            await self._core.scale(self, new_dp_size, drain_timeout)
        finally:
            self._scaling = False

    # -- what a scale asks of the front end (`core_client.ScaleHost`) ----------------------

    def route_to(self, dp_size: int) -> None:
        balancer = LoadBalancer(dp_size)
        kept = min(dp_size, self._balancer.dp_size)
        balancer.inflight[:kept] = self._balancer.inflight[:kept]
        self._balancer = balancer

    def resize_tables(self, dp_size: int) -> None:
        self._dp_size = dp_size
        self._requests_per_rank = (self._requests_per_rank + [0] * dp_size)[:dp_size]
        self.route_to(dp_size)

    def unfinished_on(self, ranks: Collection[int]) -> dict[str, int]:
        return {rid: rank for rid, rank in self._owner.items() if rank in ranks}

    async def request_finished(self) -> None:
        await self._request_done.wait()
        self._check_open()

    async def abort_on(self, requests: dict[str, int]) -> None:
        for request_id, rank in requests.items():
            await self._send(rank, m.AbortRequests(request_ids=(request_id,)))

    async def prepare_ranks(self, ranks: Collection[int]) -> None:
        await self._loras.load_on(sorted(ranks))

    async def call_ranks(self, ranks: Collection[int], message: Callable[[int], Any]) -> None:
        call = await self._start_call(ranks, message)
        await self._finish_call(call)

    async def coordinator_size(self, dp_size: int) -> None:
        while self._published_size != dp_size:
            await self._published.wait()
            self._check_open()

    def shrink_refused(self) -> str | None:
        if self._scaling:
            return "a scale was running"
        if self._paused or self._pausing is not None or self._sleeping or self._asleep:
            return "the engine was paused or asleep"
        if self._weights.updating:
            return "update_weights was running"
        return None

    def reconfiguring(self, active: bool) -> None:
        self._scaling = active

    async def lose_ranks(
        self, lost: Collection[int], survivors: Sequence[int], error: str, *, resend: bool
    ) -> None:
        new = {old: rank for rank, old in enumerate(survivors)}
        again: list[str] = []
        for request_id, rank in list(self._owner.items()):
            stream = self._streams[request_id]
            if rank in new:
                self._owner[request_id] = new[rank]
            elif resend and not stream.produced_output and not stream.resent:
                again.append(request_id)
            else:
                stream.end_with_error(error)
                self._finished(request_id)
        for call_id, call in list(self._calls.items()):
            # Every answer so far came under the old numbers; a lost rank that did not
            # answer never will.
            silent = (call.ranks & set(lost)) - call.answered
            if silent:
                call.errors.append(error)
                call.pending -= len(silent)
            call.ranks = {new[rank] for rank in call.ranks if rank in new}
            call.answered = {new[rank] for rank in call.answered if rank in new}
            if call.pending <= 0:
                del self._calls[call_id]
                call.done.set()
        self._outbox = deque((new[rank], item) for rank, item in self._outbox if rank in new)
        inflight = [self._balancer.inflight[old] for old in survivors]
        self._requests_per_rank = [self._requests_per_rank[old] for old in survivors]
        self._dp_size = len(survivors)
        self.route_to(len(survivors))
        self._balancer.inflight = inflight
        for request_id in again:
            # No output yet: sent again whole, once (it may be what broke its rank), so
            # its caller sees one exact answer. Under a new id, so that what the lost
            # rank produced before it died and is still on its way finds no stream.
            stream = self._streams.pop(request_id)
            del self._owner[request_id]
            stream.resent = True
            sent_as = request_id + "\x00"
            while sent_as in self._streams or sent_as in self._resent_as:
                sent_as += "\x00"
            self._resent_as[request_id] = sent_as
            self._streams[sent_as] = stream
            request = stream.request
            rank = self._balancer.pick()
            self._owner[sent_as] = rank
            self._requests_per_rank[rank] += 1
            message = m.AddRequest(
                request_id=sent_as,
                prompt_token_ids=request.prompt_token_ids,
                params=request.params,
                wave=self._wave,
                lora=request.lora,
            )
            await self._send(rank, message)
