"""Elastic scaling: the client's script for changing the number of DP ranks.

Theory of operation:

1. One ``ScalingMachine`` lives in the client; its actions are the whole script, and
   the engine's scaler and the simulated client perform them and nothing else. Ranks
   keep their numbers: a scale up appends ranks ``old..new-1``, a scale down removes
   the highest ones. The ranks' own side of a switch is ``RankMachine`` rule 11.
2. Scale up: ``ScaleRequested`` -> STARTING with ``StartRanks`` (the new ranks start
   joining: paused KEEP, ``ignore_start_wave``, their scheduler frozen; the others keep
   serving meanwhile). ``RanksReady`` -> PAUSING with ``PauseRanks`` (every old rank,
   KEEP: requests stay frozen, none is lost).
3. Scale down: ``ScaleRequested`` -> DRAINING with ``RouteTo`` (new requests reach only
   the staying ranks) and ``DrainRanks`` (the leaving ranks finish what they hold; at
   the caller's bound what is left is aborted, so its callers see "abort": never a
   silent loss). ``Drained`` -> PAUSING with ``PauseRanks`` (every old rank, KEEP: the
   leaving ones too, since a lockstep pause is a consensus of the whole old group).
4. ``RanksPaused`` -> SWITCHING with, for a scale down, ``StopRanks`` (the leaving
   ranks, now empty, exit), then ``SwitchGroup`` (every rank of the new group joins it
   and adopts the group's max of running, wave and step counter).
5. ``SwitchDone`` -> RESIZING with ``ResizeCoordinator``; ``CoordinatorResized`` (the
   coordinator published the new size, so no message from a new rank can reach it
   first) -> RESUMING with ``ResizeTables`` and ``ResumeRanks``; ``Resumed`` -> IDLE with
   ``ReconfigureFinished``.
6. Why drain, and why the group is built at the commit: draining keeps every accepted
   request's output (aborting would throw work away that the leaving rank can finish
   in moments); gloo's rendezvous needs every member, and new ranks are members only
   once they are ready, so a group prepared in the background would wait for them all
   the same; the commit costs one rendezvous while paused.
7. One reconfiguration at a time: ``ScaleRequested`` while one is active raises
   ``ReconfigurationActiveError``.
8. ``ScaleAborted`` before the switch rolls back (STARTING: ``StopRanks`` of the new
   ranks; DRAINING: ``RouteTo`` the old size; PAUSING: both as they apply, then
   ``ResumeRanks``, which a rank whose pause is still pending takes once the pause
   completes, ``rank_loop`` rule 7) and returns to IDLE with the engine at its old size. A scale up
   aborted while SWITCHING rolls back like PAUSING: a rank whose new group does not
   form stays in its old group (and says so in its answer), and every old rank is
   still there to resume it. A scale down's leaving ranks are gone once SWITCHING, and
   RESIZING and RESUMING come after a switch that succeeded: nothing can be rolled
   back there, ``ScaleAbandoned`` says so, and IDLE takes a new attempt.
9. Rank loss (``on_rank_failure="shrink"``): ``RanksLost`` (ranks of the group died or
   are stuck) -> LEAVING with ``DropRanks`` (their requests end, or go to a survivor
   when they produced nothing yet; their processes are killed; the survivors are
   renumbered ``0..n-1`` in their old order, everywhere the client keeps ranks) and
   ``LeaveGroup`` (every survivor leaves the broken group: ``RankMachine`` rule 13,
   paused KEEP without a vote, since a lockstep pause needs the whole group).
   ``GroupLeft`` -> SWITCHING with ``SwitchGroup``, and on as a scale down from there
   (rule 5): the survivors build their new group through the same switch. Nothing can
   be rolled back (the lost ranks are gone), so an abort of it is ``ScaleAbandoned``.
   From IDLE the group is the whole engine (``old_dp_size`` ranks).
10. Rank loss during a reconfiguration (a scale, or a shrink: a second loss): every
    active phase takes ``RanksLost`` of its *members*, the ranks that hold the engine's
    requests there (``members``: the old ranks until a scale up's switch succeeded or
    a scale down's leaving ranks stopped, the new group from then on; a shrink's
    renumbered survivors); the event's ``old_dp_size`` must equal it. What the
    reconfiguration changed is undone first, valid whichever of the phase's actions
    were performed when the loss cut in (its client drops them): a scale up before its
    switch succeeded stops its new ranks (``StopRanks``: they never served), a scale
    down before its leaving ranks stopped routes to every old rank again (``RouteTo``),
    and after a scale up's switch the tables grow to the new group first
    (``ResizeTables``: its new ranks are members). Then rule 9 from LEAVING:
    ``DropRanks`` and ``LeaveGroup`` of the members, and on as a shrink to the largest
    group still healthy; the scale itself failed. A loss of every member is refused
    by the event (nothing could serve).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .errors import ReconfigurationActiveError
from .table import TableMachine, Transition


class ScalePhase(Enum):
    IDLE = "idle"
    STARTING = "starting"
    DRAINING = "draining"
    PAUSING = "pausing"
    LEAVING = "leaving"
    SWITCHING = "switching"
    RESIZING = "resizing"
    RESUMING = "resuming"


# -- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRequested:
    old_dp_size: int
    dp_size: int

    def __post_init__(self) -> None:
        for name in ("old_dp_size", "dp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaleRequested.{name} must be >= 1, got {getattr(self, name)}")
        if self.old_dp_size == self.dp_size:
            raise ValueError(f"ScaleRequested: already {self.dp_size} ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksReady:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksPaused:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchDone:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorResized:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RanksLost:
    """Rule 9: these ranks of the group of ``old_dp_size`` died or are stuck."""

    old_dp_size: int
    lost: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lost or not set(self.lost) <= set(range(self.old_dp_size)):
            raise ValueError(
                f"RanksLost.lost must name ranks of the group of {self.old_dp_size}, "
                f"got {self.lost}"
            )
        if len(set(self.lost)) == self.old_dp_size:
            raise ValueError(f"RanksLost: every rank of {self.old_dp_size} is lost")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLeft:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleAborted:
    reason: str


# -- actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRanks:
    ranks: tuple[int, ...]
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteTo:
    """New requests go to ranks ``[0, dp_size)`` only."""

    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainRanks:
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseRanks:
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DropRanks:
    """Rule 9: the lost ranks leave every table and their processes are killed; the
    ``survivors`` (old numbers, in order) become ranks ``0..len(survivors)-1``."""

    ranks: tuple[int, ...]
    survivors: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveGroup:
    """Rule 9: these ranks (new numbers) leave the broken group, paused KEEP."""

    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRanks:
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchGroup:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResizeCoordinator:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResizeTables:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRanks:
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconfigureFinished:
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRolledBack:
    reason: str
    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleAbandoned:
    reason: str


# -- machine ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalingSnapshot:
    phase: ScalePhase
    old_dp_size: int | None = None
    dp_size: int | None = None


_IDLE, _STARTING, _DRAINING, _PAUSING, _LEAVING, _SWITCHING, _RESIZING, _RESUMING = ScalePhase
ACTIVE_PHASES = (_STARTING, _DRAINING, _PAUSING, _LEAVING, _SWITCHING, _RESIZING, _RESUMING)
Result = tuple[ScalingSnapshot, tuple[object, ...]]


def _rows() -> dict[tuple[ScalePhase, type], Transition]:
    def row(handler: str, *targets: ScalePhase) -> Transition:
        return Transition(handler=handler, targets=targets)

    rows: dict[tuple[ScalePhase, type], Transition] = {
        (_IDLE, ScaleRequested): row("on_requested", _STARTING, _DRAINING),
        (_IDLE, RanksLost): row("on_lost", _LEAVING),
        (_LEAVING, GroupLeft): row("on_left", _SWITCHING),
        (_STARTING, RanksReady): row("on_ready", _PAUSING),
        (_DRAINING, Drained): row("on_drained", _PAUSING),
        (_PAUSING, RanksPaused): row("on_paused", _SWITCHING),
        (_SWITCHING, SwitchDone): row("on_switched", _RESIZING),
        (_RESIZING, CoordinatorResized): row("on_resized", _RESUMING),
        (_RESUMING, Resumed): row("on_resumed", _IDLE),
    }
    for phase in ACTIVE_PHASES:
        rows[phase, ScaleRequested] = row("on_second_request", phase)
        rows[phase, ScaleAborted] = row("on_aborted", _IDLE)
        # Rule 10: a loss cuts into any reconfiguration.
        rows[phase, RanksLost] = row("on_lost_during", _LEAVING)
    return rows


def _members(state: ScalingSnapshot) -> int | None:
    """Rule 10: the old group until a scale up's switch succeeded (its new ranks only
    join) or a scale down's leaving ranks stopped (they still serve while they
    drain); the new group after that, and a shrink's survivors throughout."""
    if state.phase is _IDLE:
        return None
    old, new = state.old_dp_size or 0, state.dp_size or 0
    before = (_STARTING, _PAUSING, _SWITCHING) if new > old else (_DRAINING, _PAUSING)
    return old if state.phase in before else new


