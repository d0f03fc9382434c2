"""Message channels over nng sockets, in anyio's object-stream vocabulary.

* `MessageSender` (PUSH, PUB) implements `anyio.abc.ObjectSendStream`. It coalesces:
  `send` encodes at once (so a bad message fails in the caller) and appends the bytes to a
  pending batch without yielding (checking for cancellation every 64 messages); a flusher task sends the whole batch as ONE frame when
  the event loop next gets to it (once per tick). Backpressure: when the batch holds
  `max_batch_messages` messages or `max_batch_bytes` bytes, `send` flushes it itself and
  waits until nng accepts the frame, so memory stays bounded by the batch, nng's
  `send_buffer_size` frames, and the peer's `recv_buffer_size` frames. PUB never blocks
  (nng drops frames for subscribers that are too slow).
* `MessageReceiver` (PULL, SUB) implements `anyio.abc.ObjectReceiveStream`: it receives
  a frame and yields its messages one by one. `receive` checks for cancellation and lets
  other tasks run when it waits for a frame and every 64 messages of a batch; in between
  it hands out already-decoded messages without an event-loop round each. A frame that fails to decode, or a rejected
  message inside a batch, raises `DecodeError` from `receive` (or goes to `on_invalid`
  and is skipped); the channel stays usable either way.
* `MessageStream` (PAIR, REQ, REP) implements `anyio.abc.ObjectStream`, one frame per
  message, for handshakes and other request/response exchanges.

End of stream: closing a sender (or `send_eof`) flushes, then sends an `EndOfStream`
message; a receiver raises `anyio.EndOfStream` once it has seen `expected_end_of_streams`
of them (one per sending peer: a second marker on one pipe is refused as invalid, so one
peer cannot end a stream others still send on) and handed out every message before them. PUSH/PULL is
reliable (a barrier frame after the marker proves nng wrote it before the socket closes);
over PUB/SUB the marker is best-effort like every PUB frame. Our own `aclose` makes every
later call raise `anyio.ClosedResourceError`; nng failures raise
`anyio.BrokenResourceError`.

PUB/SUB topics: a PUB frame is `topic (UTF-8) + NUL + CBOR frame`; subscribing to topic
`t` filters on the prefix `t + NUL`, so "stats" never matches "stats2".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from .builtin_messages import EndOfStream, StreamBarrier
from .codec import Codec
from .errors import DecodeError, MessageTooLargeError
from .frame_signer import FrameSigner
from .nng_io import NngIO

TOPIC_SEPARATOR = b"\x00"
InvalidHandler = Callable[[DecodeError], None]
# How many messages `send` / `receive` may handle without waiting before they check for
# cancellation (and, receiving, let other tasks run); see the module docstring.
_CHECKPOINT_EVERY = 64


class _FrameReader:
    """Turns received frames into messages, holding the rest of a batch between calls."""

    def __init__(
        self,
        io: NngIO,
        codec: Codec,
        *,
        topics: bool,
        expected_end_of_streams: int,
        on_invalid: InvalidHandler | None,
        request_reply: bool = False,
        signer: FrameSigner | None = None,
    ) -> None:
        if expected_end_of_streams < 1:
            raise ValueError(f"expected_end_of_streams must be >= 1, got {expected_end_of_streams}")
        self._io = io
        self._codec = codec
        self._topics = topics
        self._ends_left = expected_end_of_streams
        self._on_invalid = on_invalid
        # REQ/REP: each frame is one request or reply, answered one by one; a batch or
        # an end marker there is as invalid as any stray frame.
        self._request_reply = request_reply
        self._signer = signer
        self._ended_pipes: set[int] = set()
        self._ready: deque[tuple[str, Any]] = deque()
        self._since_yield = 0
        self.frames_received = 0

    def expect_more_ends(self, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if not self._ends_left:
            raise ValueError("the stream already ended; it cannot expect more senders")
        self._ends_left += count

    async def receive(self) -> tuple[str, Any]:
        while True:
            if self._io.closed:
                raise anyio.ClosedResourceError
            if self._ready:
                # A batch frame holds thousands of messages, already decoded: handing one
                # out is synchronous, and a checkpoint per message cost more than decoding
                # it. So check for cancellation and let other tasks run every
                # `_CHECKPOINT_EVERY` messages (and whenever we wait for a frame).
                self._since_yield += 1
                if self._since_yield >= _CHECKPOINT_EVERY:
                    self._since_yield = 0
                    await anyio.lowlevel.checkpoint()
                topic, item = self._ready.popleft()
                if type(item) is DecodeError and self._on_invalid is None:
                    raise item
                if type(item) is DecodeError:
                    self._on_invalid(item)  # type: ignore[misc]
                    continue
                return topic, item
            if not self._ends_left:
                await anyio.lowlevel.checkpoint()
                raise anyio.EndOfStream
            frame, pipe = await self._io.receive()
            self.frames_received += 1
            try:
                self._accept(frame, pipe)
            except DecodeError as error:
                if self._on_invalid is None:
                    raise
                self._on_invalid(error)

    def _accept(self, frame: bytes, pipe: int) -> None:
        topic = ""
        raw_topic = b""
        if self._topics:
            cut = frame.find(TOPIC_SEPARATOR)
            if cut < 0:
                raise DecodeError("PUB frame without a topic separator")
            raw_topic = frame[:cut]
            try:
                topic = raw_topic.decode()
            except UnicodeDecodeError:
                raise DecodeError("PUB frame topic is not UTF-8") from None
            frame = frame[cut + 1 :]
        if self._signer is not None:
            frame = self._signer.verify(frame, raw_topic)
        if self._request_reply:
            message = self._codec.decode(frame)
            if type(message) is EndOfStream:
                raise DecodeError(self._stray_end())
            self._ready.append((topic, message))
            return
        for item in self._codec.decode_frame(frame):
            if type(item) is StreamBarrier:
                continue
            if type(item) is EndOfStream:
                if pipe in self._ended_pipes:
                    self._ready.append((topic, DecodeError(self._stray_end())))
                    continue
                self._ended_pipes.add(pipe)
                self._ends_left -= 1
                if not self._ends_left:
                    return  # anything after the last end is not ours to deliver
                continue
            self._ready.append((topic, item))

    def _stray_end(self) -> str:
        if self._request_reply:
            return "an end-of-stream marker on a request/reply channel"
        return "a second end-of-stream marker from one peer"


def _frame_of(codec: Codec, encoded: list[bytes]) -> bytes:
    return encoded[0] if len(encoded) == 1 else codec.batch_frame(encoded)


class MessageSender(anyio.abc.ObjectSendStream[Any]):
    """PUSH or PUB side; see the module docstring for batching and backpressure."""

    def __init__(
        self,
        io: NngIO,
        codec: Codec,
        *,
        address: str,
        topics: bool,
        max_batch_messages: int,
        max_batch_bytes: int,
        linger: float,
        signer: FrameSigner | None = None,
    ) -> None:
        if max_batch_messages < 1 or max_batch_bytes < 1:
            raise ValueError("max_batch_messages and max_batch_bytes must be positive")
        self.address = address
        self.codec = codec
        self._io = io
        self._topics = topics
        self._max_messages = max_batch_messages
        self._max_bytes = min(max_batch_bytes, codec.max_message_size)
        self._linger = linger
        self._signer = signer
        self._pending: list[tuple[str, bytes]] = []
        self._pending_bytes = 0
        self._since_check = 0
        self._flush_lock = anyio.Lock(fast_acquire=True)
        self._wake = anyio.Event()
        self._eof_sent = False
        self._failure: Exception | None = None

    @property
    def connected_peers(self) -> int:
        return self._io.pipes.connected

    async def wait_connected(self, peers: int = 1) -> None:
        """Wait until at least `peers` peers are connected (PUB drops frames until then)."""
        await self._io.pipes.wait_connected(peers)

    async def send(self, item: Any) -> None:
        """Queue one message for the next frame (see the module docstring)."""
        await self._enqueue("", self.codec.encode(item))

    async def publish(self, topic: str, item: Any) -> None:
        """PUB only: queue one message under `topic` (no NUL characters)."""
        if not self._topics:
            raise TypeError("publish() needs a PUB channel; use send()")
        if "\x00" in topic:
            raise ValueError(f"topic {topic!r} contains a NUL character")
        await self._enqueue(topic, self.codec.encode(item))

    async def send_many(self, items: Iterable[Any]) -> None:
        """Queue several messages, in order."""
        for item in items:
            await self._enqueue("", self.codec.encode(item))

    async def send_frame(self, frame: bytes, topic: str = "") -> None:
        """Forward an already-encoded frame as is (after the pending batch), e.g. a relay."""
        # Under the flush lock: the flusher task must not send between the two.
        async with self._flush_lock:
            await self._send_pending()
            await self._send_now(topic, frame)

    async def _enqueue(self, topic: str, encoded: bytes) -> None:
        if self._io.closed or self._eof_sent:
            raise anyio.ClosedResourceError
        if self._failure is not None:
            raise anyio.BrokenResourceError(f"the channel failed: {self._failure!r}")
        if len(encoded) + 16 > self.codec.max_message_size:
            raise MessageTooLargeError(
                f"message of {len(encoded)} bytes exceeds max_message_size "
                f"{self.codec.max_message_size}"
            )
        self._since_check += 1
        if self._since_check >= _CHECKPOINT_EVERY:
            self._since_check = 0
            await anyio.lowlevel.checkpoint_if_cancelled()
        if self._pending_bytes + len(encoded) > self._max_bytes:
            await self.flush()
        self._pending.append((topic, encoded))
        self._pending_bytes += len(encoded)
        if len(self._pending) >= self._max_messages:
            await self.flush()
        else:
            self._wake.set()

    async def flush(self) -> None:
        """Send everything pending now, as few frames as topics allow."""
        async with self._flush_lock:
            await self._send_pending()

    async def _send_pending(self) -> None:
        while self._pending:
            topic = self._pending[0][0]
            run = 0
            while run < len(self._pending) and self._pending[run][0] == topic:
                run += 1
            encoded = [item for _, item in self._pending[:run]]
            await self._send_now(topic, _frame_of(self.codec, encoded))
            # Only forget the run once nng took it: a cancelled flush loses nothing.
            del self._pending[:run]
            self._pending_bytes -= sum(map(len, encoded))

    async def _send_now(self, topic: str, frame: bytes) -> None:
        if self._signer is not None:
            frame = self._signer.sign(frame, topic.encode())
        if self._topics:
            frame = topic.encode() + TOPIC_SEPARATOR + frame
        await self._io.send(frame)

    async def run_flusher(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The once-per-tick flusher; `open_*` starts it in the channel's task group."""
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as error:
            # Surfaces from the next send() instead of tearing down the task group.
            self._failure = error

    async def send_eof(self) -> None:
        """Flush, then tell the receiver that this sender is done."""
        if self._eof_sent or self._io.closed:
            return
        await self.flush()
        self._eof_sent = True
        await self._send_now("", self.codec.encode(EndOfStream()))
        if not self._topics:
            # A PUSH pipe takes a frame only once it has written the previous one, and nng
            # queues one frame (send_buffer_size=1): once the second barrier is accepted,
            # the marker is on the wire. Receivers skip barriers.
            barrier = self.codec.encode(StreamBarrier())
            await self._send_now("", barrier)
            await self._send_now("", barrier)

    async def aclose(self) -> None:
        if self._io.closed:
            await anyio.lowlevel.checkpoint()
            return
        try:
            with anyio.move_on_after(self._linger, shield=True):
                await self.send_eof()
        finally:
            self._io.close()


