"""`Int8Projection`: a projection whose weight is stored and multiplied as int8.

The kernel is fbgemm's dynamic quantized linear (`torch.ops.quantized.linear_dynamic`,
the int8 GEMM library inside every x86 build of torch): int8 weights prepacked once,
activations quantized per call, int8 x int8 products accumulated in int32 with the
CPU's VNNI instructions, results rescaled to float32. The weights are never
dequantized, so a step streams a quarter of float32's bytes.

Why this kernel (measured on a shared 2-core AMD EPYC with SmolLM2-135M's shapes,
one thread, every projection of one decode step, LM head included): fbgemm 16 ms at
batch 1 and 244 ms at batch 64, against float32 oneDNN-packed 34 / 496 ms, float32
BLAS 27 / 362 ms, oneDNN's int8 `qlinear_pointwise` 46 / 229 ms; torch's weight-only
kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) and `_int_mm` have
no vectorized float32 path (checked again in torch 2.13: `_weight_int8pack_mm` took
1.0 ms for a 1536x576 product at batch 1 against float32's 0.08, 83 ms at batch 64
against 2.8).

fbgemm quantizes the activations per call with one range for the whole call. The
range holds 8 bits on CPUs with AVX-512 VNNI, whose instruction accumulates u8 x s8
products straight into int32; without it fbgemm sums pairs of products in saturating
16-bit lanes and needs `reduce_range` (7 bits), which costs quality (measured on
SmolLM2-135M: 91.9% top-1 agreement with float32 at 7 bits, 97.5% at 8; README).
LLM activations have a few channels and tokens hundreds of times larger than the
rest; exact rewrites of `x @ W.T` keep the 8 bits for the rest
(`engine/model/quality.py` measures what is left):
- smoothing (after SmoothQuant): input channel j is divided by `s_j = (range_x_j /
  range_w_j) ** 0.3` and weight column j multiplied by it, moving part of the
  activations' outlier channels into the weights, where per-row scales absorb them;
  `range_x` comes from a calibration pass in float32 at load (`int8_weights.py`);
- outlier channels: the `_OUTLIERS` channels of largest calibrated range are
  multiplied in float32 (LLM.int8()'s decomposition, with a fixed set of channels);
- per-token scales: each row of `x` is divided by its largest magnitude before the
  call and the output row multiplied back, so a prefill's first token (often hundreds
  of times larger than the others) does not take the range of its batch mates;
- pinned range: two extra input columns, +1 and -1 against zero weights, make every
  call's range exactly [-1, 1]. fbgemm's range would otherwise be the batch's min and
  max, so a token's int8 product would depend on its batch mates; pinned, it is the
  same bits alone or in any batch (the int32 sums are exact).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

_QMAX = 127
_ENGINE = "fbgemm"
# 8-bit activations only where fbgemm's products cannot saturate (see above).
ACTIVATION_BITS = 8 if torch.cpu._is_vnni_supported() else 7
# The pinned range's columns (see above), appended to every call's input.
_PINS = torch.tensor([1.0, -1.0])
_OUTLIERS = 16
# How much of the activations' range moves into the weights; of 0.2, 0.3, 0.5 and 0.7,
# 0.3 kept most of float32's predictions on SmolLM2-135M (8-bit activations: 97.5%,
# against 96.7% at 0.15 and 95.0% at 0.5).
_SMOOTHING = 0.3
# Floors that keep a channel or row of zeros from dividing by zero.
_TINY = 1e-12


def require_fbgemm() -> None:
    """Raise a ValueError unless this torch build has fbgemm (x86 CPUs), which
    `Int8Projection` runs on."""
    if _ENGINE not in torch.backends.quantized.supported_engines:
        raise ValueError(
            "weights='int8' needs torch's fbgemm backend (x86 CPUs); this build has "
            f"{torch.backends.quantized.supported_engines}"
        )


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of a float `[out, in]` matrix: `(int8 matrix, float32 scales)`.

    `matrix ~= int8 * scales[:, None]`; a row of zeros gets scale 1 (any scale is exact)."""
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(
            f"cannot quantize a {tuple(matrix.shape)} matrix to int8: it holds NaN or infinity"
        )
    peak = matrix.abs().amax(dim=1)
    scales = torch.where(peak > 0, peak / _QMAX, torch.ones_like(peak))
    values = torch.round(matrix / scales[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return values, scales


def _prepack(values: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    with warnings.catch_warnings():
        # torch deprecates quantized tensors as a user-facing type; fbgemm's prepack
        # still takes its weight in that form, and only here.
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(
            values, scales.to(torch.float64), torch.zeros(values.shape[0], dtype=torch.long), 0
        )
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = _ENGINE
        try:
            return torch.ops.quantized.linear_prepack(weight, None)
        finally:
            torch.backends.quantized.engine = previous


@dataclass(frozen=True, slots=True, kw_only=True)
class Int8Projection:
    params: torch.ScriptObject  # fbgemm's prepacked int8 weight (outlier and pin columns zero)
    input_range: torch.Tensor  # [in] calibrated max |x_j|, kept to requantize updates
    input_scale: torch.Tensor  # [in] 1 / s_j, the smoothing of the inputs
    outliers: torch.Tensor  # [k] int64, input channels multiplied in float32
    outlier_weight: torch.Tensor  # [k, out] float32, smoothed weight rows of those channels
    in_features: int
    out_features: int
    # Like a oneDNN-packed projection, it cannot be gathered by row (see weights.py).
    packed = True

    @classmethod
    def build(cls, matrix: torch.Tensor, input_range: torch.Tensor) -> Int8Projection:
        """From a float `[out, in]` matrix and the calibrated range of each input channel."""
        require_fbgemm()
        if matrix.dim() != 2:
            raise ValueError(
                f"an int8 projection needs a 2-D matrix, got shape {tuple(matrix.shape)}"
            )
        out_features, in_features = matrix.shape
        if tuple(input_range.shape) != (in_features,):
            raise ValueError(
                f"input_range has shape {tuple(input_range.shape)}, expected ({in_features},)"
            )
        dense = matrix.detach().to(device="cpu", dtype=torch.float32)
        x_range = input_range.to(torch.float32).clamp_min(_TINY)
        smooth = (x_range / dense.abs().amax(dim=0).clamp_min(_TINY)).pow(_SMOOTHING)
        smoothed = dense * smooth
        outliers = torch.topk(x_range, min(_OUTLIERS, in_features)).indices.sort().values
        outlier_weight = smoothed[:, outliers].t().contiguous()
        smoothed[:, outliers] = 0
        pinned = torch.cat([smoothed, torch.zeros(out_features, _PINS.numel())], dim=1)
        values, scales = quantize_rows(pinned)
        return cls(
            params=_prepack(values, scales),
            input_range=x_range,
            input_scale=1 / smooth,
            outliers=outliers,
            outlier_weight=outlier_weight,
            in_features=in_features,
            out_features=out_features,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W`, a new float32 `[tokens, out]` tensor."""
        pinned = torch.empty(x.shape[0], self.in_features + _PINS.numel())
        smoothed = pinned[:, : self.in_features]
        torch.mul(x, self.input_scale, out=smoothed)
        exact = smoothed.index_select(1, self.outliers)
        smoothed.index_fill_(1, self.outliers, 0.0)
        rows = smoothed.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY)
        smoothed.div_(rows)
        pinned[:, self.in_features :] = _PINS
        out = torch.ops.quantized.linear_dynamic(pinned, self.params, ACTIVATION_BITS == 7)
        return out.mul_(rows).addmm_(exact, self.outlier_weight)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W`, updating `residual` in place."""
        return residual.add_(self(x))

    def to(self, device: torch.device) -> Int8Projection:
        if device.type != "cpu":
            raise ValueError(f"an int8 projection runs on the CPU only, not on {device}")
        return self

    @property
    def num_bytes(self) -> int:
        """What a product reads: an int8 weight matrix (with its pin columns) and its
        per-row float32 scales, the outlier rows and the smoothing vector."""
        return (
            (self.in_features + _PINS.numel()) * self.out_features
            + 4 * self.out_features
            + self.outlier_weight.numel() * 4
            + self.input_scale.numel() * 4
        )

    def bytes_read(self, rows: int) -> int:
        """Every product reads the one form."""
        return self.num_bytes
