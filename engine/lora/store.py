"""`LoRAStore`: the adapters an executor holds, and which of them are resident.

`LoRAStore` keeps every adapter added in host memory and at most `max_loras` of them
on the device ("resident": on a CPU both are the same tensors), swapping them in least
recently used first and never evicting a pinned one; a step's adapters are made
resident before its forward (`activate`). With the C kernel (`native.py`) a resident
adapter also has its kernel form, `NativeAdapter` (the same tensors for float32
weights, a bfloat16 copy beside a base that rounds to it), and a step's rows go
through the kernel (`native_rows`); without it, decodes that mix adapters run them
stacked (`StackedAdapters`, a copy kept for the last two sets while they stay
resident). A sleep (either level) drops the device copies and keeps the host copies, so
adapters come back on the first step that needs them after a wake-up (upstream drops
them at level 2; wavecore keeps them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from wavecore.engine.errors import LoRAError, UnknownLoRAError
from wavecore.engine.lora.adapters import Adapter, StackedAdapters, build_adapter
from wavecore.engine.lora.native import NativeAdapter, NativeKernel, NativeRows
from wavecore.engine.lora.peft_files import read_peft_adapter
from wavecore.engine.lora.request import LoRARequest

if TYPE_CHECKING:  # the model package imports this one (through its executor)
    from wavecore.engine.model.config import ModelConfig

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
        native: NativeKernel | None = None,
    ) -> None:
        self._config = config
        self.native = native
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._device = device
        self._dtype = dtype
        self._host: dict[str, Adapter] = {}
        self._resident: OrderedDict[str, Adapter] = OrderedDict()  # least recent first
        # Stacked copies of resident adapters that decodes mixed lately (most recent last).
        self._stacked: OrderedDict[tuple[str, ...], StackedAdapters] = OrderedDict()
        self._pinned: set[str] = set()
        self._native: dict[str, NativeAdapter] = {}  # the resident ones' kernel forms
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
                if self.native is not None:
                    self._native[name] = self.native.adapter(adapter)
                self._resident[name] = adapter
                self.swaps += 1
            else:
                self._resident.move_to_end(name)
            active[name] = adapter
        return active

    def native_rows(self, names: tuple[str, ...], owner: torch.Tensor) -> NativeRows:
        """The kernel's view of a step whose resident adapters are `names` and whose
        rows belong to `owner` (indices into `names`, -1 for the base model)."""
        if self.native is None:
            raise RuntimeError("this store has no LoRA kernel")
        return self.native.rows([self._native[name] for name in names], owner)

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
        self._native.pop(name, None)
        for names in [names for names in self._stacked if name in names]:
            del self._stacked[names]

    def evict_all(self) -> None:
        """Drop every device copy (a sleep); the host copies stay."""
        self._resident.clear()
        self._native.clear()
        self._stacked.clear()

    def _known(self, name: str) -> None:
        if name not in self._host:
            held = ", ".join(self.names()) or "none"
            raise UnknownLoRAError(f"no LoRA adapter {name!r} is loaded (loaded: {held})")