class MessageReceiver(anyio.abc.ObjectReceiveStream[Any]):
    """PULL or SUB side; yields messages one by one from received frames."""

    def __init__(self, io: NngIO, reader: _FrameReader, *, address: str, topics: bool) -> None:
        self.address = address
        self._io = io
        self._reader = reader
        self._topics = topics

    @property
    def connected_peers(self) -> int:
        return self._io.pipes.connected

    async def wait_connected(self, peers: int = 1) -> None:
        await self._io.pipes.wait_connected(peers)

    def subscribe(self, topic: str) -> None:
        """SUB only: also deliver messages published under exactly `topic`."""
        self._require_sub().subscribe(topic.encode() + TOPIC_SEPARATOR)

    def unsubscribe(self, topic: str) -> None:
        self._require_sub().unsubscribe(topic.encode() + TOPIC_SEPARATOR)

    def _require_sub(self) -> Any:
        if not self._topics:
            raise TypeError("topics exist only on SUB channels")
        return self._io.socket

    @property
    def frames_received(self) -> int:
        """Frames taken off the socket so far (batching makes this far below messages)."""
        return self._reader.frames_received

    def expect_more_end_of_streams(self, count: int) -> None:
        """Expect `count` more senders to end before this stream ends.

        For senders that join a live stream, or that leave it early while others stay:
        raise the count before their end markers can arrive. Refused once it ended.
        """
        self._reader.expect_more_ends(count)

    async def receive(self) -> Any:
        return (await self._reader.receive())[1]

    async def receive_with_topic(self) -> tuple[str, Any]:
        """SUB: the next message with the topic it was published under."""
        return await self._reader.receive()

    async def aclose(self) -> None:
        self._io.close()
        await anyio.lowlevel.checkpoint()


