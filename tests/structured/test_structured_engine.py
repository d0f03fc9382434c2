"""Structured output through the one `Engine` interface, in this process and over two
rank processes, with and without the batch queue: the same outputs as one core run
serially, whatever pauses and sleeps happen on the way; a bad spec refused on its own
`generate` while the requests in flight finish exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from structured_helpers import NULL_SPECS, TOKENIZER, null_core, request, run_to_end

from wavecore.channels.codec import Codec
from wavecore.engine import messages as m
from wavecore.engine.api import Engine, open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import InvalidRequestError
from wavecore.engine.executors.null_executor import null_continuation
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured import grammars
from wavecore.engine.structured_outputs import StructuredOutputs
from wavecore.statemachines import PauseMode

pytestmark = pytest.mark.anyio
HANG_GUARD = 60  # seconds; only ever reached if an engine hangs

# The batch queue runs at dp 2 (its deferred bitmask is the same code in one rank).
ENGINES = {
    "one-rank": {"dp_size": 1},
    "dp2-lockstep-queue": {
        "dp_size": 2,
        "dp_mode": "lockstep",
        "sync_interval": 4,
        "async_scheduling": True,
    },
    "dp2-independent": {"dp_size": 2, "dp_mode": "independent"},
}
# Every engine on asyncio; the one-rank engine on trio too.
CASES = [("asyncio", name) for name in ENGINES] + [("trio", "one-rank")]
# A long object: its array keeps the request running across a pause or a sleep.
LONG = StructuredOutputs(
    json={
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 10, "maximum": 99},
                "minItems": 30,
                "maxItems": 30,
            },
        },
        "required": ["id", "items"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}-{n}" for b, n in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


@pytest.fixture(scope="module")
def anyio_backend(case: tuple[str, str]) -> str:
    return case[0]


@pytest.fixture(scope="module")
async def engine(case: tuple[str, str], anyio_backend: str) -> AsyncIterator[Engine]:
    config = EngineConfig(executor="null", max_num_seqs=8, max_model_len=512, **ENGINES[case[1]])
    async with open_engine(config) as opened:
        yield opened


def serially(prompt: str, spec: StructuredOutputs | None, max_tokens: int) -> list[int]:
    """What one core, stepped serially, outputs for this request."""
    core = null_core()
    core.add_request(request("r", prompt, max_tokens=max_tokens, structured_outputs=spec))
    return run_to_end(core)["r"][0]


async def collect(engine: Engine, prompt: str, params: SamplingParams, **kw: Any) -> list[Any]:
    return [delta async for delta in engine.generate(prompt, params, **kw)]


def tokens(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


async def test_every_kind_gives_what_one_core_gives_and_matches_its_spec(engine: Engine) -> None:
    results: dict[str, list[Any]] = {}
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for kind, (spec, _) in NULL_SPECS.items():
                for copy in range(2):  # both ranks of a DP engine, and a cached grammar

                    async def one(kind: str = kind, spec: StructuredOutputs = spec, c: int = copy):
                        params = SamplingParams(max_tokens=200, structured_outputs=spec)
                        results[f"{kind}-{c}"] = await collect(engine, f"{kind} prompt", params)

                    tg.start_soon(one)
    for name, deltas in results.items():
        kind = name.rsplit("-", 1)[0]
        spec, matches = NULL_SPECS[kind]
        assert deltas[-1].finish_reason == "stop"
        assert tokens(deltas) == serially(f"{kind} prompt", spec, 200)
        assert matches("".join(delta.text for delta in deltas))
    stats = await engine.stats()
    assert all(stats.structured_requests[kind] >= 2 for kind in NULL_SPECS)
    assert sum(rank.core.grammar_compiles for rank in stats.ranks) >= len(NULL_SPECS)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutputs(json={"type": "frobnicate"}), "structured_outputs.json"),
        (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputs(grammar="start: no_such_rule"), "structured_outputs.grammar"),
    ],
)
async def test_a_spec_that_does_not_compile_is_refused_and_nothing_else_changes(
    engine: Engine, spec: StructuredOutputs, field: str
) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("in flight", SamplingParams(max_tokens=30))
        first = await stream.__anext__()
        with pytest.raises(InvalidRequestError, match=field):
            await collect(engine, "refused", SamplingParams(structured_outputs=spec))
        rest = [delta async for delta in stream]
    expected = null_continuation(
        list(b"in flight"), 30, vocab_size=TOKENIZER.vocab_size, eos_token_id=TOKENIZER.eos_token_id
    )
    assert tokens([first, *rest]) == expected


@pytest.mark.parametrize("interruption", ["keep-pause", "sleep-keep"])
async def test_a_pause_or_a_sleep_in_the_middle_of_an_object_changes_nothing(
    engine: Engine, interruption: str
) -> None:
    """Requests kept across a KEEP pause, or across a sleep that drops the KV cache and
    recomputes them, end in the same valid JSON as without it."""
    params = SamplingParams(max_tokens=300, structured_outputs=LONG)
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("long object", params, request_id=interruption)
        first = await stream.__anext__()
        if interruption == "keep-pause":
            await engine.pause(PauseMode.KEEP)
            await engine.resume()
        else:
            await engine.sleep(1, mode=PauseMode.KEEP)
            await engine.wake_up()
        deltas = [first, *[delta async for delta in stream]]
    assert deltas[-1].finish_reason == "stop"
    assert tokens(deltas) == serially("long object", LONG, 300)


async def test_a_grammar_that_fails_on_the_rank_ends_that_request_with_its_error(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front end's check passes and the rank's compile fails (patched here, so only
    a rank in this process fails; a DP engine's ranks compile as usual): that request
    ends with "error" and the compiler's message, every other finishes."""

    def failing(vocabulary: object, spec: StructuredOutputs) -> object:
        raise grammars.GrammarError("structured_outputs.regex: the rank could not compile it")

    monkeypatch.setattr(grammars.GrammarVocabulary, "matcher", failing)
    spec = StructuredOutputs(regex="[a-z]+ failing on the rank")
    with anyio.fail_after(HANG_GUARD):
        failed = await collect(engine, "x", SamplingParams(max_tokens=50, structured_outputs=spec))
        fine = await collect(engine, "y", SamplingParams(max_tokens=5))
    if engine.dp_size == 1:
        assert failed[-1].finish_reason == "error"
        assert failed[-1].error == "structured_outputs.regex: the rank could not compile it"
    else:
        assert failed[-1].finish_reason == "stop"
    assert len(tokens(fine)) == 5


def test_step_outputs_carry_the_errors_of_failed_requests_over_the_wire() -> None:
    outputs = m.StepOutputs(
        rank=1,
        request_ids=("a", "b"),
        token_counts=(1, 0),
        token_ids=(7,),
        finished={"b": "error"},
        errors={"b": "structured_outputs.json: no"},
    )
    codec = Codec()
    assert codec.decode(codec.encode(outputs)) == outputs
