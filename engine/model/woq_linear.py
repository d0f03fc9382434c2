"""`WeightOnlyProjection`: weights in 4 or 8 bits, read by torch's CPU weight-only
products with bfloat16 activations (kernel "woq").

Which width a matrix gets is decided by the matrix itself, so that this form never
rounds a weight coarser than its source had it:
- 4 bits, in groups of 32 along the input with a scale and a zero each (minimum and
  maximum: llama.cpp's Q4_1 layout), when the matrix already is such groups: a
  GGUF's Q4_1 tensors (every projection of the shipped SmolLM2) dequantize to groups
  whose minimum has code 0 and whose maximum code 15, so quantizing them again gives
  back the file's own codes and scales. The form then holds the GGUF's blocks.
- 8 bits per output channel (a scale each, symmetric) otherwise: a float matrix, or
  finer blocks (the shipped model's embedding, its LM head, is Q8_0; rounded to 4 bits
  it took the greedy agreement with float32 from 99% to 87%).

The products are `aten._weight_int4pack_mm_for_cpu` (the kernel of torchao's int4
weight-only quantization on CPUs) and `aten._weight_int8pack_mm`. Both are vectorized
for bfloat16 activations; the 4-bit one took 20-50x longer in float32 or float16 on the
Xeon of the README's figures. So `x` is rounded to bfloat16 on the way in (as
"onednn-bf16" rounds it) and the product comes back in float32; scales and zeros are
bfloat16 too. One row streams the weights at close to the memory's rate (4 bits: a
quarter of the bfloat16 form's bytes, 8 bits: half); each further row reads them
again, so from a few rows on oneDNN's bfloat16 wins: the kernel plan measures which
shape classes this kernel serves (`kernel_choice.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
# The 4-bit packing's inner tiles along the input (2 x 16 values: one group).
_INNER_K_TILES = 2
# A group counts as 4-bit when its codes give it back within this share of its step.
EXACT = 1e-3


def can_pack_woq(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int
) -> bool:
    """Whether this CPU build can hold a float32 `[out, in]` product in either width."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        and in_features % GROUP == 0
        and out_features % 16 == 0
    )


@dataclass(frozen=True, slots=True)
class FourBitGroups:
    """A matrix as groups of `GROUP` inputs: weight = code * step + low."""

    codes: torch.Tensor  # `[out, in / GROUP, GROUP]` float32, whole numbers 0..15
    step: torch.Tensor  # `[out, in / GROUP, 1]` float32
    low: torch.Tensor  # `[out, in / GROUP, 1]` float32


def four_bit_groups(matrix: torch.Tensor) -> FourBitGroups | None:
    """`matrix` `[out, in]` as 4-bit groups (minimum and maximum: llama.cpp's Q4_1)
    when every weight is one within `EXACT` of its group's step, else None."""
    out_features, in_features = matrix.shape
    groups = matrix.to(torch.float32).reshape(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    step = ((high - low) / 15).clamp_(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - low) / step).round_().clamp_(0, 15)
    if not bool(((codes * step + low - groups).abs() <= EXACT * step).all()):
        return None
    return FourBitGroups(codes, step, low)


def per_channel_int8(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`matrix` `[out, in]` rounded to int8 codes `[out, in]` with a float32 scale per
    output `[out]` (symmetric: weight = code * scale, codes -127..127)."""
    matrix = matrix.to(torch.float32).contiguous()
    scale = (matrix.abs().amax(dim=1) / 127).clamp_(min=torch.finfo(torch.float32).tiny)
    codes = (matrix / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


@dataclass(frozen=True, slots=True)
class WeightOnlyProjection:
    bits: int  # 4 or 8
    codes: torch.Tensor  # 4: the kernel's packed layout (uint8); 8: `[out, in]` int8
    scales: torch.Tensor  # 4: `[in / GROUP, out, 2]` scale and zero; 8: `[out]`; bfloat16
    in_features: int
    out_features: int

    @classmethod
    def build(cls, matrix: torch.Tensor) -> WeightOnlyProjection:
        """From a float `[out, in]` matrix: 4 bits where it is 4-bit groups, else 8."""
        out_features, in_features = matrix.shape
        groups = four_bit_groups(matrix)
        if groups is not None:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                groups.codes.to(torch.int32).reshape(out_features, in_features), _INNER_K_TILES
            )
            # The kernel reads a weight as (code - 8) * scale + zero.
            scale_zero = torch.cat([groups.step, groups.low + 8 * groups.step], dim=-1)
            return cls(
                4,
                packed,
                scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16),
                in_features,
                out_features,
            )
        codes8, scale = per_channel_int8(matrix)
        return cls(8, codes8, scale.to(torch.bfloat16), in_features, out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W` in float32."""
        return self.product(x).to(torch.float32)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W` in bfloat16, as the kernels give it (adding it to a float32 tensor
        widens it exactly, without a conversion of its own)."""
        x = x.to(torch.bfloat16)
        if self.bits == 4:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, GROUP, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))
