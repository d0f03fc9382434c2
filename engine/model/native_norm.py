"""RMS norm of float32 rows through the C kernel (`rms_norm.c`) on the CPU.

Why: a step of one decode takes 61 norms of one 576-wide row (SmolLM2), and torch's
`rms_norm` spends about 12 us on each, more inside a step (its ops' code and data
evicted by the weights streamed between them): on the 2 vCPU AMD EPYC of the README, the
kernel took the eager batch-1 step from 10.7 to 9.3 ms in alternating rounds.

Rules:
1. Eager float32 rows on the CPU, where the kernel is built (`engine/native_build.py`;
   `WAVECORE_NORM_KERNEL=torch` turns it off). A compiled graph keeps torch's norm,
   which inductor fuses with the ops around it; reduced precision keeps torch's too.
2. The same arithmetic as torch's and Hugging Face's (float32 squares, mean, reciprocal
   square root, times the weight), summed in another order: they agree to rounding.
3. A torch operator (`wavecore::rms_norm`, its CPU kernel registered in C++ by
   `rms_norm_op.cpp` through torch's stable ABI): eager code calls it without Python.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from wavecore.engine.native_build import KernelSource, build

NORM_KERNEL = KernelSource(
    Path(__file__).with_name("rms_norm.c"),
    "rms_norm",
    "WAVECORE_NORM_KERNEL",
    torch_ops=Path(__file__).with_name("rms_norm_op.cpp"),
)

# `x` `[rows, width]` float32, `weight` `[width]` float32 -> `x`'s shape. The CPU kernel
# comes with the library (rule 3).
torch.library.define("wavecore::rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor")


@torch.library.register_fake("wavecore::rms_norm")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@cache
def _kernel() -> tuple[bool, str]:
    """Whether the operator runs here (its library loaded); with the reason, in words."""
    built = build(NORM_KERNEL)
    return built.library is not None, built.reason


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel normalizes `x` with `weight` (rule 1)."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and _kernel()[0]
    )
