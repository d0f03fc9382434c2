"""The admin API (pause, resume, sleep, wake_up, stats, ...), a client disconnect that
aborts its request, and the Prometheus metrics moving with the requests served."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import EXIT_GUARD, ServerProcess, error_of, wait_held

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
COMPLETION = {"prompt": "hello", "max_tokens": 6}


@pytest.fixture
async def http(admin_server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=admin_server.url, timeout=EXIT_GUARD) as client:
        yield client


async def stats(http: httpx.AsyncClient) -> dict[str, object]:
    response = await http.get("/stats")
    assert response.status_code == 200, response.text
    return response.json()


async def test_pause_keep_holds_new_requests_until_resume(http: httpx.AsyncClient) -> None:
    assert (await http.post("/pause", params={"mode": "keep"})).json() == {}
    assert (await http.get("/is_paused")).json() == {"is_paused": True}
    finished: list[str] = []

    async def one() -> None:
        response = await http.post("/v1/completions", json=COMPLETION)
        finished.append(response.json()["choices"][0]["finish_reason"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await wait_held(http, 1)
        assert (await stats(http))["paused"] == "keep"
        assert finished == []  # held, not served
        assert (await http.post("/resume")).status_code == 200
    assert finished == ["length"]
    assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_sleep_and_wake_up(http: httpx.AsyncClient) -> None:
    assert (await http.post("/sleep", params={"level": "1"})).status_code == 200
    assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
    refused = error_of(await http.post("/resume"), 409)
    assert "wake_up" in str(refused["message"])
    assert (await http.post("/wake_up", params=[("tags", "weights")])).status_code == 200
    assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}  # kv_cache too
    assert (await http.post("/wake_up")).status_code == 200
    assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
    assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (await http.post("/reset_prefix_cache")).status_code == 200


async def test_bad_admin_arguments_are_named(http: httpx.AsyncClient) -> None:
    assert "level" in str(error_of(await http.post("/sleep", params={"level": "x"}), 400)["param"])
    assert "0, 1 or 2" in str(
        error_of(await http.post("/sleep", params={"level": "7"}), 400)["message"]
    )
    assert "bogus" in str(
        error_of(await http.post("/pause", params={"mode": "bogus"}), 400)["message"]
    )
    assert "bogus" in str(
        error_of(await http.post("/wake_up", params={"tags": "bogus"}), 400)["message"]
    )
    bad_size = await http.post("/scale", json={"new_dp_size": "two"})
    assert error_of(bad_size, 400)["param"] == "new_dp_size"
    # One rank in this process has no ranks to add: refused, and nothing changed.
    error_of(await http.post("/scale", json={"new_dp_size": 2}), 409)
    assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_a_client_that_disconnects_mid_stream_aborts_its_request(
    http: httpx.AsyncClient,
) -> None:
    # The null engine finishes any request within milliseconds; held by a pause, a
    # request can only leave the engine by being aborted.
    assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
    stream = {"prompt": "hello", "max_tokens": 50, "stream": True}
    async with http.stream("POST", "/v1/completions", json=stream) as response:
        assert response.status_code == 200
        await wait_held(http, 1)
    # Leaving the block closed the connection.
    with anyio.fail_after(EXIT_GUARD):
        while (await stats(http))["held"]:  # noqa: ASYNC110 (the condition is in another process)
            await anyio.sleep(0.01)
    after = await stats(http)
    assert (after["num_waiting"], after["num_running"]) == (0, 0)
    assert [rank["core"]["kv_usage"] for rank in after["ranks"]] == [0.0]  # type: ignore[union-attr]
    assert (await http.post("/resume")).status_code == 200
    assert (await stats(http))["num_running"] == 0  # nothing was left to resume


async def test_a_client_that_gives_up_on_a_whole_answer_aborts_its_request(
    admin_server: ServerProcess, http: httpx.AsyncClient
) -> None:
    assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
    async with (
        httpx.AsyncClient(base_url=admin_server.url, timeout=EXIT_GUARD) as impatient,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(functools.partial(impatient.post, "/v1/completions", json=COMPLETION))
        await wait_held(http, 1)
        tg.cancel_scope.cancel()  # the client gives up: its connection closes
    await wait_held(http, 0)
    assert (await stats(http))["num_waiting"] == 0
    assert (await http.post("/resume")).status_code == 200


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    parsed = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            parsed[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return parsed


async def test_metrics_parse_and_move_with_a_request(http: httpx.AsyncClient) -> None:
    model = (("model_name", MODEL),)
    before = samples((await http.get("/metrics")).text)
    response = await http.post("/v1/completions", json={"prompt": "four", "max_tokens": 7})
    assert response.status_code == 200
    after = samples((await http.get("/metrics")).text)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("wavecore:generation_tokens_total") == 7
    assert moved("wavecore:prompt_tokens_total") == 4
    success = (("finished_reason", "length"), ("model_name", MODEL))
    assert moved("wavecore:request_success_total", success) == 1
    assert moved("wavecore:time_to_first_token_seconds_count") == 1
    assert moved("wavecore:e2e_request_latency_seconds_count") == 1
    assert moved("wavecore:inter_token_latency_seconds_count") >= 1
    rank = (("engine", "0"), ("model_name", MODEL))
    assert after[("wavecore:num_requests_running", rank)] == 0
    assert after[("wavecore:kv_cache_usage_perc", rank)] == 0


async def test_prefix_cache_counters_count_a_repeated_prompt(http: httpx.AsyncClient) -> None:
    rank = (("engine", "0"), ("model_name", MODEL))
    prompt = "a prompt long enough to fill several KV blocks of the cache " * 2
    before = samples((await http.get("/metrics")).text)
    for _ in range(2):
        response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200
    after = samples((await http.get("/metrics")).text)

    def moved(name: str) -> float:
        return after[(name, rank)] - before.get((name, rank), 0.0)

    queried = moved("wavecore:prefix_cache_queries_total")
    hits = moved("wavecore:prefix_cache_hits_total")
    assert queried >= 2 * len(prompt) - 2 and 0 < hits <= queried / 2


async def test_profile_routes(http: httpx.AsyncClient, tmp_path: Path) -> None:
    error_of(await http.post("/start_profile"), 400)  # no directory, no environment
    assert error_of(await http.post("/stop_profile"), 409)["type"] == "conflict_error"
    started = await http.post("/start_profile", params={"directory": str(tmp_path)})
    assert started.status_code == 200, started.text
    assert "already runs" in str(
        error_of(await http.post("/start_profile", params={"directory": str(tmp_path)}), 409)[
            "message"
        ]
    )
    assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
    stopped = await http.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    (trace,) = stopped.json()["traces"]
    assert Path(trace).parent == tmp_path
    assert trace_events(trace)


def trace_events(path: str) -> list[object]:
    return json.loads(Path(path).read_text())["traceEvents"]
