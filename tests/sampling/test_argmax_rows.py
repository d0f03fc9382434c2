"""`argmax_rows` (numpy on the CPU) picks exactly what torch's argmax picks."""

from __future__ import annotations

import math

import torch

from wavecore.engine.sampling.sampler import argmax_rows


def test_it_agrees_with_torch_on_ties_nan_infinities_and_strides() -> None:
    inf, nan = math.inf, math.nan
    values = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # a tie: the first index
            [-inf, -inf, -inf, -inf],  # nothing but -inf: index 0
            [0.0, nan, 5.0, nan],  # NaN counts as largest: the first NaN
            [inf, 1.0, inf, 0.0],
            [-2.0, -1.0, -3.0, -1.5],
        ]
    )
    expected = values.argmax(dim=1)
    got = argmax_rows(values)
    assert got.dtype == torch.int64
    assert got.tolist() == expected.tolist() == [1, 0, 1, 0, 1]
    # A strided view, and random rows of a real vocabulary's width.
    wide = torch.randn(16, 49_152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(wide[::3]), wide[::3].argmax(dim=1))
    assert torch.equal(argmax_rows(wide.t()[:100].t()), wide[:, :100].argmax(dim=1))
    assert argmax_rows(torch.empty(0, 8)).tolist() == []


def test_other_dtypes_go_to_torch() -> None:
    values = torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.bfloat16)
    assert argmax_rows(values).tolist() == [1]
