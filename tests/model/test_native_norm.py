"""RMS norm through the C kernel (`engine/model/native_norm.py`): torch's values to
rounding for any width and row count, used by the forward pass for eager float32 rows
only, and the operator's own checks."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from wavecore.engine.model import llama, native_norm


@pytest.fixture(autouse=True)
def built() -> None:
    if not native_norm._kernel()[0]:
        if shutil.which("cc") is not None and shutil.which("c++") is not None:
            pytest.fail(f"the norm kernel did not build: {native_norm._kernel()[1]}")
        pytest.skip(native_norm._kernel()[1])


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (3, 70), (2000, 64)])  # 2000: threads
def test_the_kernel_gives_torchs_norm_to_rounding(rows: int, width: int) -> None:
    x, weight = torch.randn(rows, width) * 3, torch.randn(width)
    got = torch.ops.wavecore.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), weight, eps=1e-5))
    # A transposed input is read as its values.
    columns = torch.randn(width, rows).t()
    torch.testing.assert_close(
        torch.ops.wavecore.rms_norm(columns, weight, 1e-5),
        F.rms_norm(columns, (width,), weight, eps=1e-5),
    )


def test_the_forward_pass_uses_it_for_eager_float32_rows_only() -> None:
    x, weight = torch.randn(2, 32), torch.randn(32)
    assert native_norm.usable(x, weight)
    assert not native_norm.usable(x.to(torch.bfloat16), weight.to(torch.bfloat16))
    traced: list[object] = []

    def backend(graph: torch.fx.GraphModule, inputs: object) -> object:
        traced.extend(node.target for node in graph.graph.nodes)
        return graph.forward

    compiled = torch.compile(lambda x: llama.rms_norm(x, weight, 1e-5), backend=backend)
    torch.testing.assert_close(compiled(x), F.rms_norm(x, (32,), weight, eps=1e-5))
    # Traced, the forward pass keeps torch's norm, for inductor to fuse with its neighbours.
    assert traced and torch.ops.wavecore.rms_norm.default not in traced
    assert torch.ops.wavecore.rms_norm not in traced


def test_the_operator_refuses_what_the_kernel_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 CPU tensor"):
        torch.ops.wavecore.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 vector"):
        torch.ops.wavecore.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
