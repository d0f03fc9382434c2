"""Every refusal is an OpenAI-style error with the right status, naming what was wrong,
and leaves the server serving: bad JSON, unknown model, a bad field, a prompt past the
context, an unknown route or method, an oversize body, load shedding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from serve_helpers import EXIT_GUARD, ServerProcess, error_of, wait_held

COMPLETION = {"prompt": "hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def http(admin_server: ServerProcess) -> Iterator[httpx.Client]:
    with admin_server.client() as client:
        yield client


def test_invalid_json_and_a_body_that_is_not_an_object(http: httpx.Client) -> None:
    error = error_of(http.post("/v1/completions", content=b'{"prompt": '), 400)
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert "JSON object" in str(error_of(http.post("/v1/completions", json=[1, 2]), 400)["message"])


def test_an_unknown_model_is_named(http: httpx.Client) -> None:
    error = error_of(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"}), 400)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "gpt-9" in str(error["message"])


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"top_p": 0}, "top_p"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"seed": -1}, "seed"),
        ("/v1/completions", {"stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
        ("/v1/completions", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(
    http: httpx.Client, route: str, fields: dict[str, Any], param: str
) -> None:
    base = COMPLETION if route == "/v1/completions" else CHAT
    error = error_of(http.post(route, json={**base, **fields}), 400)
    assert error["param"] == param
    assert param.split(".")[0].split("[")[0] in str(error["message"])


def test_a_prompt_past_the_context(http: httpx.Client) -> None:
    # The null engine's context is 8192 tokens, one per byte.
    error = error_of(http.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 9000}), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert "9000 tokens" in str(error["message"])


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    assert error_of(http.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert "GET /v1/completions" in str(error_of(http.get("/v1/completions"), 405)["message"])


def test_an_oversize_body_is_a_413_with_or_without_a_length(http: httpx.Client) -> None:
    big = json.dumps({**COMPLETION, "prompt": "x" * 2**21}).encode()
    assert error_of(http.post("/v1/completions", content=big), 413)["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(big), 2**16):
            yield big[start : start + 2**16]

    assert error_of(http.post("/v1/completions", content=chunked()), 413)["code"] == (
        "request_too_large"
    )
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200  # still serving


@pytest.mark.anyio
async def test_load_shedding_past_max_waiting_with_retry_after(
    admin_server: ServerProcess,
) -> None:
    async with httpx.AsyncClient(base_url=admin_server.url, timeout=EXIT_GUARD) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        reasons: list[str] = []

        async def wait_for_one() -> None:
            response = await client.post("/v1/completions", json=COMPLETION)
            reasons.append(response.json()["choices"][0]["finish_reason"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_one)
            tg.start_soon(wait_for_one)
            await wait_held(client, 2)
            shed = await client.post("/v1/chat/completions", json=CHAT)
            assert error_of(shed, 503)["code"] == "overloaded"
            assert shed.headers["retry-after"] == "1"
            assert (await client.post("/resume")).status_code == 200
        assert reasons == ["length", "length"]
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
