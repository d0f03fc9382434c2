"""The properties a simulated deployment must hold; ``Violation`` names the one broken.

After every move: the coordinator's wave never goes backwards nor ahead of the ranks;
the members of one collective wait in the same kind of collective; no rank ran more
forwards than a peer waiting in the all-reduce admits (drift); no collective waits
for a member that is idle while nothing is in flight (deadlock). The world itself
raises the violations it sees as they happen: a forward after the pause consensus or
after the client saw the pause done, a request waiting unannounced at a paused or
sleeping rank, a refused call, a lockstep mismatch in an all-reduce, a request left
on a leaving rank.

At quiescence (nothing to deliver, nothing to step): the coordinator agrees with the
ranks, every call the client waits for was answered, no scale is stuck, and every
accepted request finished unless the engines are paused.
"""

from __future__ import annotations

from ..rank import JoinGroup, PauseMode, PauseState, SyncDP
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


def check_after_move(world: WorldView, coordinator_wave_before: int) -> None:
    wave = world.coordinator.wave
    if wave < coordinator_wave_before:
        raise Violation("coordinator_wave", f"went back from {coordinator_wave_before} to {wave}")
    if world.client.paused:
        unpaused = [
            r for r in world.group if world.loops[r].machine.pause_state is not PauseState.PAUSED
        ]
        if unpaused:
            raise Violation("paused_view", f"the client sees paused engines, ranks {unpaused} not")
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
        kinds = {type(waiting[q]).__name__ for q in members if q in waiting}
        if len(kinds) > 1:
            raise Violation("deadlock", f"ranks wait in different collectives: {sorted(kinds)}")
        if isinstance(action, SyncDP):
            _check_drift(world, r, action, waiting)
        if not world.network:
            idle = [
                q
                for q in members
                if q not in waiting and isinstance(world.loops[q].pending, WaitForInput)
            ]
            if idle:
                raise Violation(
                    "deadlock",
                    f"ranks {sorted(waiting)} wait in the {type(action).__name__} while ranks "
                    f"{idle} are idle and nothing is in flight",
                )


def _check_drift(world: WorldView, r: int, action: SyncDP, waiting: dict[int, object]) -> None:
    for q in world.group:
        peer = world.toys[q]
        if (
            q not in waiting
            and world.loops[q].machine.wave == action.wave
            and peer.forwards_wave == action.wave
            and peer.forwards > action.step_counter
        ):
            raise Violation(
                "drift",
                f"rank {q} ran {peer.forwards} forwards while rank {r} waits at step "
                f"{action.step_counter}",
            )


def check_answer(world: WorldView, r: int, mode: PauseMode | None) -> None:
    """Each call's contract, when rank ``r`` answers a pause or sleep in ``mode``: the
    rank is paused, and after an ABORT or WAIT pause nothing it admitted is left to run
    (requests that arrived since wait unadmitted; a KEEP pause keeps them frozen)."""
    machine = world.loops[r].machine
    if machine.pause_state is not PauseState.PAUSED:
        raise Violation("call_contract", f"rank {r} answered while {machine.pause_state.name}")
    toy = world.toys[r]
    # Admitted requests may stay only frozen: a WAIT pause answered over a KEEP pause
    # keeps what the KEEP froze (rank rule 7).
    admitted = [q.id for q in toy.requests if q.admitted]
    frozen = toy.scheduler_pause is PauseMode.KEEP
    if mode in (PauseMode.ABORT, PauseMode.WAIT) and admitted and not frozen:
        raise Violation(
            "call_contract", f"rank {r} answered a {mode.name} pause still running {admitted}"
        )


def check_quiescent(world: WorldView) -> None:
    """The end-state properties; call only when nothing is left to deliver or step."""
    machines = [world.loops[r].machine for r in world.group]
    running = any(m.running for m in machines)
    coordinator = world.coordinator
    if coordinator.engines_running != running:
        raise Violation(
            "coordinator_running",
            f"coordinator says running={coordinator.engines_running}, ranks {running}",
        )
    waves = {m.wave for m in machines}
    if waves != {coordinator.wave}:
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
    lost = set(range(client.submitted)) - client.done
    if lost and not paused and not world.scaler.active:
        raise Violation("request_lost", f"requests {sorted(lost)} never finished")
