"""PUB/SUB topics, the handshake, receiver-side limits, and pynng's cancellation leak."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

import anyio
import pynng
import pytest

from wavecore.channels import (
    Codec,
    DecodeError,
    HandshakeError,
    MessageRegistry,
    answer_handshake,
    config_hash,
    open_pub,
    open_pull,
    open_push,
    open_rep,
    open_req,
    open_sub,
    request_handshake,
)

registry = MessageRegistry()


@registry.register(tag=31100)
@dataclass(frozen=True, slots=True, kw_only=True)
class Stat:
    value: int


codec = Codec(registry)


@pytest.mark.anyio
async def test_pub_sub_filters_exact_topics() -> None:
    async with open_pub(listen="tcp://127.0.0.1:0", codec=codec) as pub:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_sub(dial=pub.address, codec=codec, topics=["stats"]) as sub:
            with anyio.fail_after(20):
                await pub.wait_connected()
                await pub.publish("stats2", Stat(value=-1))
                await pub.publish("other", Stat(value=-2))
                for value in range(3):
                    await pub.publish("stats", Stat(value=value))
                received = [await sub.receive_with_topic() for _ in range(3)]
    assert received == [("stats", Stat(value=v)) for v in range(3)]


@pytest.mark.anyio
@pytest.mark.parametrize("client_version", [1, 2])
async def test_handshake_accepts_matches_and_names_mismatches(client_version: int) -> None:
    digest = config_hash({"model": "smollm2", "ranks": 2})
    async with open_rep(listen="tcp://127.0.0.1:0", codec=codec) as rep:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_req(dial=rep.address, codec=codec) as req:
            answer = functools.partial(
                answer_handshake,
                rep,
                protocol_version=1,
                config_hash=digest,
                peer_name="coordinator",
            )
            outcome: list[BaseException | None] = []

            async def serve() -> None:
                try:
                    await answer()
                    outcome.append(None)
                except HandshakeError as error:
                    outcome.append(error)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(serve)
                    request = request_handshake(
                        req, protocol_version=client_version, config_hash=digest, peer_name="rank0"
                    )
                    if client_version == 1:
                        welcome = await request
                        assert welcome.accepted and welcome.peer_name == "coordinator"
                    else:
                        with pytest.raises(
                            HandshakeError,
                            match="coordinator refused the handshake: protocol_version: ours 1, theirs 2",
                        ):
                            await request
    assert (outcome[0] is None) == (client_version == 1)


@pytest.mark.anyio
async def test_inproc_oversize_frame_is_a_decode_error_and_channel_survives() -> None:
    small = Codec(registry, max_message_size=256)
    async with open_pull(listen="inproc://oversize", codec=small) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec) as tx:
            with anyio.fail_after(20):
                await tx.send_frame(b"\x00" * 1000)
                with pytest.raises(DecodeError, match="exceeds max_message_size"):
                    await rx.receive()
                await tx.send(Stat(value=1))
                assert await rx.receive() == Stat(value=1)
                async with anyio.create_task_group() as group:
                    group.start_soon(tx.aclose)
                    with pytest.raises(anyio.EndOfStream):
                        await rx.receive()


@pytest.mark.anyio
async def test_invalid_frames_can_go_to_a_handler() -> None:
    seen: list[DecodeError] = []
    async with open_pull(listen="inproc://handler", codec=codec, on_invalid=seen.append) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec) as tx:
            with anyio.fail_after(20):
                await tx.send_frame(b"\xff")
                await tx.send(Stat(value=3))
                assert await rx.receive() == Stat(value=3)
    assert len(seen) == 1


def test_pynng_arecv_leaks_cancelled_error_from_anyio_scopes() -> None:
    """Why `nng_io` polls descriptors instead of using pynng's own `arecv`."""

    async def pynng_arecv() -> str:
        with pynng.Pull0(listen="inproc://leak") as pull:
            try:
                with anyio.move_on_after(0.01):
                    await pull.arecv()
            except asyncio.CancelledError:
                return "leaked"
            return "contained"

    async def ours() -> str:
        async with open_pull(listen="inproc://contained", codec=codec) as rx:
            with anyio.move_on_after(0.01) as scope:
                await rx.receive()
            return "contained" if scope.cancelled_caught else "not cancelled"

    assert anyio.run(pynng_arecv, backend="asyncio") == "leaked"
    assert anyio.run(ours, backend="asyncio") == "contained"
    assert anyio.run(ours, backend="trio") == "contained"


@pytest.mark.anyio
async def test_cancelling_receive_inside_a_batch_loses_nothing() -> None:
    # Within a batch, receive checks for cancellation every few dozen messages only; a
    # message is either handed out or stays queued, never dropped or repeated.
    count = 300
    received: list[int] = []
    async with open_pull(listen="tcp://127.0.0.1:0", codec=codec) as rx:  # noqa: SIM117 - the inner channel dials the outer one's address
        async with open_push(dial=rx.address, codec=codec) as tx:
            with anyio.fail_after(20):
                for value in range(count):
                    await tx.send(Stat(value=value))
                await tx.flush()
                with anyio.CancelScope() as scope:
                    while True:
                        received.append((await rx.receive()).value)
                        if len(received) == 10:
                            scope.cancel()
                assert scope.cancelled_caught
                stopped_at = len(received)
                while len(received) < count:
                    received.append((await rx.receive()).value)
    assert 10 <= stopped_at < count
    assert received == list(range(count))
    assert rx.frames_received == 1


@pytest.mark.anyio
async def test_a_receiver_can_expect_a_sender_that_joins_later() -> None:
    received: list[Stat] = []

    async def drain(rx: object) -> None:
        async for message in rx:  # type: ignore[attr-defined]
            received.append(message)

    async with open_pull(listen="inproc://expect-more", codec=codec) as rx:
        with pytest.raises(ValueError, match="count must be an int >= 0"):
            rx.expect_more_end_of_streams(-1)
        rx.expect_more_end_of_streams(1)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, rx)
                async with open_push(dial=rx.address, codec=codec) as first:
                    await first.send(Stat(value=1))
                # The first sender's end is not the stream's: a second one was announced.
                async with open_push(dial=rx.address, codec=codec) as second:
                    await second.send(Stat(value=2))
        with pytest.raises(ValueError, match="already ended"):
            rx.expect_more_end_of_streams(1)
    assert received == [Stat(value=1), Stat(value=2)]
