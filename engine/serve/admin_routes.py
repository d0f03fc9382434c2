"""The admin routes (`--enable-admin-api`), as upstream's development endpoints: pause,
resume, sleep, wake_up, reset_prefix_cache, scale, is_paused, is_sleeping, stats,
start_profile and stop_profile (the traces go into `?directory=`, else the directory
that `WAVECORE_TORCH_PROFILER_DIR` names, as upstream's `VLLM_TORCH_PROFILER_DIR`), and
upstream's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (JSON bodies with
`lora_name`, and `lora_path` to load).

Each is one engine call; its arguments come from the query string (`/sleep?level=1`),
`/scale` from a JSON body. The engine refuses what its state does not allow, and that
refusal is the response (409), so the server keeps no protocol state of its own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wavecore.engine.errors import EngineError
from wavecore.engine.interface import Engine
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.serve.bodies import read_json
from wavecore.engine.serve.errors import bad_field
from wavecore.engine.serve.state import ServerState

AdminCall = Callable[[Engine, Request], Awaitable[dict[str, Any]]]
PROFILER_DIR_ENV = "WAVECORE_TORCH_PROFILER_DIR"


async def _pause(engine: Engine, request: Request) -> dict[str, Any]:
    mode = request.query_params.get("mode", "keep")
    clear_cache = _query_bool(request, "clear_cache", default=True)
    await engine.pause(mode, clear_cache=clear_cache)  # type: ignore[arg-type]
    return {}


async def _resume(engine: Engine, request: Request) -> dict[str, Any]:
    await engine.resume()
    return {}


async def _sleep(engine: Engine, request: Request) -> dict[str, Any]:
    level = _query_int(request, "level", default=1)
    await engine.sleep(level, mode=request.query_params.get("mode", "abort"))  # type: ignore[arg-type]
    return {}


async def _wake_up(engine: Engine, request: Request) -> dict[str, Any]:
    tags = request.query_params.getlist("tags")
    await engine.wake_up(tags or None)
    return {}


async def _reset_prefix_cache(engine: Engine, request: Request) -> dict[str, Any]:
    await engine.reset_prefix_cache()
    return {}


async def _is_paused(engine: Engine, request: Request) -> dict[str, Any]:
    return {"is_paused": await engine.is_paused()}


async def _is_sleeping(engine: Engine, request: Request) -> dict[str, Any]:
    return {"is_sleeping": await engine.is_sleeping()}


async def _stats(engine: Engine, request: Request) -> dict[str, Any]:
    stats = await engine.stats()
    described = dataclasses.asdict(stats)
    described["held"] = dict(stats.held)
    described["num_waiting"] = stats.num_waiting
    described["num_running"] = stats.num_running
    described["paused"] = stats.paused
    described["asleep"] = list(stats.asleep)
    return described


async def _start_profile(engine: Engine, request: Request) -> dict[str, Any]:
    directory = request.query_params.get("directory") or os.environ.get(PROFILER_DIR_ENV)
    if not directory:
        raise bad_field(
            "directory", f"give the traces' directory, or set {PROFILER_DIR_ENV} for the server"
        )
    await engine.start_profile(directory)
    return {}


async def _stop_profile(engine: Engine, request: Request) -> dict[str, Any]:
    return {"traces": await engine.stop_profile()}


def _scale_call(limit: int) -> AdminCall:
    async def scale(engine: Engine, request: Request) -> dict[str, Any]:
        body = await read_json(request, limit)
        size = body.get("new_dp_size")
        if isinstance(size, bool) or not isinstance(size, int):
            raise bad_field("new_dp_size", f"must be an integer, got {size!r}")
        drain = body.get("drain_timeout")
        if drain is not None and (isinstance(drain, bool) or not isinstance(drain, int | float)):
            raise bad_field("drain_timeout", f"must be a number of seconds, got {drain!r}")
        await engine.scale(size, drain_timeout=drain)
        return {"dp_size": engine.dp_size}

    return scale


def _lora_calls(limit: int) -> tuple[AdminCall, AdminCall]:
    async def names(request: Request, *fields: str) -> list[str]:
        body = await read_json(request, limit)
        values = [body.get(field) for field in fields]
        for field, value in zip(fields, values, strict=True):
            if not isinstance(value, str) or not value:
                raise bad_field(field, f"must be a non-empty string, got {value!r}")
        return values  # type: ignore[return-value]

    async def load(engine: Engine, request: Request) -> dict[str, Any]:
        name, path = await names(request, "lora_name", "lora_path")
        try:
            adapter = LoRARequest(name, path)
        except ValueError as error:
            raise bad_field("lora_name", str(error)) from None
        await engine.add_lora(adapter)
        return {"lora_name": name, "lora_path": adapter.path}

    async def unload(engine: Engine, request: Request) -> dict[str, Any]:
        (name,) = await names(request, "lora_name")
        await engine.remove_lora(name)
        return {"lora_name": name}

    return load, unload


def _query_int(request: Request, name: str, *, default: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise bad_field(name, f"must be an integer, got {text!r}") from None


def _query_bool(request: Request, name: str, *, default: bool) -> bool:
    text = request.query_params.get(name)
    if text is None:
        return default
    if text.lower() not in ("true", "false"):
        raise bad_field(name, f"must be true or false, got {text!r}")
    return text.lower() == "true"


def admin_routes(state: ServerState) -> list[Route]:
    def route(path: str, call: AdminCall, method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            engine = state.ready().engine
            try:
                return JSONResponse(await call(engine, request))
            except EngineError as error:
                raise state.error_of(error) from None

        return Route(path, endpoint, methods=[method])

    load_lora, unload_lora = _lora_calls(state.options.max_request_bytes)
    return [
        route("/v1/load_lora_adapter", load_lora, "POST"),
        route("/v1/unload_lora_adapter", unload_lora, "POST"),
        route("/pause", _pause, "POST"),
        route("/resume", _resume, "POST"),
        route("/sleep", _sleep, "POST"),
        route("/wake_up", _wake_up, "POST"),
        route("/reset_prefix_cache", _reset_prefix_cache, "POST"),
        route("/start_profile", _start_profile, "POST"),
        route("/stop_profile", _stop_profile, "POST"),
        route("/scale", _scale_call(state.options.max_request_bytes), "POST"),
        route("/is_paused", _is_paused, "GET"),
        route("/is_sleeping", _is_sleeping, "GET"),
        route("/stats", _stats, "GET"),
    ]
