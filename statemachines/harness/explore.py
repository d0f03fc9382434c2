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
   from the start with tracing on, so only parent links are kept in memory. A
   ``survey`` goes on past violations instead (a violating move ends its path) and
   reports every rule broken and every terminal state, to compare searches.
5. The search is complete when a level adds no new state before the depth bound: then
   every reachable state was checked. Otherwise it stopped at the bound (``complete``
   is False) and says nothing of the states beyond.
6. The cyclic garbage collector is off while the search runs: worlds form no reference
   cycles, so it would only rescan the hundreds of thousands of live worlds again and
   again (a third of the time in the large configurations), freeing nothing.
7. With ``reduction="por"`` (the default) a state where one rank's moves stand for
   every interleaving expands only those, unless one of them leads back to a state
   first reached at the same or a lower level, or (in a survey) violates; and the
   messages their receivers would ignore whenever they arrive are dropped after every
   move. ``por`` explains why neither hides a violation. A machine that breaks a
   premise of the reduction (``ReductionError``) is searched again without it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace

from ..rank_events import PauseMode
from .por import (
    REDUCTIONS,
    ReductionError,
    calm_ranks,
    check_premises,
    drop_inert,
    persistent_moves,
)
from .variants import VARIANTS
from .world import RequestSpec, Violation, World, WorldConfig

