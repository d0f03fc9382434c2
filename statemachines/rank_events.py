"""The rank machine's vocabulary: its phases and pause states, the events it takes and
the actions it returns (``rank`` explains what each means and when it is legal)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PauseMode(Enum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class PauseState(Enum):
    UNPAUSED = "unpaused"
    PENDING = "pending"
    PAUSED = "paused"


class RankPhase(Enum):
    IDLE = "idle"
    RUNNING = "running"
    SYNCING = "syncing"
    BARRIER = "barrier"
    SWITCHING = "switching"


SLEEP_TAGS = frozenset({"weights", "kv_cache", "scheduling"})


def sleep_tags(level: int) -> frozenset[str]:
    """What a sleep of this level puts to sleep."""
    return frozenset({"scheduling"}) if level == 0 else SLEEP_TAGS


def _check_non_negative(owner: object, **values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be >= 0, got {value}")


# -- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived:
    """A request was added to this rank's scheduler (stamped with the client's wave)."""

    request_id: str
    wave: int

    def __post_init__(self) -> None:
        _check_non_negative(self, wave=self.wave)


@dataclass(frozen=True, slots=True, kw_only=True)
class StartWave:
    wave: int
    exclude_rank: int

    def __post_init__(self) -> None:
        _check_non_negative(self, wave=self.wave)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    """One scheduler step: whether it ran a forward, whether any request is unfinished,
    and whether one the scheduler admitted is (running, or preempted and waiting to be
    recomputed): what a WAIT pause lets finish (rule 6). A step may run nothing while
    admitted work remains (a preempted request is readmitted only on a prefill step),
    so ``executed`` alone cannot say a WAIT pause's drain is over."""

    executed: bool
    has_unfinished: bool
    has_admitted: bool

    def __post_init__(self) -> None:
        if self.has_admitted and not self.has_unfinished:
            raise ValueError("StepDone: has_admitted without has_unfinished")


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncDone:
    """The result of a vote: OR of the voters' work, the count of pausing voters."""

    any_unfinished: bool
    pausing_ranks: int
    wave_span: tuple[int, int] | None = None
    step_counter_span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _check_non_negative(self, pausing_ranks=self.pausing_ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseRequested:
    mode: PauseMode


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRequested:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeSynced:
    any_unfinished: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepRequested:
    """Pause in ``mode`` (what happens to requests in flight), then sleep ``level``."""

    level: int
    mode: PauseMode = PauseMode.ABORT

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2):
            raise ValueError(f"SleepRequested.level must be 0, 1 or 2, got {self.level}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeUpRequested:
    """Wake the given parts; ``None`` wakes everything."""

    tags: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.tags is not None and not self.tags <= SLEEP_TAGS:
            unknown = sorted(self.tags - SLEEP_TAGS)
            raise ValueError(f"WakeUpRequested.tags: unknown {unknown}; known {sorted(SLEEP_TAGS)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchRequested:
    """A scale's commit: join the new DP group of ``dp_size`` ranks."""

    dp_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"SwitchRequested.dp_size must be >= 1, got {self.dp_size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconfigured:
    """The new group's all-reduced max of (running, wave, step_counter), plus placement."""

    rank: int
    dp_size: int
    wave: int
    running: bool
    step_counter: int

    def __post_init__(self) -> None:
        _check_non_negative(self, rank=self.rank, wave=self.wave, step_counter=self.step_counter)
        if not 0 <= self.rank < self.dp_size:
            raise ValueError(f"Reconfigured.rank {self.rank} outside dp_size {self.dp_size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLost:
    """Rule 13: the DP group is broken; pause out of it and wait for a switch."""


# -- actions ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDummyBatch:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class StartVote:
    """Start, without waiting, the all-reduce of ``[has_unfinished, pending_pause]`` (OR
    and count); wave and step_counter are for the drift check (min and max)."""

    has_unfinished: bool
    pending_pause: bool
    wave: int
    step_counter: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AwaitVote:
    """Wait for the oldest vote this rank started; feed its result as ``SyncDone``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainVote:
    """Wait for the oldest vote this rank started and drop its result: the wave it
    would have decided on is over."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeBarrier:
    has_unfinished: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyStartWave:
    wave: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyWaveComplete:
    wave: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseComplete:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseScheduler:
    """ABORT: finish every request as aborted, then hold new ones; WAIT: hold new ones,
    let running ones finish; KEEP: schedule nothing, keep everything."""

    mode: PauseMode


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeScheduler:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestHeld:
    """Tell the client its request waits (``reason`` is "paused" or "asleep")."""

    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinGroup:
    """Join the new group and all-reduce the max of (running, wave, step_counter) over
    it; feed the result as ``Reconfigured``."""

    dp_size: int
    running: bool
    wave: int
    step_counter: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSwitched:
    """The switch is done: answer the commit."""

    dp_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EnterSleep:
    level: int
    tags: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeUp:
    tags: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Idle:
    pass
