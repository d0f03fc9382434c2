"""Adding a step's LoRA deltas beside the base products, grouped per adapter.

A step's tokens are grouped by adapter (`LoRARows`): when each adapter's rows are one
contiguous run (prefill chunks, or a step that serves one adapter) they are taken as
slices; when they are scattered among the decodes (which the batch plan orders by
context length, for attention), the step's adapter rows are gathered once per product
in adapter order (`index_select`), each adapter's run computed, and the deltas added
back in one `index_add_`. Each adapter costs two small products per targeted fused
product, in the activations' dtype, added to the base product's output whatever kernel
computed it. (One gather per adapter instead cost about a third of a 4-adapter
decode step's LoRA time on SmolLM2: index ops, not products.)
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
class LoRARows:
    """A step's rows per adapter: `groups` are `(adapter, start, end)` runs of the rows
    of `x`, or, with `order`, of `x.index_select(0, order)` (the rows sorted by
    adapter, so that each adapter's rows are one run however the batch orders them)."""

    groups: tuple[tuple[Adapter, int, int], ...]
    order: torch.Tensor | None = None


def add_lora(out: torch.Tensor, x: torch.Tensor, lora: LoRARows, layer: int, product: str) -> None:
    """`out[rows] += (x[rows] @ a) @ b` for each adapter's `product` delta at `layer`."""
    present = []
    for adapter, start, end in lora.groups:
        delta: FusedDelta | None = getattr(adapter.layers[layer], product)
        if delta is not None:
            present.append((delta, start, end))
    if not present:
        return
    order = lora.order
    if order is None:
        for delta, start, end in present:
            out[start:end].addmm_(x[start:end] @ delta.a, delta.b)
        return
    # One gather and one scatter for every adapter of the step: rows of adapters that
    # do not target this product stay zero.
    # (`gate`, a column slice of gate_up, is strided: index_select on it took 40x the
    # time of a copy and a gather on a 2-core Xeon.)
    taken = x.contiguous().index_select(0, order)
    shape = (order.shape[0], out.shape[1])
    every = len(present) == len(lora.groups)
    deltas = x.new_empty(shape) if every else x.new_zeros(shape)
    for delta, start, end in present:
        torch.mm(taken[start:end] @ delta.a, delta.b, out=deltas[start:end])
    out.index_add_(0, order, deltas)
