"""A representative subset on trio: generate, pause/resume, rank death, cancellation,
with tcp transport and independent mode so those paths run too."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of, wiring_of

from wavecore.engine.api import open_dp_engine, open_engine
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.rank_events import PauseMode

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "trio"


@pytest.mark.parametrize("dp_mode", ["lockstep", "independent"])
async def test_generate_pause_resume_over_tcp_on_trio(dp_mode: str) -> None:
    results: dict[str, list] = {}

    async def run(prompt: str) -> None:
        results[prompt] = await collect(engine, prompt, SamplingParams(max_tokens=8))

    prompts = [f"trio {i}" for i in range(8)]
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(null_config(transport="tcp", dp_mode=dp_mode)) as engine:
            assert all(
                a.startswith("tcp://127.0.0.1:") for a in wiring_of(engine).addresses.values()
            )
            async with anyio.create_task_group() as tg:
                for prompt in prompts[:4]:
                    tg.start_soon(run, prompt)
            await engine.pause(PauseMode.KEEP)
            async with anyio.create_task_group() as tg:
                for prompt in prompts[4:]:
                    tg.start_soon(run, prompt)
                while len((await engine.stats()).held) < 4:
                    pass
                await engine.resume()
            stats = await engine.stats()
    for prompt in prompts:
        assert tokens_of(results[prompt]) == expected_tokens(prompt, 8)
    votes = sum(report.counters.votes for report in stats.ranks)
    dummies = sum(report.counters.dummy_steps for report in stats.ranks)
    if dp_mode == "independent":
        assert (votes, dummies) == (0, 0)
    else:
        assert votes > 0


async def test_rank_death_and_cancellation_on_trio() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config()) as engine:
            stream = engine.generate("doomed", SamplingParams(max_tokens=1_000_000), dp_rank=0)
            await stream.__anext__()
            os.kill(wiring_of(engine).processes["rank 0"].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 0 died"):
                async for _ in stream:
                    pass
        with anyio.CancelScope() as scope:
            async with open_dp_engine(null_config(dp_mode="independent")) as second:
                scope.cancel()
                await anyio.sleep_forever()
    for process in [*wiring_of(engine).processes.values(), *wiring_of(second).processes.values()]:
        assert not process.is_alive()
