"""Elastic scaling: one party's phases while the DP group changes size.

Theory of operation:

1. Every party of a reconfiguration runs one ``ScalingMachine``: ranks that stay
   (``EXISTING``), ranks that join (``NEW``, scale up only) and ranks that leave
   (``REMOVING``, scale down only).
2. ``ScaleRequested`` starts it (IDLE -> PREPARING, ``PrepareGroup``): staying ranks
   build the new group in the background while still serving on the old one, new ranks
   load the model (their ``RankMachine`` starts joining: paused, ``ignore_start_wave``),
   leaving ranks are dropped from load balancing.
3. ``GroupPrepared`` -> READY (``ReadyForSwitch``). The client then pauses everyone
   (staying ranks KEEP, leaving ranks ABORT) and commits.
4. ``CommitRequested`` -> SWITCHING: ``SwitchGroup`` (adopt the new group, all-reduce the
   max of running, wave and step counter into ``RankMachine.Reconfigured``), or for a
   leaving rank ``DrainAndShutdown``.
5. ``SwitchDone`` -> IDLE with ``ReconfigureFinished`` (rank 0 reports it; coordinator
   and client resize, then resume), or for a leaving rank -> SHUT_DOWN with
   ``ShutdownComplete``.
6. One reconfiguration at a time: ``ScaleRequested`` while one is active raises
   ``ReconfigurationActiveError``.
7. ``ScaleAborted`` from any active phase discards the new group and returns to IDLE,
   usable and ready for another attempt; a new rank that was never switched in shuts
   down instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .errors import ReconfigurationActiveError
from .table import TableMachine, Transition


class ScaleRole(Enum):
    EXISTING = "existing"
    NEW = "new"
    REMOVING = "removing"


class ScaleDirection(Enum):
    UP = "up"
    DOWN = "down"


class ScalePhase(Enum):
    IDLE = "idle"
    PREPARING = "preparing"
    READY = "ready"
    SWITCHING = "switching"
    SHUT_DOWN = "shut_down"


# -- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRequested:
    direction: ScaleDirection
    dp_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"ScaleRequested.dp_size must be >= 1, got {self.dp_size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPrepared:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRequested:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchDone:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleAborted:
    reason: str


# -- actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareGroup:
    role: ScaleRole
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadyForSwitch:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchGroup:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainAndShutdown:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconfigureFinished:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShutdownComplete:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscardNewGroup:
    reason: str


# -- machine ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingSnapshot:
    phase: ScalePhase
    direction: ScaleDirection | None = None
    dp_size: int | None = None


_IDLE, _PREPARING, _READY, _SWITCHING, _SHUT_DOWN = ScalePhase
_ACTIVE = (_PREPARING, _READY, _SWITCHING)
Result = tuple[ScalingSnapshot, tuple[object, ...]]


def _rows() -> dict[tuple[ScalePhase, type], Transition]:
    rows: dict[tuple[ScalePhase, type], Transition] = {
        (_IDLE, ScaleRequested): Transition(handler="on_requested", targets=(_PREPARING,)),
        (_PREPARING, GroupPrepared): Transition(handler="on_prepared", targets=(_READY,)),
        (_READY, CommitRequested): Transition(handler="on_commit", targets=(_SWITCHING,)),
        (_SWITCHING, SwitchDone): Transition(handler="on_switched", targets=(_IDLE, _SHUT_DOWN)),
    }
    for phase in _ACTIVE:
        rows[phase, ScaleRequested] = Transition(handler="on_second_request", targets=(phase,))
        rows[phase, ScaleAborted] = Transition(handler="on_aborted", targets=(_IDLE, _SHUT_DOWN))
    return rows


_ALLOWED = {
    ScaleRole.EXISTING: (ScaleDirection.UP, ScaleDirection.DOWN),
    ScaleRole.NEW: (ScaleDirection.UP,),
    ScaleRole.REMOVING: (ScaleDirection.DOWN,),
}


class ScalingMachine(TableMachine[ScalingSnapshot]):
    """One party's view of a reconfiguration; see the module docstring."""

    TRANSITIONS = _rows()

    def __init__(self, role: ScaleRole) -> None:
        self.role = role
        self._state = ScalingSnapshot(phase=_IDLE)

    @property
    def phase(self) -> ScalePhase:
        return self._state.phase

    @property
    def active(self) -> bool:
        return self._state.phase in _ACTIVE

    @property
    def direction(self) -> ScaleDirection | None:
        return self._state.direction

    @property
    def target_dp_size(self) -> int | None:
        return self._state.dp_size

    def abort_target(self) -> ScalePhase:
        """Rule 7: an aborted reconfiguration leaves the party usable."""
        return _SHUT_DOWN if self.role is ScaleRole.NEW else _IDLE

    def on_requested(self, state: ScalingSnapshot, event: ScaleRequested) -> Result:
        if event.direction not in _ALLOWED[self.role]:
            raise self.refuse(
                state, event, f"a {self.role.name} party cannot scale {event.direction.name}"
            )
        preparing = replace(
            state, phase=_PREPARING, direction=event.direction, dp_size=event.dp_size
        )
        return preparing, (PrepareGroup(role=self.role, dp_size=event.dp_size),)

    def on_second_request(self, state: ScalingSnapshot, event: ScaleRequested) -> Result:
        raise ReconfigurationActiveError(
            type(self).__name__,
            state.phase.name,
            event,
            f"scaling {state.direction.name if state.direction else '?'} to {state.dp_size} "
            "is still in progress",
        )

    def on_prepared(self, state: ScalingSnapshot, event: GroupPrepared) -> Result:
        return replace(state, phase=_READY), (ReadyForSwitch(),)

    def on_commit(self, state: ScalingSnapshot, event: CommitRequested) -> Result:
        switching = replace(state, phase=_SWITCHING)
        if self.role is ScaleRole.REMOVING:
            return switching, (DrainAndShutdown(),)
        return switching, (SwitchGroup(dp_size=state.dp_size or 0),)

    def on_switched(self, state: ScalingSnapshot, event: SwitchDone) -> Result:
        if self.role is ScaleRole.REMOVING:
            return ScalingSnapshot(phase=_SHUT_DOWN), (ShutdownComplete(),)
        return ScalingSnapshot(phase=_IDLE), (ReconfigureFinished(dp_size=state.dp_size or 0),)

    def on_aborted(self, state: ScalingSnapshot, event: ScaleAborted) -> Result:
        target = self.abort_target()
        actions: tuple[object, ...] = (DiscardNewGroup(reason=event.reason),)
        if target is _SHUT_DOWN:
            actions = (*actions, ShutdownComplete())
        return ScalingSnapshot(phase=target), actions