ClientOp = tuple[object, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreConfig:
    world: WorldConfig = field(default_factory=WorldConfig)
    requests: tuple[RequestSpec, ...] = ()
    script: tuple[ClientOp, ...] = ()
    # "por": expand one rank's moves where they stand for all (rule 7); "none": all.
    reduction: str = "por"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; known: {REDUCTIONS}")

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

    Most are explored to their end at depth 60; statemachines/README.md gives each
    one's states, depth and time at dp 2 and 3 with votes every 1, 2 and 3 steps, and
    which stop at the bound.
    """
    return tuple(
        (name, replace(config, world=replace(config.world, sync_interval=sync_interval)))
        for name, config in _configs(dp_size)
    )


def _configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    last = RequestSpec(rank=dp_size - 1, steps=1)
    pause_resume = _pause_resume(PauseMode.KEEP)
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
    world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False)
    # A WAIT pause must outlast the request's remaining steps, so that one takes four:
    # a draining rank that voted for the pause too soon would answer with work left.
    steps = {PauseMode.KEEP: 1, PauseMode.ABORT: 1, PauseMode.WAIT: 4}
    for mode, mode_steps in steps.items():
        suffix = "" if mode is PauseMode.KEEP else f"-{mode.name.lower()}"
        request_and_pause = ExploreConfig(
            world=world,
            requests=(RequestSpec(rank=dp_size - 1, steps=mode_steps),),
            script=_pause_resume(mode),
        )
        configs.append((f"request-and-pause{suffix}", request_and_pause))
    # A request that stalls after its admission (``toy``: a preempted request waiting
    # for a prefill step), under a WAIT pause: the rank must not vote for the pause,
    # nor an independent one reach it, while the request is unfinished. Independent
    # ranks (no votes) answer once the last admitted request finished, without a wave
    # to end.
    stalled = (RequestSpec(rank=dp_size - 1, steps=2, stalls=3),)
    for lockstep, prefix in ((True, ""), (False, "independent-")):
        config = ExploreConfig(
            world=replace(world, lockstep=lockstep),
            requests=stalled,
            script=_pause_resume(PauseMode.WAIT),
        )
        configs.append((f"{prefix}request-stalls-and-pause-wait", config))
    # One rank drifts out of lockstep: the first vote that meets it must end with
    # LockstepDriftError (``world`` rule 8).
    drift = ExploreConfig(
        world=replace(world, drift=True), requests=(RequestSpec(rank=dp_size - 1, steps=2),)
    )
    configs.append(("request-and-drift", drift))
    # Several requests in flight at once: the votes of a wave that serves more than
    # one, with a WAIT pause whose drain ends on one rank while another request runs.
    several = (RequestSpec(rank=0, steps=1), RequestSpec(rank=dp_size - 1, steps=1))
    three = (*several, RequestSpec(rank=dp_size - 1, steps=1))
    # The larger scenarios come last: ``--every-variant`` tries the scenarios in order.
    later = [("requests-3", ExploreConfig(world=world, requests=three))]
    if dp_size == 2:
        # Two requests for the rank a WAIT pause drains, one able to finish while the
        # other runs. At dp 3 this runs past 700,000 states (over ten minutes).
        two_and_pause = ExploreConfig(
            world=world,
            requests=(several[1], several[1]),
            script=(("pause", PauseMode.WAIT), ("resume",)),
        )
        later.append(("requests-2-and-pause-wait", two_and_pause))
    # A request for the rank a scale up adds: it reaches rank 0 while the client's table
    # has dp_size ranks, the new rank once the coordinator confirmed the new group.
    grow = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(RequestSpec(rank=dp_size),),
        script=scale_script(dp_size + 1),
    )
    # A scale down while the leaving rank serves a request: it drains, or the client's
    # drain timeout aborts it, at any point of the interleaving.
    shrink = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(RequestSpec(rank=dp_size - 1, steps=2),),
        script=scale_script(dp_size - 1),
    )
    # A sleep that keeps its requests (they are recomputed), then a wake.
    sleep_keep = ExploreConfig(
        world=WorldConfig(dp_size=dp_size, duplicate_wave_complete=False),
        requests=(last,),
        script=(("sleep", 1, PauseMode.KEEP), ("wake",)),
    )
    return (
        *configs,
        *scale_configs(dp_size),
        *abort_configs(dp_size),
        (f"scale-up-{dp_size + 1}-request", grow),
        (f"scale-down-{dp_size - 1}-request", shrink),
        ("sleep-keep-wake", sleep_keep),
        *death_configs(dp_size),
        *later,
        *repause_configs(dp_size),
    )


def repause_configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    """A pause, then a pause of each other mode or a sleep of each mode while it holds
    a request, then the resume or wake: the second call must keep its own contract
    (``invariants.check_answer``: an ABORT drops what the first pause froze or held,
    a WAIT after a KEEP loosens nothing). The request (two steps) reaches its rank at
    any point: admitted, frozen half done, or held by the first pause (after an ABORT
    pause, the only way one can be there)."""
    world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False)
    requests = (RequestSpec(rank=dp_size - 1, steps=2),)
    configs = []
    for first in PauseMode:
        seconds: list[tuple[str, ClientOp, ClientOp]] = [
            (f"pause-{mode.name.lower()}", ("pause", mode), ("resume",))
            for mode in PauseMode
            if mode is not first
        ]
        seconds += [
            (f"sleep-{mode.name.lower()}", ("sleep", 1, mode), ("wake",)) for mode in PauseMode
        ]
        for suffix, second, undo in seconds:
            script = (("pause", first), second, undo)
            name = f"request-pause-{first.name.lower()}-then-{suffix}"
            configs.append((name, ExploreConfig(world=world, requests=requests, script=script)))
    return tuple(configs)


def death_configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    """A rank dies at any moment (``world`` rule 5): the shrink around it (scaling rule
    9) with a request in flight, which ends with an error on the dead rank and finishes
    on a survivor; and a scale up and back down, into any phase of which the death cuts
    (scaling rule 10; at dp 2 the death may leave one rank, and the next scale goes up).
    Both are explored to their end, at dp 3 in about two minutes and fifteen seconds."""
    world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False, deaths=1)
    request = ExploreConfig(world=world, requests=(RequestSpec(rank=dp_size - 1, steps=2),))
    scales = ExploreConfig(world=world, script=(("scale", dp_size + 1), ("scale", dp_size)))
    return (
        ("request-and-death", request),
        (f"scale-up-{dp_size + 1}-down-{dp_size}-death", scales),
    )


def _pause_resume(mode: PauseMode) -> tuple[ClientOp, ...]:
    """A pause, its resume, and a duplicate resume (failure mode 7)."""
    return (("pause", mode), ("resume",), ("resume",))


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


def abort_configs(dp_size: int) -> tuple[tuple[str, ExploreConfig], ...]:
    """A scale up and, from two ranks on, a scale down, which the client may abort at
    any moment the scaling machine rolls it back (``World.abort_moves``): every rank it
    paused must be resumed (the pause may still be pending when the rollback's resume
    arrives) and routing must cover every rank again; a second scale is refused in
    every phase (``World`` checks it at each part of a scale)."""
    world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False, abort_scales=True)
    up = ExploreConfig(world=world, script=scale_script(dp_size + 1))
    configs = [(f"scale-up-{dp_size + 1}-abort", up)]
    if dp_size >= 2:
        down = ExploreConfig(world=world, script=scale_script(dp_size - 1))
        configs.append((f"scale-down-{dp_size - 1}-abort", down))
    return tuple(configs)


def abort_drain_config(dp_size: int) -> ExploreConfig:
    """A scale down aborted while its leaving rank drains a request: the request must
    finish there, and routing cover that rank again. Without the reduction (an abort
    may cut in anywhere) its whole space is large (about 240,000 states at dp 2): the
    tests bound its depth, and the simulation draws such runs at random."""
    world = WorldConfig(dp_size=dp_size, duplicate_wave_complete=False, abort_scales=True)
    request = (RequestSpec(rank=dp_size - 1, steps=1),)
    return ExploreConfig(world=world, requests=request, script=scale_script(dp_size - 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Survey:
    """What a search that goes on past violations met: every rule broken, and the keys
    of the terminal states (nothing left to deliver, step or do)."""

    rules: frozenset[str]
    ends: frozenset[object]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreResult:
    states: int
    depth: int
    violation: Violation | None
    # Every reachable state was explored (rule 5); False when the depth bound stopped it.
    complete: bool = False
    survey: Survey | None = None
    # The reduction the search ran with (rule 7: "none" where a premise of "por" broke).
    reduction: str = "none"


Node = tuple[World, int]


def _client_moves(config: ExploreConfig, world: World, position: int) -> list[tuple[object, ...]]:
    moves: list[tuple[object, ...]] = []
    if world.client.submitted < len(config.requests):
        moves.append(("submit",))
    if position < len(config.script) and world.refusal(config.script[position]) is None:
        moves.append(("op",))
    if world.halted is not None:
        return []  # the engine ended (``world`` rule 8)
    extra = world.scale_moves() + world.abort_moves() + world.death_moves() + world.drift_moves()
    return moves + extra


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
            if config.reduction == "por":
                drop_inert(world)
        world.check_quiescent()
    except Violation as violation:
        violation.trace = world.trace
        return violation
    raise RuntimeError("replaying the violating trace did not reproduce the violation")


def explore(config: ExploreConfig, depth: int, *, survey: bool = False) -> ExploreResult:
    """Breadth-first search to ``depth`` moves; the first violation with its trace.
    ``survey``: go on past violations instead and report every rule broken and every
    terminal state (``Survey``), to compare searches."""
    collecting = gc.isenabled()
    gc.disable()  # rule 6
    try:
        try:
            return _search(config, depth, survey)
        except ReductionError:  # rule 7: a machine broke a premise of the reduction
            return _search(replace(config, reduction="none"), depth, survey)
    finally:
        if collecting:
            gc.enable()


def _search(config: ExploreConfig, depth: int, survey: bool) -> ExploreResult:
    start = World.start(config.world)
    if not config.requests:
        start.forget_views()
    start_key = _Key((start.key(), 0))
    parents: dict[object, tuple[object, tuple[object, ...]] | None] = {start_key: None}
    frontier: list[tuple[object, Node]] = [(start_key, (start, 0))]
    rules: set[str] = set()
    ends: set[object] = set()
    reached = 0
    for level in range(depth + 1):
        next_frontier: list[tuple[object, Node]] = []
        fresh: set[object] = set()  # the keys first reached at the next level
        for key, (world, position) in frontier:
            network = world.network_moves()
            moves = network + _client_moves(config, world, position)
            try:
                if not network:
                    world.check_quiescent()
            except Violation as violation:
                if not survey:
                    path = _path(parents, key)
                    return ExploreResult(
                        states=len(parents),
                        depth=level,
                        violation=_replay(config, path),
                        reduction=config.reduction,
                    )
                rules.add(violation.rule)
                continue
            if not moves:
                ends.add(key.value)
            if level == depth:
                continue
            # A death changes the group as a scale does: no reduction while one may come,
            # nor while a scale may move on (por rule 2a).
            no_scale_left = not world.deaths_left and all(
                op[0] != "scale" for op in config.script[position:]
            )
            scaling_over = no_scale_left and not world.scaler.active
            # An abort may cut into a scale at any moment: a scale moving on (rule 2a).
            scale_waits = (
                world.scaler.active
                and world.client.awaited_call is not None
                and not config.world.abort_scales
            )
            reducible = scaling_over or (no_scale_left and scale_waits and not config.world.deaths)
            # A drift changes a rank outside its own moves: no reduction while one may come.
            reducible = reducible and not world.drift_moves()
            calm = _calm(config, world, position) if reducible else frozenset()
            submits_left = world.client.submitted < len(config.requests)
            chosen = (persistent_moves(world, moves, calm, submits_left) if calm else None) or moves
            children: list[tuple[object, Node, tuple[object, ...]]] = []
            todo, full = list(chosen), chosen is moves
            while todo:
                move = todo.pop(0)
                try:
                    children.append(_child(config, world, position, move, scaling_over))
                except _Violating as violating:
                    if not survey:
                        path = [*_path(parents, key), move]
                        return ExploreResult(
                            states=len(parents),
                            depth=level + 1,
                            violation=_replay(config, path),
                            reduction=config.reduction,
                        )
                    # A survey goes on past it: the paths that avoid the move are
                    # only kept by expanding the state in full.
                    rules.add(violating.rule)
                    back = True
                else:
                    # Rule 7: a move back to this level or an earlier one.
                    child_key = children[-1][0]
                    back = child_key in parents and child_key not in fresh
                if back and not full:
                    full = True
                    todo += [other for other in moves if other not in chosen]
            for child_key, node, move in children:
                if child_key not in parents:
                    parents[child_key] = (key, move)
                    fresh.add(child_key)
                    next_frontier.append((child_key, node))
        if not next_frontier:
            break
        reached = level + 1
        frontier = next_frontier
    # Nothing is expanded at the bound: a search that reached it says nothing beyond.
    complete = reached < depth
    found = Survey(rules=frozenset(rules), ends=frozenset(ends)) if survey else None
    return ExploreResult(
        states=len(parents),
        depth=reached,
        violation=None,
        complete=complete,
        survey=found,
        reduction=config.reduction,
    )


class _Key:
    """A state's key with its hash computed once: each key is looked up several times,
    and a tuple hashes its nested snapshots anew on every lookup."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: object) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self._hash == other._hash and self.value == other.value


class _Violating(Exception):
    def __init__(self, rule: str) -> None:
        self.rule = rule


def _calm(config: ExploreConfig, world: World, position: int) -> frozenset[int]:
    if config.reduction == "none":
        return frozenset()
    routing = world.client.routing
    targets = frozenset(spec.rank % routing for spec in config.requests[world.client.submitted :])
    return calm_ranks(world, targets, position < len(config.script))


def _child(
    config: ExploreConfig,
    world: World,
    position: int,
    move: tuple[object, ...],
    scaling_over: bool,
) -> tuple[object, Node, tuple[object, ...]]:
    """The state ``move`` leads to, checked for the reduction's premises."""
    child = world.clone()
    try:
        child_position = _apply(config, child, position, move)
    except Violation as violation:
        raise _Violating(violation.rule) from violation
    if config.reduction == "por":
        check_premises(world, move, child, scaling_over=scaling_over)
        drop_inert(child)
    return _Key((child.key(), child_position)), (child, child_position), move


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
