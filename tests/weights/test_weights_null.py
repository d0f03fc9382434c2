"""update_weights, weight versions and collective_rpc on one rank and on dp 2, with the
null executor (its one weight, `token_shift`, decides every token it samples)."""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file
from weights_helpers import (
    HANG_GUARD,
    build_test_core,
    check_null_tokens,
    shift,
    tokens_of,
)

from wavecore.engine.api import open_dp_engine, open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import (
    CollectiveRpcError,
    InvalidRequestError,
    WeightUpdateError,
    WeightUpdateInProgressError,
    WeightUpdateRefusedError,
)
from wavecore.engine.interface import Engine
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

CASES = {
    "one-rank-asyncio": (1, "asyncio"),
    "one-rank-trio": (1, "trio"),
    "dp2-asyncio": (2, "asyncio"),
    "dp2-trio": (2, "trio"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[int, str]:
    return CASES[request.param]


@pytest.fixture(scope="module")
def anyio_backend(case: tuple[int, str]) -> str:
    return case[1]


@pytest.fixture(scope="module")
async def engine(case: tuple[int, str], anyio_backend: str) -> AsyncIterator[Engine]:
    dp_size = case[0]
    config = EngineConfig(
        executor="null",
        dp_size=dp_size,
        max_num_seqs=8,
        max_model_len=8192,
        sync_interval=4,
        startup_timeout=60.0,
    )
    if dp_size == 1:
        opened = open_engine_core(functools.partial(build_test_core, config))
    else:
        opened = open_dp_engine(config, build_core=build_test_core)
    async with opened as engine:
        yield engine


@pytest.fixture
async def fresh(engine: Engine) -> Engine:
    """The engine serving shift 0 under version None, unpaused, as at the start."""
    with anyio.fail_after(HANG_GUARD):
        await engine.collective_rpc("fail_stage_in", (None,))
        await engine.pause("abort")
        await engine.update_weights(shift(0), version=None)
        await engine.resume()
    return engine


async def run_on_each_rank(engine: Engine, prompt: str, count: int) -> list[list[Any]]:
    params = SamplingParams(max_tokens=count)
    return [
        [d async for d in engine.generate(prompt, params, dp_rank=rank)]
        for rank in range(engine.dp_size)
    ]


async def assert_serving(engine: Engine, token_shift: int, version: str | None) -> None:
    """Every rank serves `token_shift` under `version` (outputs and stats agree)."""
    for deltas in await run_on_each_rank(engine, "probe", 12):
        assert {d.weight_version for d in deltas} == {version}
        check_null_tokens("probe", deltas, {version: token_shift})
    stats = await engine.stats()
    assert [rank.core.weight_version for rank in stats.ranks] == [version] * engine.dp_size
    assert engine.weight_version == version


async def test_update_while_kept_requests_wait(fresh: Engine) -> None:
    engine = fresh
    prompts = [f"request {i}" for i in range(2 * engine.dp_size)]
    params = SamplingParams(max_tokens=6000)
    with anyio.fail_after(HANG_GUARD):
        streams = [
            engine.generate(p, params, request_id=f"kept-{i}", dp_rank=i % engine.dp_size)
            for i, p in enumerate(prompts)
        ]
        firsts = [await stream.__anext__() for stream in streams]
        await engine.pause("keep")
        await engine.update_weights(shift(7), version="B")
        assert (await engine.stats()).num_running == 0  # kept requests wait to be recomputed
        await engine.resume()
        for prompt, stream, first in zip(prompts, streams, firsts, strict=True):
            deltas = [first]
            async for delta in stream:
                deltas.append(delta)
                if delta.weight_version == "B" and len(tokens_of(deltas)) > 40:
                    break
            await stream.aclose()
            versions = [d.weight_version for d in deltas]
            # Old weights first, then the new ones, never mixed in a delta.
            assert versions[0] is None and versions[-1] == "B"
            assert versions == sorted(versions, key=lambda v: v is not None)
            check_null_tokens(prompt, deltas, {None: 0, "B": 7})
        await assert_serving(engine, 7, "B")


async def test_prefix_cache_is_reset(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        await run_on_each_rank(engine, "x" * 64, 4)
        await engine.pause("keep")
        await engine.update_weights(shift(3), version="C")
        stats = await engine.stats()
        assert all(rank.core.kv_usage == 0 for rank in stats.ranks)
        await engine.resume()
        await assert_serving(engine, 3, "C")


def bad_sources(tmp_path: Path) -> dict[str, tuple[object, str]]:
    truncated = tmp_path / "truncated.safetensors"
    save_file({"token_shift": torch.tensor([4.0] * 1000)}, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    return {
        "wrong shape": (shift(1) | {"token_shift": torch.zeros(2)}, "'token_shift' has shape (2,)"),
        "extra tensor": (shift(1) | {"layers.0.q": torch.zeros(1)}, "'layers.0.q' is not a weight"),
        "integer dtype": ({"token_shift": torch.tensor([1])}, "dtype torch.int64"),
        "not a whole number": (shift(1.5), "whole number"),
        "truncated file": (truncated, str(truncated)),
        "no such file": (tmp_path / "absent.safetensors", "absent.safetensors"),
        "not a tensor": ({"token_shift": [1.0]}, "not a torch.Tensor"),
        "empty mapping": ({}, "empty mapping"),
        "wrong source type": (42, "got a int"),
    }


@pytest.mark.parametrize(
    "bad", ["wrong shape", "extra tensor", "integer dtype", "not a whole number",
            "truncated file", "no such file", "not a tensor", "empty mapping",
            "wrong source type"]
)  # fmt: skip
async def test_bad_update_keeps_old_weights(fresh: Engine, tmp_path: Path, bad: str) -> None:
    engine = fresh
    source, named = bad_sources(tmp_path)[bad]
    with anyio.fail_after(HANG_GUARD):
        await engine.pause("keep")
        await engine.update_weights(shift(2), version="old")
        with pytest.raises(WeightUpdateError, match=re.escape(named)):
            await engine.update_weights(source, version="new")  # type: ignore[arg-type]
        await engine.resume()
        await assert_serving(engine, 2, "old")


async def test_one_refusing_rank_fails_the_update_everywhere(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        pids = await engine.collective_rpc("pid")
        last = engine.dp_size - 1
        await engine.collective_rpc("fail_stage_in", (pids[last],))
        await engine.pause("keep")
        with pytest.raises(WeightUpdateError, match=f"rank {last}: .*injected refusal") as caught:
            await engine.update_weights(shift(9), version="bad")
        assert "every rank kept its old weights" in str(caught.value)
        await engine.resume()
        await assert_serving(engine, 0, None)


async def test_file_sources(fresh: Engine, tmp_path: Path) -> None:
    engine = fresh
    file = tmp_path / "shift.safetensors"
    save_file(shift(5), str(file))
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    save_file(shift(6), str(directory / "model-00001-of-00001.safetensors"))
    with anyio.fail_after(HANG_GUARD):
        await engine.pause("abort")
        await engine.update_weights(file, version="file")
        await engine.resume()
        await assert_serving(engine, 5, "file")
        await engine.pause("abort")
        await engine.update_weights(str(directory), version="dir", partial=True)
        await engine.resume()
        await assert_serving(engine, 6, "dir")


async def test_refused_unless_paused_with_weights_awake(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        with pytest.raises(WeightUpdateRefusedError, match="engine is serving"):
            await engine.update_weights(shift(1))
        await engine.sleep(1)
        with pytest.raises(WeightUpdateRefusedError, match="weights are asleep"):
            await engine.update_weights(shift(1))
        await engine.wake_up(["weights"])
        await engine.update_weights(shift(4), version="slept")
        await engine.wake_up(["kv_cache", "scheduling"])
        await assert_serving(engine, 4, "slept")
        with pytest.raises(InvalidRequestError, match="partial must be a bool"):
            await engine.update_weights(shift(1), partial="yes")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="weight version"):
            await engine.update_weights(shift(1), version=3)  # type: ignore[arg-type]


async def test_set_weight_version(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        await engine.set_weight_version("step-12")
        await assert_serving(engine, 0, "step-12")


async def test_collective_rpc(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        pids = await engine.collective_rpc("pid")
        assert len(set(pids)) == engine.dp_size
        echoed = await engine.collective_rpc("echo", (1, "two", [3.5, None]), {"k": b"v"})
        assert echoed == [{"args": [1, "two", [3.5, None]], "kwargs": {"k": b"v"}}] * engine.dp_size
        assert await engine.collective_rpc("weight_shapes") == [{"token_shift": [1]}] * len(pids)
        with pytest.raises(
            CollectiveRpcError, match=r"rank 0: .*no remotely callable method 'close'"
        ):
            await engine.collective_rpc("close")
        with pytest.raises(CollectiveRpcError, match="object is not plain data"):
            await engine.collective_rpc("echo", (object(),))
        with pytest.raises(CollectiveRpcError, match=r"rank 0: .*object is not plain data"):
            await engine.collective_rpc("not_plain")
        last = engine.dp_size - 1
        with pytest.raises(CollectiveRpcError, match=f"rank {last}: RuntimeError: injected"):
            await engine.collective_rpc("raise_in", (pids[last],))
        with pytest.raises(CollectiveRpcError, match=f"rank {last} did not answer within 0.3 s"):
            await engine.collective_rpc("stall_in", (pids[last], 1.5), timeout=0.3)
        # The engine serves on, the slow rank too.
        await assert_serving(engine, 0, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
async def test_mapping_dtypes_travel(fresh: Engine, dtype: torch.dtype) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        await engine.pause("keep")
        await engine.update_weights({"token_shift": torch.tensor([3.0], dtype=dtype)}, version="d")
        await engine.resume()
        await assert_serving(engine, 3, "d")


async def test_level_2_sleep_reloads_the_loaded_weights(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        await engine.pause("keep")
        await engine.update_weights(shift(4), version="v4")
        await engine.sleep(2)
        await engine.wake_up()
        await assert_serving(engine, 0, None)


async def test_no_resume_sleep_wake_or_save_while_an_update_runs(
    fresh: Engine, tmp_path: Path
) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        pids = await engine.collective_rpc("pid")
        await engine.collective_rpc("slow_stage_in", (pids[-1], 2.0))
        await engine.pause("keep")
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(engine.update_weights, shift(8), version="slow"))
            await anyio.wait_all_tasks_blocked()  # the update waits for the slow rank
            save = functools.partial(engine.save_weights, tmp_path / "saved")
            for call in (engine.resume, engine.sleep, engine.wake_up, save):
                with pytest.raises(WeightUpdateInProgressError, match="still running"):
                    await call()
        await engine.resume()
        await assert_serving(engine, 8, "slow")


async def test_save_weights_is_refused_clearly(fresh: Engine, tmp_path: Path) -> None:
    engine = fresh
    target = tmp_path / "saved"
    with anyio.fail_after(HANG_GUARD):
        # The null executor has no weights to write; rank 0 writes for every rank.
        with pytest.raises(WeightUpdateRefusedError, match="rank 0: RpcTestExecutor cannot save"):
            await engine.save_weights(target)
        with pytest.raises(InvalidRequestError, match="max_shard_size must be positive"):
            await engine.save_weights(target, max_shard_size=0)
        with pytest.raises(InvalidRequestError, match="takes a directory path"):
            await engine.save_weights(3)  # type: ignore[arg-type]
        await engine.sleep(1)
        with pytest.raises(WeightUpdateRefusedError, match="the weights are asleep"):
            await engine.save_weights(target)
        await engine.wake_up()
        await engine.resume()
        await assert_serving(engine, 0, None)
    assert not target.exists()


async def test_a_cancelled_update_changes_nothing(fresh: Engine) -> None:
    engine = fresh
    with anyio.fail_after(HANG_GUARD):
        pids = await engine.collective_rpc("pid")
        await engine.collective_rpc("slow_stage_in", (pids[-1], 1.0))
        await engine.pause("keep")
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(engine.update_weights, shift(6), version="gone"))
                await anyio.wait_all_tasks_blocked()  # staged on the slow rank, not committed
                scope.cancel()
        await engine.resume()
        await assert_serving(engine, 0, None)
        await engine.pause("keep")
        await engine.update_weights(shift(6), version="kept")
        await engine.resume()
        await assert_serving(engine, 6, "kept")
