"""Signed channels (`frame_signer`): a frame without the key's signature, with another
key's, altered, replayed, or recorded on another channel is refused before anything
decodes it, and the channel serves on; signed pairs pass the conformance suite on
every socket pattern."""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from wavecore.channels import (
    ChannelKey,
    Codec,
    DecodeError,
    MessageRegistry,
    open_pub,
    open_pull,
    open_push,
    open_rep,
    open_req,
    open_sub,
)
from wavecore.channels.frame_signer import MAX_SENDERS
from wavecore.channels.testing import check_channel_pair

registry = MessageRegistry()


@registry.register(tag=31160)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    value: int


codec = Codec(registry)
pytestmark = pytest.mark.anyio
KEY = ChannelKey.generate()
HANG_GUARD = 20


def test_a_signed_frame_round_trips_and_each_forgery_is_refused() -> None:
    sender, receiver = KEY.signer("inputs"), KEY.signer("inputs")
    first, second = sender.sign(b"one"), sender.sign(b"two")
    assert receiver.verify(first) == b"one"
    assert receiver.verify(second) == b"two"
    refusals = {
        "unsigned": b"two",
        "replayed": second,
        "replayed older": first,
        "altered": second[:-1] + b"X",
        "another key": ChannelKey.generate().signer("inputs").sign(b"three"),
        "another channel": KEY.signer("outputs").sign(b"three"),
    }
    reasons = {}
    for name, frame in refusals.items():
        with pytest.raises(DecodeError) as refused:
            receiver.verify(frame)
        reasons[name] = refused.value.reason
    assert reasons["unsigned"].startswith("an unauthenticated frame")
    assert reasons["replayed"].startswith("a replayed frame")
    assert reasons["replayed older"].startswith("a replayed frame")
    for name in ("altered", "another key", "another channel"):
        assert reasons[name].startswith("a frame that failed authentication"), name
    # Refusals changed nothing: the sender's next frame is accepted.
    assert receiver.verify(sender.sign(b"four")) == b"four"


def test_every_sender_is_counted_on_its_own_and_the_table_is_bounded() -> None:
    receiver = KEY.signer("outputs")
    senders = [KEY.signer("outputs") for _ in range(3)]
    for round_ in range(2):
        for index, sender in enumerate(senders):
            assert receiver.verify(sender.sign(bytes([round_, index]))) == bytes([round_, index])
    first = senders[0].sign(b"x")
    for _ in range(MAX_SENDERS):  # the oldest sender ids are forgotten
        receiver.verify(KEY.signer("outputs").sign(b"y"))
    assert len(receiver._last_seen) == MAX_SENDERS
    assert receiver.verify(first) == b"x"


def test_keys_load_from_hex_files_and_say_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    loaded = ChannelKey.load(path)
    assert loaded.signer("c").verify(KEY.signer("c").sign(b"ok")) == b"ok"
    assert repr(loaded) == "ChannelKey(...)" and KEY.hex() not in repr(loaded)
    copy = pickle.loads(pickle.dumps(KEY))  # how spawned processes get it
    assert copy.hex() == KEY.hex()
    path.write_text("not hex")
    with pytest.raises(ValueError, match=r"the channel key file .*key is not hexadecimal"):
        ChannelKey.load(path)
    path.write_text("ab" * 16 + "a")
    with pytest.raises(ValueError, match="not hexadecimal"):
        ChannelKey.load(path)
    path.write_text("ab" * 16)
    assert ChannelKey.load(path).hex() == "ab" * 16
    path.write_text("ab" * 4)
    with pytest.raises(ValueError, match="holds 4 bytes; a channel key needs 16 or more"):
        ChannelKey.load(path)
    with pytest.raises(ValueError, match="cannot read the channel key file"):
        ChannelKey.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ChannelKey(b"short")


async def test_signed_push_pull_passes_the_conformance_suite(tmp_path: Path) -> None:
    @asynccontextmanager
    async def push_pull(codec: Codec) -> AsyncIterator[tuple[object, object]]:
        async with (
            open_pull(
                listen=f"ipc://{tmp_path}/signed.ipc", codec=codec, signer=KEY.signer("c")
            ) as rx,
            open_push(dial=rx.address, codec=codec, signer=KEY.signer("c")) as tx,
        ):
            yield tx, rx

    await check_channel_pair(push_pull)


async def test_unsigned_and_forged_frames_are_dropped_and_the_channel_serves_on() -> None:
    seen: list[DecodeError] = []
    async with (
        open_pull(
            listen="tcp://127.0.0.1:0", codec=codec, on_invalid=seen.append, signer=KEY.signer("in")
        ) as rx,
        open_push(dial=rx.address, codec=codec) as unsigned,
        open_push(dial=rx.address, codec=codec, signer=KEY.signer("out")) as wrong_channel,
        open_push(dial=rx.address, codec=codec, signer=KEY.signer("in")) as member,
    ):
        received: list[object] = []

        async def receive_all() -> None:
            async for message in rx:
                received.append(message)

        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive_all)
                for sender in (unsigned, wrong_channel):
                    await sender.send(Ping(value=666))
                    await sender.flush()
                    await sender.send_frame(b"")
                while len(seen) < 4:  # noqa: ASYNC110 - refused by the receiving task
                    await anyio.sleep(0.01)
                await member.send(Ping(value=1))
                while not received:  # noqa: ASYNC110 - received by that task
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    assert received == [Ping(value=1)]
    reasons = sorted(error.reason.split(" (")[0] for error in seen)
    # The wrong channel's empty frame is signed, so it fails authentication too.
    assert reasons == [
        "a frame that failed authentication",
        "a frame that failed authentication",
        "an unauthenticated frame",
        "an unauthenticated frame",
    ]


async def test_signed_pub_sub_and_request_reply() -> None:
    async with (
        open_pub(listen="tcp://127.0.0.1:0", codec=codec, signer=KEY.signer("p")) as pub,
        open_sub(dial=pub.address, topics=["t"], codec=codec, signer=KEY.signer("p")) as sub,
    ):
        with anyio.fail_after(HANG_GUARD):
            await pub.wait_connected()
            while True:  # PUB drops frames until the subscription reached it
                await pub.publish("t", Ping(value=7))
                with anyio.move_on_after(0.1):
                    assert await sub.receive() == Ping(value=7)
                    break
    async with (
        open_rep(listen="tcp://127.0.0.1:0", codec=codec, signer=KEY.signer("h")) as rep,
        open_req(dial=rep.address, codec=codec, signer=KEY.signer("h")) as req,
    ):
        with anyio.fail_after(HANG_GUARD):
            await req.send(Ping(value=1))
            assert await rep.receive() == Ping(value=1)
            await rep.send(Ping(value=2))
            assert await req.receive() == Ping(value=2)


def test_what_travels_beside_a_frame_is_covered_by_its_signature() -> None:
    """A PUB frame's topic travels in clear (SUB filters on it): a frame moved to
    another topic fails authentication."""
    sender, receiver = KEY.signer("p"), KEY.signer("p")
    signed = sender.sign(b"wave 3", b"wave")
    with pytest.raises(DecodeError, match="failed authentication"):
        receiver.verify(signed, b"state")
    assert receiver.verify(signed, b"wave") == b"wave 3"
