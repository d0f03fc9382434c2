"""Elastic scaling (issue 7): `Engine.scale` while requests stream, on null-executor
ranks in their own processes. One engine serves the whole walk 1 -> 2 -> 3 -> 1 -> 2;
failures get engines of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from dp_helpers import (
    HANG_GUARD,
    SteadyLoad,
    collect,
    expected_tokens,
    null_config,
    tokens_of,
    wiring_of,
)

from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.cli.main import main
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    ScalingFailedError,
    ScalingInProgressError,
    ScalingRefusedError,
)
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.rank_events import PauseMode

pytestmark = pytest.mark.anyio

FAIL_BUILD_ENV = "WAVECORE_TEST_FAIL_RANK_BUILD"


def build_core_failing_when_asked(config: EngineConfig) -> EngineCore:
    """Fails in ranks spawned while FAIL_BUILD_ENV is set (spawn copies the env)."""
    if os.environ.get(FAIL_BUILD_ENV):
        raise RuntimeError("injected start-up failure of a new rank")
    return EngineCore.from_config(config)


def live_ranks(engine: Engine) -> list[str]:
    return sorted(
        name
        for name, p in wiring_of(engine).processes.items()
        if name.startswith("rank") and "retired" not in name and p.is_alive()
    )


async def test_scale_walk_under_load_loses_nothing_and_balances_over_new_ranks() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=1)) as engine:
            load = SteadyLoad(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.run)
                await load.wait_for(4)
                for size in (2, 3, 1, 2):
                    await engine.scale(size)
                    assert engine.dp_size == size
                    assert len(live_ranks(engine)) == size
                    # One counter per rank of the new size: a pick of a removed rank
                    # would fail the request (no counter, no channel).
                    before = (await engine.stats()).requests_per_rank
                    assert len(before) == size
                    await load.wait_for(4 * size + 4)
                    after = (await engine.stats()).requests_per_rank
                    assert after[size - 1] > before[size - 1]  # the newest rank serves
                load.stop.set()
            assert load.started == len(load.finished)
            stats = await engine.stats()
            assert [r.rank for r in stats.ranks] == [0, 1]
            assert sum(r.core.num_running + r.core.num_waiting for r in stats.ranks) == 0


async def test_a_rank_added_by_a_scale_is_watched_like_the_first_ones() -> None:
    """Removing rank 1 is no death; the rank 1 a later scale up starts is watched, and
    killing it fails its request and every later call, as for a first rank.
    Independent mode: no collective in which rank 0 would notice the death first."""
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=2, dp_mode="independent")) as engine:
            await engine.scale(1)
            await engine.scale(2)
            deltas = await collect(engine, "before", SamplingParams(max_tokens=5), dp_rank=1)
            assert tokens_of(deltas) == expected_tokens("before", 5)
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=1)
            await stream.__anext__()
            os.kill(wiring_of(engine).processes["rank 1"].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 1 died"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError, match="rank 1 died"):
                await engine.stats()


@pytest.fixture(scope="module")
async def engine():
    """Shared by the tests below, in file order: each leaves it serving at 2 ranks."""
    async with open_dp_engine(null_config(dp_size=2)) as dp_engine:
        yield dp_engine


async def test_scale_while_paused_is_refused_and_bad_sizes_are_refused(engine: Engine) -> None:
    """The choice: refused while the user has paused (the scale ends with a resume)."""
    with anyio.fail_after(HANG_GUARD):
        await engine.pause(PauseMode.KEEP)
        with pytest.raises(ScalingRefusedError, match="paused"):
            await engine.scale(3)
        await engine.resume()
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ScalingRefusedError, match="new_dp_size"):
                await engine.scale(bad)  # type: ignore[arg-type]
        assert engine.dp_size == 2
        deltas = await collect(engine, "unchanged", SamplingParams(max_tokens=5), dp_rank=1)
        assert tokens_of(deltas) == expected_tokens("unchanged", 5)


async def test_scale_down_drain_timeout_aborts_what_is_left_visibly(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=1)
        first = await stream.__anext__()
        staying = engine.generate("staying", SamplingParams(max_tokens=30), dp_rank=0)
        staying_first = await staying.__anext__()
        await engine.scale(1, drain_timeout=0.2)
        rest = [delta async for delta in stream]
        assert not first.finished and rest[-1].finish_reason == "abort"
        staying_rest = [delta async for delta in staying]
        assert tokens_of([staying_first, *staying_rest]) == expected_tokens("staying", 30)
        assert engine.dp_size == 1 and len(live_ranks(engine)) == 1
        with pytest.raises(InvalidRequestError, match="dp_rank"):
            await collect(engine, "gone", SamplingParams(max_tokens=2), dp_rank=1)
        deltas = await collect(engine, "later", SamplingParams(max_tokens=5))
        assert tokens_of(deltas) == expected_tokens("later", 5)


async def test_second_scale_while_one_is_active_is_refused_at_once(engine: Engine) -> None:
    refused: list[Exception] = []

    async def second() -> None:
        try:
            await engine.scale(3)
        except ScalingInProgressError as error:
            refused.append(error)

    with anyio.fail_after(HANG_GUARD):
        assert engine.dp_size == 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.scale, 2)
            await anyio.lowlevel.checkpoint()
            tg.start_soon(second)
        assert len(refused) == 1 and "still in progress" in str(refused[0])
        assert engine.dp_size == 2
        deltas = await collect(engine, "after", SamplingParams(max_tokens=5), dp_rank=1)
        assert tokens_of(deltas) == expected_tokens("after", 5)


async def test_a_new_rank_failing_at_startup_rolls_back_and_the_next_scale_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(
            null_config(dp_size=1), build_core=build_core_failing_when_asked
        ) as engine:
            running = engine.generate("survivor", SamplingParams(max_tokens=40))
            first = await running.__anext__()
            monkeypatch.setenv(FAIL_BUILD_ENV, "1")
            with pytest.raises(ScalingFailedError) as failed:
                await engine.scale(2)
            monkeypatch.delenv(FAIL_BUILD_ENV)
            message = str(failed.value)
            assert "rolled back (still 1 ranks)" in message
            assert "injected start-up failure of a new rank" in message
            assert engine.dp_size == 1 and len(live_ranks(engine)) == 1
            rest = [delta async for delta in running]
            assert tokens_of([first, *rest]) == expected_tokens("survivor", 40)
            await engine.scale(2)
            assert engine.dp_size == 2 and len(live_ranks(engine)) == 2
            deltas = await collect(engine, "on new", SamplingParams(max_tokens=5), dp_rank=1)
            assert tokens_of(deltas) == expected_tokens("on new", 5)


async def test_generate_scale_at_scales_after_that_many_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out.jsonl"
    prompts = [f"prompt {n}" for n in range(10)]
    argv = ["generate", "--dp", "2", "--executor", "null", "--max-tokens", "6"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    # A scale down: it spawns nothing, so the test stays quick.
    argv += ["--scale-at", "3:1", "--output", str(output)]
    # The CLI runs its own event loop: give it a thread of its own.
    assert await anyio.to_thread.run_sync(main, argv) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    results = sorted(lines, key=lambda row: row["index"])  # written as they finish
    assert [r["token_ids"] for r in results] == [expected_tokens(p, 6) for p in prompts]
    printed = capsys.readouterr().out
    assert "scaled to 1 data-parallel ranks" in printed
    assert "requests per DP rank" not in printed  # one rank left at the end


@pytest.mark.parametrize("bad", ["3", "x:2", "3:0", "3:"])
def test_generate_refuses_a_bad_scale_at(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--dp", "2", "--executor", "null", "--prompt", "x", "--scale-at", bad])
    assert "REQS:SIZE" in capsys.readouterr().err


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_scale_benchmark_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    output = tmp_path / "scale.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "scale.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD * 2,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(output.read_text())
    assert [event["to_dp_size"] for event in result["events"]] == [2, 1]
    assert result["lost_requests"] == 0
    assert all(event["seconds"] > 0 for event in result["events"])
    assert output.with_suffix(".png").stat().st_size > 0
    assert "scale to 2" in run.stdout
