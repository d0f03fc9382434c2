"""The DP coordinator's protocol: the global wave, whether the engines run, statistics.

Theory of operation:

1. The coordinator believes the engines IDLE or RUNNING; ``wave`` never goes backwards.
2. ``FirstRequest`` while IDLE broadcasts ``StartWave`` to every rank but the one that
   asked. It does NOT mark the engines running: a paused or sleeping rank discards the
   broadcast, and only a rank's own announcement proves a wave runs.
3. ``RankStartedWave(w)`` for a newer wave, or for the current wave while IDLE: adopt
   it, mark RUNNING, re-broadcast excluding the sender, publish at once. Otherwise it
   is old news and is ignored.
4. ``WaveCompleted(w)`` with ``w >= wave``: ``wave = w + 1``, mark IDLE, publish at
   once. Duplicates and stale completions change nothing.
5. ``RankStats`` updates that rank's counts and asks for a publication the caller may
   rate-limit (``immediate=False``); wave changes ask for one at once.
6. ``Resize`` (elastic scaling) changes the number of ranks; statistics of removed
   ranks are dropped and new ranks start at zero. A message from a removed rank, or a
   ``FirstRequest`` naming one, can still arrive after the resize (it was in flight on
   another connection): it is about a wave the scale's pause ended, so it is ignored. A
   rank that never belonged to the group is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .table import TableMachine, Transition


class CoordinatorPhase(Enum):
    IDLE = "idle"
    RUNNING = "running"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLoad:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0


# -- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstRequest:
    rank: int
    wave: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStartedWave:
    rank: int
    wave: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WaveCompleted:
    wave: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    rank: int
    waiting: int
    running: int
    kv_usage: float

    def __post_init__(self) -> None:
        if self.waiting < 0 or self.running < 0:
            raise ValueError(f"RankStats counts must be >= 0, got {self.waiting}, {self.running}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"RankStats.kv_usage must be within [0, 1], got {self.kv_usage}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resize:
    dp_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"Resize.dp_size must be >= 1, got {self.dp_size}")


# -- actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastStartWave:
    wave: int
    exclude_rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishState:
    wave: int
    engines_running: bool
    loads: tuple[RankLoad, ...]
    immediate: bool


# -- machine ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSnapshot:
    phase: CoordinatorPhase
    wave: int
    loads: tuple[RankLoad, ...]
    departed: frozenset[int] = frozenset()


_IDLE, _RUNNING = CoordinatorPhase
Result = tuple[CoordinatorSnapshot, tuple[object, ...]]


def _rows() -> dict[tuple[CoordinatorPhase, type], Transition]:
    rows: dict[tuple[CoordinatorPhase, type], Transition] = {}
    for phase in CoordinatorPhase:
        rows[phase, FirstRequest] = Transition(handler="on_first_request", targets=(phase,))
        rows[phase, RankStartedWave] = Transition(
            handler="on_started", targets=tuple(dict.fromkeys((phase, _RUNNING)))
        )
        rows[phase, WaveCompleted] = Transition(
            handler="on_completed", targets=tuple(dict.fromkeys((phase, _IDLE)))
        )
        rows[phase, RankStats] = Transition(handler="on_stats", targets=(phase,))
        rows[phase, Resize] = Transition(handler="on_resize", targets=(phase,))
    return rows


class CoordinatorMachine(TableMachine[CoordinatorSnapshot]):
    """The coordinator of one DP group; see the module docstring."""

    TRANSITIONS = _rows()

    def __init__(self, dp_size: int) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self._state = CoordinatorSnapshot(
            phase=_IDLE, wave=0, loads=tuple(RankLoad() for _ in range(dp_size))
        )

    @property
    def wave(self) -> int:
        return self._state.wave

    @property
    def engines_running(self) -> bool:
        return self._state.phase is _RUNNING

    @property
    def dp_size(self) -> int:
        return len(self._state.loads)

    # -- rules that broken variants in the tests override ----------------------------

    def marks_running_on_first_request(self) -> bool:
        """Rule 2: never on its own."""
        return False

    def completion_applies(self, state: CoordinatorSnapshot, wave: int) -> bool:
        """Rule 4: only a completion of the current or a newer wave."""
        return wave >= state.wave

    # -- handlers ----------------------------------------------------------------------

    def _current_rank(self, state: CoordinatorSnapshot, event: object, rank: int) -> bool:
        """Whether ``rank`` is in the group (False: it left, its news is stale)."""
        if 0 <= rank < len(state.loads):
            return True
        if rank in state.departed:
            return False
        raise self.refuse(state, event, f"rank {rank} outside dp_size {len(state.loads)}")

    def _publish(self, state: CoordinatorSnapshot, *, immediate: bool) -> PublishState:
        return PublishState(
            wave=state.wave,
            engines_running=state.phase is _RUNNING,
            loads=state.loads,
            immediate=immediate,
        )

    def on_first_request(self, state: CoordinatorSnapshot, event: FirstRequest) -> Result:
        if not self._current_rank(state, event, event.rank) or state.phase is _RUNNING:
            return state, ()
        wave = max(state.wave, event.wave)
        woken = replace(state, wave=wave)
        if self.marks_running_on_first_request():
            woken = replace(woken, phase=_RUNNING)
        return woken, (BroadcastStartWave(wave=wave, exclude_rank=event.rank),)

    def on_started(self, state: CoordinatorSnapshot, event: RankStartedWave) -> Result:
        if not self._current_rank(state, event, event.rank):
            return state, ()
        newer = event.wave > state.wave
        if not newer and not (event.wave == state.wave and state.phase is _IDLE):
            return state, ()
        running = replace(state, phase=_RUNNING, wave=event.wave)
        broadcast = BroadcastStartWave(wave=event.wave, exclude_rank=event.rank)
        return running, (broadcast, self._publish(running, immediate=True))

    def on_completed(self, state: CoordinatorSnapshot, event: WaveCompleted) -> Result:
        if not self.completion_applies(state, event.wave):
            return state, ()
        idle = replace(state, phase=_IDLE, wave=event.wave + 1)
        return idle, (self._publish(idle, immediate=True),)

    def on_stats(self, state: CoordinatorSnapshot, event: RankStats) -> Result:
        if not self._current_rank(state, event, event.rank):
            return state, ()
        load = RankLoad(waiting=event.waiting, running=event.running, kv_usage=event.kv_usage)
        if state.loads[event.rank] == load:
            return state, ()
        loads = (*state.loads[: event.rank], load, *state.loads[event.rank + 1 :])
        updated = replace(state, loads=loads)
        return updated, (self._publish(updated, immediate=False),)

    def on_resize(self, state: CoordinatorSnapshot, event: Resize) -> Result:
        kept = state.loads[: event.dp_size]
        loads = kept + tuple(RankLoad() for _ in range(event.dp_size - len(kept)))
        removed = frozenset(range(event.dp_size, len(state.loads)))
        departed = (state.departed | removed) - frozenset(range(event.dp_size))
        resized = replace(state, loads=loads, departed=departed)
        return resized, (self._publish(resized, immediate=True),)