class ScalingMachine(TableMachine[ScalingSnapshot]):
    """The client's side of one reconfiguration at a time; see the module docstring."""

    TRANSITIONS = _rows()

    def __init__(self) -> None:
        self._state = ScalingSnapshot(phase=_IDLE)

    @property
    def phase(self) -> ScalePhase:
        return self._state.phase

    @property
    def active(self) -> bool:
        return self._state.phase in ACTIVE_PHASES

    @property
    def target_dp_size(self) -> int | None:
        return self._state.dp_size

    @property
    def members(self) -> int | None:
        """Rule 10: how many ranks (``0..members-1``) hold the engine's requests now;
        None when idle (the client's own size)."""
        return _members(self._state)

    # -- rules that broken variants in the tests override ------------------------------

    def pause_targets(self, state: ScalingSnapshot) -> tuple[int, ...]:
        """Rules 2 and 3: every rank of the old group pauses (a lockstep pause is a
        consensus of the whole group, the leaving ranks included)."""
        return tuple(range(state.old_dp_size or 0))

    # -- handlers -----------------------------------------------------------------------

    def on_requested(self, state: ScalingSnapshot, event: ScaleRequested) -> Result:
        old, new = event.old_dp_size, event.dp_size
        started = replace(state, old_dp_size=old, dp_size=new)
        if new > old:
            return replace(started, phase=_STARTING), (
                StartRanks(ranks=tuple(range(old, new)), dp_size=new),
            )
        return replace(started, phase=_DRAINING), (
            RouteTo(dp_size=new),
            DrainRanks(ranks=tuple(range(new, old))),
        )

    def on_lost(self, state: ScalingSnapshot, event: RanksLost) -> Result:
        old = event.old_dp_size
        survivors = tuple(rank for rank in range(old) if rank not in event.lost)
        new = len(survivors)
        leaving = ScalingSnapshot(phase=_LEAVING, old_dp_size=old, dp_size=new)
        lost = tuple(sorted(set(event.lost)))
        return leaving, (
            DropRanks(ranks=lost, survivors=survivors),
            LeaveGroup(ranks=tuple(range(new))),
        )

    def on_lost_during(self, state: ScalingSnapshot, event: RanksLost) -> Result:
        """Rule 10: undo what the reconfiguration changed, then shrink (rule 9)."""
        members = _members(state)
        if event.old_dp_size != members:
            raise self.refuse(state, event, f"the group has {members} members here")
        old, new = state.old_dp_size or 0, state.dp_size or 0
        undo: tuple[object, ...] = ()
        if new > old and state.phase in (_STARTING, _PAUSING, _SWITCHING):
            undo = (StopRanks(ranks=tuple(range(old, new))),)
        elif new > old:
            undo = (ResizeTables(dp_size=new),)
        elif state.phase in (_DRAINING, _PAUSING):
            undo = (RouteTo(dp_size=old),)
        leaving, actions = self.on_lost(state, event)
        return leaving, (*undo, *actions)

    def on_left(self, state: ScalingSnapshot, event: GroupLeft) -> Result:
        return replace(state, phase=_SWITCHING), (SwitchGroup(dp_size=state.dp_size or 0),)

    def on_second_request(self, state: ScalingSnapshot, event: ScaleRequested) -> Result:
        raise ReconfigurationActiveError(
            type(self).__name__,
            state.phase.name,
            event,
            f"scaling from {state.old_dp_size} to {state.dp_size} ranks is still in progress",
        )

    def on_ready(self, state: ScalingSnapshot, event: RanksReady) -> Result:
        return replace(state, phase=_PAUSING), (PauseRanks(ranks=self.pause_targets(state)),)

    def on_drained(self, state: ScalingSnapshot, event: Drained) -> Result:
        return replace(state, phase=_PAUSING), (PauseRanks(ranks=self.pause_targets(state)),)

    def on_paused(self, state: ScalingSnapshot, event: RanksPaused) -> Result:
        old, new = state.old_dp_size or 0, state.dp_size or 0
        stop = (StopRanks(ranks=tuple(range(new, old))),) if new < old else ()
        return replace(state, phase=_SWITCHING), (*stop, SwitchGroup(dp_size=new))

    def on_switched(self, state: ScalingSnapshot, event: SwitchDone) -> Result:
        return replace(state, phase=_RESIZING), (ResizeCoordinator(dp_size=state.dp_size or 0),)

    def on_resized(self, state: ScalingSnapshot, event: CoordinatorResized) -> Result:
        new = state.dp_size or 0
        return replace(state, phase=_RESUMING), (
            ResizeTables(dp_size=new),
            ResumeRanks(ranks=tuple(range(new))),
        )

    def on_resumed(self, state: ScalingSnapshot, event: Resumed) -> Result:
        return ScalingSnapshot(phase=_IDLE), (ReconfigureFinished(dp_size=state.dp_size or 0),)

    def on_aborted(self, state: ScalingSnapshot, event: ScaleAborted) -> Result:
        old, new = state.old_dp_size or 0, state.dp_size or 0
        idle = ScalingSnapshot(phase=_IDLE)
        if state.phase in (_LEAVING, _RESIZING, _RESUMING) or (
            state.phase is _SWITCHING and new < old
        ):
            return idle, (ScaleAbandoned(reason=event.reason),)
        rollback: list[object] = []
        if new > old:
            rollback.append(StopRanks(ranks=tuple(range(old, new))))
        else:
            rollback.append(RouteTo(dp_size=old))
        if state.phase in (_PAUSING, _SWITCHING):
            rollback.append(ResumeRanks(ranks=tuple(range(old))))
        return idle, (*rollback, ScaleRolledBack(reason=event.reason, dp_size=old))
