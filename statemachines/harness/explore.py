"""Exhaustive exploration: every interleaving of a small deployment, breadth first.

Theory of operation:

1. A node is a ``World`` plus how far the client got through its script. From each
   node every enabled move is tried: each channel's head delivered, each rank stepped,
   the next request submitted, the next script operation (pause, resume, sleep, wake,
   scale) issued. The client's moves are optional: it may stop at any point.
2. States are hashed (``World.key``); a state seen before is not expanded again.
3. Every move is checked by the world's invariants; nodes with nothing left to deliver
   or step are also checked for the end-state properties.
4. The first violation stops the search. Its trace is rebuilt by replaying the moves
   from the start with tracing on, so only parent links are kept in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..rank import PauseMode
from .variants import VARIANTS
from .world import RequestSpec, Violation, World, WorldConfig

ClientOp = tuple[object, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreConfig:
    world: WorldConfig = field(default_factory=WorldConfig)
    requests: tuple[RequestSpec, ...] = ()
    script: tuple[ClientOp, ...] = ()
    # A configuration whose interleavings multiply too fast caps the depth it is
    # explored to, whatever depth is asked for.
    depth_limit: int | None = None

    def broken(self, name: str) -> ExploreConfig:
        """The same configuration running the named broken variant."""
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
        variant = VARIANTS[name]
        world = replace(
            self.world,
            rank_class=variant.rank_class,
            coordinator_class=variant.coordinator_class,
            scaling_class=variant.scaling_class,
        )
        return replace(self, world=world)


def default_configs(dp_size: int, sync_interval: int = 1) -> tuple[tuple[str, ExploreConfig], ...]:
    """The configurations the command line explores, every one with votes every
    ``sync_interval`` steps.

    A request and a pause together multiply the interleavings: at dp_size 3 that
    product does not fit the time budget, so there the request and the pause (with a
    duplicate resume) are explored in separate configurations.
    """
    return tuple(
        (name, replace(config, world=replace(config.world, sync_interval=sync_interval)))
        for name, config in _configs(dp_size)
    )


def _configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    last = RequestSpec(rank=dp_size - 1, steps=1)
    pause_resume = (("pause", PauseMode.KEEP), ("resume",), ("resume",))
    # Each call arrives while the previous one's pause, of another mode, is in force.
    pause_modes = (
        ("pause", PauseMode.KEEP),
        ("pause", PauseMode.ABORT),
        ("sleep", 1, PauseMode.WAIT),
        ("wake",),
        ("resume",),
        ("resume",),
    )
    configs = [
        ("request", ExploreConfig(world=WorldConfig(dp_size=dp_size), requests=(last,))),
        ("pause-resume", ExploreConfig(world=WorldConfig(dp_size=dp_size), script=pause_resume)),
        ("pause-modes", ExploreConfig(world=WorldConfig(dp_size=dp_size), script=pause_modes)),
    ]
    if dp_size <= 2:
        world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False)
        configs.append(
            ("request-and-pause", ExploreConfig(world=world, requests=(last,), script=pause_resume))
        )
    # A request for the rank a scale up adds: it reaches rank 0 while the client's table
    # has dp_size ranks, the new rank once the coordinator confirmed the new group.
    grow = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(RequestSpec(rank=dp_size),),
        script=scale_script(dp_size + 1),
        depth_limit=14 if dp_size <= 2 else 12,
    )
    # A scale down while the leaving rank serves a request: it drains, or the client's
    # drain timeout aborts it, at any point of the interleaving.
    shrink = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(RequestSpec(rank=dp_size - 1, steps=2),),
        script=scale_script(dp_size - 1),
        depth_limit=16 if dp_size <= 2 else 13,
    )
    # A sleep that keeps its requests (they are recomputed), then a wake.
    sleep_keep = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(last,),
        script=(("sleep", 1, PauseMode.KEEP), ("wake",)),
        depth_limit=None if dp_size <= 2 else 14,
    )
    return (
        *configs,
        *scale_configs(dp_size),
        (f"scale-up-{dp_size + 1}-request", grow),
        (f"scale-down-{dp_size - 1}-request", shrink),
        ("sleep-keep-wake", sleep_keep),
    )


def scale_script(dp_size: int) -> tuple[ClientOp, ...]:
    """A scale: the client's later moves come from its ``ScalingMachine``."""
    return (("scale", dp_size),)


