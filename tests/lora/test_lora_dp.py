"""LoRA adapters at dp 2 on the tiny model: an add that one rank refuses leaves no rank
holding it (the error names the rank), an adapter request on each rank, and a rank
added by `scale` that serves an adapter request with the set loaded before it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from lora_helpers import (
    HANG_GUARD,
    build_lora_core,
    greedy_alone,
    write_adapter,
    write_tiny_model,
)

from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import LoRAError, UnknownLoRAError
from wavecore.engine.interface import Engine
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model.executor import ModelExecutor
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

PROMPT = "A prompt for every rank, two blocks long: 0123456789abcdef"
TOKENS = 8


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Both backends, each with its own engine."""
    return request.param


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-dp")
    return {
        "model": write_tiny_model(root / "model"),
        "A": write_adapter(root / "A", seed=1),
        "B": write_adapter(root / "B", seed=2, targets=("gate_proj", "k_proj")),
    }


@pytest.fixture(scope="module")
async def engine(files: dict[str, Path], anyio_backend: str) -> AsyncIterator[Engine]:
    config = EngineConfig(
        model=str(files["model"]),
        dp_size=2,
        enable_lora=True,
        max_loras=2,
        kv_cache_memory=2**20,
        max_model_len=256,
        startup_timeout=60.0,
    )
    async with open_dp_engine(config, build_core=build_lora_core) as opened:
        yield opened


def alone(files: dict[str, Path], lora: str | None) -> list[int]:
    executor = ModelExecutor(
        resolve_model_source(files["model"]),
        device="cpu",
        dtype="float32",
        weights="float32",
        kv_cache_memory=2**20,
        enable_lora=True,
    )
    executor.add_lora(LoRARequest("A", str(files["A"])))
    try:
        return greedy_alone(executor, list(PROMPT.encode()), TOKENS, lora)
    finally:
        executor.close()


async def tokens_on(engine: Engine, rank: int, lora: str | None) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for delta in engine.generate(PROMPT, params, dp_rank=rank, lora=lora):
        tokens.extend(delta.token_ids)
    return tokens


async def test_an_add_one_rank_refuses_leaves_no_rank_holding_it(engine, files) -> None:
    with anyio.fail_after(HANG_GUARD):
        pids = await engine.collective_rpc("pid")
        await engine.collective_rpc("fail_add_in", (pids[1],))
        try:
            with pytest.raises(LoRAError, match=r"rank 1: .*injected refusal") as raised:
                await engine.add_lora(LoRARequest("B", str(files["B"])))
        finally:
            await engine.collective_rpc("fail_add_in", (None,))
        assert "rank 0" not in str(raised.value)
        assert await engine.collective_rpc("list_loras") == [[], []]
        with pytest.raises(UnknownLoRAError):
            await tokens_on(engine, 0, "B")


async def test_every_rank_and_a_rank_added_by_scale_serve_an_adapter(engine, files) -> None:
    expected, base = alone(files, "A"), alone(files, None)
    assert expected != base
    with anyio.fail_after(HANG_GUARD):
        await engine.add_lora(LoRARequest("A", str(files["A"])))
        await engine.pin_lora("A")
        assert [await tokens_on(engine, rank, "A") for rank in (0, 1)] == [expected] * 2
        await engine.scale(3)
        assert await engine.collective_rpc("list_loras") == [["A"]] * 3
        (*_, slots) = await engine.collective_rpc("resident_loras")
        assert slots["pinned"] == ["A"]
        assert await tokens_on(engine, 2, "A") == expected
        assert await tokens_on(engine, 2, None) == base
        stats = await engine.stats()
    assert len(stats.ranks) == 3
