"""Fair admission of engine requests across HTTP clients.

The engine serves its queue first come, first served, so a caller that sent 64 prompts
x n, or a hundred calls at once, used to fill that queue ahead of everyone else: every
other client waited for all of it. Here every engine request of a call (each prompt,
each of its `n`) waits for a slot before it reaches the engine:

* `capacity` slots in all (by default the sequences the engine runs at once, so its
  own queue stays short and the order is decided here, not by arrival);
* at most `per_client` held by one client (by default three quarters of `capacity`:
  one caller alone never fills the engine, so another's request starts at once, at
  the cost of a quarter of the engine a lone caller could have used);
* a free slot goes to the next client in turn that has work queued and is under its
  cap: first the clients not served since they came (in order of arrival), then the
  others round-robin, the least recently served first; within a client its requests
  keep their order.

A client may have at most `per_client + queue_per_client` requests outstanding (in
flight and queued): a call past that is refused whole, before anything of it runs,
with a 429 and `Retry-After`. A queued request whose waiter is cancelled (its client
went away, its call failed) leaves the queue at once; at a shutdown's timeout `close`
ends every request still queued (they must not start once those in flight are aborted).

Who is a client: `client_key`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import chain

import anyio

from wavecore.engine.serve.errors import APIError


def client_key(peer: str | None, user: str | None, *, authenticated: bool) -> str:
    """Who a request counts against: the `user` field of an authenticated request (the
    server requires an API key, so whoever sets it holds the key: a proxy or service
    naming its own end users), else the peer's address, without its port (one client
    opening many connections stays one client). An unauthenticated `user` is ignored:
    a stranger could otherwise take a new name for every request."""
    if authenticated and user:
        return f"user:{user}"
    return f"peer:{peer or 'unknown'}"


class AdmissionClosedError(Exception):
    """The server is shutting down: a request still waiting for its turn never runs."""


@dataclass(eq=False, slots=True)
class _Waiter:
    granted: anyio.Event = field(default_factory=anyio.Event)
    admitted: bool = False


@dataclass(slots=True)
class _Client:
    in_flight: int = 0
    outstanding: int = 0  # reserved: queued, in flight, or about to be queued
    queue: deque[_Waiter] = field(default_factory=deque)


class FairAdmission:
    """Slots for engine requests, shared round-robin among clients (see the module)."""

    def __init__(
        self,
        capacity: Callable[[], int],
        *,
        per_client: int | None,
        queue_per_client: int,
    ) -> None:
        # A callable: the engine's capacity changes when it scales.
        self._capacity = capacity
        self._per_client = per_client
        self.queue_per_client = queue_per_client
        self.in_flight = 0
        self._closed = False
        # Clients with anything outstanding. Their turns: first those not served since
        # they came (in order of arrival: they have had no share of the engine lately),
        # then the round of those served, the least recently served first.
        self._clients: dict[str, _Client] = {}
        self._fresh: OrderedDict[str, None] = OrderedDict()
        self._round: OrderedDict[str, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return max(1, self._capacity())

    @property
    def per_client(self) -> int:
        if self._per_client is not None:
            return self._per_client
        return max(1, self.capacity * 3 // 4)

    @property
    def queued(self) -> int:
        return sum(len(client.queue) for client in self._clients.values())

    def reserve(self, key: str, count: int) -> None:
        """Count `count` requests of one call against `key`, or refuse the call (429)
        if that would pass its bound. Each reserved request must then go through `slot`
        (which ends the reservation) exactly once."""
        client = self._clients.get(key)
        outstanding = 0 if client is None else client.outstanding
        bound = self.per_client + self.queue_per_client
        if count > bound:
            raise APIError(
                400,
                f"this call asks for {count} generations; one client may have at most {bound} "
                f"outstanding (--max-inflight-per-client {self.per_client} + "
                f"--max-queued-per-client {self.queue_per_client})",
                code="invalid_value",
            )
        if outstanding + count > bound:
            raise APIError(
                429,
                f"too many requests from this client: {outstanding} outstanding, this call "
                f"adds {count}, at most {bound} (--max-inflight-per-client {self.per_client}"
                f" + --max-queued-per-client {self.queue_per_client}); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        if client is None:
            client = self._clients[key] = _Client()
            self._fresh[key] = None
        client.outstanding += count

    def release_reservation(self, key: str, count: int) -> None:
        """Give back `count` reserved requests that will never go through `slot` (the call
        was refused after `reserve`)."""
        client = self._clients[key]
        client.outstanding -= count
        self._forget_if_idle(key, client)

    @asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[None]:
        """Wait for this client's turn, hold a slot for the block, then free it for the
        next client in turn. One reserved request of `key` ends here, however it ends."""
        client = self._clients[key]
        waiter = _Waiter()
        client.queue.append(waiter)
        try:
            if self._closed:
                raise AdmissionClosedError
            self._dispatch()
            await waiter.granted.wait()
            if not waiter.admitted:
                raise AdmissionClosedError  # woken by `close`
        except BaseException:
            if not waiter.admitted:
                if waiter in client.queue:
                    client.queue.remove(waiter)
                client.outstanding -= 1
                self._forget_if_idle(key, client)
            else:  # granted, and cancelled before it could run
                self._release(key, client)
            raise
        try:
            yield
        finally:
            self._release(key, client)

    def close(self) -> None:
        """Admit nothing more: every request still queued, and any that comes, raises
        `AdmissionClosedError` (the server is shutting down: what waited for its turn
        must not start once the requests in flight were aborted)."""
        self._closed = True
        for client in self._clients.values():
            for waiter in client.queue:
                waiter.granted.set()
            client.queue.clear()

    def _release(self, key: str, client: _Client) -> None:
        client.in_flight -= 1
        client.outstanding -= 1
        self.in_flight -= 1
        self._forget_if_idle(key, client)
        self._dispatch()

    def _forget_if_idle(self, key: str, client: _Client) -> None:
        if client.outstanding == 0:
            del self._clients[key]
            self._fresh.pop(key, None)
            self._round.pop(key, None)

    def _dispatch(self) -> None:
        """Grant free slots, one request per client in turn, while any can be granted."""
        while self.in_flight < self.capacity and (key := self._next_turn()) is not None:
            client = self._clients[key]
            waiter = client.queue.popleft()
            waiter.admitted = True
            client.in_flight += 1
            self.in_flight += 1
            waiter.granted.set()
            # Served: to the back of the round.
            self._fresh.pop(key, None)
            self._round.pop(key, None)
            self._round[key] = None

    def _next_turn(self) -> str | None:
        """The first client in turn with work queued and room under its cap."""
        per_client = self.per_client
        for key in chain(self._fresh, self._round):
            client = self._clients[key]
            if client.queue and client.in_flight < per_client:
                return key
        return None
