"""`Projection` against a float64 product, in every layout, and its choice of kernel by rows."""

from __future__ import annotations

import pytest
import torch

from wavecore.engine.model.kernel_plan import KernelPlan, forced_kernels
from wavecore.engine.model.linear import Projection, pack

CPU = torch.device("cpu")


def build(matrix: torch.Tensor, layout: str) -> Projection:
    """`layout` is the `projections` fixture's value, which set the layout up."""
    kernels = KernelPlan(**forced_kernels())
    projection = Projection.build(matrix, device=CPU, dtype=torch.float32, kernels=kernels)
    assert projection.packed is (layout == "packed")
    return projection


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_products_match_float64(projections: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    matrix = torch.randn(48, 40, generator=gen)  # [out, in]
    projection = build(matrix, projections)
    # A strided slice, as the forward pass hands over the gate half of gate_up.
    x = torch.randn(rows, 80, generator=gen)[:, :40]
    residual = torch.randn(rows, 48, generator=gen)
    expected = x.double() @ matrix.double().t()

    torch.testing.assert_close(projection(x).double(), expected, atol=1e-5, rtol=1e-5)
    before = residual.clone()
    summed = projection.add_to(residual, x)
    torch.testing.assert_close(summed.double(), before.double() + expected, atol=1e-5, rtol=1e-5)
    assert (projection.in_features, projection.out_features) == (40, 48)
    assert projection.num_bytes == 40 * 48 * 4 * (2 if projections == "mixed" else 1)


@pytest.mark.parametrize("projections", ["packed"], indirect=True)
def test_packed_projection_stays_on_the_cpu(projections: str) -> None:
    projection = build(torch.randn(8, 4), projections)
    assert projection.to(CPU) is projection
    with pytest.raises(ValueError, match="cannot move to meta"):
        projection.to(torch.device("meta"))


@pytest.mark.parametrize("projections", ["plain"], indirect=True)
def test_plain_projection_moves(projections: str) -> None:
    moved = build(torch.randn(8, 4), projections).to(torch.device("meta"))
    assert moved.weight.device.type == "meta" and moved.weight.shape == (4, 8)


@pytest.mark.parametrize("projections", ["mixed"], indirect=True)
def test_rows_pick_the_kernel(projections: str) -> None:
    # Two different matrices in the two layouts show which one each product read.
    ones, twos = torch.ones(3, 5), torch.full((3, 5), 2.0)
    plan = KernelPlan(decode="blas", small="onednn", large="blas", prefill="onednn")
    projection = Projection(ones.t().contiguous(), pack(twos), plan, 5, 3)
    for rows, kernel_matrix in ((1, ones), (2, twos), (8, twos), (9, ones), (129, twos)):
        x = torch.ones(rows, 5)
        torch.testing.assert_close(projection(x), x @ kernel_matrix.t())
        summed = projection.add_to(torch.zeros(rows, 3), x)
        torch.testing.assert_close(summed, x @ kernel_matrix.t())
