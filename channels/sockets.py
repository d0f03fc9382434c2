"""Opening channels: one async context manager per socket pattern.

Each `open_*` creates the pynng socket, listens on or dials the address (dialing is
non-blocking and reconnects in the background), starts what the channel needs in a task
group, and closes everything on exit. `channel.address` is the address peers should use:
for `tcp://host:0` it carries the port the kernel picked (read back from the listener,
so there is no pick-then-bind race).

Authentication: every `open_*` takes `signer=` (`frame_signer`: one end of a channel,
from the deployment's `ChannelKey`); a channel's ends must both sign or neither. A
signer whose key carries TLS files (`ChannelKey.with_tls`) also puts its `tcp://`
channels on nng's `tls+tcp` transport (`tls`).

Buffers (counted in frames, nng's unit): `recv_buffer_size` on receivers, and
`max_batch_messages`/`max_batch_bytes` on senders, bound memory; see `streams`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pynng

from .codec import Codec
from .frame_signer import SIGNATURE_SIZE, FrameSigner
from .nng_io import NngIO, bound_address
from .streams import InvalidHandler, MessageReceiver, MessageSender, MessageStream, _FrameReader
from .tls import ChannelTLS, secure_address

DEFAULT_RECV_BUFFER = 64
DEFAULT_MAX_BATCH_MESSAGES = 4096
DEFAULT_MAX_BATCH_BYTES = 4 * 1024 * 1024
DEFAULT_LINGER = 2.0  # seconds aclose() may spend flushing before it drops what is left


def _attach(
    socket: pynng.Socket, listen: str | None, dial: str | None, signer: FrameSigner | None
) -> str:
    if (listen is None) == (dial is None):
        socket.close()
        raise ValueError("give exactly one of listen= or dial=")
    tls: ChannelTLS | None = signer.tls if signer is not None else None
    try:
        if listen is not None:
            listener = socket.listen(secure_address(socket, listen, tls, listen=True))
            return bound_address(listener, listen)
        socket.dial(secure_address(socket, dial, tls, listen=False), block=False)  # type: ignore[arg-type]
        return dial  # type: ignore[return-value]
    except pynng.NNGException as error:
        socket.close()
        raise OSError(
            f"cannot {'listen on' if listen else 'dial'} {listen or dial}: {error}"
        ) from error


def _receive_options(codec: Codec, recv_buffer_size: int) -> dict[str, Any]:
    # nng drops oversize frames on tcp/ipc itself; inproc ones are refused by the codec.
    # A signed frame carries its signature besides the codec's largest frame.
    return {
        "recv_max_size": codec.max_message_size + SIGNATURE_SIZE,
        "recv_buffer_size": recv_buffer_size,
    }


@asynccontextmanager
async def _sender(
    socket: pynng.Socket,
    *,
    listen: str | None,
    dial: str | None,
    codec: Codec | None,
    topics: bool,
    max_batch_messages: int,
    max_batch_bytes: int,
    linger: float,
    signer: FrameSigner | None,
) -> AsyncIterator[MessageSender]:
    codec = codec or Codec()
    address = _attach(socket, listen, dial, signer)
    sender = MessageSender(
        NngIO(socket),
        codec,
        address=address,
        topics=topics,
        max_batch_messages=max_batch_messages,
        max_batch_bytes=max_batch_bytes,
        linger=linger,
        signer=signer,
    )
    async with anyio.create_task_group() as group:
        await group.start(sender.run_flusher)
        try:
            yield sender
        finally:
            await sender.aclose()
            group.cancel_scope.cancel()


def open_push(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    max_batch_messages: int = DEFAULT_MAX_BATCH_MESSAGES,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    linger: float = DEFAULT_LINGER,
    signer: FrameSigner | None = None,
) -> Any:
    """`async with open_push(dial=...) as tx`: a batching PUSH `MessageSender`."""
    return _sender(
        pynng.Push0(send_buffer_size=1),
        listen=listen,
        dial=dial,
        codec=codec,
        topics=False,
        max_batch_messages=max_batch_messages,
        max_batch_bytes=max_batch_bytes,
        linger=linger,
        signer=signer,
    )


def open_pub(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    max_batch_messages: int = DEFAULT_MAX_BATCH_MESSAGES,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    linger: float = DEFAULT_LINGER,
    signer: FrameSigner | None = None,
) -> Any:
    """`async with open_pub(listen=...) as pub`: `await pub.publish(topic, message)`."""
    return _sender(
        pynng.Pub0(),
        listen=listen,
        dial=dial,
        codec=codec,
        topics=True,
        max_batch_messages=max_batch_messages,
        max_batch_bytes=max_batch_bytes,
        linger=linger,
        signer=signer,
    )


@asynccontextmanager
async def _receiver(
    socket: pynng.Socket,
    *,
    listen: str | None,
    dial: str | None,
    codec: Codec,
    topics: bool,
    expected_end_of_streams: int,
    on_invalid: InvalidHandler | None,
    signer: FrameSigner | None,
) -> AsyncIterator[MessageReceiver]:
    io = NngIO(socket)
    reader = _FrameReader(
        io,
        codec,
        topics=topics,
        expected_end_of_streams=expected_end_of_streams,
        on_invalid=on_invalid,
        signer=signer,
    )
    address = _attach(socket, listen, dial, signer)
    receiver = MessageReceiver(io, reader, address=address, topics=topics)
    try:
        yield receiver
    finally:
        await receiver.aclose()


def open_pull(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    recv_buffer_size: int = DEFAULT_RECV_BUFFER,
    expected_end_of_streams: int = 1,
    on_invalid: InvalidHandler | None = None,
    signer: FrameSigner | None = None,
) -> Any:
    """`async with open_pull(listen=...) as rx`: a PULL `MessageReceiver`."""
    codec = codec or Codec()
    return _receiver(
        pynng.Pull0(**_receive_options(codec, recv_buffer_size)),
        listen=listen,
        dial=dial,
        codec=codec,
        topics=False,
        expected_end_of_streams=expected_end_of_streams,
        on_invalid=on_invalid,
        signer=signer,
    )


def open_sub(
    *,
    listen: str | None = None,
    dial: str | None = None,
    topics: Iterable[str] = (),
    codec: Codec | None = None,
    recv_buffer_size: int = DEFAULT_RECV_BUFFER,
    expected_end_of_streams: int = 1,
    on_invalid: InvalidHandler | None = None,
    signer: FrameSigner | None = None,
) -> Any:
    """`async with open_sub(dial=..., topics=["stats"]) as sub`: a SUB `MessageReceiver`.

    The empty topic "" carries end-of-stream markers; it is always subscribed.
    """
    codec = codec or Codec()
    socket = pynng.Sub0(**_receive_options(codec, recv_buffer_size))
    for topic in {"", *topics}:
        socket.subscribe(topic.encode() + b"\x00")
    return _receiver(
        socket,
        listen=listen,
        dial=dial,
        codec=codec,
        topics=True,
        expected_end_of_streams=expected_end_of_streams,
        on_invalid=on_invalid,
        signer=signer,
    )


@asynccontextmanager
async def _stream(
    socket: pynng.Socket,
    *,
    listen: str | None,
    dial: str | None,
    codec: Codec | None,
    on_invalid: InvalidHandler | None = None,
    request_reply: bool = False,
    signer: FrameSigner | None = None,
) -> AsyncIterator[MessageStream]:
    codec = codec or Codec()
    socket.recv_max_size = codec.max_message_size + SIGNATURE_SIZE
    io = NngIO(socket)
    reader = _FrameReader(
        io,
        codec,
        topics=False,
        expected_end_of_streams=1,
        on_invalid=on_invalid,
        request_reply=request_reply,
        signer=signer,
    )
    address = _attach(socket, listen, dial, signer)
    stream = MessageStream(io, reader, codec, address=address, signer=signer)
    try:
        yield stream
    finally:
        await stream.aclose()


def open_pair(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    signer: FrameSigner | None = None,
) -> Any:
    """`async with open_pair(...) as stream`: a bidirectional PAIR `MessageStream`."""
    return _stream(pynng.Pair0(), listen=listen, dial=dial, codec=codec, signer=signer)


def open_req(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    signer: FrameSigner | None = None,
) -> Any:
    """REQ: `send` one request, then `receive` its reply."""
    return _stream(
        pynng.Req0(), listen=listen, dial=dial, codec=codec, request_reply=True, signer=signer
    )


def open_rep(
    *,
    listen: str | None = None,
    dial: str | None = None,
    codec: Codec | None = None,
    on_invalid: InvalidHandler | None = None,
    signer: FrameSigner | None = None,
) -> Any:
    """REP: `receive` a request, then `send` its reply. With `on_invalid`, a request that
    fails to decode goes there and is skipped (nng drops it unanswered: a REP socket
    forgets a request it receives past)."""
    return _stream(
        pynng.Rep0(),
        listen=listen,
        dial=dial,
        codec=codec,
        on_invalid=on_invalid,
        request_reply=True,
        signer=signer,
    )
