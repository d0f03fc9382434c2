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

A projection keeps each layout its plan names and no other: a plan that mixes the two
keeps both (twice the memory, bought for speed, and only when measured faster).
Either way the arithmetic is an ordinary float32 (or model dtype) matrix product;
only the order of the accumulation inside the kernel differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wavecore.engine.model.kernel_plan import KernelPlan

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


def pack(matrix: torch.Tensor) -> torch.Tensor:
    """A float32 `[out, in]` CPU matrix in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous(), _PACKED_FOR_ROWS)


def packed_product(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")


@dataclass(frozen=True, slots=True)
class Projection:
    plain: torch.Tensor | None  # `[in, out]`, when the plan uses "blas"
    blocked: torch.Tensor | None  # oneDNN's layout of `[out, in]`, when it uses "onednn"
    kernels: KernelPlan
    in_features: int
    out_features: int

    @classmethod
    def build(
        cls,
        matrix: torch.Tensor,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kernels: KernelPlan | None = None,
    ) -> Projection:
        """From a `[out, in]` matrix (the checkpoint's orientation), placed for `device`,
        with the layouts `kernels` runs (default: oneDNN where it can pack, else BLAS)."""
        out_features, in_features = matrix.shape
        dense = matrix.to(device=device, dtype=dtype)
        packable = can_pack(device, dtype)
        if kernels is None:
            kernels = KernelPlan.uniform("onednn") if packable else BLAS
        if kernels.uses("fbgemm"):
            raise ValueError("a float projection cannot run the int8 kernel fbgemm")
        if kernels.uses("onednn") and not packable:
            raise ValueError(
                f"kernel 'onednn' needs float32 on a CPU with oneDNN, not {dtype} on {device}"
            )
        plain = dense.t().contiguous() if kernels.uses("blas") else None
        blocked = pack(dense) if kernels.uses("onednn") else None
        return cls(plain, blocked, kernels, in_features, out_features)

    @property
    def packed(self) -> bool:
        """Whether there is no plain matrix (the embedding cannot be a view of it)."""
        return self.plain is None

    @property
    def weight(self) -> torch.Tensor:
        """The plain `[in, out]` matrix when there is one, else the blocked one."""
        return self.plain if self.plain is not None else self.blocked  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W`, a new `[tokens, out]` tensor."""
        if self.kernels.for_rows(x.shape[0]) == "onednn":
            return packed_product(x, self.blocked)
        return x @ self.plain

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W`; the plain form updates `residual` in place."""
        if self.kernels.for_rows(x.shape[0]) == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.blocked, None, "add")
        return residual.addmm_(x, self.plain)

    def to(self, device: torch.device) -> Projection:
        """This projection on `device`; a packed one lives on the CPU and stays there."""
        if device.type == "cpu" and self.weight.device.type == "cpu":
            return self
        if self.blocked is not None:
            raise ValueError(f"a oneDNN-packed projection cannot move to {device}")
        return Projection(
            self.plain.to(device), None, self.kernels, self.in_features, self.out_features
        )

    @property
    def num_bytes(self) -> int:
        layouts = (self.plain is not None) + (self.blocked is not None)
        return layouts * self.in_features * self.out_features * self.weight.element_size()
