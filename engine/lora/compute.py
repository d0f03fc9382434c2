"""Adding a step's LoRA deltas beside the base products, grouped per adapter.

A step's tokens are grouped by adapter (`LoRAGroup`): the rows of one adapter are a
contiguous run (one prefill chunk, or every row of a step that serves one adapter),
taken as a slice, or scattered among the decodes (which the batch plan orders by
context length for attention), gathered with `index_select` and added back with
`index_add_`. Each group costs two small products per targeted fused product, in the
activations' dtype, added to the base product's output whatever kernel computed it.
bench/lora.py measured this against a gather-based batched product (each token's own
`a` and `b` gathered, one `bmm` for all tokens): grouping won at every batch size on
the CPU it names (the gather copies `in x R` values per token), so grouping is what
runs. Rows of the base model belong to no group and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wavecore.engine.lora.adapters import Adapter, FusedDelta


@dataclass(frozen=True, slots=True)
class LoRAGroup:
    """The rows of one adapter in a step: `[start, end)`, or `rows` when scattered."""

    adapter: Adapter
    start: int
    end: int
    rows: torch.Tensor | None = None


def add_lora(
    out: torch.Tensor, x: torch.Tensor, groups: tuple[LoRAGroup, ...], layer: int, product: str
) -> None:
    """`out[rows] += (x[rows] @ a) @ b` for each group's adapter's `product` delta."""
    for group in groups:
        delta: FusedDelta | None = getattr(group.adapter.layers[layer], product)
        if delta is None:
            continue
        if group.rows is None:
            rows = slice(group.start, group.end)
            out[rows].addmm_(x[rows] @ delta.a, delta.b)
        else:
            taken = x.index_select(0, group.rows)
            out.index_add_(0, group.rows, (taken @ delta.a) @ delta.b)
