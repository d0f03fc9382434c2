"""The device and the dtypes a model runs in: the device (`pick_device`), the compute
dtype of activations and weights (`pick_dtype`) and the KV cache's
(`pick_kv_cache_dtype`), each named as `EngineConfig` and the CLI name them."""

from __future__ import annotations

from typing import Literal

import torch

DeviceSpec = Literal["cpu", "cuda", "auto"] | str | torch.device
DTypeSpec = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: DeviceSpec) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return resolved


def pick_dtype(device: torch.device, dtype: DTypeSpec = "auto") -> torch.dtype:
    """The activations' and weights' dtype: `dtype` as named, or for "auto" float32 on
    the CPU (reduced precision is hundreds of times slower on CPUs without native
    support) and bfloat16 on a GPU that has it (else float16)."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype 'bfloat16' was asked for, but {device} does not support it")
    return DTYPES[dtype]


def pick_kv_cache_dtype(spec: object, *, compute: torch.dtype, rounds_to_bf16: bool) -> torch.dtype:
    """The KV cache's dtype: `spec` as named, or for "auto" bfloat16 where the
    projections already round activations to bfloat16 (`rounds_to_bf16`: the "auto"
    weights' plan runs a rounding kernel on a CPU with native bfloat16, and judged it
    beside this cache), else the compute dtype, so that float32 stays exact where it is
    asked for."""
    if spec == "auto":
        return torch.bfloat16 if rounds_to_bf16 and compute == torch.float32 else compute
    if not isinstance(spec, str) or spec not in DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {spec!r}"
        )
    return DTYPES[spec]


def dtype_name(dtype: torch.dtype) -> str:
    """How `kv_cache_dtype` and the reports name `dtype`: "bfloat16", "float32"."""
    return str(dtype).removeprefix("torch.")
