"""The state key of a world: everything that decides its future, and nothing more.

The forwards a rank counted in a wave it has left are dropped (``_current``).

Step counters of a long-running wave (and the votes the ranks started in it) are
shifted down by a multiple of ``sync_interval``: the rules only ever compare them with
1 and 2, with each other and modulo the interval, so shifted states behave alike (a
pause message can stay in flight for any number of dummy steps, and without the shift
the search would never close).
"""

from __future__ import annotations

from dataclasses import replace

from ..rank import RankSnapshot
from ..rank_loop import LoopSnapshot
from .client import ClientState
from .toy import ToyRank
from .view import WorldView


def world_key(world: WorldView) -> tuple[object, ...]:
    loops = [loop.snapshot() for loop in world.loops]
    toys = [
        _current(toy, machine.wave) for toy, (machine, _) in zip(world.toys, loops, strict=True)
    ]
    interval = world.config.sync_interval
    client = world.client
    counters = [machine.step_counter for machine, _ in loops if machine.running]
    # Open votes lie at most two vote points back: past the shift they stay above 2.
    if counters and min(counters) > 3 * interval + 2 and _deadline_shifts(client, loops, toys):
        shift = ((min(counters) - 2 * interval - 3) // interval) * interval
        loops, toys = _shifted(loops, toys, shift)
        if client.pause_deadline is not None:
            wave, step = client.pause_deadline
            client = replace(client, pause_deadline=(wave, step - shift))
    return (
        tuple(loops),
        tuple(toys),
        world.coordinator.snapshot(),
        client,
        world.group_size,
        world.network.key(),
        world.scaler.snapshot(),
        world.deaths_left,
        world.broken_calls,
        world.dead,
        world.shrinking,
        world.aborted_switch,
        world.drifted,
        world.halted,
    )


def _deadline_shifts(
    client: ClientState, loops: list[tuple[RankSnapshot, LoopSnapshot]], toys: list[ToyRank]
) -> bool:
    """Whether a pause's deadline (a step of a wave) shifts with the counters: every
    rank held to it runs in its wave, so every forward checked against it is shifted
    alike. Unshifted, a deadline fixed after any number of dummy steps would make the
    states of a long pause all differ."""
    if client.pause_deadline is None:
        return True
    wave = client.pause_deadline[0]
    return all(
        r < len(loops)
        and loops[r][0].running
        and loops[r][0].wave == wave
        and toys[r].forwards_wave == wave
        for r in client.awaiting
    )


def _current(toy: ToyRank, wave: int) -> ToyRank:
    """The toy with the forwards of a wave its rank has left counted as none in its
    current one: they are read only while their wave is the rank's (a rank's wave never
    goes back), and a first forward in a wave counts one either way."""
    if toy.forwards_wave >= wave:
        return toy
    return replace(toy, forwards=0, forwards_wave=wave)


def _shifted(
    loops: list[tuple[RankSnapshot, LoopSnapshot]], toys: list[ToyRank], shift: int
) -> tuple[list[tuple[RankSnapshot, LoopSnapshot]], list[ToyRank]]:
    shifted_loops, shifted_toys = [], []
    for (machine, loop), toy in zip(loops, toys, strict=True):
        if machine.running:
            machine = replace(machine, step_counter=machine.step_counter - shift)
            if toy.forwards_wave == machine.wave:
                toy = replace(toy, forwards=toy.forwards - shift)
            votes = tuple(
                replace(vote, step_counter=vote.step_counter - shift)
                if vote.wave == machine.wave
                else vote
                for vote in toy.votes
            )
            toy = replace(toy, votes=votes)
        shifted_loops.append((machine, loop))
        shifted_toys.append(toy)
    return shifted_loops, shifted_toys
