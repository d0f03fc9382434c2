"""Requests through a 2-rank lockstep engine: outputs, spreading, routing, waves."""

from __future__ import annotations

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of

from wavecore.engine.api import Engine, open_engine
from wavecore.engine.errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def engine():
    # Startup is bounded by the config's startup_timeout; each test guards itself.
    async with open_engine(null_config()) as dp_engine:
        yield dp_engine


async def test_open_engine_with_dp_size_2_serves_two_ranks(engine: Engine) -> None:
    assert engine.dp_size == 2
    stats = await engine.stats()
    assert [report.rank for report in stats.ranks] == [0, 1]


async def test_every_request_gets_its_own_output_and_requests_spread(engine: Engine) -> None:
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(24)]
    results: dict[str, list] = {}
    before = (await engine.stats()).requests_per_rank

    async def run(prompt: str) -> None:
        results[prompt] = await collect(
            engine, prompt, SamplingParams(max_tokens=3 + len(prompt) % 5)
        )

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(run, prompt)
    for prompt in prompts:
        deltas = results[prompt]
        assert tokens_of(deltas) == expected_tokens(prompt, 3 + len(prompt) % 5)
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == "length"
        counts = [d.usage.output_tokens for d in deltas]
        assert counts == sorted(counts)  # streamed in order
    after = (await engine.stats()).requests_per_rank
    spread = [b - a for a, b in zip(before, after, strict=True)]
    assert sum(spread) == len(prompts)
    assert min(spread) >= len(prompts) // 4, spread


async def test_explicit_dp_rank_wins(engine: Engine) -> None:
    before = (await engine.stats()).ranks
    with anyio.fail_after(HANG_GUARD):
        for _ in range(3):
            deltas = await collect(engine, "pinned", SamplingParams(max_tokens=2), dp_rank=1)
            assert tokens_of(deltas) == expected_tokens("pinned", 2)
    after = (await engine.stats()).ranks
    added = [
        a.counters.requests_added - b.counters.requests_added
        for a, b in zip(after, before, strict=True)
    ]
    assert added == [0, 3]


async def test_bad_calls_are_refused_in_the_caller(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="dp_rank"):
        await collect(engine, "x", SamplingParams(), dp_rank=2)
    with pytest.raises(InvalidRequestError, match="empty"):
        await collect(engine, "", SamplingParams())
    with pytest.raises(UnknownRequestError, match="nope"):
        await engine.abort("nope")
    stream = engine.generate("dup", SamplingParams(max_tokens=10_000), request_id="dup")
    with anyio.fail_after(HANG_GUARD):
        await stream.__anext__()
        with pytest.raises(DuplicateRequestError):
            await collect(engine, "again", SamplingParams(), request_id="dup")
        await engine.abort("dup")
        rest = [d async for d in stream]
    assert rest[-1].finish_reason == "abort"


async def test_abort_goes_to_the_rank_that_holds_the_request(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        for rank in (0, 1):
            stream = engine.generate("x", SamplingParams(max_tokens=10_000), dp_rank=rank)
            first = await stream.__anext__()
            await engine.abort(first.request_id)
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "abort"


async def test_leaving_a_stream_early_aborts_it_on_its_rank(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("leave", SamplingParams(max_tokens=10_000), dp_rank=0)
        await stream.__anext__()
        await stream.aclose()
        while True:  # the abort travels through the outbox; stats are ordered after it
            stats = await engine.stats()
            if stats.ranks[0].core.num_running == 0:
                break
    assert stats.ranks[0].core.num_waiting == 0


async def ranks_at_rest(engine: Engine) -> list:
    """The ranks' reports once no rank runs a wave (an earlier test's wave may still be
    running: it ends at a vote once nobody has work left)."""
    while True:
        stats = await engine.stats()
        if not any(report.counters.running for report in stats.ranks):
            return stats.ranks


async def test_idle_rank_runs_dummy_batches_and_waves_end_together(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        before = await ranks_at_rest(engine)
        deltas = await collect(engine, "wave", SamplingParams(max_tokens=12), dp_rank=0)
        assert tokens_of(deltas) == expected_tokens("wave", 12)
        after = await ranks_at_rest(engine)
    assert after[1].counters.dummy_steps > before[1].counters.dummy_steps
    assert after[0].counters.real_steps >= before[0].counters.real_steps + 12
    assert after[0].counters.wave == after[1].counters.wave > before[0].counters.wave
    assert after[0].counters.waves_completed > before[0].counters.waves_completed
    assert after[1].counters.waves_started > before[1].counters.waves_started


async def test_lockstep_ranks_admit_prefills_on_the_prefill_cadence() -> None:
    """`prefill_interval` reaches every rank (in its configuration hash too) and the
    ranks, admitting only on every third step of their wave, still serve exactly."""
    prompts = [f"cadence {i}" for i in range(10)]
    results: dict[str, list] = {}

    async def run(prompt: str) -> None:
        results[prompt] = await collect(prompted, prompt, SamplingParams(max_tokens=9))

    with anyio.fail_after(HANG_GUARD):
        async with (
            open_engine(null_config(prefill_interval=3)) as prompted,
            anyio.create_task_group() as tg,
        ):
            for prompt in prompts:
                tg.start_soon(run, prompt)
    assert {p: tokens_of(d) for p, d in results.items()} == {
        p: expected_tokens(p, 9) for p in prompts
    }
