"""Starting and stopping: SIGTERM lets requests in flight finish (or, past
`--shutdown-timeout`, aborts them visibly) and exits 0, on asyncio and trio; an engine
that cannot start stops the server with status 1; the API key comes from the
environment."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import anyio.from_thread
import httpx
import openai
import pytest
from serve_helpers import EXIT_GUARD, NULL_FLAGS, ServerProcess, error_of, wait_held


def finish_reasons(lines: list[str]) -> list[str]:
    """The finish reasons in the SSE `lines` of a completion stream."""
    reasons = []
    for line in lines:
        if line.startswith("data: {"):
            reason = json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"]
            if reason is not None:
                reasons.append(reason)
    return reasons


async def wait_held_at(url: str, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=EXIT_GUARD) as client:
        await wait_held(client, count)


class Streamer:
    """One streamed completion read on a thread, so the test can signal the server."""

    def __init__(self, server: ServerProcess, max_tokens: int) -> None:
        self.lines: list[str] = []
        self.first = threading.Event()
        self._body = {"prompt": "drain me", "max_tokens": max_tokens, "stream": True}
        self._server = server
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with (
            self._server.client() as http,
            http.stream("POST", "/v1/completions", json=self._body) as response,
        ):
            for line in response.iter_lines():
                self.lines.append(line)
                self.first.set()

    def join(self) -> list[str]:
        self._thread.join(timeout=EXIT_GUARD)
        assert not self._thread.is_alive()
        return self.lines


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_lets_a_request_in_flight_finish_and_exits_0(backend: str) -> None:
    server = ServerProcess.start(*NULL_FLAGS, "--backend", backend)
    try:
        with server.client() as http:
            whole = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            assert whole.json()["choices"][0]["finish_reason"] == "length"
        streamer = Streamer(server, max_tokens=4000)
        assert streamer.first.wait(EXIT_GUARD)  # in flight when the signal comes
        status, err = server.terminate()
        lines = streamer.join()
    finally:
        server.kill()
    assert status == 0, err
    assert finish_reasons(lines) == ["length"]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert any(line.startswith("SIGTERM: shutting down") for line in server.lines)


def test_past_the_shutdown_timeout_requests_are_aborted_visibly() -> None:
    server = ServerProcess.start(*NULL_FLAGS, "--enable-admin-api", "--shutdown-timeout", "0.2")
    try:
        with server.client() as http:
            assert http.post("/pause", params={"mode": "keep"}).status_code == 200
            streamer = Streamer(server, max_tokens=50)
            # Held by the pause: it cannot finish before the timeout.
            with anyio.from_thread.start_blocking_portal() as portal:
                portal.call(wait_held_at, server.url, 1)
        status, err = server.terminate()
        lines = streamer.join()
    finally:
        server.kill()
    assert status == 0, err
    assert finish_reasons(lines) == ["abort"]
    assert "aborted 1 request(s) still in flight after the shutdown timeout (0.2 s)" in err


def test_the_api_key_guards_v1_and_admin_routes_only() -> None:
    server = ServerProcess.start(
        *NULL_FLAGS, "--enable-admin-api", env={"WAVECORE_API_KEY": "sesame"}
    )
    try:
        with server.client() as http:
            assert error_of(http.get("/v1/models"), 401)["code"] == "invalid_api_key"
            wrong = {"Authorization": "Bearer sesame2"}
            error_of(http.get("/v1/models", headers=wrong), 401)
            error_of(http.get("/stats"), 401)
            good = {"Authorization": "Bearer sesame"}
            assert http.get("/stats", headers=good).status_code == 200
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame") as client:
            assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        with (
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0) as client,
            pytest.raises(openai.AuthenticationError),
        ):
            client.models.list()
        status, err = server.terminate()
    finally:
        server.kill()
    assert status == 0, err


def test_an_engine_that_cannot_start_stops_the_server_with_status_1() -> None:
    command = [sys.executable, "-m", "wavecore.engine.cli.main", "serve", "--port", "0"]
    ended = subprocess.run(
        [*command, "--model", "/nonexistent/model.gguf"],
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD,
        check=False,
    )
    assert ended.returncode == 1
    assert ended.stdout.startswith("serving on http://127.0.0.1:")
    assert "the model could not be loaded: /nonexistent/model.gguf" in ended.stderr
