"""What the checks read of a world: a narrow, read-only view, so that ``invariants``
and ``reduction`` depend on it and not on ``world`` (which uses them)."""

from __future__ import annotations

from typing import Protocol

from ..coordinator import CoordinatorMachine
from ..rank_loop import RankLoop
from ..scaling import ScalingMachine
from .client import ClientState
from .network import Network
from .toy import ToyRank


class WorldConfigView(Protocol):
    @property
    def sync_interval(self) -> int: ...


class WorldView(Protocol):
    @property
    def config(self) -> WorldConfigView: ...

    @property
    def loops(self) -> list[RankLoop]: ...

    @property
    def toys(self) -> list[ToyRank]: ...

    @property
    def coordinator(self) -> CoordinatorMachine: ...

    @property
    def client(self) -> ClientState: ...

    @property
    def scaler(self) -> ScalingMachine: ...

    @property
    def group_size(self) -> int: ...

    @property
    def group(self) -> range: ...

    @property
    def network(self) -> Network: ...

    @property
    def deaths_left(self) -> int: ...

    @property
    def broken_calls(self) -> int | None: ...

    @property
    def dead(self) -> frozenset[int]: ...

    @property
    def shrinking(self) -> bool: ...

    @property
    def aborted_switch(self) -> int | None: ...

    @property
    def halted(self) -> str | None: ...

    def scale_moves(self) -> list[tuple[object, ...]]: ...
