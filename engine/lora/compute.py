"""Adding a step's LoRA deltas beside the base products, grouped per adapter.

A step's tokens are grouped by adapter (`LoRARows`): each contiguous run of one
adapter's rows (a prefill chunk, or decodes all of one adapter) is a slice, its delta
one product `x @ a` per targeted fused product and one `b` product per target, added
in place into the target's columns of the base product's output. Decodes that mix
adapters (scattered among the rows, which the batch plan orders by context length, for
attention) are taken against the step's adapters stacked (`MixedDecodes`): one product
with every adapter's `a`, a mask keeping each row's own adapter's columns, then one
product per target with the adapters' `b` rows of that target stacked (no zero blocks:
`adapters.StackedDelta`), whatever the number of adapters. Everything runs in the
activations' dtype and is added to the base product's output whatever kernel computed
it. bench/lora.py measured these against a gather in adapter order and a gather-based
batched product (each token's own `a` and `b` gathered, one `bmm` for all tokens),
and the README says what won where. Rows of the base model belong to no group and cost
nothing.

Where the C kernel is built (`native.py`: float32 rows on a CPU with a C compiler),
every adapter row of a step goes through it instead, one call per product whatever
the runs and mixes (`LoRARows.native`); these paths remain for the GPU, other dtypes,
and machines without a compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wavecore.engine.lora.adapters import Adapter, FusedDelta, StackedAdapters, TargetSpan
from wavecore.engine.lora.native import NativeRows


class MixedDecodes:
    """The decode rows `[0, len(owner))` when they mix adapters: `owner[row]` is the
    index of the row's adapter in `stacked` (-1: the base model). Each row's delta is
    taken against every adapter at once and masked to its own adapter's columns."""

    def __init__(self, stacked: StackedAdapters, owner: torch.Tensor) -> None:
        self.stacked = stacked
        self.owner = owner
        self.rows = int(owner.shape[0])
        self._masks: dict[int, torch.Tensor] = {}  # by column layout (its tensor's id)

    def mask(self, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[rows, R]`: 1 where column `c` is the row's own adapter's."""
        mask = self._masks.get(id(columns))
        if mask is None:
            mask = (self.owner[:, None] == columns[None, :]).to(dtype)
            self._masks[id(columns)] = mask
        return mask


@dataclass(frozen=True, slots=True)
class LoRARows:
    """A step's rows per adapter: contiguous `runs` `(adapter, start, end)`, and the
    decodes when they mix adapters (`mixed`); or every row through the C kernel
    (`native`, which then holds them all)."""

    runs: tuple[tuple[Adapter, int, int], ...]
    mixed: MixedDecodes | None = None
    native: NativeRows | None = None


def add_lora(out: torch.Tensor, x: torch.Tensor, lora: LoRARows, layer: int, product: str) -> None:
    """`out[rows] += (x[rows] @ a) @ b` for each adapter's `product` delta at `layer`."""
    if lora.native is not None:
        lora.native.add(out, x, layer, product)
        return
    for adapter, start, end in lora.runs:
        delta: FusedDelta | None = getattr(adapter.layers[layer], product)
        if delta is not None:
            _add_blocks(out[start:end], x[start:end] @ delta.a, delta.blocks)
    mixed = lora.mixed
    if mixed is None:
        return
    stacked = mixed.stacked.layers[layer][product]
    if stacked is not None:
        rows = mixed.rows
        h = x[:rows] @ stacked.a
        h.mul_(mixed.mask(stacked.columns, h.dtype))
        _add_blocks(out[:rows], h, stacked.blocks)


def _add_blocks(
    out: torch.Tensor, h: torch.Tensor, blocks: tuple[tuple[TargetSpan, torch.Tensor], ...]
) -> None:
    """Each target's `h` columns times its `b`, added into its own output columns."""
    for span, b in blocks:
        out[:, span.out_start : span.out_stop].addmm_(h[:, span.start : span.stop], b)
