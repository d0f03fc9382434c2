"""`check_channel_pair`: the conformance suite every sender/receiver pair must pass.

Call it from a test with a factory that opens a connected pair for a given codec::

    @asynccontextmanager
    async def push_pull(codec):
        async with open_pull(listen=address, codec=codec) as rx:
            async with open_push(dial=rx.address, codec=codec) as tx:
                yield tx, rx

    await check_channel_pair(push_pull)

The receiver must be a fresh PULL-like end with one expected sender. Every check opens
its own pair; timeouts are hang guards only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import anyio
import cbor2

from .codec import Codec
from .errors import DecodeError, MessageTooLargeError
from .registry import MessageRegistry

PairFactory = Callable[[Codec], AbstractAsyncContextManager[tuple[Any, Any]]]

conformance_registry = MessageRegistry()
HANG_GUARD_SECONDS = 20.0
_SMALL_LIMIT = 4096


@conformance_registry.register(tag=31990)
@dataclass(frozen=True, slots=True, kw_only=True)
class Numbered:
    """A test message: a sequence number and some payload."""

    seq: int
    payload: bytes = b""


async def _receive_all(receiver: Any, into: list[Any]) -> None:
    async for message in receiver:
        into.append(message)


async def _close_sender_while_draining(sender: Any, receiver: Any) -> None:
    """Close the sender while the receiver reads up to the end of stream (no linger)."""
    leftovers: list[Any] = []
    with anyio.fail_after(HANG_GUARD_SECONDS):
        async with anyio.create_task_group() as group:
            group.start_soon(_receive_all, receiver, leftovers)
            await sender.aclose()
    if leftovers:
        raise AssertionError(f"unexpected messages at close: {leftovers!r}")


async def check_ordering_batching_and_end(factory: PairFactory) -> None:
    count = 500
    received: list[Any] = []
    async with factory(Codec(conformance_registry)) as (sender, receiver):
        async with anyio.create_task_group() as group:
            group.start_soon(_receive_all, receiver, received)
            for seq in range(count):
                await sender.send(Numbered(seq=seq))
            await sender.aclose()
        if [m.seq for m in received] != list(range(count)):
            raise AssertionError("messages arrived out of order or incomplete")
        # The loop never yielded, so all 500 messages shared one frame (+ end markers).
        if receiver.frames_received > 4:
            raise AssertionError(f"no batching: {receiver.frames_received} frames for {count}")
        for _ in range(2):
            try:
                await receiver.receive()
            except anyio.EndOfStream:
                pass
            else:
                raise AssertionError("receive after the end of stream must raise EndOfStream")
        try:
            await sender.send(Numbered(seq=0))
        except anyio.ClosedResourceError:
            pass
        else:
            raise AssertionError("send after aclose must raise ClosedResourceError")
        await receiver.aclose()
        try:
            await receiver.receive()
        except anyio.ClosedResourceError:
            pass
        else:
            raise AssertionError("receive after aclose must raise ClosedResourceError")


async def check_cancellation(factory: PairFactory) -> None:
    async with factory(Codec(conformance_registry)) as (sender, receiver):
        with anyio.move_on_after(0.05) as scope:
            await receiver.receive()
        if not scope.cancelled_caught:
            raise AssertionError("the cancel scope did not catch its cancellation")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await receiver.receive()
        await sender.send(Numbered(seq=7))
        with anyio.fail_after(HANG_GUARD_SECONDS):
            message = await receiver.receive()
        if message != Numbered(seq=7):
            raise AssertionError(f"after cancellation got {message!r}")
        await _close_sender_while_draining(sender, receiver)


async def check_garbage_and_oversize(factory: PairFactory) -> None:
    codec = Codec(conformance_registry, max_message_size=_SMALL_LIMIT)
    async with factory(codec) as (sender, receiver):
        with anyio.fail_after(HANG_GUARD_SECONDS):
            for garbage in (b"\xff\x00garbage", b"\x9f", codec.encode(Numbered(seq=1)) + b"\x00"):
                await sender.send_frame(garbage)
                try:
                    await receiver.receive()
                except DecodeError:
                    pass
                else:
                    raise AssertionError(f"{garbage!r} was not rejected")
            try:
                await sender.send(Numbered(seq=2, payload=b"x" * _SMALL_LIMIT))
            except MessageTooLargeError:
                pass
            else:
                raise AssertionError("an oversize message was accepted for sending")
            # A batch with one ill-typed message still delivers its neighbours.
            bad = cbor2.dumps(cbor2.CBORTag(31990, ("not an int", b"")))
            good = [codec.encode(Numbered(seq=seq)) for seq in (3, 4)]
            await sender.send_frame(codec.batch_frame([good[0], bad, good[1]]))
            first = await receiver.receive()
            try:
                await receiver.receive()
            except DecodeError:
                pass
            else:
                raise AssertionError("the ill-typed message was not rejected")
            last = await receiver.receive()
            if (first, last) != (Numbered(seq=3), Numbered(seq=4)):
                raise AssertionError(f"batch neighbours lost: {first!r}, {last!r}")
            await sender.send(Numbered(seq=5))
            if await receiver.receive() != Numbered(seq=5):
                raise AssertionError("the channel is unusable after bad input")
        await _close_sender_while_draining(sender, receiver)


async def check_channel_pair(factory: PairFactory) -> None:
    """Run every conformance check against pairs made by `factory`."""
    await check_ordering_batching_and_end(factory)
    await check_cancellation(factory)
    await check_garbage_and_oversize(factory)
