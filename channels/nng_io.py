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
"""

from __future__ import annotations

import contextlib
import os
import socket as stdlib_socket
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pynng


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


class NngIO:
    """Non-blocking send/receive of whole frames on one pynng socket."""

    def __init__(self, socket: pynng.Socket) -> None:
        self.socket = socket
        self.pipes = PipeWatch(socket)
        self._send_fd: int | None = None
        self._recv_fd: int | None = None
        self._closed = False
        self._receiving = False
        self._sending = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError

    async def send(self, frame: bytes) -> None:
        self._check_open()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._sending:
            raise anyio.BusyResourceError("sending")
        self._sending = True
        try:
            while True:
                try:
                    self.socket.send(frame, block=False)
                    return
                except pynng.TryAgain:
                    if self._send_fd is None:
                        self._send_fd = self.socket.send_fd
                    await anyio.wait_readable(self._send_fd)
                except pynng.NNGException as error:
                    raise self._translate(error) from error
        except anyio.ClosedResourceError:
            raise
        except OSError as error:
            raise self._closed_or_broken(error) from error
        finally:
            self._sending = False

    async def receive(self) -> bytes:
        self._check_open()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._receiving:
            raise anyio.BusyResourceError("receiving")
        self._receiving = True
        try:
            while True:
                try:
                    return self.socket.recv(block=False)
                except pynng.TryAgain:
                    if self._recv_fd is None:
                        self._recv_fd = self.socket.recv_fd
                    await anyio.wait_readable(self._recv_fd)
                except pynng.NNGException as error:
                    raise self._translate(error) from error
        except anyio.ClosedResourceError:
            raise
        except OSError as error:
            raise self._closed_or_broken(error) from error
        finally:
            self._receiving = False

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
        for fd in (self._send_fd, self._recv_fd):
            if fd is not None:
                anyio.notify_closing(fd)
        self.socket.close()
        self.pipes.close()


def bound_address(listener: Any, requested: str) -> str:
    """The address peers should dial: for tcp, the real port picked by the kernel."""
    if requested.startswith(("tcp://", "tcp4://", "tcp6://")):
        scheme = requested.split("://", 1)[0]
        local = listener.local_address
        host = requested.split("://", 1)[1].rsplit(":", 1)[0]
        # pynng reports the port in network byte order.
        return f"{scheme}://{host}:{stdlib_socket.ntohs(local.port)}"
    return requested
