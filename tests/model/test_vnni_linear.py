"""The kernel "woq-vnni" (`vnni_linear.py`, `vnni_product.c`): "woq"'s weights times
activations rounded to int8 per group of 32, through AVX-512 VNNI. Products equal to a
float64 reference with the same rounding, for 1 to more than 8 rows; the width each
matrix gets; a projection that holds it; one op in a compiled graph."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from test_woq_linear import q4_1_matrix, relative_error

from wavecore.engine import native_build
from wavecore.engine.model.kernel_plan import KernelPlan
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.vnni_linear import (
    VNNI_KERNEL,
    VnniProjection,
    can_pack_vnni,
    kernel_report,
)
from wavecore.engine.model.woq_linear import GROUP, per_channel_int8

CPU = torch.device("cpu")
VNNI = KernelPlan.uniform("woq-vnni")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


# Where the CPU has the instructions and a compiler exists, the kernel must build: a
# failed build fails `test_the_kernel_builds_where_the_cpu_has_vnni`, not a skip.
pytestmark = pytest.mark.skipif(
    not {"avx512_vnni", "avx512bw"} <= cpu_flags()
    or shutil.which("cc") is None
    or shutil.which("c++") is None,
    reason="the kernel needs AVX-512 VNNI and C and C++ compilers",
)


def test_the_kernel_builds_where_the_cpu_has_vnni() -> None:
    assert can_pack_vnni(CPU, torch.float32, GROUP, 16), kernel_report()


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernel rounds it: per group of 32, codes round(x * 127 / max |x|)."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    # 127 / largest as the kernel divides (a Python number over a tensor would multiply
    # by the tensor's reciprocal, another rounding, and now and then another code).
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    return (torch.round(groups * inverse) * (largest / 127)).reshape(x.shape).double()


def test_4_bit_products_equal_the_rounded_reference() -> None:
    matrix = q4_1_matrix(48, 96)
    form = VnniProjection.build(matrix)
    assert form.bits == 4
    # Half a byte a weight, and a float16 scale and minimum per group of 32.
    assert form.num_bytes == 48 * 96 // 2 + 48 * (96 // GROUP) * 4
    for rows in (1, 3, 8, 11):  # 11: a second pass over the weights for rows 9-11
        x = torch.randn(rows, 96)
        want = rounded_activations(x) @ matrix.double().t()
        assert relative_error(form(x).double(), want) < 1e-6


def test_8_bit_products_equal_the_rounded_reference() -> None:
    torch.manual_seed(0)
    matrix = torch.randn(32, 64)
    matrix[5] *= 100  # a channel of its own scale
    form = VnniProjection.build(matrix)
    assert form.bits == 8
    codes, scale = per_channel_int8(matrix)
    weights = codes.double() * scale.double()[:, None]
    for rows in (1, 2, 9):
        x = torch.randn(rows, 64)
        want = rounded_activations(x) @ weights.t()
        assert relative_error(form(x).double(), want) < 1e-6
        # What rounding the activations costs against float32.
        assert relative_error(form(x), x @ matrix.t()) < 2e-2


def test_4_bit_groups_whose_scales_float16_would_round_get_8_bits() -> None:
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (16, 2, GROUP), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    step = torch.full((16, 2, 1), 1.1e-3)  # not a float16 value
    matrix = (codes * step - 0.1).reshape(16, 2 * GROUP)
    assert VnniProjection.build(matrix).bits == 8


def test_zero_activations_give_zero_and_zero_rows_an_empty_product() -> None:
    form = VnniProjection.build(q4_1_matrix(16, 64))
    assert torch.equal(form(torch.zeros(2, 64)), torch.zeros(2, 16))
    assert form(torch.zeros(0, 64)).shape == (0, 16)


def test_the_operator_refuses_what_the_kernel_cannot_take() -> None:
    form = VnniProjection.build(q4_1_matrix(16, 64))
    product = torch.ops.wavecore.vnni_product
    with pytest.raises(RuntimeError, match="do not hold 4-bit weights of 96 inputs"):
        product(torch.randn(1, 96), form.packed, 4, 16)
    with pytest.raises(RuntimeError, match="do not hold 8-bit weights"):
        product(torch.randn(1, 64), form.packed, 8, 16)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 CPU tensor"):
        product(torch.randn(1, 64).double(), form.packed, 4, 16)
    # A transposed (non-contiguous) input is read as its values, not its storage.
    x = torch.randn(64, 3).t()
    torch.testing.assert_close(product(x, form.packed, 4, 16), form(x.contiguous()))


def test_a_projection_holds_the_form_its_plan_runs() -> None:
    matrix = q4_1_matrix(64, 64)
    plan = KernelPlan(decode="woq-vnni", small="woq-vnni", large="blas", prefill="blas")
    projection = Projection.build(matrix, device=CPU, dtype=torch.float32, kernels=plan)
    assert projection.vnni is not None and projection.woq is None
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64)
        got, exact = projection(x), x @ matrix.t()
        if plan.for_rows(rows) == "blas":
            torch.testing.assert_close(got, exact)
        else:
            assert relative_error(got, exact) < 2e-2
        torch.testing.assert_close(projection.add_to(torch.ones(rows, 64), x), got + 1)
    assert projection.bytes_read(rows=1) == projection.vnni.num_bytes
    only = projection.run_by(VNNI).trimmed()
    assert only.plain is None and only.num_bytes == projection.vnni.num_bytes
    # Dequantized through the kernel (an identity's rows round exactly).
    assert relative_error(only.matrix(), matrix) < 1e-6


def test_a_shape_the_kernel_cannot_pack_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kernel 'woq-vnni' needs .* 64 -> 24"):
        Projection.build(torch.randn(24, 64), device=CPU, dtype=torch.float32, kernels=VNNI)


def test_the_op_is_one_kernel_in_a_compiled_graph() -> None:
    form = VnniProjection.build(q4_1_matrix(32, 64))
    x = torch.randn(1, 64)
    # No graph break, the operator's shape function serving the trace (inductor's C++
    # wrapper calling it: `test_compiled_decode.py`'s weight-only test, in `make soak`).
    compiled = torch.compile(lambda x: form(x) * 2 + 1, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), form(x) * 2 + 1)
    torch.library.opcheck(torch.ops.wavecore.vnni_product.default, (x, form.packed, 4, 32))


def test_without_a_cxx_compiler_there_is_no_kernel_and_the_reason_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    unbuilt = dataclasses.replace(VNNI_KERNEL, stem="vnni_product_unbuilt")
    try:
        with monkeypatch.context() as patch:
            patch.setenv("CXX", "/nonexistent/c++")
            build = native_build.build(unbuilt)
        assert build.library is None and "no C++ compiler" in build.reason
        # The library this process loaded stays the one: a second copy (here it would be
        # built into the new cache) would register the operator again and abort.
        native_build.build.cache_clear()
        again = native_build.build(VNNI_KERNEL)
        assert again.library is not None and not list(tmp_path.rglob("vnni_product-*"))
    finally:
        native_build.build.cache_clear()
