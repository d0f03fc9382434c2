"""How a model's projection matrices are stored: `"auto"` (the default), `"float32"`
or `"int8"`.

`"auto"` holds the forms of the per-machine, per-shape-class plan
(`kernel_choice.py`, `auto_weights.py`): float32, bfloat16 and/or int8, whichever
ran fastest within the accuracy budget; it resolves to `"float32"` where there is no
choice (a GPU, or a dtype other than "auto").
`"float32"` keeps every matrix in the model's dtype (`linear.Projection`);
`"int8"` quantizes the projections of every layer (q/k/v, o, gate/up, down) and the
LM head at load (`int8_weights.py`, `int8_linear.Int8Projection`). The embedding,
the norms and biases stay float32 in both: a step gathers one embedding row per
token, so int8 there would save memory but no time.
"""

from __future__ import annotations

from typing import Literal

import torch

from wavecore.engine.model.int8_linear import Int8Projection, require_fbgemm
from wavecore.engine.model.linear import Projection

WeightFormat = Literal["auto", "float32", "int8"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("auto", "float32", "int8")
AnyProjection = Projection | Int8Projection


def check_weight_format(weights: object, device: torch.device, dtype: str = "auto") -> WeightFormat:
    """`weights` if it is a known format that runs on `device` with the `dtype` asked
    for ("auto" resolved as above); else a ValueError saying why."""
    if weights == "auto":
        return "auto" if device.type == "cpu" and dtype == "auto" else "float32"
    if weights == "float32":
        return "float32"
    if weights != "int8":
        raise ValueError(f"weights must be 'auto', 'float32' or 'int8', got {weights!r}")
    if device.type != "cpu":
        raise ValueError(f"weights='int8' runs on the CPU only; the device is {device}")
    require_fbgemm()
    return "int8"


def build_projection(
    matrix: torch.Tensor, *, device: torch.device, dtype: torch.dtype, like: AnyProjection
) -> AnyProjection:
    """The `[out, in]` `matrix` as a projection of the same kind as `like`, the one it
    replaces: int8 with `like`'s calibration, or float in the model's dtype (with the
    same forms as `like`, its int8 form requantized with its calibration)."""
    if isinstance(like, Int8Projection):
        return Int8Projection.build(matrix, like.input_range)
    int8 = Int8Projection.build(matrix, like.int8.input_range) if like.int8 is not None else None
    return Projection.build(matrix, device=device, dtype=dtype, kernels=like.kernels, int8=int8)
