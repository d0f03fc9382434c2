"""The state key of a world: everything that decides its future, and nothing more.

Step counters of a long-running wave are shifted down by a multiple of
``sync_interval``: the rules only ever compare them with 1, with each other and modulo
the interval, so shifted states behave alike (a pause message can stay in flight for
any number of dummy steps, and without the shift the search would never close).
"""

from __future__ import annotations

from dataclasses import replace

from ..rank import RankSnapshot, SyncDP
from ..rank_loop import Collective, LoopSnapshot
from .toy import ToyRank
from .view import WorldView


def world_key(world: WorldView) -> tuple[object, ...]:
    loops = [loop.snapshot() for loop in world.loops]
    toys = list(world.toys)
    interval = world.config.sync_interval
    counters = [machine.step_counter for machine, _ in loops if machine.running]
    if counters and min(counters) > 2 * interval:
        shift = ((min(counters) - interval - 1) // interval) * interval
        loops, toys = _shifted(loops, toys, shift)
    return (
        tuple(loops),
        tuple(toys),
        world.coordinator.snapshot(),
        world.client,
        world.group_size,
        world.network.key(),
        world.scaler.snapshot(),
    )


def _shifted(
    loops: list[tuple[RankSnapshot, LoopSnapshot]], toys: list[ToyRank], shift: int
) -> tuple[list[tuple[RankSnapshot, LoopSnapshot]], list[ToyRank]]:
    shifted_loops, shifted_toys = [], []
    for (machine, loop), toy in zip(loops, toys, strict=True):
        if machine.running:
            machine = replace(machine, step_counter=machine.step_counter - shift)
            if toy.forwards_wave == machine.wave:
                toy = replace(toy, forwards=toy.forwards - shift)
            pending = loop.pending
            if isinstance(pending, Collective) and isinstance(pending.action, SyncDP):
                action = replace(pending.action, step_counter=pending.action.step_counter - shift)
                loop = replace(loop, pending=Collective(action=action))
        shifted_loops.append((machine, loop))
        shifted_toys.append(toy)
    return shifted_loops, shifted_toys
