"""The batch queue in rank processes (`EngineConfig(async_scheduling=True)`, issue 16):
streams exact at dp 2 in both modes, through a KEEP pause and its resume.
Null-executor ranks in processes (which freeze their heap once loaded with the queue
on: `rank_process`)."""

from __future__ import annotations

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of

from wavecore.engine.api import open_dp_engine
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

TOKENS = 2000  # long enough to be in flight at the pause


@pytest.mark.parametrize("dp_mode", ["lockstep", "independent"])
async def test_streams_are_exact_through_a_keep_pause(dp_mode: str) -> None:
    config = null_config(dp_size=2, dp_mode=dp_mode, async_scheduling=True)
    results: dict[str, list[int]] = {}
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:

            async def run(prompt: str, rank: int, streaming: anyio.Event) -> None:
                deltas = []
                async for delta in engine.generate(
                    prompt, SamplingParams(max_tokens=TOKENS), dp_rank=rank
                ):
                    deltas.append(delta)
                    streaming.set()
                results[prompt] = tokens_of(deltas)

            async with anyio.create_task_group() as tg:
                for index in range(4):
                    streaming = anyio.Event()
                    tg.start_soon(run, f"queued {index}", index % 2, streaming)
                    await streaming.wait()
                await engine.pause(mode="keep")
                await engine.resume()
            short = await collect(engine, "after", SamplingParams(max_tokens=5), dp_rank=1)
            assert tokens_of(short) == expected_tokens("after", 5)
    for prompt, tokens in results.items():
        assert tokens == expected_tokens(prompt, TOKENS), prompt
