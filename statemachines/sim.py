"""Randomized simulation of a DP deployment, and the explorer's command line.

Theory of operation:

1. ``Simulation`` wraps one ``World`` (see ``world.py``): N ranks, a coordinator, a
   client, FIFO channels per (sender, receiver). Client operations (``submit``,
   ``pause``, ``resume``, ``sleep``, ``wake``, ``scale``) send their messages at once;
   ``step()`` then performs one enabled move chosen by the seeded generator, so every
   seed is one reproducible interleaving.
2. A scale is the script of the client's ``ScalingMachine`` (drain the leaving ranks,
   pause every rank KEEP, stop the leaving ones, switch groups, wait for the
   coordinator's new size, resume). ``step()`` runs its later parts, and a drain
   timeout, as client moves among the others; ``abort_scale()`` aborts it where the
   machine rolls it back (never a random move: a scale would rarely finish).
3. ``run()`` steps until nothing is left to deliver or step, then checks the end-state
   properties. Any broken property raises ``Violation`` carrying the whole trace.
4. ``python -m wavecore.statemachines.sim --dp 3`` explores every interleaving of the
   small configurations of ``explore.default_configs`` (requests, pauses of each mode
   with resumes, a sleep and its wake, scales up and down with and without a request),
   to depth 60 unless ``--depth`` says less, and
   exits 0 with "no violation", or 1 with the violating trace; ``--break NAME`` runs a
   deliberately broken variant, ``--scenario NAME`` only the configurations named.
   Each configuration's line gives the depth reached, the states, the seconds (wall
   clock, and the process's CPU time, which a machine shared with other work does not
   inflate), and whether it explored every reachable state or stopped at its depth
   bound.
   ``--reduction none`` turns off the partial-order reduction (``harness/por.py``).
   ``--every-variant`` runs each broken variant through the scenarios instead and
   exits 1 if one escapes them all (a rule guarded only by a deeper or special search
   is a gap).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from .harness.explore import ExploreConfig, default_configs, explore
from .harness.por import REDUCTIONS
from .harness.variants import VARIANTS
from .harness.world import ClientRefused, RequestSpec, Violation, World, WorldConfig
from .rank_events import PauseMode

__all__ = ["ClientRefused", "Simulation", "Violation", "main"]


class Simulation:
    """N ranks and a coordinator under one seeded random interleaving."""

    def __init__(
        self,
        dp_size: int,
        seed: int,
        *,
        sync_interval: int = 1,
        lockstep: bool = True,
        duplicate_wave_complete: bool = True,
        variant: str | None = None,
    ) -> None:
        config = WorldConfig(
            dp_size=dp_size,
            sync_interval=sync_interval,
            lockstep=lockstep,
            duplicate_wave_complete=duplicate_wave_complete,
            abort_scales=True,
        )
        if variant is not None:
            if variant not in VARIANTS:
                raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
            chosen = VARIANTS[variant]
            config = replace(
                config,
                rank_class=chosen.rank_class,
                coordinator_class=chosen.coordinator_class,
                scaling_class=chosen.scaling_class,
            )
        self.world = World.start(config)
        self.world.trace = []
        self._random = random.Random(seed)
        self.moves = 0

    @property
    def trace(self) -> list[str]:
        return self.world.trace or []

    def _guard(self, action: object) -> None:
        try:
            action()  # type: ignore[operator]
        except Violation as violation:
            violation.trace = list(self.trace)
            raise

    # -- client operations ------------------------------------------------------------------

    def submit(self, *, steps: int = 2, stalls: int = 0, rank: int | None = None) -> int:
        if steps < 1 or stalls < 0:
            raise ValueError(f"a request needs steps >= 1 and stalls >= 0, got {steps}, {stalls}")
        target = self._random.randrange(self.world.client.group) if rank is None else rank
        spec = RequestSpec(rank=target, steps=steps, stalls=stalls)
        ids: list[int] = []
        self._guard(lambda: ids.append(self.world.submit(spec)))
        return ids[0]

    def _op(self, op: tuple[object, ...]) -> None:
        self._guard(lambda: self.world.client_op(op))

    def pause(self, mode: PauseMode) -> None:
        self._op(("pause", mode))

    def resume(self) -> None:
        self._op(("resume",))

    def sleep(self, level: int, mode: PauseMode = PauseMode.ABORT) -> None:
        self._op(("sleep", level, mode))

    def wake(self) -> None:
        self._op(("wake",))

    def scale(self, dp_size: int) -> None:
        if dp_size < 1 or dp_size == self.world.client.group:
            raise ValueError(
                f"scale to {dp_size}: must differ from {self.world.client.group} and be >= 1"
            )
        self._op(("scale", dp_size))

    def abort_scale(self) -> bool:
        """Abort the running scale where it can be rolled back (``World.abort_moves``);
        False where it cannot. Never one of ``step``'s random moves: a scale would
        rarely finish."""
        if not self.world.abort_moves():
            return False
        self._guard(lambda: self.world.apply(("scale_abort",)))
        return True

    # -- running ------------------------------------------------------------------------------

    @property
    def reconfiguring(self) -> bool:
        """A scale is in progress: other operations are refused."""
        return self.world.scaler.active

    def quiescent(self) -> bool:
        return self.world.quiescent() and not self.world.scale_moves()

    def step(self) -> bool:
        """One randomly chosen move (the scale's moves among them); False when nothing
        can move."""
        moves = [
            *self.world.network_moves(),
            *self.world.scale_moves(),
            *self.world.death_moves(),
        ]
        if not moves:
            return False
        move = self._random.choice(moves)
        self._guard(lambda: self.world.apply(move))
        self.moves += 1
        return True

    def run(self, max_moves: int = 100_000) -> int:
        """Step until quiescent, then check the end-state properties. A run still moving
        after ``max_moves`` is a livelock (ranks stepping forever), never a success."""
        start = self.moves
        while self.step():
            if self.moves - start >= max_moves:
                violation = Violation("livelock", f"still moving after {max_moves} moves")
                violation.trace = list(self.trace)
                raise violation
        self._guard(self.world.check_quiescent)
        return self.moves - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wavecore.statemachines.sim",
        description="Explore every interleaving of a small DP deployment.",
    )
    parser.add_argument("--dp", type=int, default=2, help="number of ranks (2 or 3 is practical)")
    parser.add_argument("--depth", type=int, default=60, help="maximum number of moves")
    parser.add_argument(
        "--break", dest="variant", choices=sorted(VARIANTS), help="run a deliberately broken rule"
    )
    parser.add_argument(
        "--sync-interval", type=int, default=1, help="steps between lockstep votes (default 1)"
    )
    parser.add_argument(
        "--reduction",
        choices=REDUCTIONS,
        default="por",
        help="por (default): one rank's moves where they stand for all; none: every move",
    )
    parser.add_argument(
        "--every-variant",
        action="store_true",
        help="run every broken variant; exit 1 if one is caught by no scenario",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help="explore only this configuration (repeatable; default: every one)",
    )
    args = parser.parse_args(argv)
    if args.sync_interval < 1:
        parser.error(f"--sync-interval must be >= 1, got {args.sync_interval}")
    configs = default_configs(args.dp, args.sync_interval)
    names = [name for name, _ in configs]
    unknown = sorted(set(args.scenario or ()) - set(names))
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)} at dp {args.dp}: choose from {names}")
    if args.every_variant:
        return _catch_every_variant(configs, args)
    total = 0
    for name, config in configs:
        if args.scenario and name not in args.scenario:
            continue
        config = replace(config, reduction=args.reduction)
        if args.variant:
            config = config.broken(args.variant)
        started, cpu_started = time.perf_counter(), time.process_time()
        result = explore(config, args.depth)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        total += result.states
        extent = "every state" if result.complete else "stopped at the depth bound"
        print(
            f"{name}: dp={args.dp} sync_interval={args.sync_interval} "
            f"reduction={result.reduction} depth={result.depth} "
            f"states explored: {result.states} "
            f"({seconds:.1f} s, {cpu:.1f} s CPU, {extent})"
        )
        if result.violation is not None:
            print(result.violation.report())
            return 1
    print(f"{total} states explored in all: no violation")
    return 0


def _catch_every_variant(
    configs: tuple[tuple[str, ExploreConfig], ...], args: argparse.Namespace
) -> int:
    """Each broken variant must be caught by one of the scenarios at the depth asked
    for: a rule guarded only by a deeper or special search is a gap."""
    escaped = []
    for variant in sorted(VARIANTS):
        for name, config in configs:
            if args.scenario and name not in args.scenario:
                continue
            broken = replace(config, reduction=args.reduction).broken(variant)
            result = explore(broken, args.depth)
            if result.violation is not None:
                print(
                    f"{variant}: caught by {name} at depth {result.depth} ({result.violation.rule})"
                )
                break
        else:
            escaped.append(variant)
            print(f"{variant}: NOT caught by any scenario at depth {args.depth}")
    if escaped:
        print(f"{len(escaped)} broken variants escaped: {', '.join(escaped)}")
        return 1
    print(f"all {len(VARIANTS)} broken variants caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
