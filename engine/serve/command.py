"""The `wavecore serve` subcommand: its flags and its entry point. The engine flags are
`generate`'s own (passed in by the CLI), so both commands build engines alike."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from wavecore.engine.cli.prompts import UsageError
from wavecore.engine.config import EngineConfig
from wavecore.engine.serve.options import ServeOptions, model_name_of

API_KEY_VARIABLE = "WAVECORE_API_KEY"


def add_serve_parser(
    commands: Any, add_engine_flags: Callable[[argparse.ArgumentParser], object]
) -> None:
    serve = commands.add_parser("serve", help="serve an engine over OpenAI-compatible HTTP")
    http = serve.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    http.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"require 'Authorization: Bearer KEY' on /v1 and admin routes "
        f"(default: ${API_KEY_VARIABLE})",
    )
    http.add_argument(
        "--enable-admin-api",
        action="store_true",
        help="serve /pause, /resume, /sleep, /wake_up, /reset_prefix_cache, /scale, "
        "/is_paused, /is_sleeping, /stats",
    )
    http.add_argument(
        "--max-waiting",
        type=int,
        help="answer 503 (Retry-After) while this many requests wait for their first token",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight may run on after SIGTERM/Ctrl-C before being aborted",
    )
    http.add_argument("--max-request-bytes", type=int, default=2**20)
    http.add_argument(
        "--max-requests-per-call",
        type=int,
        default=64,
        help="engine requests one call may ask for (prompts x n); more is a 400",
    )
    http.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body not all there this long after its headers is a 408",
    )
    http.add_argument(
        "--max-inflight",
        type=int,
        help="engine requests admitted at once, all clients together; the rest wait at the "
        "server and are admitted round-robin across clients (default: --max-num-seqs x --dp)",
    )
    http.add_argument(
        "--max-inflight-per-client",
        type=int,
        help="engine requests one client may have admitted at once "
        "(default: 3/4 of --max-inflight, leaving the rest for other clients)",
    )
    http.add_argument(
        "--max-queued-per-client",
        type=int,
        default=256,
        help="engine requests one client may have waiting at the server; a call past it is "
        "a 429 with Retry-After",
    )
    http.add_argument("--served-model-name", help="the `model` clients name (default: --model's)")
    add_engine_flags(serve)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    try:
        return ServeOptions(
            model_name=args.served_model_name or model_name_of(args.model),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            enable_admin_api=args.enable_admin_api,
            max_waiting=args.max_waiting,
            shutdown_timeout=args.shutdown_timeout,
            max_request_bytes=args.max_request_bytes,
            max_requests_per_call=args.max_requests_per_call,
            body_timeout=args.body_timeout,
            max_inflight=args.max_inflight,
            max_inflight_per_client=args.max_inflight_per_client,
            max_queued_per_client=args.max_queued_per_client,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def cmd_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Serve until SIGTERM or Ctrl-C; 0 after a graceful shutdown."""
    options = serve_options(args)
    # The server (and torch, through the engine) loads only for this command.
    from wavecore.engine.serve.server import run_serve

    return run_serve(config, options, args.backend)
