"""`Projection`: one weight matrix and the two products the forward pass takes of it.

A projection computes `x @ W` for activations `x` `[tokens, in]`, or adds that into
the residual stream. Which kernel runs depends on the rows of `x`, by the projection's
`KernelPlan` (`kernel_plan.py`; chosen per machine at load, `kernel_choice.py`):

- "blas": the matrix kept plain as `[in, out]`; `x @ W` reads it row-major through
  torch's BLAS, and the residual add is fused into the product as an in-place
  `addmm_`. The only kernel on CUDA, in reduced precision and without oneDNN.
- "onednn": the matrix reordered once, at load, into oneDNN's blocked layout for the
  batch sizes of decoding (`_PACKED_FOR_ROWS`), products through oneDNN's linear
  primitive. On a 2-core AMD EPYC it ran batch-64 decode about 1.5x faster than BLAS;
  on an Intel Xeon it ran batch-1 decode 1.5x slower, hence the choice per class.
- "onednn-bf16": the matrix rounded to bfloat16 and reordered into oneDNN's blocked
  layout; float32 activations are rounded to bfloat16 per product and the product
  (accumulated in float32 by AMX or AVX-512 BF16) returned as float32. Only on CPUs
  with native bf16 (`native_bf16`): elsewhere oneDNN emulates it hundreds of times
  slower. Measured on a 2 vCPU Xeon with AMX (every projection of SmolLM2-135M):
  20 ms at batch 1 against float32 BLAS's 26, 32 against 92 at batch 64.
- "fbgemm": the int8 form (`int8_linear.Int8Projection`), held here when a plan mixes
  it with float kernels (`weights="auto"`).
- "woq": weight-only 4 or 8 bits (`woq_linear.WeightOnlyProjection`): a GGUF's Q4_1
  blocks as they are, 8 bits per channel for any other matrix; bfloat16 activations.
  For batch-1 decode, which streams every weight once: an eighth to a quarter of
  float32's bytes.
- "woq-vnni": the same weights, activations rounded to int8, products by AVX-512 VNNI
  dot products (`vnni_linear.VnniProjection`): at one row on a 2 vCPU AMD EPYC,
  torch's weight-only products were compute-bound, these stream the weights.

A projection keeps each form its plan names and no other: a plan that mixes kernels
keeps several (more memory, bought for speed, and only when measured faster). The
float32 kernels differ only in the order of accumulation; "onednn-bf16", "fbgemm",
"woq" and "woq-vnni" round, and are chosen only within an accuracy budget
(`quality.py`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from wavecore.engine.model.int8_linear import Int8Projection
from wavecore.engine.model.kernel_plan import Kernel, KernelPlan
from wavecore.engine.model.vnni_linear import VnniProjection, can_pack_vnni
from wavecore.engine.model.vnni_linear import kernel_report as vnni_kernel_report
from wavecore.engine.model.woq_linear import GROUP as WOQ_GROUP
from wavecore.engine.model.woq_linear import WeightOnlyProjection, can_pack_woq

# oneDNN picks its blocking for an expected row count; decode batches are the steps
# whose speed depends on the product most (prefill chunks are large enough for any).
_PACKED_FOR_ROWS = 64
BLAS = KernelPlan.uniform("blas")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# "off" makes `native_bf16` answer no: a CPU whose flags claim bfloat16 that its
# hypervisor does not deliver at speed, or the plan a CPU without it would choose,
# measured on one that has it (bench/paths.py --emulate-cpu-without-bf16).
CPU_BF16_ENV = "WAVECORE_CPU_BF16"


@cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16, by the flags
    of /proc/cpuinfo) and oneDNN can use it: the only CPUs where bf16 is not slower.
    Read once per process; `WAVECORE_CPU_BF16=off` says no whatever the flags."""
    setting = os.environ.get(CPU_BF16_ENV, "")
    if setting not in ("", "off"):
        raise ValueError(f"{CPU_BF16_ENV} must be 'off' or unset, got {setting!r}")
    if setting == "off":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    return (
        bool(flags & {"amx_bf16", "avx512_bf16"})
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def can_pack_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the "onednn-bf16" kernel runs for float32 activations on `device`."""
    return can_pack(device, dtype) and native_bf16()


def pack(matrix: torch.Tensor) -> torch.Tensor:
    """A float32 (or bfloat16) `[out, in]` CPU matrix in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous(), _PACKED_FOR_ROWS)


