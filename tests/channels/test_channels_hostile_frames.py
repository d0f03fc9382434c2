"""Frames no well-behaved peer sends: empty ones (pynng's `recv` raises a bare
RuntimeError on them), a second end-of-stream marker from one peer, and garbage on a
request/reply channel. Each is refused as invalid; the channel keeps serving."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import anyio.to_thread
import pynng
import pytest

from wavecore.channels import (
    Codec,
    DecodeError,
    EndOfStream,
    MessageRegistry,
    open_pull,
    open_push,
    open_rep,
)

registry = MessageRegistry()


@registry.register(tag=31150)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    value: int


codec = Codec(registry)
pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
async def test_an_empty_frame_is_invalid_not_a_crash(transport: str, tmp_path: object) -> None:
    address = {
        "inproc": "inproc://empty-frame",
        "ipc": f"ipc://{tmp_path}/empty",
        "tcp": "tcp://127.0.0.1:0",
    }[transport]
    seen: list[DecodeError] = []
    async with open_pull(listen=address, codec=codec, on_invalid=seen.append) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec) as tx:
            with anyio.fail_after(20):
                await tx.send_frame(b"")
                await tx.send(Ping(value=1))
                assert await rx.receive() == Ping(value=1)
    assert [error.reason for error in seen] == ["empty frame"]


async def test_without_a_handler_an_empty_frame_raises_decode_error() -> None:
    async with open_pull(listen="inproc://empty-raises", codec=codec) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec) as tx:
            with anyio.fail_after(20):
                await tx.send_frame(b"")
                with pytest.raises(DecodeError, match="empty frame"):
                    await rx.receive()
                await tx.send(Ping(value=2))
                assert await rx.receive() == Ping(value=2)


async def test_one_peer_cannot_end_a_stream_meant_for_two() -> None:
    seen: list[DecodeError] = []
    marker = codec.encode(EndOfStream())
    delivered, received = anyio.create_memory_object_stream[object](16)

    async def drain(rx: object) -> None:
        async with delivered:
            async for message in rx:  # type: ignore[attr-defined]
                await delivered.send(message)

    async with (
        open_pull(
            listen="inproc://two-ends",
            codec=codec,
            expected_end_of_streams=2,
            on_invalid=seen.append,
        ) as rx,
        anyio.create_task_group() as tg,
        received,
    ):
        tg.start_soon(drain, rx)
        with anyio.fail_after(20):
            async with open_push(dial=rx.address, codec=codec) as hostile:
                async with open_push(dial=rx.address, codec=codec) as honest:
                    # Its own end counts once; replays of it are refused. (A peer's
                    # frames arrive in order: its ping comes after every marker.)
                    for _ in range(3):
                        await hostile.send_frame(marker)
                    await hostile.send_frame(codec.batch_frame([marker, marker]))
                    await hostile.send(Ping(value=6))
                    assert await received.receive() == Ping(value=6)
                    assert len(seen) == 4
                    await honest.send(Ping(value=7))
                    assert await received.receive() == Ping(value=7)
                # The honest peer's end is the second: the stream ends.
                assert [message async for message in received] == []
    assert all("second end-of-stream marker" in error.reason for error in seen)


async def test_a_reply_channel_skips_garbage_and_answers_the_next_request() -> None:
    seen: list[DecodeError] = []
    answered: list[object] = []
    refused = [anyio.Event()]

    def on_invalid(error: DecodeError) -> None:
        seen.append(error)
        refused[0].set()

    async with open_rep(listen="inproc://rep-garbage", codec=codec, on_invalid=on_invalid) as rep:
        with pynng.Req0(dial=rep.address, recv_timeout=20_000) as stranger:

            async def serve_one() -> None:
                answered.append(await rep.receive())
                await rep.send(Ping(value=6))

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(serve_one)
                    # One at a time: a REQ socket abandons a request when it sends the
                    # next, possibly before it went out.
                    for frame in (b"", b"\xff\x00", codec.encode(EndOfStream())):
                        await anyio.to_thread.run_sync(stranger.send, frame)
                        await refused[0].wait()
                        refused[0] = anyio.Event()
                    await anyio.to_thread.run_sync(stranger.send, codec.encode(Ping(value=5)))
                reply = await anyio.to_thread.run_sync(stranger.recv)
    assert answered == [Ping(value=5)]
    assert codec.decode(reply) == Ping(value=6)
    reasons = [error.reason for error in seen]
    assert reasons[0] == "empty frame"
    assert "end-of-stream marker on a request/reply channel" in reasons[2]
