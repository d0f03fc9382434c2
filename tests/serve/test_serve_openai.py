"""The OpenAI-compatible routes, driven by the official `openai` client (sync and
async): completions and chat, whole and streamed, n > 1, stop strings, usage, prompts as
lists and token ids; the text equals what `engine.generate` gives in process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from serve_helpers import ServerProcess, error_of

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.request import Prompt
from wavecore.engine.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


async def in_process(
    prompt: Prompt, max_tokens: int, stop: tuple[str, ...] = ()
) -> tuple[str, str]:
    """What the engine gives in this process for the same request: text, finish reason."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    text, reason = "", ""
    async with open_engine(EngineConfig(executor="null")) as engine:
        async for delta in engine.generate(prompt, params):
            text += delta.text
            reason = delta.finish_reason or reason
    return text, reason


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
async def aclient(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.mark.anyio
async def test_a_completion_equals_engine_generate_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    expected, reason = await in_process("The capital of France is", 12)
    whole = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == reason == "length"
    assert whole.usage is not None
    prompt_tokens = len(b"The capital of France is")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert whole.usage.total_tokens == prompt_tokens + 12
    assert whole.model == MODEL and whole.id.startswith("cmpl-") and whole.created > 0

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


@pytest.mark.anyio
async def test_chat_equals_engine_generate_with_the_chat_template(
    aclient: openai.AsyncOpenAI,
) -> None:
    expected, _ = await in_process(CHAT, 10)
    whole = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)  # type: ignore[arg-type]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.object == "chat.completion"

    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_completion_tokens=10,
        stream=True,
    )
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.anyio
async def test_text_parts_render_like_string_content(aclient: openai.AsyncOpenAI) -> None:
    expected, _ = await in_process([{"role": "user", "content": "Hello there"}], 6)
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    whole = await aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_tokens=6,
    )
    assert whole.choices[0].message.content == expected


def test_n_choices_each_finish_and_usage_counts_the_prompt_once(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, seed=7)
    assert sorted(choice.index for choice in whole.choices) == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in whole.choices)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 12)

    chunks = list(
        client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=3, stream=True)
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1, 2]


@pytest.mark.anyio
async def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free, _ = await in_process("stop here", 20)
    stop = free[8:10]
    whole = client.completions.create(model=MODEL, prompt="stop here", max_tokens=20, stop=[stop])
    assert whole.choices[0].text == free[: free.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.anyio
async def test_prompts_as_a_list_and_as_token_ids(client: openai.OpenAI) -> None:
    first, _ = await in_process("one", 5)
    second, _ = await in_process("two", 5)
    whole = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=5)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [first, second]
    by_ids = client.completions.create(model=MODEL, prompt=list(b"one"), max_tokens=5, echo=True)
    assert by_ids.choices[0].text == "one" + first


def test_models_health_and_version(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        # Without --enable-admin-api the admin routes do not exist.
        assert error_of(http.post("/pause"), 404)["type"] == "not_found_error"
