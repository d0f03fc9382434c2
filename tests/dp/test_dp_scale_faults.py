"""Scales that cannot hurt serving (issue 15): a size beyond the machine is refused
before anything starts, a new rank that dies at the commit is named with its cause and
the scale is rolled back (one that dies while it loads: test_dp_exit_causes and
test_dp_scaling), and a scale up logs no dropped frame. Null-executor ranks in
processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of, wiring_of

from wavecore.engine import messages as m
from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.capacity import (
    RANK_PROCESS_BYTES,
    RANKS_PER_CORE,
    dp_capacity,
    rank_memory_bytes,
)
from wavecore.engine.dp.exit_status import wait_for_exits
from wavecore.engine.errors import ScalingFailedError, ScalingRefusedError
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import (
    Drained,
    RanksPaused,
    RanksReady,
    ResumeRanks,
    ScaleAbandoned,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScaleRolledBack,
    ScalingMachine,
    StopRanks,
)

pytestmark = pytest.mark.anyio


def rank_processes(engine: Engine) -> dict[str, int | None]:
    return {
        name: process.pid
        for name, process in wiring_of(engine).processes.items()
        if name.startswith("rank")
    }


async def serves_on_every_rank(engine: Engine) -> None:
    for rank in range(engine.dp_size):
        prompt = f"still serving {rank}"
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=5), dp_rank=rank)
        assert tokens_of(deltas) == expected_tokens(prompt, 5)


def test_the_machine_bound_comes_from_cores_and_memory() -> None:
    null = dp_capacity(null_config(dp_size=1))
    cores = len(os.sched_getaffinity(0))
    assert 1 <= null.max_dp_size <= RANKS_PER_CORE * cores
    assert "per CPU core" in null.reason or "MiB per rank" in null.reason
    chosen = dp_capacity(null_config(dp_size=1, max_dp_size=3))
    assert (chosen.max_dp_size, chosen.reason) == (3, "EngineConfig.max_dp_size")
    # A 1 TiB KV cache per rank leaves room for one rank at most, whatever the cores.
    huge = dp_capacity(EngineConfig(executor="model", kv_cache_memory=2**40))
    assert huge.max_dp_size == 1 and "MiB per rank" in huge.reason
    assert RANK_PROCESS_BYTES > 0
    # A draft model (here the model itself) adds its weights and a KV cache as large.
    model = EngineConfig(executor="model", kv_cache_memory=2**28)
    drafting = EngineConfig(
        executor="model",
        kv_cache_memory=2**28,
        speculative_method="draft_model",
        draft_model=str(resolve_model_source(None).path),
    )
    alone, with_draft = (rank_memory_bytes(c, 2**34) for c in (model, drafting))
    # (the same, but for the part of a block the draft's whole blocks leave out)
    assert 0 <= (alone - RANK_PROCESS_BYTES) - (with_draft - alone) < 2**20


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_dp_size": 0}, "max_dp_size must be a positive int or None"),
        ({"max_dp_size": True}, "max_dp_size must be a positive int or None"),
        ({"max_dp_size": 2, "dp_size": 3}, "dp_size 3 exceeds max_dp_size 2"),
    ],
)
def test_a_bad_max_dp_size_is_refused_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


async def test_a_scale_beyond_the_machine_is_refused_at_once_and_the_engine_serves() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=1)) as engine:
            running = engine.generate("in flight", SamplingParams(max_tokens=30))
            first = await running.__anext__()
            before = rank_processes(engine)
            with pytest.raises(ScalingRefusedError) as refused:
                await engine.scale(100)
            message = str(refused.value)
            assert "scaling from 1 to 100 ranks refused: at most" in message
            assert "per CPU core" in message or "MiB per rank" in message
            assert "still serves at 1 ranks" in message
            assert rank_processes(engine) == before  # nothing was spawned
            rest = [delta async for delta in running]
            assert tokens_of([first, *rest]) == expected_tokens("in flight", 30)
            await serves_on_every_rank(engine)


async def test_a_chosen_max_dp_size_is_the_limit() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=1, max_dp_size=2)) as engine:
            with pytest.raises(ScalingRefusedError, match=r"at most 2 ranks \(EngineConfig"):
                await engine.scale(3)
            await engine.scale(2)
            assert engine.dp_size == 2
            await serves_on_every_rank(engine)


async def test_a_scale_up_drops_no_frame_at_the_coordinator(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A new rank's first statistics used to reach the coordinator before it knew the
    new size, logged as "dropped a malformed frame" (the processes share this stderr)."""
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=1)) as engine:
            await engine.scale(2)
            await engine.scale(3)
            await serves_on_every_rank(engine)
            await engine.scale(1)
    assert "dropped a malformed frame" not in capfd.readouterr().err


