"""Running the server: bind first (so `--port 0` is known at once), then serve HTTP
while the engine loads (503 until it is ready), and shut down gracefully on SIGTERM
or Ctrl-C.

Shutdown: the listeners close (Hypercorn stops accepting), requests in flight run on
for `shutdown_timeout` seconds, then the ones left are aborted through the engine, so
their clients see finish reason "abort" rather than a cut connection. The engine
closes only after the HTTP server has finished, since the last responses still use it.
"""

from __future__ import annotations

import signal
import socket
import sys

import anyio
import sniffio
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app
from starlette.applications import Starlette

from wavecore.engine.api import open_engine
from wavecore.engine.cli.prompts import UsageError
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.serve.app import build_app
from wavecore.engine.serve.options import ServeOptions
from wavecore.engine.serve.state import ServerState

# Hypercorn's own deadline comes this long after ours, so that requests we abort at
# the shutdown timeout can still send their last chunk before Hypercorn cancels them.
_HYPERCORN_GRACE = 5.0


def announce(line: str) -> None:
    print(line, flush=True)


def run_serve(config: EngineConfig, options: ServeOptions, backend: str) -> int:
    """0 after a graceful shutdown, 1 if the engine died while serving."""
    hypercorn = _hypercorn_config(options)
    listener = _listen(options, hypercorn.backlog)
    with listener:
        sockets = Sockets(secure_sockets=[], insecure_sockets=[listener], quic_sockets=[])
        return anyio.run(serve, config, options, hypercorn, sockets, backend=backend)


def _listen(options: ServeOptions, backlog: int) -> socket.socket:
    """The listening socket, bound here rather than by Hypercorn: a port that cannot be
    had is a usage error, and `--port 0` is known before anything starts."""
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.bind((options.host, options.port))
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError as error:
        listener.close()
        raise UsageError(
            f"cannot listen on {options.host}:{options.port}: {error.strerror or error}"
        ) from None
    return listener


async def serve(
    config: EngineConfig, options: ServeOptions, hypercorn: Config, sockets: Sockets
) -> int:
    state = ServerState(options)
    host, port = sockets.insecure_sockets[0].getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    announce(f"serving on http://{host}:{port}")
    shutdown = anyio.Event()
    http_done = anyio.Event()
    async with anyio.create_task_group() as tg:
        # The engine outlives the HTTP server: its last responses still use it.
        tg.start_soon(_run_engine, config, state, shutdown, http_done)
        async with anyio.create_task_group() as http:
            http.start_soon(_watch_signals, state, shutdown)
            http.start_soon(_drain, state, shutdown, options.shutdown_timeout)
            # In a task of its own: Hypercorn's asyncio worker cancels the task that
            # runs it (and uncancels it) on shutdown, which must not be this task, the
            # host of a task group.
            http.start_soon(_serve_http, build_app(state), hypercorn, sockets, shutdown, http_done)
            await http_done.wait()
            http.cancel_scope.cancel()
    announce("server stopped")
    if state.dead is not None:
        print(f"the engine died: {state.dead}", file=sys.stderr, flush=True)
        return 1
    return 0


def _hypercorn_config(options: ServeOptions) -> Config:
    config = Config()
    # Hypercorn queues 100 connections not yet accepted; a burst past that waits for
    # SYN retries (seconds). uvicorn, upstream's server, queues 2048.
    config.backlog = 2048
    config.graceful_timeout = options.shutdown_timeout + _HYPERCORN_GRACE
    config.accesslog = None
    return config


async def _run_engine(
    config: EngineConfig, state: ServerState, shutdown: anyio.Event, http_done: anyio.Event
) -> None:
    """Open the engine and hold it until the HTTP server has finished. An engine that
    cannot start stops the server: there is nothing it could ever serve."""
    try:
        async with open_engine(config) as engine:
            state.set_ready(engine, max_num_seqs=config.max_num_seqs)
            announce(f"ready: {state.options.model_name} on {engine.dp_size} data-parallel rank(s)")
            await http_done.wait()
    except Exception as error:
        if state.serving() is not None:
            raise  # not a start-up failure: a bug, with its traceback
        state.dead = state.dead or EngineDeadError(f"the model could not be loaded: {error}")
        shutdown.set()


async def _watch_signals(state: ServerState, shutdown: anyio.Event) -> None:
    """The first SIGTERM or Ctrl-C starts a graceful shutdown; a second one aborts
    the requests still in flight at once."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not shutdown.is_set():
                announce(
                    f"{signal.Signals(signum).name}: shutting down, {len(state.in_flight)} "
                    f"request(s) in flight"
                )
                shutdown.set()
            else:
                await _abort_in_flight(state, "a second signal")


async def _drain(state: ServerState, shutdown: anyio.Event, seconds: float) -> None:
    """Once shutdown starts, give requests in flight `seconds` more; the task is
    cancelled as soon as the HTTP server has finished, whichever comes first."""
    await shutdown.wait()
    await anyio.sleep(seconds)
    await _abort_in_flight(state, f"the shutdown timeout ({seconds:g} s)")


async def _abort_in_flight(state: ServerState, why: str) -> None:
    aborted = await state.abort_in_flight()
    if aborted:
        print(
            f"aborted {aborted} request(s) still in flight after {why}", file=sys.stderr, flush=True
        )


async def _serve_http(
    app: Starlette, config: Config, sockets: Sockets, shutdown: anyio.Event, done: anyio.Event
) -> None:
    """Hypercorn's worker for the backend this runs on (it has one per event loop),
    until `shutdown` and the graceful part of it are over."""
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio.run import worker_serve
    else:
        from hypercorn.asyncio.run import worker_serve  # type: ignore[assignment]
    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        sockets=sockets,
        shutdown_trigger=shutdown.wait,
    )
    done.set()
