"""pynng sockets driven from anyio without threads, on asyncio and trio alike.

nng exposes, per socket, a pollable descriptor for "a message can be received"
(`recv_fd`) and one for "a message can be sent" (`send_fd`); both signal by becoming
*readable*. `NngIO` tries the non-blocking call first and, on `TryAgain`, waits with
`anyio.wait_readable` on the matching descriptor. Waiting is a plain anyio checkpoint, so
cancelling a pending receive or send (move_on_after, CancelScope) takes nothing off the
socket and leaves it usable. pynng's own `arecv`/`asend` instead complete an nng aio from
an nng thread, and on asyncio a cancelled `arecv` lets a bare `CancelledError` escape
anyio's cancel scope (tests/channels/test_channels_pynng_cancel.py demonstrates it).

Closing calls `anyio.notify_closing` on the descriptors first, so that a task blocked in
`receive`/`send` wakes with `ClosedResourceError` instead of waiting on a dead descriptor.
The pipe watch counts connected peers from nng's pipe callbacks through a self-pipe (never
blocking the nng thread, which `close` waits for).

Receiving goes through nng's message API (`receive_message`), not pynng's `recv`: that one
raises a bare `RuntimeError` on an empty message (pynng 0.9), which any peer can send, and
only the message says which pipe (connected peer) a frame came on.
"""

from __future__ import annotations

import contextlib
import os
import socket as stdlib_socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import pynng
from pynng.exceptions import check_err
from pynng.nng import ffi, lib

T = TypeVar("T")


class PipeWatch:
    """Counts connected peers; `wait_connected` wakes on nng's pipe callbacks."""

    def __init__(self, socket: pynng.Socket) -> None:
        self._lock = threading.Lock()
        self._connected = 0
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        socket.add_post_pipe_connect_cb(self._on_connect)
        socket.add_post_pipe_remove_cb(self._on_remove)

    @property
    def connected(self) -> int:
        with self._lock:
            return self._connected

    def _notify(self, delta: int) -> None:
        with self._lock:
            self._connected += delta
        # A full pipe means a wake-up is already pending; an error means we are closing.
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\x01")

    def _on_connect(self, pipe: pynng.Pipe) -> None:
        self._notify(1)

    def _on_remove(self, pipe: pynng.Pipe) -> None:
        self._notify(-1)

    async def wait_connected(self, peers: int) -> None:
        while self.connected < peers:
            await anyio.wait_readable(self._read_fd)
            with contextlib.suppress(BlockingIOError):
                os.read(self._read_fd, 4096)
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        anyio.notify_closing(self._read_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)


class _Direction:
    """One direction of a socket: its pollable descriptor, fetched once, and whether a
    task is using it (nng would interleave two tasks' frames)."""

    def __init__(self, name: str, descriptor: Callable[[], int]) -> None:
        self.name = name
        self._descriptor = descriptor
        self.fd: int | None = None
        self.busy = False

    def wait_fd(self) -> int:
        if self.fd is None:
            self.fd = self._descriptor()
        return self.fd


class NngIO:
    """Non-blocking send/receive of whole frames on one pynng socket."""

    def __init__(self, socket: pynng.Socket) -> None:
        self.socket = socket
        self.pipes = PipeWatch(socket)
        self._send = _Direction("sending", lambda: socket.send_fd)
        self._recv = _Direction("receiving", lambda: socket.recv_fd)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError

    async def send(self, frame: bytes) -> None:
        await self._until_done(self._send, lambda: self.socket.send(frame, block=False))

    async def receive(self) -> tuple[bytes, int]:
        """The next frame and the id of the pipe it came on (empty frames included)."""
        return await self._until_done(self._recv, lambda: receive_message(self.socket))

    async def _until_done(self, direction: _Direction, attempt: Callable[[], T]) -> T:
        """Try `attempt` (a non-blocking nng call) until it stops saying `TryAgain`."""
        self._check_open()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if direction.busy:
            raise anyio.BusyResourceError(direction.name)
        direction.busy = True
        try:
            while True:
                try:
                    return attempt()
                except pynng.TryAgain:
                    await anyio.wait_readable(direction.wait_fd())
                except pynng.NNGException as error:
                    raise self._translate(error) from error
        except anyio.ClosedResourceError:
            raise
        except OSError as error:
            raise self._closed_or_broken(error) from error
        finally:
            direction.busy = False

    def _translate(self, error: pynng.NNGException) -> Exception:
        if isinstance(error, pynng.Closed) or self._closed:
            return anyio.ClosedResourceError()
        return anyio.BrokenResourceError(f"nng: {error}")

    def _closed_or_broken(self, error: OSError) -> Exception:
        if self._closed:
            return anyio.ClosedResourceError()
        return anyio.BrokenResourceError(f"polling the nng socket failed: {error}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for direction in (self._send, self._recv):
            if direction.fd is not None:
                anyio.notify_closing(direction.fd)
        self.socket.close()
        self.pipes.close()


def receive_message(socket: pynng.Socket) -> tuple[bytes, int]:
    """One message without blocking (`pynng.TryAgain` if none): its body, which may be
    empty, and its pipe's id (-1 if the pipe closed meanwhile)."""
    pointer = ffi.new("nng_msg **")
    check_err(lib.nng_recvmsg(socket.socket, pointer, lib.NNG_FLAG_NONBLOCK))
    message = pointer[0]
    try:
        size = lib.nng_msg_len(message)
        body = ffi.buffer(ffi.cast("char *", lib.nng_msg_body(message)), size)[:] if size else b""
        return body, lib.nng_pipe_id(lib.nng_msg_get_pipe(message))
    finally:
        lib.nng_msg_free(message)


def bound_address(listener: Any, requested: str) -> str:
    """The address peers should dial: for tcp, the real port picked by the kernel."""
    if requested.startswith(("tcp://", "tcp4://", "tcp6://")):
        scheme = requested.split("://", 1)[0]
        local = listener.local_address
        host = requested.split("://", 1)[1].rsplit(":", 1)[0]
        # pynng reports the port in network byte order.
        return f"{scheme}://{host}:{stdlib_socket.ntohs(local.port)}"
    return requested
