"""Iteration details (`EngineConfig(log_iteration_details=True)`): every forward of
every rank reaches the front end, consistent with what the ranks ran and streamed."""

from __future__ import annotations

import logging

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, null_config, tokens_of

from wavecore.engine.api import open_engine
from wavecore.engine.interface import Engine, EngineStats, RankIterations
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

# Distinct first bytes: no prompt shares a cached prefix with another.
PROMPTS = {"alpha one": 7, "bravo two three": 12, "c": 3, "delta four five six": 9}


async def _generate_all(engine: Engine, dp_rank: int | None = None) -> int:
    """Run PROMPTS at once; the tokens they streamed."""
    generated = 0

    async def run(prompt: str, max_tokens: int) -> None:
        nonlocal generated
        params = SamplingParams(max_tokens=max_tokens)
        tokens = tokens_of(await collect(engine, prompt, params, dp_rank=dp_rank))
        generated += len(tokens)

    async with anyio.create_task_group() as group:
        for prompt, max_tokens in PROMPTS.items():
            group.start_soon(run, prompt, max_tokens)
    return generated


def _assert_consistent(rank: RankIterations, stats: EngineStats) -> None:
    """The details of one rank agree with its loop's own counters and with themselves."""
    counters = next(r.counters for r in stats.ranks if r.rank == rank.rank)
    assert (rank.steps, rank.dummy_steps) == (counters.real_steps, counters.dummy_steps)
    assert sum(rank.ms_buckets) == rank.steps + rank.dummy_steps
    assert sum(rank.tokens_buckets) == rank.steps
    # Every decode runs one token.
    assert rank.generation_tokens == rank.generation_requests


async def _after_the_wave(engine: Engine) -> EngineStats:
    """Stats once the wave is over: while it runs, the idle rank goes on with dummy
    steps after it answered, and their details may reach the front end before the
    other rank's answer does (then they count, but not in the counters answered)."""
    while True:
        stats = await engine.stats()
        if not stats.engines_running and not any(r.counters.running for r in stats.ranks):
            return await engine.stats()
        await anyio.sleep(0.01)  # the wave ends on the ranks' own vote: polled


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_details_at_dp_1_add_up_to_what_was_generated(async_scheduling: bool, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="wavecore.engine.frontend.iteration_stats")
    config = null_config(dp_size=1, log_iteration_details=True, async_scheduling=async_scheduling)
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(config) as engine:
            generated = await _generate_all(engine)
            stats = await engine.stats()
    (rank,) = stats.iterations
    _assert_consistent(rank, stats)
    assert rank.dummy_steps == 0  # one rank has no peer to step with
    # Each prompt is one context (prefill) chunk whose sample is its first token; every
    # later token is one generation request's.
    assert rank.context_requests == len(PROMPTS)
    assert rank.context_tokens == sum(len(prompt.encode()) for prompt in PROMPTS)
    assert rank.context_requests + rank.generation_requests == generated
    assert generated == sum(PROMPTS.values())
    logged = [r for r in caplog.records if "iteration" in r.getMessage()]
    assert len(logged) == rank.steps


async def test_no_details_without_the_flag() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(null_config(dp_size=1)) as engine:
            await _generate_all(engine)
            assert (await engine.stats()).iterations == ()


async def test_dummy_steps_only_in_lockstep_on_the_rank_without_work() -> None:
    config = null_config(log_iteration_details=True)
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(config) as engine:
            generated = await _generate_all(engine, dp_rank=1)
            stats = await _after_the_wave(engine)
    idle, busy = stats.iterations
    for rank in (idle, busy):
        _assert_consistent(rank, stats)
    assert idle.steps == 0 and idle.dummy_steps > 0
    assert busy.context_requests + busy.generation_requests == generated


async def test_no_dummy_steps_when_ranks_run_independently() -> None:
    config = null_config(log_iteration_details=True, dp_mode="independent")
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(config) as engine:
            generated = await _generate_all(engine, dp_rank=0)
            generated += await _generate_all(engine, dp_rank=1)
            stats = await engine.stats()
    assert len(stats.iterations) == 2
    for rank in stats.iterations:
        _assert_consistent(rank, stats)
        assert rank.dummy_steps == 0 and rank.steps > 0
    assert generated == sum(
        rank.context_requests + rank.generation_requests for rank in stats.iterations
    )
