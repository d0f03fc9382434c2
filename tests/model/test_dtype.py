"""The compute dtype: EngineConfig(dtype=...), `load_executor(dtype=...)`, what "auto" picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_test_helpers import ArgmaxSampler, GreedyRunner

from wavecore.engine.config import EngineConfig
from wavecore.engine.model import load_executor
from wavecore.engine.model.dtypes import pick_dtype

CPU = torch.device("cpu")


def test_auto_is_float32_on_the_cpu_and_names_are_taken_as_given() -> None:
    assert pick_dtype(CPU) is torch.float32
    assert pick_dtype(CPU, "bfloat16") is torch.bfloat16
    assert pick_dtype(CPU, "float16") is torch.float16
    with pytest.raises(
        ValueError, match="dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'float64'"
    ):
        pick_dtype(CPU, "float64")  # type: ignore[arg-type]


def test_engine_config_validates_the_dtype() -> None:
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"EngineConfig.dtype must be .*got 'half'"):
        EngineConfig(dtype="half")  # type: ignore[arg-type]
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype must be .*got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_executor_computes_in_the_dtype_asked_for(tiny_gguf: Path, dtype: str) -> None:
    """Every tensor of a step (weights, rotary table, KV cache, mask) agrees on the dtype:
    a mixed-dtype op would raise. The greedy tokens need not equal float32's."""
    executor = load_executor(
        str(tiny_gguf), device="cpu", kv_cache_memory=2**20, dtype=dtype, sampler=ArgmaxSampler()
    )
    try:
        assert executor.dtype is getattr(torch, dtype)
        runner = GreedyRunner(executor)
        requests = [runner.add([1, 2, 3, 4, 5][: 2 + i], 6) for i in range(3)]
        runner.run(requests, chunk_size=3)  # chunked prefill, then decodes
        vocab = executor.config.vocab_size
        assert all(len(r.output) == 6 and all(0 <= t < vocab for t in r.output) for r in requests)
    finally:
        executor.close()


def test_int8_weights_refuse_a_reduced_precision_dtype(tiny_gguf: Path) -> None:
    with pytest.raises(ValueError, match="weights='int8' computes in float32; dtype 'float16'"):
        load_executor(
            str(tiny_gguf), device="cpu", kv_cache_memory=2**20, weights="int8", dtype="float16"
        )
