"""Pause, resume and sleep across two lockstep ranks, under load."""

from __future__ import annotations

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of

from wavecore.engine.api import Engine, open_engine
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.rank_events import PauseMode

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def engine():
    # Startup is bounded by the config's startup_timeout; each test guards itself.
    async with open_engine(null_config()) as dp_engine:
        yield dp_engine


async def _start_streams(engine: Engine, count: int, max_tokens: int) -> list:
    """`count` requests over both ranks, each having produced a first delta."""
    streams = []
    for number in range(count):
        stream = engine.generate(
            f"load {number}", SamplingParams(max_tokens=max_tokens), dp_rank=number % 2
        )
        await stream.__anext__()
        streams.append(stream)
    return streams


async def test_pause_abort_ends_every_request_then_resume_serves_again(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        streams = await _start_streams(engine, 4, 100_000)
        await engine.pause(PauseMode.ABORT)
        for stream in streams:
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "abort"
        stats = await engine.stats()
        assert [r.core.paused for r in stats.ranks] == ["abort", "abort"]
        assert all(r.core.num_running == r.core.num_waiting == 0 for r in stats.ranks)
        await engine.resume()
        deltas = await collect(engine, "after", SamplingParams(max_tokens=4))
    assert tokens_of(deltas) == expected_tokens("after", 4)


async def test_pause_wait_drains_running_requests_and_queues_new_ones(engine: Engine) -> None:
    results: dict[str, list] = {}

    async def run(prompt: str, rank: int) -> None:
        results[prompt] = await collect(engine, prompt, SamplingParams(max_tokens=30), dp_rank=rank)

    with anyio.fail_after(HANG_GUARD):
        streams = await _start_streams(engine, 2, 30)
        await engine.pause(PauseMode.WAIT)
        # The running requests finished before the pause held.
        for stream in streams:
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "length"
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "queued zero", 0)
            tg.start_soon(run, "queued one", 1)
            while len((await engine.stats()).held) < 2:
                pass  # each stats() is a round trip to both ranks, after the adds
            stats = await engine.stats()
            assert sorted(stats.held.values()) == ["rank 0 is paused", "rank 1 is paused"]
            assert all(r.core.num_waiting == 1 for r in stats.ranks)
            await engine.resume()
    for prompt in ("queued zero", "queued one"):
        assert tokens_of(results[prompt]) == expected_tokens(prompt, 30)


async def test_pause_keep_freezes_requests_and_resume_finishes_them(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        streams = await _start_streams(engine, 2, 60)
        await engine.pause(PauseMode.KEEP)
        frozen = await engine.stats()
        assert sum(r.core.num_running for r in frozen.ranks) == 2
        steps = [r.counters.real_steps for r in frozen.ranks]
        again = await engine.stats()
        assert [r.counters.real_steps for r in again.ranks] == steps
        await engine.resume()
        for stream in streams:
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "length"
            assert rest[-1].usage.output_tokens == 60


async def test_duplicate_resume_does_not_deadlock(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        await engine.pause(PauseMode.KEEP)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.resume)
            tg.start_soon(engine.resume)
        await engine.resume()
        deltas = await collect(engine, "still alive", SamplingParams(max_tokens=5))
    assert tokens_of(deltas) == expected_tokens("still alive", 5)


async def test_a_request_during_sleep_waits_visibly_until_wake_up(engine: Engine) -> None:
    results: list = []

    async def run() -> None:
        results.extend(await collect(engine, "sleepy", SamplingParams(max_tokens=6), dp_rank=1))

    with anyio.fail_after(HANG_GUARD):
        await engine.sleep(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while not (await engine.stats()).held:
                pass
            stats = await engine.stats()
            assert list(stats.held.values()) == ["rank 1 is asleep"]
            assert all(r.core.asleep == ("kv_cache", "scheduling", "weights") for r in stats.ranks)
            await engine.wake_up(["weights"])
            assert (await engine.stats()).held  # still asleep in part
            await engine.wake_up()
    assert tokens_of(results) == expected_tokens("sleepy", 6)
    stats = await engine.stats()
    assert [r.core.asleep for r in stats.ranks] == [(), ()]
    assert [r.core.paused for r in stats.ranks] == [None, None]
