"""LoRA adapters in the form the forward pass adds them, and where they are kept.

The model runs four fused products per layer (`qkv`, `o`, `gate_up`, `down`,
`model/weights.py`), so an adapter is laid out the same way: per layer and fused
product, `a` `[in, R]` (the targets' `lora_A` side by side), so `x @ a` is one product
for however many of the product's targets the adapter has, and per target its `b`
block, `scale * lora_B^T` `[rank, width]`, added into the target's own output columns.
The blocks are kept apart, not as one block-diagonal `[R, out]` matrix: its zero
blocks (q's rows never reach k's or v's columns) were a third of an adapter's bytes
and multiply-adds on SmolLM2, and a decode step took as long either way (more calls,
fewer bytes: bench/lora.py, README), so the smaller form is kept. A product the
adapter does not target has no `a` and costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from wavecore.engine.lora.peft_files import PeftAdapter
from wavecore.engine.lora.request import LoRARequest

if TYPE_CHECKING:  # the model package imports this one (through its executor)
    from wavecore.engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TargetSpan:
    """Where one target sits in a fused product's delta: its rank's columns
    `[start, stop)` of `x @ a` and its output columns `[out_start, out_stop)`."""

    start: int
    stop: int
    out_start: int
    out_stop: int


@dataclass(frozen=True, slots=True)
class FusedDelta:
    """One fused product's delta for rows `x`: `h = x @ a`, then for each target
    `out[:, span.out_start:span.out_stop] += h[:, span.start:span.stop] @ b`."""

    a: torch.Tensor  # [in, R]
    blocks: tuple[tuple[TargetSpan, torch.Tensor], ...]  # b: [rank, width], scale folded in

    def to(self, device: torch.device, dtype: torch.dtype) -> FusedDelta:
        blocks = tuple((span, b.to(device, dtype)) for span, b in self.blocks)
        return FusedDelta(self.a.to(device, dtype), blocks)


@dataclass(frozen=True, slots=True)
class AdapterLayer:
    qkv: FusedDelta | None
    o: FusedDelta | None
    gate_up: FusedDelta | None
    down: FusedDelta | None

    def to(self, device: torch.device, dtype: torch.dtype) -> AdapterLayer:
        def move(delta: FusedDelta | None) -> FusedDelta | None:
            return None if delta is None else delta.to(device, dtype)

        return AdapterLayer(move(self.qkv), move(self.o), move(self.gate_up), move(self.down))


@dataclass(frozen=True, slots=True)
class Adapter:
    request: LoRARequest
    rank: int
    layers: tuple[AdapterLayer, ...]

    def to(self, device: torch.device, dtype: torch.dtype) -> Adapter:
        return Adapter(self.request, self.rank, tuple(lay.to(device, dtype) for lay in self.layers))

    @property
    def num_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for delta in (layer.qkv, layer.o, layer.gate_up, layer.down)
            if delta is not None
            for t in (delta.a, *(b for _, b in delta.blocks))
        )


PRODUCTS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True, slots=True)
class StackedDelta:
    """Several adapters' `FusedDelta`s of one product as one, laid out target by
    target: `a` holds every adapter's columns of the first target, then of the next,
    and `blocks` pairs each target's columns of `x @ a` (`TargetSpan`) with its `b`
    blocks stacked over the adapters, `[sum of their ranks, target's outputs]`: one
    product per target whatever the number of adapters, and no zero blocks (in a mixed
    decode of SmolLM2 with four rank-16 adapters on every projection, a block-diagonal
    `b` would take 4 x 163k multiply-adds per token and layer, these 4 x 83k).
    `columns` is the index of the adapter each of the `R` columns of `x @ a` belongs
    to."""

    a: torch.Tensor  # [in, sum of R]
    columns: torch.Tensor  # [sum of R] int64
    blocks: tuple[tuple[TargetSpan, torch.Tensor], ...]


def _stacked_delta(
    parts: Sequence[tuple[int, FusedDelta]], layouts: dict[tuple, torch.Tensor]
) -> StackedDelta:
    """`parts` (adapter number, delta) of one product stacked target by target; equal
    column layouts share one `columns` tensor through `layouts`."""
    by_target: dict[tuple[int, int], list[tuple[int, torch.Tensor, TargetSpan, torch.Tensor]]]
    by_target = {}
    for number, delta in parts:
        for span, b in delta.blocks:
            by_target.setdefault((span.out_start, span.out_stop), []).append(
                (number, delta.a, span, b)
            )
    a_parts, layout, blocks = [], [], []
    width = 0
    for (out_start, out_stop), pieces in sorted(by_target.items()):
        start = width
        for number, a, span, _ in pieces:
            a_parts.append(a[:, span.start : span.stop])
            layout.append((number, span.stop - span.start))
            width += span.stop - span.start
        b = torch.cat([b for _, _, _, b in pieces])
        blocks.append((TargetSpan(start, width, out_start, out_stop), b))
    key = tuple(layout)
    columns = layouts.get(key)
    if columns is None:
        owners = [torch.full((count,), number) for number, count in layout]
        columns = layouts[key] = torch.cat(owners).to(parts[0][1].a.device)
    return StackedDelta(torch.cat(a_parts, dim=1), columns, tuple(blocks))


class StackedAdapters:
    """Adapters stacked per layer and product (`StackedDelta`, None where none of them
    targets it), for decodes that mix them (`compute.MixedDecodes`)."""

    def __init__(self, adapters: Sequence[Adapter]) -> None:
        self.names = tuple(adapter.request.name for adapter in adapters)
        # One column-owner tensor per layout, shared by the layers that have it (the
        # forward builds one mask per tensor per step).
        layouts: dict[tuple, torch.Tensor] = {}
        layers = []
        for index in range(len(adapters[0].layers)):
            stacked: dict[str, StackedDelta | None] = {}
            for product in PRODUCTS:
                parts = [
                    (number, delta)
                    for number, adapter in enumerate(adapters)
                    if (delta := getattr(adapter.layers[index], product)) is not None
                ]
                stacked[product] = _stacked_delta(parts, layouts) if parts else None
            layers.append(stacked)
        self.layers = tuple(layers)


def fused_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each fused product's targets with the first output column each one fills."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "qkv": (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)),
        "o": (("o_proj", 0),),
        "gate_up": (("gate_proj", 0), ("up_proj", inter)),
        "down": (("down_proj", 0),),
    }


def build_adapter(request: LoRARequest, peft: PeftAdapter, config: ModelConfig) -> Adapter:
    """The fused float32 host form of `peft` (`FusedDelta`)."""
    layers = []
    for index in range(config.num_layers):
        fused: dict[str, FusedDelta | None] = {}
        for product, parts in fused_parts(config).items():
            present = [
                (t, col, peft.modules[(index, t)]) for t, col in parts if (index, t) in peft.modules
            ]
            if not present:
                fused[product] = None
                continue
            a = torch.cat([mod.a for _, _, mod in present]).t().contiguous()
            blocks = []
            row = 0
            for _, column, mod in present:
                rank, width = mod.b.shape[1], mod.b.shape[0]
                span = TargetSpan(row, row + rank, column, column + width)
                blocks.append((span, (mod.scale * mod.b.t()).contiguous()))
                row += rank
            fused[product] = FusedDelta(a, tuple(blocks))
        layers.append(AdapterLayer(**fused))
    return Adapter(request, peft.rank, tuple(layers))
