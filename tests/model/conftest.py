"""Fixtures of the model runtime's tests.

Tiny synthetic models are written once per session. The real model (SmolLM2-135M)
and the transformers reference are each loaded once per session, since dequantizing
takes seconds; tests that use them are marked `model` and skip when the default
model package is absent. `WAVECORE_TEST_DEVICE=cuda` runs the real model and its
reference on the GPU, both in float32 (`bench/device_check.sh` does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_test_helpers import (
    ArgmaxSampler,
    TinySpec,
    random_state_dict,
    write_gguf,
    write_hf_directory,
)

from wavecore.engine.model import (
    ModelExecutor,
    ModelLoadError,
    default_model_path,
    linear,
    load_executor,
)


@pytest.fixture
def needs_bf16_kernel() -> None:
    if not linear.can_pack_bf16(torch.device("cpu"), torch.float32):
        pytest.skip("this CPU has no native bfloat16 (or torch no oneDNN)")


# What each `projections` layout forces (`WAVECORE_KERNELS`).
LAYOUT_KERNELS = {
    "packed": "onednn",
    "plain": "blas",
    "mixed": "decode=blas,small=onednn,large=onednn,prefill=onednn",
}


@pytest.fixture(params=["packed", "plain", "mixed"])
def projections(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every weight layout: oneDNN-packed, plain (as on CUDA), and both with the kernel
    chosen by rows (BLAS for one row, oneDNN for more), forced rather than measured."""
    monkeypatch.setenv("WAVECORE_KERNELS", LAYOUT_KERNELS[request.param])
    if request.param == "plain":
        monkeypatch.setattr(linear, "can_pack", lambda device, dtype: False)
    elif not linear.can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN")
    return request.param


@pytest.fixture(scope="session")
def tiny_spec() -> TinySpec:
    return TinySpec()


@pytest.fixture(scope="session")
def tiny_state(tiny_spec: TinySpec) -> dict[str, torch.Tensor]:
    return random_state_dict(tiny_spec)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_spec: TinySpec, tiny_state) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny_spec, tiny_state)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, tiny_spec: TinySpec, tiny_state) -> Path:
    return write_hf_directory(tmp_path_factory.mktemp("tiny-hf"), tiny_spec, tiny_state)


@pytest.fixture
def tiny_executor(tiny_gguf: Path) -> Iterator[ModelExecutor]:
    executor = load_executor(
        str(tiny_gguf), device="cpu", kv_cache_memory=64 * 2**10, sampler=ArgmaxSampler()
    )
    yield executor
    executor.close()


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except ModelLoadError as error:
        pytest.skip(f"default model unavailable: {error}")


REFERENCE_DEVICE = os.environ.get("WAVECORE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def smollm_executor(smollm_path: Path) -> Iterator[ModelExecutor]:
    executor = load_executor(
        str(smollm_path),
        device=REFERENCE_DEVICE,
        dtype="float32",
        kv_cache_memory=160 * 2**20,
        sampler=ArgmaxSampler(),
        # For test_lora_reference; steps of the base model alone run exactly as without.
        enable_lora=True,
    )
    yield executor
    executor.close()


@pytest.fixture(scope="session")
def hf_reference(smollm_path: Path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
    )
    model.to(REFERENCE_DEVICE).eval()
    return model
