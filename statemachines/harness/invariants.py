"""The properties a simulated deployment must hold; ``Violation`` names the one broken.

After every move: the coordinator's wave never goes backwards nor ahead of the ranks,
nor does a rank's wave go backwards (with the checks in ``world`` that the coordinator
adopts only a wave a message carried and a rank announces only a wave it is in, these
are the local halves of "never ahead of the ranks" that ``por`` relies on);
the client sees the engines paused, or asleep, only while every rank is;
no collective waits for a member that waits in another collective, or that is idle
while nothing is in flight (deadlock; a vote waits only for the members that have not
started it). The world itself raises the violations it sees as they happen: a vote that met an
injected drift taken without ``LockstepDriftError`` (drift_unnoticed; with it, the run
ends there and nothing more is checked), a forward
after the pause consensus or after the client saw the pause done, more forwards after
a KEEP or ABORT pause reached every rank than rank rule 7 allows (slow_pause), a
request waiting unannounced at a paused or sleeping rank, a refused call, a vote whose
voters disagree on wave or step or whose step is not the voter's forward count
(lockstep), a blocking collective entered with a vote unread (collective_order), a
request left on a leaving rank, a finished scale whose leaving ranks still run or
whose ranks are not all in the new group numbered 0..n-1 (scale_roles), a request that
ends twice (request_ended_twice), a shrink that drops other ranks than the dead ones or
keeps other survivors, in another order (shrink_survivors).

After every move, too: while no scale runs, new requests may go to every rank (an
aborted scale down routes to its leaving ranks again).

At quiescence (nothing to deliver, nothing to step): the coordinator agrees with the
ranks (once a shrink switched: its survivors left their wave unended), every call the
client waits for was answered, no scale is stuck, no rank is paused or asleep unless
the client paused it or a scale runs (an aborted scale resumed every rank it paused),
and every accepted request finished unless the engines are paused.
"""

from __future__ import annotations

from ..rank_events import AwaitVote, DrainVote, JoinGroup, PauseMode, PauseState
from ..rank_loop import Collective, WaitForInput
from .view import WorldView


class Violation(Exception):
    """A protocol property was broken; ``rule`` names it, ``trace`` shows how."""

    def __init__(self, rule: str, detail: str) -> None:
        self.rule = rule
        self.detail = detail
        self.trace: list[str] = []
        super().__init__(f"{rule}: {detail}")

    def report(self) -> str:
        lines = [f"VIOLATION {self.rule}: {self.detail}", "trace:"]
        lines += [f"  {n:3d}. {line}" for n, line in enumerate(self.trace, 1)]
        return "\n".join(lines)


def collective_members(world: WorldView, action: object) -> range:
    """A group join is over the new group; every other collective over the current one."""
    return range(action.dp_size) if isinstance(action, JoinGroup) else world.group


def check_after_move(
    world: WorldView, coordinator_wave_before: int, rank_waves_before: list[int] | None = None
) -> None:
    if world.halted is not None:
        return  # the engine ended with the named error (``world`` rule 8)
    wave = world.coordinator.wave
    if wave < coordinator_wave_before:
        raise Violation("coordinator_wave", f"went back from {coordinator_wave_before} to {wave}")
    for r, before in enumerate((rank_waves_before or [])[: len(world.loops)]):
        if world.loops[r].machine.wave < before:
            now = world.loops[r].machine.wave
            raise Violation("coordinator_wave", f"rank {r}'s wave went back from {before} to {now}")
    if world.client.paused:
        unpaused = [
            r for r in world.group if world.loops[r].machine.pause_state is not PauseState.PAUSED
        ]
        if unpaused:
            raise Violation("paused_view", f"the client sees paused engines, ranks {unpaused} not")
    client = world.client
    if not world.scaler.active and client.routing != client.group:
        raise Violation(
            "routing",
            f"no scale runs, but requests go to ranks 0..{client.routing - 1} of "
            f"{client.group} (a scale that ended left ranks without requests)",
        )
    if world.client.asleep and not world.client.awaiting:  # the sleep was answered
        awake = [r for r in world.group if not world.loops[r].machine.asleep]
        if awake:
            raise Violation("asleep_view", f"the client sees sleeping engines, ranks {awake} not")
    rank_wave = max(world.loops[r].machine.wave for r in world.group)
    if wave > rank_wave:
        raise Violation("coordinator_wave", f"coordinator at {wave}, ranks at most {rank_wave}")
    waiting = {
        r: pending.action
        for r, loop in enumerate(world.loops)
        if isinstance(pending := loop.pending, Collective)
    }
    for r, action in waiting.items():
        members = collective_members(world, action)
        if isinstance(action, AwaitVote | DrainVote):
            # A vote is still awaited only while a member has not started it.
            index = world.toys[r].votes_read
            blockers = [q for q in members if len(world.toys[q].votes) <= index]
        else:
            blockers = [q for q in members if not isinstance(waiting.get(q), type(action))]
        other = sorted({_kind(waiting[q]) for q in blockers if q in waiting} - {_kind(action)})
        if other:
            raise Violation(
                "deadlock", f"rank {r} waits in a {_kind(action)} while ranks wait in {other}"
            )
        if not world.network:
            idle = [q for q in blockers if isinstance(world.loops[q].pending, WaitForInput)]
            if idle:
                raise Violation(
                    "deadlock",
                    f"rank {r} waits in the {_kind(action)} while ranks {idle} are idle "
                    "and nothing is in flight",
                )


