"""The front end's side of LoRA adapters: the engine's set, and the calls that change it.

Theory of operation:

1. The front end keeps the set every rank holds (`adapters`, `pinned`) and counts the
   requests in flight per adapter. A request naming an adapter outside the set is
   refused in the caller's own call (`UnknownLoRAError`), before it reaches a rank.
2. `add` is all or nothing: every rank reads and checks the adapter (`core.rank_calls`);
   if any refuses, the ranks that took it drop it again, and the error names each rank
   that refused and why. `remove` is refused while requests under the adapter are in
   flight; `pin` while pinning would leave no slot for the adapters of requests in
   flight. One change at a time (a lock), so every rank sees them in the same order.
3. A rank started later (a scale up, or a restart after a loss) is given the whole
   set, pins included, before it serves (`load_on`, from the scale's start phase: a
   rank that cannot load it fails the scale, which is rolled back).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import anyio

from wavecore.engine.errors import InvalidRequestError, LoRAError, UnknownLoRAError
from wavecore.engine.frontend.weight_calls import WeightCalls
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.weight_messages import LORA_ADD, LORA_PIN, LORA_REMOVE, LoRACall, RankReply


class LoRACalls:
    def __init__(self, calls: WeightCalls, *, enabled: bool, max_loras: int) -> None:
        self._calls = calls
        self.enabled = enabled
        self.max_loras = max_loras
        self.adapters: dict[str, LoRARequest] = {}
        self.pinned: set[str] = set()
        # Requests in flight per adapter (`/metrics` and the checks of remove and pin).
        self.in_flight: Counter[str] = Counter()
        self._removing: set[str] = set()
        self._lock = anyio.Lock()

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def check_request(self, name: str) -> None:
        """Refuse a request under adapter `name` that could not be served."""
        self._check_enabled()
        if not isinstance(name, str):
            raise InvalidRequestError(f"lora must be a str or a LoRARequest, got {name!r}")
        if name not in self.adapters or name in self._removing:
            raise UnknownLoRAError(
                f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(self.names()) or 'none'})"
            )
        if name not in self.pinned and len(self.pinned) >= self.max_loras:
            raise LoRAError(
                f"LoRA adapter {name!r} cannot run: all max_loras={self.max_loras} slots "
                f"hold pinned adapters ({', '.join(sorted(self.pinned))})"
            )

    async def add(self, ranks: Sequence[int], request: LoRARequest) -> None:
        self._check_enabled()
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"add_lora takes a LoRARequest, got {request!r}")
        async with self._lock:
            held = self.adapters.get(request.name)
            if held is not None:
                if held.path == request.path:
                    return
                raise LoRAError(
                    f"LoRA adapter {request.name!r} is already loaded from {held.path}; "
                    "remove it before loading another adapter under that name"
                )
            await self._add_on(ranks, request)
            self.adapters[request.name] = request

    async def remove(self, ranks: Sequence[int], name: str) -> None:
        self._check_enabled()
        async with self._lock:
            self._check_known(name)
            if self.in_flight[name]:
                raise LoRAError(
                    f"LoRA adapter {name!r} serves {self.in_flight[name]} request(s) in "
                    "flight: abort them or let them finish before remove_lora"
                )
            self._removing.add(name)
            try:
                replies = await self._send(ranks, LORA_REMOVE, name)
            finally:
                self._removing.discard(name)
            # Gone from the set whatever a rank answered: no request may name it now.
            del self.adapters[name]
            self.pinned.discard(name)
            _raise_failed(replies, f"remove_lora {name!r}")

    async def pin(self, ranks: Sequence[int], name: str) -> None:
        self._check_enabled()
        async with self._lock:
            self._check_known(name)
            if name in self.pinned:
                return
            if len(self.pinned) >= self.max_loras:
                raise LoRAError(
                    f"cannot pin LoRA adapter {name!r}: all max_loras={self.max_loras} "
                    f"slots hold pinned adapters ({', '.join(sorted(self.pinned))})"
                )
            waiting = {n for n, count in self.in_flight.items() if count} - self.pinned - {name}
            if waiting and len(self.pinned) + 1 >= self.max_loras:
                raise LoRAError(
                    f"cannot pin LoRA adapter {name!r}: it would pin the last free slot "
                    f"while requests under {', '.join(sorted(waiting))} are in flight"
                )
            replies = await self._send(ranks, LORA_PIN, name)
            _raise_failed(replies, f"pin_lora {name!r}")
            self.pinned.add(name)

    async def load_on(self, ranks: Sequence[int]) -> None:
        """Give ranks that are not serving yet the whole set, pins included."""
        if not self.adapters:
            return
        async with self._lock:
            for request in self.adapters.values():
                replies = await self._send(ranks, LORA_ADD, request.name, request.path)
                _raise_failed(replies, f"loading LoRA adapter {request.name!r} on a new rank")
            for name in sorted(self.pinned):
                replies = await self._send(ranks, LORA_PIN, name)
                _raise_failed(replies, f"pinning LoRA adapter {name!r} on a new rank")

    async def _add_on(self, ranks: Sequence[int], request: LoRARequest) -> None:
        try:
            replies = await self._send(ranks, LORA_ADD, request.name, request.path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._send(ranks, LORA_REMOVE, request.name)
            raise
        failed = {rank: reply.error for rank, reply in sorted(replies.items()) if reply.error}
        if failed:
            took = [rank for rank in ranks if rank not in failed]
            if took:
                await self._send(took, LORA_REMOVE, request.name)
            detail = "; ".join(f"rank {rank}: {error}" for rank, error in failed.items())
            raise LoRAError(f"add_lora {request.name!r} failed ({detail}); no rank holds it")

    async def _send(
        self, ranks: Sequence[int], action: str, name: str, path: str | None = None
    ) -> dict[int, RankReply]:
        message = LoRACall(call_id=self._calls.next_call_id(), action=action, name=name, path=path)
        return await self._calls.call(ranks, message)

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("LoRA is not enabled: start the engine with enable_lora=True")

    def _check_known(self, name: object) -> None:
        if not isinstance(name, str) or name not in self.adapters:
            raise UnknownLoRAError(
                f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(self.names()) or 'none'})"
            )


def _raise_failed(replies: dict[int, RankReply], what: str) -> None:
    failed = [(rank, reply.error) for rank, reply in sorted(replies.items()) if reply.error]
    if failed:
        raise LoRAError(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
