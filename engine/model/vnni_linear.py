"""`VnniProjection`: the weights of "woq" (4 bits where a GGUF's Q4_1 groups are, 8
bits per channel elsewhere) multiplied by activations rounded to int8, through AVX-512
VNNI dot products (kernel "woq-vnni", the C kernel `vnni_product.c`).

Why: torch's weight-only products (`woq_linear.py`) widen every weight to bfloat16 and
multiply in floating point; at one row on the 2 vCPU AMD EPYC of the README that kept
them compute-bound (the 8-bit LM head at 10 GB/s, the 4-bit layers at 10-15). Rounding
the activations to int8 per group of 32 (llama.cpp's Q8 blocks) makes each 4 inputs
of 16 outputs one integer instruction: every product of a batch-1 step together,
torch's 6.4 ms against 3.6 on that EPYC (layer order, the weights streamed from
memory), 4 rows 9.3 against 3.7.

Rules:
1. Where the kernel runs (`can_pack_vnni`): a float32 product on a CPU whose kernel
   was built with AVX-512 VNNI (`engine/native_build.py`;
   `WAVECORE_VNNI_KERNEL=torch` turns it off), inputs in groups of 32, outputs in 16s.
2. The same choice of width as "woq", per matrix, so that no weight is rounded coarser
   than its source; the 4-bit groups keep the GGUF's float16 scales and minimums
   exactly (a group whose scale float16 would round is held in 8 bits instead).
3. It rounds the activations, so like every rounding kernel it runs only where the
   plan's accuracy budget admits it (`quality.py`, judged on the model at load).
4. A torch operator (`wavecore::vnni_product`, registered in C++ by `vnni_op.cpp`
   through torch's stable ABI), so that a compiled decode graph (`compiled_decode.py`)
   and eager steps call it without Python in between: in a compiled graph 4.6 us a
   call against 8.2 as a Python custom op (121 calls a step); from eager code 4.4-5.2
   against 5.6-7.9 for the same C function through ctypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from wavecore.engine.model.woq_linear import EXACT, GROUP, four_bit_groups, per_channel_int8
from wavecore.engine.native_build import KernelSource, build

VNNI_KERNEL = KernelSource(
    Path(__file__).with_name("vnni_product.c"),
    "vnni_product",
    "WAVECORE_VNNI_KERNEL",
    torch_ops=Path(__file__).with_name("vnni_op.cpp"),
)
TILE = 16  # output rows per tile of the packed layout


# The operator's CPU kernel comes with the library (`vnni_op.cpp`, rule 4).
torch.library.define(
    "wavecore::vnni_product", "(Tensor x, Tensor packed, int bits, int out_features) -> Tensor"
)


@torch.library.register_fake("wavecore::vnni_product")
def _(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@cache
def _kernel() -> tuple[bool, str]:
    """Whether `wavecore::vnni_product` runs here (its library loaded, which registers
    its CPU kernel); with the reason, in words."""
    built = build(VNNI_KERNEL)
    if built.library is None:
        return False, built.reason
    if not built.library.wavecore_vnni_available():
        return False, "this CPU has no AVX-512 VNNI"
    return True, built.reason


def kernel_report() -> str:
    """Whether "woq-vnni" can run here, and why, for reports."""
    runs, reason = _kernel()
    return f"native kernel ({reason})" if runs else f"unavailable ({reason})"


def can_pack_vnni(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int
) -> bool:
    """Whether a float32 `[out, in]` product can run "woq-vnni" here (rule 1)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and in_features % GROUP == 0
        and out_features % TILE == 0
        and _kernel()[0]
    )


@dataclass(frozen=True, slots=True)
class VnniProjection:
    bits: int  # 4 or 8
    packed: torch.Tensor  # uint8, `vnni_product.c`'s layout, one tile's bytes after another
    in_features: int
    out_features: int

    @classmethod
    def build(cls, matrix: torch.Tensor) -> VnniProjection:
        """From a float `[out, in]` matrix: 4 bits where it is 4-bit groups whose scales
        and minimums float16 holds, else 8 (rule 2); a ValueError where the kernel
        cannot run (rule 1)."""
        runs, reason = _kernel()
        if not runs:
            raise ValueError(f"the kernel 'woq-vnni' cannot run here: {reason}")
        out_features, in_features = matrix.shape
        groups = four_bit_groups(matrix)
        if groups is not None and _float16_holds(groups.step, groups.low):
            packed = _pack_4bit(groups.codes, groups.step, groups.low)
            return cls(4, packed, in_features, out_features)
        codes, scale = per_channel_int8(matrix)
        return cls(8, _pack_8bit(codes, scale), in_features, out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W` in float32, for float32 `x` `[rows, in]`."""
        return torch.ops.wavecore.vnni_product(x, self.packed, self.bits, self.out_features)

    @property
    def num_bytes(self) -> int:
        return self.packed.numel()


def _float16_holds(step: torch.Tensor, low: torch.Tensor) -> bool:
    """Whether float16 scales and minimums give every weight back within `EXACT` of
    its step (a GGUF's own float16 values always do; one beyond float16's range rounds
    to infinity, an error no bound admits)."""
    error = 15 * (step.half().float() - step).abs() + (low.half().float() - low).abs()
    return bool((error <= EXACT * step).all())


def _pack_4bit(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    out_features, groups, _ = codes.shape
    tiles = out_features // TILE
    # [tile, row, group, part q, half, b]: input 8q + 4 half + b of the group
    nibbles = codes.to(torch.uint8).reshape(tiles, TILE, groups, 4, 2, 4)
    joined = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # [tile, row, group, q, b]
    codes_part = joined.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 4 * TILE * 4)

    def per_group(values: torch.Tensor) -> torch.Tensor:  # [out, groups, 1] -> float16 bytes
        halves = values.reshape(tiles, TILE, groups).transpose(1, 2).to(torch.float16)
        return halves.contiguous().view(torch.uint8).reshape(tiles, groups, 2 * TILE)

    return torch.cat([codes_part, per_group(step), per_group(low)], dim=-1).reshape(-1)


def _pack_8bit(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = codes.shape
    tiles, groups = out_features // TILE, in_features // GROUP
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    # [tile, group, part j, row, b]: input 4j + b of the group
    parts = unsigned.reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    scales = scale.to(torch.float32).reshape(tiles, TILE).contiguous().view(torch.uint8)
    return torch.cat([scales, parts.reshape(tiles, groups * 8 * TILE * 4)], dim=-1).reshape(-1)