def _kind(action: object) -> str:
    return "vote" if isinstance(action, AwaitVote | DrainVote) else type(action).__name__


def check_answer(world: WorldView, r: int, mode: PauseMode | None) -> None:
    """Each call's contract, when rank ``r`` answers a pause or sleep in ``mode``: the
    rank is paused; after an ABORT pause it holds nothing it admitted, nor any request
    it held when the call reached it (frozen by an earlier pause or waiting under it:
    the caller believes them aborted, so none may be resumed later); after a WAIT
    pause nothing it admitted is left either, unless an earlier KEEP pause froze it
    (rank rule 7: a pause while paused keeps what the first one decided). Requests that
    arrived since wait unadmitted."""
    machine = world.loops[r].machine
    if machine.pause_state is not PauseState.PAUSED:
        raise Violation("call_contract", f"rank {r} answered while {machine.pause_state.name}")
    if mode is PauseMode.ABORT:
        kept = sorted(world.client.doomed & {q.id for q in world.toys[r].requests})
        if kept:
            raise Violation(
                "call_contract",
                f"rank {r} answered an ABORT call still holding {kept}, which it held "
                "when the call arrived",
            )
    admitted = [q.id for q in world.toys[r].requests if q.admitted]
    kept_by_keep = machine.snapshot().pause_mode is PauseMode.KEEP
    if admitted and (mode is PauseMode.ABORT or (mode is PauseMode.WAIT and not kept_by_keep)):
        raise Violation(
            "call_contract", f"rank {r} answered a {mode.name} pause still holding {admitted}"
        )


def check_quiescent(world: WorldView) -> None:
    """The end-state properties; call only when nothing is left to deliver or step."""
    if world.halted is not None:
        return  # the engine ended with the named error (``world`` rule 8)
    machines = [world.loops[r].machine for r in world.group]
    running = any(m.running for m in machines)
    coordinator = world.coordinator
    # A shrink's survivors left their group's wave unended, each where it was: they
    # agree with the coordinator again once the switch ended that wave (rank rule 13).
    if not world.shrinking and coordinator.engines_running != running:
        raise Violation(
            "coordinator_running",
            f"coordinator says running={coordinator.engines_running}, ranks {running}",
        )
    waves = {m.wave for m in machines}
    if not world.shrinking and waves != {coordinator.wave}:
        raise Violation("coordinator_wave", f"coordinator at {coordinator.wave}, ranks {waves}")
    client = world.client
    if client.awaiting:
        raise Violation(
            "call_unanswered",
            f"ranks {sorted(client.awaiting)} never answered the client's call "
            f"{client.awaited_call}",
        )
    if world.scaler.active and not world.scale_moves():
        raise Violation("scale_stuck", f"the scale is stuck in {world.scaler.phase.name}")
    paused = any(m.pause_state is not PauseState.UNPAUSED or m.asleep for m in machines)
    if paused and not (client.paused or client.asleep or world.scaler.active):
        stuck = [r for r, m in enumerate(machines) if m.pause_state is not PauseState.UNPAUSED]
        raise Violation(
            "paused_unseen",
            f"ranks {stuck} stay paused, but the client resumed the engines or never "
            "paused them (nothing will ever resume them)",
        )
    lost = set(range(client.submitted)) - client.done
    if lost and not paused and not world.scaler.active:
        raise Violation("request_lost", f"requests {sorted(lost)} never finished")
