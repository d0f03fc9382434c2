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
4. A torch custom op (`wavecore::vnni_product`), so that a compiled decode graph
   (`compiled_decode.py`) calls it as one kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from wavecore.engine.model.woq_linear import EXACT, GROUP, four_bit_groups, per_channel_int8
from wavecore.engine.native_build import KernelSource, build

VNNI_KERNEL = KernelSource(
    Path(__file__).with_name("vnni_product.c"), "vnni_product", "WAVECORE_VNNI_KERNEL"
)
TILE = 16  # output rows per tile of the packed layout
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64


@cache
def _kernel() -> tuple[ctypes._CFuncPtr | None, str]:
    """The kernel's function, or None; with the reason, in words."""
    built = build(VNNI_KERNEL)
    if built.library is None:
        return None, built.reason
    if not built.library.wavecore_vnni_available():
        return None, "this CPU has no AVX-512 VNNI"
    function = built.library.wavecore_vnni_product
    function.argtypes = [_POINTER, _INT, _INT, _INT, ctypes.c_int, _POINTER, _POINTER]
    function.restype = ctypes.c_int
    return function, built.reason


def kernel_report() -> str:
    """Whether "woq-vnni" can run here, and why, for reports."""
    function, reason = _kernel()
    return f"native kernel ({reason})" if function is not None else f"unavailable ({reason})"


def can_pack_vnni(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int
) -> bool:
    """Whether a float32 `[out, in]` product can run "woq-vnni" here (rule 1)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and in_features % GROUP == 0
        and out_features % TILE == 0
        and _kernel()[0] is not None
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
        and minimums float16 holds, else 8 (rule 2)."""
        out_features, in_features = matrix.shape
        groups = four_bit_groups(matrix)
        if groups is not None and _float16_holds(groups.step, groups.low):
            packed = _pack_4bit(groups.codes, groups.step, groups.low)
            return cls(4, packed, in_features, out_features)
        codes, scale = per_channel_int8(matrix)
        return cls(8, _pack_8bit(codes, scale), in_features, out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W` in float32, for float32 `x` `[rows, in]`."""
        if torch.compiler.is_compiling():
            return torch.ops.wavecore.vnni_product(x, self.packed, self.bits, self.out_features)
        # Eager: the op's body without the dispatcher's 4-5 us a call (a step makes 121).
        return _product(x, self.packed, self.bits, self.out_features)

    @property
    def num_bytes(self) -> int:
        return self.packed.numel()


def packed_bytes(bits: int, in_features: int, out_features: int) -> int:
    """The bytes of `vnni_product.c`'s layout for these weights."""
    groups, tiles = in_features // GROUP, out_features // TILE
    if bits == 4:
        return tiles * groups * (4 * TILE * 4 + 2 * 2 * TILE)
    return tiles * (4 * TILE + groups * 8 * TILE * 4)


def _float16_holds(step: torch.Tensor, low: torch.Tensor) -> bool:
    """Whether float16 scales and minimums give every weight back within `EXACT` of
    its step (a GGUF's own float16 values always do)."""
    error = 15 * (step.half().float() - step).abs() + (low.half().float() - low).abs()
    return bool((error <= EXACT * step).all()) and bool(low.half().isfinite().all())


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


@torch.library.custom_op("wavecore::vnni_product", mutates_args=())
def vnni_product(
    x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int
) -> torch.Tensor:
    """`x` `[rows, in]` times the weights `packed` holds (`VnniProjection`), float32."""
    return _product(x, packed, bits, out_features)


def _product(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    function = _kernel()[0]
    if function is None:
        raise RuntimeError("vnni_product: the kernel is not available (check can_pack_vnni)")
    rows, in_features = x.shape
    if packed.numel() != packed_bytes(bits, in_features, out_features):
        raise ValueError(
            f"vnni_product: {packed.numel()} packed bytes do not hold {bits}-bit weights "
            f"of {in_features} inputs and {out_features} outputs"
        )
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out
    x = x.to(torch.float32).contiguous()
    status = function(
        x.data_ptr(), rows, in_features, out_features, bits, packed.data_ptr(), out.data_ptr()
    )
    if status != 0:
        reason = "out of memory" if status == 2 else "shapes it cannot take"
        raise RuntimeError(f"vnni_product: the kernel failed ({reason})")
    return out


@vnni_product.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
