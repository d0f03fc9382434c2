"""The app in this process, on asyncio and trio (httpx's ASGI transport, no sockets):
503 while the model loads, and an engine that dies turns requests into a 500 naming
the cause, after which /health fails too."""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import error_of

from wavecore.engine.api import open_engine_core
from wavecore.engine.serve.app import build_app
from wavecore.engine.serve.options import ServeOptions
from wavecore.engine.serve.state import ServerState

# The engine tests' executor that fails on demand.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_helpers import ControlledExecutor, core_with

pytestmark = pytest.mark.anyio
OPTIONS = ServeOptions(model_name="tiny")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def client_of(state: ServerState) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_app(state))
    return httpx.AsyncClient(transport=transport, base_url="http://serve")


async def test_before_the_engine_is_ready_requests_get_503() -> None:
    async with client_of(ServerState(OPTIONS)) as http:
        health = await http.get("/health")
        assert error_of(health, 503)["code"] == "not_ready"
        assert health.headers["retry-after"] == "1"
        refused = await http.post("/v1/completions", json={"prompt": "hi"})
        assert error_of(refused, 503)["code"] == "not_ready"
        # What needs no engine answers already.
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200
        assert "wavecore:num_requests_running{" not in metrics.text  # no rank yet


@pytest.fixture
async def dying() -> AsyncIterator[tuple[ServerState, ControlledExecutor]]:
    executor = ControlledExecutor()
    state = ServerState(OPTIONS)
    async with open_engine_core(functools.partial(core_with, executor)) as engine:
        state.set_ready(engine, max_num_seqs=8)
        yield state, executor


async def test_an_engine_that_dies_is_a_500_naming_the_cause_and_health_fails(
    dying: tuple[ServerState, ControlledExecutor],
) -> None:
    state, executor = dying
    async with client_of(state) as http:
        served = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert served.json()["choices"][0]["finish_reason"] == "length"
        assert (await http.get("/health")).status_code == 200
        executor.fail_with = RuntimeError("the GPU caught fire")
        died = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        error = error_of(died, 500)
        assert error["code"] == "engine_dead"
        assert "the GPU caught fire" in str(error["message"])
        assert "the GPU caught fire" in str(error_of(await http.get("/health"), 500)["message"])
        assert error_of(await http.post("/v1/chat/completions", json={}), 500)["code"] == (
            "engine_dead"
        )