def test_a_scale_up_aborted_while_switching_rolls_back_a_scale_down_does_not() -> None:
    up = ScalingMachine()
    up.handle(ScaleRequested(old_dp_size=2, dp_size=3))
    up.handle(RanksReady())
    up.handle(RanksPaused())
    assert up.phase is ScalePhase.SWITCHING
    rollback = up.handle(ScaleAborted(reason="rank 2 died"))
    assert rollback == (
        StopRanks(ranks=(2,)),
        ResumeRanks(ranks=(0, 1)),
        ScaleRolledBack(reason="rank 2 died", dp_size=2),
    )
    down = ScalingMachine()
    down.handle(ScaleRequested(old_dp_size=3, dp_size=2))
    down.handle(Drained())
    down.handle(RanksPaused())
    assert down.handle(ScaleAborted(reason="x")) == (ScaleAbandoned(reason="x"),)
    assert not up.active and not down.active


def is_pause(call: object) -> bool:
    return isinstance(call, m.UtilityCall) and call.method == "pause"


def is_switch(call: object) -> bool:
    return isinstance(call, m.SwitchGroup)


@pytest.mark.parametrize(
    ("kill_at", "where"),
    [
        # The pause's case runs in `make soak`: the switch's is the harder one.
        pytest.param(is_pause, "while pausing the ranks", marks=pytest.mark.soak),
        (is_switch, "while switching to the new group"),
    ],
)
async def test_a_new_rank_killed_at_the_commit_rolls_back_and_in_flight_requests_finish(
    monkeypatch: pytest.MonkeyPatch, kill_at: Callable[[object], bool], where: str
) -> None:
    """The new rank dies as the old ranks pause, or as the switch starts (the old rank,
    waiting in the new group's rendezvous, gives up after `collective_timeout` and stays
    in its old group): the scale is rolled back, and a request that was in flight on the
    old rank (frozen by the pause) resumes and finishes exactly."""
    survivor = "survivor"
    streams: list[Any] = []
    frozen: list[bool] = []
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=1, collective_timeout=5.0)) as engine:
            call_ranks = engine.call_ranks  # type: ignore[attr-defined]

            async def kill_new_rank(ranks: Any, message: Any) -> None:
                call = message(0)
                if is_pause(call):
                    stream = engine.generate(
                        survivor, SamplingParams(max_tokens=5000), request_id=survivor
                    )
                    streams.append((stream, await stream.__anext__()))
                if kill_at(call):
                    process = wiring_of(engine).processes["rank 1"]
                    os.kill(process.pid, signal.SIGKILL)
                    # Joined as the engine joins it (one at a time), or its status is lost.
                    await anyio.to_thread.run_sync(wait_for_exits, [process])
                await call_ranks(ranks, message)
                if is_pause(call):
                    frozen.append(survivor in engine.unfinished_on([0]))  # type: ignore[attr-defined]

            monkeypatch.setattr(engine, "call_ranks", kill_new_rank)
            with pytest.raises(ScalingFailedError) as failed:
                await engine.scale(2)
            monkeypatch.undo()
            message = str(failed.value)
            assert f"failed {where} and was rolled back (still 1 ranks)" in message
            assert f"new rank 1 exited {where}: killed by SIGKILL" in message
            assert engine.dp_size == 1
            if kill_at is is_switch:
                assert frozen == [True]  # paused in flight, across the failed switch
            ((stream, first),) = streams
            rest = [delta async for delta in stream]
            assert tokens_of([first, *rest]) == expected_tokens(survivor, 5000)
            await serves_on_every_rank(engine)
            await engine.scale(2)
            await serves_on_every_rank(engine)
