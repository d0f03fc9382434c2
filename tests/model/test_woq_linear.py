"""The weight-only kernel "woq": a matrix of 4-bit groups (a GGUF's Q4_1 blocks) is held
as those groups, any other in 8 bits per channel; products close to float32's, the
forms a plan holds, and shapes it cannot pack refused by name."""

from __future__ import annotations

import pytest
import torch

from wavecore.engine.model.kernel_plan import KernelPlan
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.woq_linear import GROUP, WeightOnlyProjection, can_pack_woq

CPU = torch.device("cpu")
WOQ = KernelPlan.uniform("woq")

pytestmark = pytest.mark.skipif(
    not can_pack_woq(CPU, torch.float32, GROUP, 16),
    reason="this torch has no weight-only CPU kernels",
)


def q4_1_matrix(out_features: int, in_features: int) -> torch.Tensor:
    """What a GGUF's Q4_1 tensor dequantizes to: per group of 32, float16 step `d` and
    minimum `m`, codes 0..15 (the quantizer gives the minimum 0 and the maximum 15)."""
    generator = torch.Generator().manual_seed(0)
    groups = in_features // GROUP
    codes = torch.randint(0, 16, (out_features, groups, GROUP), generator=generator)
    codes[..., 3], codes[..., 17] = 0, 15
    step = (torch.rand(out_features, groups, 1, generator=generator) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(out_features, groups, 1, generator=generator) * 0.2).half().float()
    return (codes * step + low).reshape(out_features, in_features)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_4_bit_groups_are_held_as_they_are() -> None:
    matrix = q4_1_matrix(48, 96)
    form = WeightOnlyProjection.build(matrix)
    assert form.bits == 4
    assert form.num_bytes < matrix.numel()  # codes in half a byte, plus the scales
    x = torch.randn(3, 96)
    # Only the bfloat16 rounding of the activations, scales and zeros is left.
    reference = x.to(torch.bfloat16).float() @ matrix.t()
    assert relative_error(form(x), reference) < 5e-3


def test_any_other_matrix_gets_8_bits_per_channel() -> None:
    torch.manual_seed(0)
    matrix = torch.randn(32, 64)
    matrix[5] *= 100  # a channel of its own scale
    form = WeightOnlyProjection.build(matrix)
    assert form.bits == 8 and form.codes.dtype == torch.int8
    x = torch.randn(2, 64)
    assert relative_error(form(x), x @ matrix.t()) < 2e-2
    # A 4-bit matrix changed by less than a step is no longer 4-bit groups.
    nudged = q4_1_matrix(16, 32)
    nudged[0, 0] += 1e-3 * 0.5
    assert WeightOnlyProjection.build(nudged).bits == 8


def test_a_mixed_plan_holds_both_forms_and_runs_each_class_on_its_own() -> None:
    matrix = q4_1_matrix(64, 64)
    plan = KernelPlan(decode="woq", small="woq", large="blas", prefill="blas")
    projection = Projection.build(matrix, device=CPU, dtype=torch.float32, kernels=plan)
    assert projection.woq is not None and projection.plain is not None
    for rows in (1, 8, 9, 200):
        x = torch.randn(rows, 64)
        got, exact = projection(x), x @ matrix.t()
        if plan.for_rows(rows) == "blas":
            torch.testing.assert_close(got, exact)
        else:
            assert not torch.equal(got, exact) and relative_error(got, exact) < 1e-2
        torch.testing.assert_close(projection.add_to(torch.ones(rows, 64), x), got + 1)
    assert projection.num_bytes == matrix.numel() * 4 + projection.woq.num_bytes
    # A batch-1 step reads the 4-bit form only; a prefill the float32 one.
    assert projection.bytes_read(rows=1) == projection.woq.num_bytes
    assert projection.bytes_read(rows=200) == matrix.numel() * 4
    only_woq = projection.run_by(WOQ).trimmed()
    assert only_woq.plain is None and only_woq.num_bytes == projection.woq.num_bytes
    # The dequantized matrix comes back from the 4-bit form (bfloat16-rounded).
    assert relative_error(only_woq.matrix(), matrix) < 5e-3
    with pytest.raises(ValueError, match="cannot move"):
        only_woq.to(torch.device("meta"))


@pytest.mark.parametrize(("out_features", "in_features"), [(24, 64), (32, 48)])
def test_a_shape_the_kernel_cannot_pack_is_refused_by_name(
    out_features: int, in_features: int
) -> None:
    with pytest.raises(ValueError, match=f"kernel 'woq' needs .* {in_features} -> {out_features}"):
        Projection.build(
            torch.randn(out_features, in_features), device=CPU, dtype=torch.float32, kernels=WOQ
        )