def scale_configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    """A scale up by one rank and, from two ranks on, a scale down by one. Without a
    request these are explored to the end (every interleaving, in a few hundred
    states); with one, the product needs a depth bound (see the tests)."""
    world = WorldConfig(dp_size=dp_size)
    configs = [
        (f"scale-up-{dp_size + 1}", ExploreConfig(world=world, script=scale_script(dp_size + 1)))
    ]
    if dp_size >= 2:
        down = ExploreConfig(world=world, script=scale_script(dp_size - 1))
        configs.append((f"scale-down-{dp_size - 1}", down))
    return tuple(configs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreResult:
    states: int
    depth: int
    violation: Violation | None


Node = tuple[World, int]


def _client_moves(config: ExploreConfig, world: World, position: int) -> list[tuple[object, ...]]:
    moves: list[tuple[object, ...]] = []
    if world.client.submitted < len(config.requests):
        moves.append(("submit",))
    if position < len(config.script) and world.refusal(config.script[position]) is None:
        moves.append(("op",))
    return moves + world.scale_moves()


def _apply(config: ExploreConfig, world: World, position: int, move: tuple[object, ...]) -> int:
    if move[0] == "submit":
        world.submit(config.requests[world.client.submitted])
        if world.client.submitted == len(config.requests):
            world.forget_views()
        return position
    if move[0] == "op":
        world.client_op(config.script[position])
        return position + 1
    world.apply(move)
    return position


def _replay(config: ExploreConfig, moves: list[tuple[object, ...]]) -> Violation:
    world = World.start(config.world)
    if not config.requests:
        world.forget_views()
    world.trace = []
    position = 0
    try:
        for move in moves:
            position = _apply(config, world, position, move)
        world.check_quiescent()
    except Violation as violation:
        violation.trace = world.trace
        return violation
    raise RuntimeError("replaying the violating trace did not reproduce the violation")


def explore(config: ExploreConfig, depth: int) -> ExploreResult:
    """Breadth-first search to ``depth`` moves (at most the configuration's
    ``depth_limit``); the first violation with its trace."""
    if config.depth_limit is not None:
        depth = min(depth, config.depth_limit)
    start = World.start(config.world)
    if not config.requests:
        start.forget_views()
    start_key = (start.key(), 0)
    parents: dict[object, tuple[object, tuple[object, ...]] | None] = {start_key: None}
    frontier: list[tuple[object, Node]] = [(start_key, (start, 0))]
    reached = 0
    for level in range(depth + 1):
        next_frontier: list[tuple[object, Node]] = []
        for key, (world, position) in frontier:
            network = world.network_moves()
            try:
                if not network:
                    world.check_quiescent()
            except Violation:
                return ExploreResult(
                    states=len(parents), depth=level, violation=_replay(config, _path(parents, key))
                )
            if level == depth:
                continue
            for move in network + _client_moves(config, world, position):
                child = world.clone()
                try:
                    child_position = _apply(config, child, position, move)
                except Violation:
                    path = [*_path(parents, key), move]
                    return ExploreResult(
                        states=len(parents), depth=level + 1, violation=_replay(config, path)
                    )
                child_key = (child.key(), child_position)
                if child_key not in parents:
                    parents[child_key] = (key, move)
                    next_frontier.append((child_key, (child, child_position)))
        if not next_frontier:
            break
        reached = level + 1
        frontier = next_frontier
    return ExploreResult(states=len(parents), depth=reached, violation=None)


def _path(
    parents: dict[object, tuple[object, tuple[object, ...]] | None], key: object
) -> list[tuple[object, ...]]:
    moves: list[tuple[object, ...]] = []
    link = parents[key]
    while link is not None:
        key, move = link
        moves.append(move)
        link = parents[key]
    return moves[::-1]
