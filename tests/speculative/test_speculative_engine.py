"""Speculative decoding through the one `Engine`, in this process and over two rank
processes, in the serial loop and under the batch queue, with prompt lookup and with
the executor drafting as a draft model does: the same tokens as plain decoding (a
cycling null executor, so prompt lookup is often right and several tokens arrive in
one step), with stop strings inside an accepted run, structured output, a KEEP pause,
a sleep that recomputes, and an abort."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from wavecore.engine.api import Engine, open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs
from wavecore.statemachines import PauseMode

pytestmark = pytest.mark.anyio
HANG_GUARD = 60  # seconds; only ever reached if an engine hangs
TOKENIZER = ByteTokenizer()
NULL = {"executor": "null", "null_repeat_period": 3, "max_model_len": 512}
METHODS = {
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4},
    # The null executor drafts as a draft model would (a few drafts wrong on purpose).
    "draft": {"speculative_method": "draft_model", "num_speculative_tokens": 4},
}
ENGINES = {
    "one-rank": {},
    "dp2-lockstep": {"dp_size": 2, "dp_mode": "lockstep", "sync_interval": 2},
    "dp2-independent": {"dp_size": 2, "dp_mode": "independent"},
    "batch-queue": {"async_scheduling": True},
    "dp2-lockstep-batch-queue": {"dp_size": 2, "dp_mode": "lockstep", "async_scheduling": True},
}
CASES = (
    [("asyncio", name, "ngram") for name in ENGINES]
    + [("trio", "one-rank", "ngram")]
    + [("asyncio", "dp2-lockstep-batch-queue", "draft")]
    + [("trio", "one-rank", "draft")]
)
PROMPTS = [("abc" * (i + 3)) + "d" * i for i in range(6)]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    return request.param


@pytest.fixture(scope="module")
def anyio_backend(case: tuple[str, str, str]) -> str:
    return case[0]


@pytest.fixture(scope="module")
async def engine(case: tuple[str, str, str], anyio_backend: str) -> AsyncIterator[Engine]:
    config = EngineConfig(**NULL, **METHODS[case[2]], **ENGINES[case[1]])
    async with open_engine(config) as opened:
        yield opened


def serially(prompt: str, params: SamplingParams) -> list[int]:
    """Plain decoding in one core, stepped serially."""
    core = EngineCore.from_config(EngineConfig(**NULL))
    core.add_request(
        EngineRequest(
            request_id="r", prompt_token_ids=tuple(TOKENIZER.encode(prompt)), params=params
        )
    )
    tokens: list[int] = []
    while core.has_unfinished():
        for update in core.step():
            tokens += update.new_token_ids
    return tokens


async def collect(engine: Engine, prompt: str, params: SamplingParams, **kw: Any) -> list[Any]:
    return [delta async for delta in engine.generate(prompt, params, **kw)]


def tokens(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


async def test_outputs_are_plain_decodings_and_arrive_several_tokens_a_step(
    engine: Engine,
) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    results: dict[int, list[Any]] = {}
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for number, prompt in enumerate(PROMPTS):

                async def one(number: int = number, prompt: str = prompt) -> None:
                    results[number] = await collect(engine, prompt, params)

                tg.start_soon(one)
    for number, prompt in enumerate(PROMPTS):
        assert tokens(results[number]) == serially(prompt, params)
    stats = await engine.stats()
    accepted = sum(rank.core.spec_decode_num_accepted_tokens for rank in stats.ranks)
    drafted = sum(rank.core.spec_decode_num_draft_tokens for rank in stats.ranks)
    assert 0 < accepted <= drafted


async def test_a_stop_string_inside_an_accepted_run_ends_it_where_plain_decoding_does(
    engine: Engine,
) -> None:
    expected_text = TOKENIZER.decode(serially(PROMPTS[2], SamplingParams(max_tokens=40)))
    stop = expected_text[12:14]  # met well inside the output, after drafts are accepted
    params = SamplingParams(max_tokens=40, stop=[stop])
    with anyio.fail_after(HANG_GUARD):
        got = await collect(engine, PROMPTS[2], params)
        async with open_engine(EngineConfig(**NULL)) as plain:
            want = await collect(plain, PROMPTS[2], params)
    assert "".join(d.text for d in got) == "".join(d.text for d in want)
    assert tokens(got) == tokens(want)
    assert got[-1].finish_reason == want[-1].finish_reason == "stop"


async def test_structured_output_with_drafts_is_plain_decoding(engine: Engine) -> None:
    spec = StructuredOutputs(regex="(abc){2,9}d")
    params = SamplingParams(max_tokens=60, structured_outputs=spec)
    with anyio.fail_after(HANG_GUARD):
        deltas = await collect(engine, "abcabcabc", params)
    assert tokens(deltas) == serially("abcabcabc", params)
    assert deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("interruption", ["keep-pause", "sleep-keep", "abort"])
async def test_an_interruption_in_the_middle_changes_nothing_it_should_not(
    engine: Engine, interruption: str
) -> None:
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    expected = serially(PROMPTS[4], params)
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate(PROMPTS[4], params, request_id=interruption)
        first = await stream.__anext__()
        if interruption == "keep-pause":
            await engine.pause(PauseMode.KEEP)
            await engine.resume()
        elif interruption == "sleep-keep":
            await engine.sleep(1, mode=PauseMode.KEEP)
            await engine.wake_up()
        else:
            await engine.abort(interruption)
        deltas = [first, *[delta async for delta in stream]]
    if interruption == "abort":
        assert deltas[-1].finish_reason in ("abort", "length")
        assert tokens(deltas) == expected[: len(tokens(deltas))]
    else:
        assert tokens(deltas) == expected
