"""The world's collectives: votes (the non-blocking all-reduce), an injected drift, and
a broken group's failed collectives (``world``'s rules 3, 5 and 8)."""

from __future__ import annotations

from dataclasses import replace

from ..errors import ProtocolError
from ..rank_events import (
    AwaitVote,
    DrainVote,
    JoinGroup,
    RankPhase,
    Reconfigured,
    ResumeBarrier,
    ResumeSynced,
    StartVote,
    SyncDone,
)
from ..rank_loop import (
    Collective,
    RunStep,
)
from .client import ClientRefused
from .invariants import Violation
from .network import Move


class CollectiveMoves:
    """``World``'s moves and handlers for votes, a drift and a broken group's collectives; a part of ``World``, whose
    fields are the state these methods read and change."""

    __slots__ = ()

    # -- votes (the non-blocking all-reduce) ---------------------------------------------------

    def start_vote(self, r: int, vote: StartVote) -> None:
        toy = self.toys[r]
        forwards = toy.forwards if toy.forwards_wave == vote.wave else 0
        if forwards != vote.step_counter:
            raise Violation(
                "lockstep",
                f"rank {r} votes at step {vote.step_counter} of wave {vote.wave} after "
                f"{forwards} forwards in it",
            )
        self.toys[r] = replace(toy, votes=(*toy.votes, vote))

    def _read_ready_votes(self) -> None:
        """Every rank waiting for a vote that every member started reads it now."""
        progress = True
        while progress:
            progress = False
            for r, loop in enumerate(self.loops):
                pending = loop.pending
                if isinstance(pending, Collective) and isinstance(
                    pending.action, AwaitVote | DrainVote
                ):
                    progress |= self._read_vote(r)

    def _read_vote(self, r: int) -> bool:
        """Rank ``r`` reads its oldest unread vote if every member started it."""
        index = self.toys[r].votes_read
        members = self.group
        if self.halted is not None:
            return False
        if self.broken_calls is not None:
            return False  # rule 5: the broken group's votes fail (``_settle``)
        if any(len(self.toys[q].votes) <= index for q in members):
            return False
        ballots = [self.toys[q].votes[index] for q in members]
        waves = {b.wave for b in ballots}
        steps = {b.step_counter for b in ballots}
        result = SyncDone(
            any_unfinished=any(b.has_unfinished for b in ballots),
            pausing_ranks=sum(b.pending_pause for b in ballots),
            wave_span=(min(waves), max(waves)),
            step_counter_span=(min(steps), max(steps)),
        )
        if len(waves) > 1 or len(steps) > 1:
            if not self.drifted:
                raise Violation("lockstep", f"a vote met waves {waves} and step counters {steps}")
            self._read_drift(r, result)
            return True
        self.toys[r] = replace(self.toys[r], votes_read=index + 1)
        read = min(self.toys[q].votes_read for q in members)
        if read:  # every member read these: forget them
            for q in members:
                toy = self.toys[q]
                self.toys[q] = replace(
                    toy, votes=toy.votes[read:], votes_read=toy.votes_read - read
                )
        self._note(f"rank {r} reads vote {index}: {result}")
        self._complete(r, result)
        return True

    # -- an injected drift (rule 8) -------------------------------------------------------

    def drift_moves(self) -> list[Move]:
        """Where a drift may be injected: once, into a rank running a lockstep wave at
        the top of an iteration."""
        if not self.config.drift or self.drifted or self.halted is not None:
            return []
        return [
            ("drift", r)
            for r in self.group
            if self.loops[r].machine.phase is RankPhase.RUNNING
            and isinstance(self.loops[r].pending, RunStep)
        ]

    def _drift(self, r: int) -> None:
        """Rank ``r`` runs one forward more than its peers and counts it (a bug the
        protocol cannot rule out): its step counter is one ahead from now on."""
        if ("drift", r) not in self.drift_moves():
            raise ClientRefused(f"rank {r} cannot drift here")
        self._note(f"rank {r} drifts: one extra forward, counted")
        self.drifted = True
        machine = self.loops[r].machine
        self._forward(r)
        machine.restore(replace(machine.snapshot(), step_counter=machine.step_counter + 1))

    def _read_drift(self, r: int, result: SyncDone) -> None:
        """A vote met the drift: the rank must end with ``LockstepDriftError`` (rank
        rule 12), which ends the engine; anything else is a violation."""
        self._note(f"rank {r} reads the drifted vote: {result}")
        self._complete(r, result)
        if self.halted is not None:
            return
        raise Violation(
            "drift_unnoticed",
            f"rank {r} took a vote of step counters {result.step_counter_span} without "
            "LockstepDriftError",
        )

    def _complete_collective(self, members: range) -> None:
        if len(self.loops) < len(members):
            return
        pendings = [self.loops[r].pending for r in members]
        if not all(isinstance(p, Collective) for p in pendings):
            return
        actions = [p.action for p in pendings]  # type: ignore[union-attr]
        if len({type(a) for a in actions}) != 1:
            return  # the invariants report the mismatch
        unread = [r for r in members if self.toys[r].votes[self.toys[r].votes_read :]]
        if unread:
            # In gloo the collective would pair with the open vote: nonsense, or a hang.
            raise Violation(
                "collective_order", f"ranks {unread} enter a collective with a vote unread"
            )
        first = actions[0]
        if isinstance(first, ResumeBarrier):
            synced = ResumeSynced(any_unfinished=any(a.has_unfinished for a in actions))  # type: ignore[union-attr]
            results: list[object] = [synced] * len(members)
        else:
            results = self._join_results(members, actions)  # type: ignore[arg-type]
        self._note(f"collective {type(first).__name__} of ranks {list(members)} completes")
        for r, result in zip(members, results, strict=True):
            self._complete(r, result)

    def _join_results(self, members: range, actions: list[JoinGroup]) -> list[object]:
        self.group_size = len(members)
        self.broken_calls = None  # rule 5: the new group is whole
        merged = Reconfigured(
            rank=0,
            dp_size=len(members),
            wave=max(a.wave for a in actions),
            running=any(a.running for a in actions),
            step_counter=max(a.step_counter for a in actions),
        )
        return [replace(merged, rank=r) for r in members]

    # -- a broken group (rule 5) ----------------------------------------------------------

    def _broken(self, r: int, pending: Collective) -> bool:
        """Whether rank ``r``'s collective belongs to the broken group: any vote or
        barrier while it is broken, a join only when a switch of the broken group asked
        for it (the shrink's own switch forms the survivors' group)."""
        calls = self.loops[r].snapshot()[1].switch_calls
        if isinstance(pending.action, JoinGroup) and self.aborted_switch in calls:
            return True
        if self.broken_calls is None:
            return False
        if not isinstance(pending.action, JoinGroup):
            return True
        return any(call_id < self.broken_calls for call_id in calls)

    def _fail_collective(self, r: int, pending: Collective) -> None:
        """The collective fails as gloo's does when a member died. A join that fails
        keeps the rank in its old group with its own counters (rank rule 11); any other
        is given up (rank rule 13), and the votes still open go with the group."""
        self._note(f"rank {r}'s {type(pending.action).__name__} fails: the group is broken")
        if isinstance(pending.action, JoinGroup):
            machine, action = self.loops[r].machine, pending.action
            kept = Reconfigured(
                rank=r,
                dp_size=machine.dp_size,
                wave=action.wave,
                running=action.running,
                step_counter=action.step_counter,
            )
            self._complete(r, kept)
            return
        self._forget_votes(r)
        try:
            self.loops[r].group_lost(self._effects(r))
        except ProtocolError as error:
            raise Violation("protocol_error", f"rank {r}: {error}") from error
        self._settle(r)

    def _forget_votes(self, r: int) -> None:
        self.toys[r] = replace(self.toys[r], votes=(), votes_read=0)