def pack_bf16(matrix: torch.Tensor) -> torch.Tensor:
    """A float `[out, in]` CPU matrix rounded to bfloat16, in oneDNN's blocked layout."""
    return pack(matrix.to(torch.bfloat16))


def packed_product(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")


def bf16_product(x: torch.Tensor, blocked_bf16: torch.Tensor) -> torch.Tensor:
    return packed_product(x.to(torch.bfloat16), blocked_bf16).to(torch.float32)


@dataclass(frozen=True, slots=True)
class Projection:
    plain: torch.Tensor | None  # `[in, out]`, when the plan uses "blas"
    blocked: torch.Tensor | None  # oneDNN's layout of `[out, in]`, when it uses "onednn"
    kernels: KernelPlan
    in_features: int
    out_features: int
    bf16: torch.Tensor | None = None  # oneDNN's bfloat16 layout, for "onednn-bf16"
    int8: Int8Projection | None = None  # for "fbgemm" in a mixed plan
    woq: WeightOnlyProjection | None = None  # for "woq"
    vnni: VnniProjection | None = None  # for "woq-vnni"

    @classmethod
    def build(
        cls,
        matrix: torch.Tensor,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kernels: KernelPlan | None = None,
        int8: Int8Projection | None = None,
    ) -> Projection:
        """From a `[out, in]` matrix (the checkpoint's orientation), placed for `device`,
        with the forms `kernels` runs (default: oneDNN where it can pack, else BLAS); a
        plan that uses "fbgemm" takes that form ready-made as `int8` (it needs the
        calibration of `int8_weights.py`)."""
        out_features, in_features = matrix.shape
        dense = matrix.to(device=device, dtype=dtype)
        packable = can_pack(device, dtype)
        if kernels is None:
            kernels = KernelPlan.uniform("onednn") if packable else BLAS
        if kernels.uses("fbgemm") and int8 is None:
            raise ValueError("a plan that runs the int8 kernel fbgemm needs the int8 form")
        if kernels.uses("onednn") and not packable:
            raise ValueError(
                f"kernel 'onednn' needs float32 on a CPU with oneDNN, not {dtype} on {device}"
            )
        if kernels.uses("onednn-bf16") and not can_pack_bf16(device, dtype):
            raise ValueError(
                f"kernel 'onednn-bf16' needs float32 activations on a CPU with native "
                f"bfloat16 (AMX or AVX-512 BF16) and oneDNN, not {dtype} on {device}"
            )
        if kernels.uses("woq") and not can_pack_woq(device, dtype, in_features, out_features):
            raise ValueError(
                f"kernel 'woq' needs float32 on a CPU, inputs in groups of {WOQ_GROUP} and "
                f"outputs in 16s, not {dtype} on {device} for {in_features} -> {out_features}"
            )
        if kernels.uses("woq-vnni") and not can_pack_vnni(device, dtype, in_features, out_features):
            raise ValueError(
                f"kernel 'woq-vnni' needs float32 on a CPU with AVX-512 VNNI and its kernel "
                f"built ({vnni_kernel_report()}), inputs in groups of {WOQ_GROUP} and "
                f"outputs in 16s, not {dtype} on {device} for {in_features} -> {out_features}"
            )
        plain = dense.t().contiguous() if kernels.uses("blas") else None
        blocked = pack(dense) if kernels.uses("onednn") else None
        bf16 = pack_bf16(dense) if kernels.uses("onednn-bf16") else None
        return cls(
            plain,
            blocked,
            kernels,
            in_features,
            out_features,
            bf16,
            int8 if kernels.uses("fbgemm") else None,
            WeightOnlyProjection.build(dense) if kernels.uses("woq") else None,
            VnniProjection.build(dense) if kernels.uses("woq-vnni") else None,
        )

    def run_by(self, kernels: KernelPlan) -> Projection:
        """This projection's forms (every one it holds) run by `kernels`; a ValueError
        if the plan needs a form it lacks."""
        for kernel in set(kernels.as_dict().values()):
            if self._form(kernel) is None:
                raise ValueError(f"this projection holds no form for kernel {kernel!r}")
        return dataclasses.replace(self, kernels=kernels)

    def trimmed(self) -> Projection:
        """Without the forms its plan does not run (their memory freed)."""
        uses = self.kernels.uses
        return Projection(
            self.plain if uses("blas") else None,
            self.blocked if uses("onednn") else None,
            self.kernels,
            self.in_features,
            self.out_features,
            self.bf16 if uses("onednn-bf16") else None,
            self.int8 if uses("fbgemm") else None,
            self.woq if uses("woq") else None,
            self.vnni if uses("woq-vnni") else None,
        )

    def _form(self, kernel: Kernel) -> object | None:
        return {
            "blas": self.plain,
            "onednn": self.blocked,
            "onednn-bf16": self.bf16,
            "fbgemm": self.int8,
            "woq": self.woq,
            "woq-vnni": self.vnni,
        }[kernel]

    @property
    def packed(self) -> bool:
        """Whether there is no plain matrix (the embedding cannot be a view of it)."""
        return self.plain is None

    @property
    def weight(self) -> torch.Tensor:
        """The plain `[in, out]` matrix when there is one, else a blocked one."""
        for form in (self.plain, self.blocked, self.bf16):
            if form is not None:
                return form
        raise ValueError("an int8-only projection has no float matrix")

    def matrix(self) -> torch.Tensor:
        """The `[out, in]` matrix from the most exact form held (float32 exactly; else
        bfloat16 or int8, dequantized), by multiplying it with an identity matrix."""
        if self.plain is not None:
            return self.plain.t()
        for kernel in ("onednn", "onednn-bf16", "fbgemm", "woq", "woq-vnni"):
            if self._form(kernel) is not None:
                eye = torch.eye(self.in_features)
                return self.run_by(KernelPlan.uniform(kernel))(eye).t()
        raise ValueError("a projection without any form")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W`, a new `[tokens, out]` tensor."""
        kernel = self.kernels.for_rows(x.shape[0])
        if kernel == "blas":
            return x @ self.plain
        if kernel == "onednn":
            return packed_product(x, self.blocked)
        if kernel == "onednn-bf16":
            return bf16_product(x, self.bf16)
        if kernel == "woq":
            return self.woq(x)  # type: ignore[misc]
        if kernel == "woq-vnni":
            return self.vnni(x)  # type: ignore[misc]
        return self.int8(x)  # type: ignore[misc]

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W`; the plain form updates `residual` in place."""
        kernel = self.kernels.for_rows(x.shape[0])
        if kernel == "blas":
            return residual.addmm_(x, self.plain)
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.blocked, None, "add")
        # The bfloat16 products are added as they come: the add widens them exactly.
        if kernel == "onednn-bf16":
            return residual.add_(packed_product(x.to(torch.bfloat16), self.bf16))
        if kernel == "woq":
            return residual.add_(self.woq.product(x))  # type: ignore[union-attr]
        if kernel == "woq-vnni":
            return residual.add_(self.vnni(x))  # type: ignore[misc]
        return self.int8.add_to(residual, x)  # type: ignore[union-attr]

    def to(self, device: torch.device) -> Projection:
        """This projection on `device`; a packed one lives on the CPU and stays there."""
        if device.type == "cpu" and self.weight.device.type == "cpu":
            return self
        packed = (self.blocked, self.bf16, self.woq, self.vnni)
        if self.plain is None or any(form is not None for form in packed):
            raise ValueError(f"a CPU-packed projection cannot move to {device}")
        return Projection(
            self.plain.to(device), None, self.kernels, self.in_features, self.out_features
        )

    def bytes_read(self, rows: int) -> int:
        """The bytes of the one form a product of `rows` rows reads."""
        form = self._form(self.kernels.for_rows(rows))
        if isinstance(form, torch.Tensor):
            return self.in_features * self.out_features * form.element_size()
        return form.num_bytes  # type: ignore[union-attr]

    @property
    def num_bytes(self) -> int:
        elements = self.in_features * self.out_features
        total = sum(
            elements * form.element_size()
            for form in (self.plain, self.blocked, self.bf16)
            if form is not None
        )
        quantized = (self.int8, self.woq, self.vnni)
        return sum((form.num_bytes for form in quantized if form is not None), total)
