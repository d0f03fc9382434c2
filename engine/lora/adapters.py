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

`LoRAStore` keeps every adapter added in host memory and at most `max_loras` of them
on the device ("resident": on a CPU both are the same tensors), swapping them in least
recently used first and never evicting a pinned one; a step's adapters are made
resident before its forward (`activate`). Decodes that mix adapters run them stacked
(`StackedAdapters`, a copy kept for the last two sets while they stay resident). A sleep (either level) drops the device
copies and keeps the host copies, so adapters come back on the first step that needs
them after a wake-up (upstream drops them at level 2; wavecore keeps them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from wavecore.engine.errors import LoRAError, UnknownLoRAError
from wavecore.engine.lora.peft_files import PeftAdapter, read_peft_adapter
from wavecore.engine.lora.request import LoRARequest
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


def _fused_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
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
        for product, parts in _fused_parts(config).items():
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


# Stacked sets kept (`LoRAStore.stacked`): each is a copy of its adapters.
_STACKED_SETS = 2


class LoRAStore:
    """Every adapter added, in host memory; up to `max_loras` on the device."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self._config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._device = device
        self._dtype = dtype
        self._host: dict[str, Adapter] = {}
        self._resident: OrderedDict[str, Adapter] = OrderedDict()  # least recent first
        # Stacked copies of resident adapters that decodes mixed lately (most recent last).
        self._stacked: OrderedDict[tuple[str, ...], StackedAdapters] = OrderedDict()
        self._pinned: set[str] = set()
        # Adapters copied into a device slot since start (a pinned one stays there).
        self.swaps = 0

    # -- the set -----------------------------------------------------------------------

    def add(self, request: LoRARequest) -> None:
        """Read and check the adapter at `request.path` (slow: the model thread's work).
        Adding a name again with the same path is a no-op; with another path, refused."""
        held = self._host.get(request.name)
        if held is not None:
            if held.request.path == request.path:
                return
            raise LoRAError(
                f"LoRA adapter {request.name!r} is already loaded from {held.request.path}; "
                "remove it before loading another adapter under that name"
            )
        try:
            peft = read_peft_adapter(request.path, self._config, max_rank=self.max_lora_rank)
        except LoRAError as error:
            raise LoRAError(f"adapter {request.name!r}: {error}") from None
        self._host[request.name] = build_adapter(request, peft, self._config)

    def remove(self, name: str) -> None:
        self._known(name)
        del self._host[name]
        self._leave_device(name)
        self._pinned.discard(name)

    def pin(self, name: str) -> None:
        """Keep `name` resident from now on (made resident now)."""
        self._known(name)
        if name in self._pinned:
            return
        if len(self._pinned) >= self.max_loras:
            raise LoRAError(
                f"cannot pin LoRA adapter {name!r}: all max_loras={self.max_loras} slots "
                f"hold pinned adapters ({', '.join(sorted(self._pinned))})"
            )
        self._pinned.add(name)
        self.activate((name,))

    def names(self) -> list[str]:
        return sorted(self._host)

    @property
    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    @property
    def resident(self) -> list[str]:
        """The adapters on the device, least recently used first."""
        return list(self._resident)

    @property
    def num_bytes(self) -> int:
        return sum(adapter.num_bytes for adapter in self._host.values())

    # -- steps -------------------------------------------------------------------------

    def activate(self, names: Collection[str]) -> dict[str, Adapter]:
        """The device forms of `names` (one step's adapters), swapping in what is not
        resident in place of the least recently used unpinned adapters not named."""
        for name in names:
            self._known(name)
        if len(set(names)) > self.max_loras:
            raise LoRAError(
                f"a step needs {len(set(names))} LoRA adapters resident "
                f"({', '.join(sorted(names))}), more than max_loras={self.max_loras}"
            )
        active = {}
        for name in names:
            adapter = self._resident.get(name)
            if adapter is None:
                while len(self._resident) >= self.max_loras:
                    self._leave_device(self._victim(names))
                adapter = self._host[name].to(self._device, self._dtype)
                self._resident[name] = adapter
                self.swaps += 1
            else:
                self._resident.move_to_end(name)
            active[name] = adapter
        return active

    def _victim(self, names: Collection[str]) -> str:
        """The least recently used adapter this step does not need, unpinned if there
        is one. (A pinned one goes only when a pin came while every slot was in use by
        running requests: the scheduler then admits no other adapter until it is back.)"""
        spare = [n for n in self._resident if n not in names]
        return next((n for n in spare if n not in self._pinned), spare[0])

    def stacked(self, names: tuple[str, ...]) -> StackedAdapters:
        """The resident adapters `names` stacked (`StackedAdapters`): built on first use
        and kept while they stay resident (the last two sets), as decodes tend to mix
        the same adapters step after step."""
        stacked = self._stacked.get(names)
        if stacked is None:
            stacked = StackedAdapters([self._resident[name] for name in names])
            self._stacked[names] = stacked
            while len(self._stacked) > _STACKED_SETS:
                self._stacked.popitem(last=False)
        else:
            self._stacked.move_to_end(names)
        return stacked

    def _leave_device(self, name: str) -> None:
        self._resident.pop(name, None)
        for names in [names for names in self._stacked if name in names]:
            del self._stacked[names]

    def evict_all(self) -> None:
        """Drop every device copy (a sleep); the host copies stay."""
        self._resident.clear()
        self._stacked.clear()

    def _known(self, name: str) -> None:
        if name not in self._host:
            held = ", ".join(self.names()) or "none"
            raise UnknownLoRAError(f"no LoRA adapter {name!r} is loaded (loaded: {held})")
