"""The world's reconfigurations: a scale's script performed part by part, an aborted
scale rolled back, and rank deaths shrunk around (``world``'s rules 4, 5 and 7)."""

from __future__ import annotations

from dataclasses import replace

from ..rank_events import GroupLost, PauseMode, PauseRequested, ResumeRequested, SwitchRequested
from ..rank_loop import Collective
from ..scaling import (
    CoordinatorResized,
    Drained,
    DrainRanks,
    DropRanks,
    GroupLeft,
    LeaveGroup,
    PauseRanks,
    RanksLost,
    RanksPaused,
    RanksReady,
    ReconfigureFinished,
    ResizeCoordinator,
    ResizeTables,
    Resumed,
    ResumeRanks,
    RouteTo,
    ScaleAborted,
    ScaleRolledBack,
    StartRanks,
    StopRanks,
    SwitchDone,
    SwitchGroup,
)
from .client import ClientRefused
from .invariants import Violation
from .network import CLIENT, COORDINATOR, Move


class ScalingMoves:
    """``World``'s moves and handlers for scales, aborted scales and rank deaths; a part of ``World``, whose
    fields are the state these methods read and change."""

    __slots__ = ()

    # -- scaling ------------------------------------------------------------------------------

    def scale_moves(self) -> list[Move]:
        """The client's moves that take a scale on: its next part, or a drain timeout."""
        phase = self.scaler.phase.name
        client = self.client
        moves: list[Move] = []
        target = self.scaler.target_dp_size or 0
        if phase == "DRAINING":
            leaving = range(target, client.group)
            if not client.unfinished_on(leaving):
                moves.append(("scale_next",))
            elif not client.drain_timed_out:
                moves.append(("drain_timeout",))
        elif (phase in ("PAUSING", "LEAVING", "SWITCHING") and not client.awaiting) or (
            phase == "RESIZING" and client.published_size == target
        ):
            moves.append(("scale_next",))
        return moves

    def abort_moves(self) -> list[Move]:
        """The client's abort of the running scale (rule 7), where the scaling machine
        rolls it back: a scale down while it drains or pauses, a scale up while it
        pauses or switches before its new group formed. Where it cannot (a scale down's
        leaving ranks stopped, a switch that succeeded, a shrink) the engine is left
        unusable by design (``ScaleAbandoned``), which is not modelled."""
        if not self.config.abort_scales or self.shrinking:
            return []
        old, new = self.client.group, self.scaler.target_dp_size or 0
        phase = self.scaler.phase.name
        if phase in ("DRAINING", "PAUSING") or (
            phase == "SWITCHING" and new > old and self.group_size == old
        ):
            return [("scale_abort",)]
        return []

    def _abort_scale(self) -> None:
        if ("scale_abort",) not in self.abort_moves():
            raise ClientRefused(f"scale_abort: not possible in {self.scaler.phase.name}")
        self._note(f"client aborts the scale in {self.scaler.phase.name}")
        if self.scaler.phase.name == "SWITCHING":
            self.aborted_switch = self.client.awaited_call
        # The call it waited for is abandoned; the ranks' answers come in unawaited.
        self._abandon_awaited_call(drain_timed_out=False)
        self._scale_actions(self._handle(self.scaler, ScaleAborted(reason="aborted"), "scaler"))
        for r, loop in enumerate(self.loops):
            if isinstance(loop.pending, Collective):
                self._settle(r)

    def _scale_move(self, kind: str) -> None:
        if (kind,) not in self.scale_moves():
            raise ClientRefused(f"{kind}: not possible in {self.scaler.phase.name}")
        self._note(f"client scale: {kind}")
        if kind == "drain_timeout":
            target = self.scaler.target_dp_size or 0
            for r in range(target, self.client.group):
                ids = self.client.unfinished_on(range(r, r + 1))
                if ids:
                    self.network.send(CLIENT, r, ("abort", ids))
            self.client = replace(self.client, drain_timed_out=True)
            return
        if self.scaler.phase.name == "DRAINING":
            self.client = replace(self.client, drain_timed_out=False)  # the drain is over
        self._check_second_scale_refused()
        event = {
            "DRAINING": Drained(),
            "PAUSING": RanksPaused(),
            "LEAVING": GroupLeft(),
            "SWITCHING": SwitchDone(),
            "RESIZING": CoordinatorResized(),
        }[self.scaler.phase.name]
        self._scale_actions(self._handle(self.scaler, event, "scaler"))

    def _scale_actions(self, actions: tuple[object, ...]) -> None:
        for action in actions:
            if isinstance(action, StartRanks):
                for r in action.ranks:
                    self._add_rank(r, action.dp_size, joining=True)
                self._scale_actions(self._handle(self.scaler, RanksReady(), "scaler"))
            elif isinstance(action, RouteTo):
                self.client = replace(self.client, routing=action.dp_size)
            elif isinstance(action, DrainRanks):
                pass  # the drain is the client's waiting (``scale_moves``)
            elif isinstance(action, PauseRanks):
                self._call(action.ranks, PauseRequested(mode=PauseMode.KEEP), awaited=True)
            elif isinstance(action, StopRanks):
                self._stop_ranks(action.ranks)
            elif isinstance(action, SwitchGroup):
                self._call(
                    range(action.dp_size), SwitchRequested(dp_size=action.dp_size), awaited=True
                )
            elif isinstance(action, ResizeCoordinator):
                self.network.send(CLIENT, COORDINATOR, ("resize", action.dp_size))
            elif isinstance(action, ResizeTables):
                self.client = replace(self.client, group=action.dp_size, routing=action.dp_size)
            elif isinstance(action, ResumeRanks):
                self._call(action.ranks, ResumeRequested(), awaited=False)
                self.client = replace(self.client, paused=False)
                if self.scaler.active:  # not a rollback's (rule 7)
                    self._scale_actions(self._handle(self.scaler, Resumed(), "scaler"))
            elif isinstance(action, ScaleRolledBack):
                pass  # the caller's error: the engine serves at its old size
            elif isinstance(action, DropRanks):
                self._drop_ranks(action)
            elif isinstance(action, LeaveGroup):
                self._call(action.ranks, GroupLost(), awaited=True)
            elif isinstance(action, ReconfigureFinished):
                self.shrinking = False
                self._check_roles(action.dp_size)
            else:
                raise Violation("scale", f"the simulation cannot perform {action}")

    def _check_roles(self, dp_size: int) -> None:
        """A finished scale: each party did its own part. The leaving ranks shut down;
        the staying ranks switched to the new group and the joining ones joined it."""
        if len(self.loops) != dp_size:
            leftover = list(range(dp_size, len(self.loops)))
            raise Violation(
                "scale_roles", f"a scale to {dp_size} ranks finished with ranks {leftover} running"
            )
        elsewhere = {
            r: (loop.machine.rank, loop.machine.dp_size)
            for r, loop in enumerate(self.loops)
            if (loop.machine.rank, loop.machine.dp_size) != (r, dp_size)
        }
        if elsewhere:
            raise Violation(
                "scale_roles",
                f"a scale to {dp_size} ranks finished with ranks numbered or grouped "
                f"otherwise (rank, dp_size): {elsewhere}",
            )

    # -- rank death (rule 5) -------------------------------------------------------------------

    def death_moves(self) -> list[Move]:
        """The ranks that may die now: a member of a reconfiguration (scaling rule 10), or
        any rank while the engines serve with no call in flight (rule 9). Elsewhere a
        death ends the engine (it cannot shrink), which is not modelled."""
        if not self.deaths_left:
            return []
        members = self.scaler.members
        if members is None:
            client = self.client
            if client.awaiting or client.paused or client.asleep:
                return []
            members = client.group
        alive = [r for r in range(members) if r not in self.dead]
        if len(alive) < 2:
            return []  # the last rank's death ends the engine
        return [("die", r) for r in alive]

    def _die(self, r: int) -> None:
        if ("die", r) not in self.death_moves():
            raise ClientRefused(f"rank {r} cannot die here")
        self._note(f"rank {r} dies")
        self.deaths_left -= 1
        self.dead = self.dead | {r}
        self.shrinking = True
        self.broken_calls = self.client.calls
        for sender, receiver in self.network.pairs():
            if r in (sender, receiver):
                self.network.take(sender, receiver)  # lost with the process
        # The loss cuts into whatever the scaler waited for: its call is abandoned.
        self._abandon_awaited_call()
        members = self.scaler.members or self.client.group
        event = RanksLost(old_dp_size=members, lost=tuple(sorted(self.dead)))
        self._scale_actions(self._handle(self.scaler, event, "scaler"))
        for q, loop in enumerate(self.loops):
            if isinstance(loop.pending, Collective):
                self._settle(q)

    def _drop_ranks(self, action: DropRanks) -> None:
        """``DropRanks`` as the engine's ``lose_ranks``: the lost ranks' requests end with
        an error, and the survivors are renumbered in every table and channel."""
        expected = tuple(r for r in range(len(self.loops)) if r not in self.dead)
        if set(action.ranks) != self.dead or action.survivors != expected:
            raise Violation(
                "shrink_survivors",
                f"ranks {sorted(self.dead)} of ranks 0..{len(self.loops) - 1} died, but the "
                f"shrink drops {action.ranks} and keeps {action.survivors}",
            )
        owners = self.client.owners
        ended = frozenset(
            i for i, owner in enumerate(owners) if owner in self.dead and i not in self.client.done
        )
        self.end_requests(ended, failed=True)
        new = {old: rank for rank, old in enumerate(action.survivors)}
        # A dropped rank's requests have all ended: they belong to no rank (-1).
        owners = tuple(new.get(owner, -1) for owner in owners)
        self.loops = [self.loops[old] for old in action.survivors]
        self.toys = [self.toys[old] for old in action.survivors]
        self.network = self.network.renumbered(new)
        n = len(action.survivors)
        self.group_size = n
        self.dead = frozenset()
        self.client = replace(self.client, owners=owners, group=n, routing=n)

    def _stop_ranks(self, ranks: tuple[int, ...]) -> None:
        for r in ranks:
            lost = [q.id for q in self.toys[r].requests]
            if lost:
                raise Violation("request_lost", f"leaving rank {r} still held {sorted(lost)}")
            for sender in (CLIENT, COORDINATOR):
                for message in self.network.take(sender, r):
                    if message[0] == "add":
                        raise Violation(
                            "request_lost", f"request {message[1]} sent to leaving rank {r}"
                        )
        keep = min(ranks)
        del self.loops[keep:]
        del self.toys[keep:]
        self.group_size = keep