class MessageStream(anyio.abc.ObjectStream[Any]):
    """PAIR, REQ or REP: one frame per message, both directions."""

    def __init__(
        self,
        io: NngIO,
        reader: _FrameReader,
        codec: Codec,
        *,
        address: str,
        signer: FrameSigner | None = None,
    ) -> None:
        self.address = address
        self.codec = codec
        self._signer = signer
        self._io = io
        self._reader = reader
        self._eof_sent = False

    @property
    def connected_peers(self) -> int:
        return self._io.pipes.connected

    async def wait_connected(self, peers: int = 1) -> None:
        await self._io.pipes.wait_connected(peers)

    async def send(self, item: Any) -> None:
        if self._eof_sent:
            raise anyio.ClosedResourceError
        frame = self.codec.encode(item)
        if len(frame) > self.codec.max_message_size:
            raise MessageTooLargeError(
                f"message of {len(frame)} bytes exceeds max_message_size {self.codec.max_message_size}"
            )
        await self._send_frame(frame)

    async def receive(self) -> Any:
        return (await self._reader.receive())[1]

    async def send_eof(self) -> None:
        if not self._eof_sent and not self._io.closed:
            await self._send_frame(self.codec.encode(EndOfStream()))
            self._eof_sent = True

    async def _send_frame(self, frame: bytes) -> None:
        await self._io.send(frame if self._signer is None else self._signer.sign(frame))

    async def aclose(self) -> None:
        self._io.close()
        await anyio.lowlevel.checkpoint()
