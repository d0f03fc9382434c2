"""Every (state, event) pair of every transition table: a listed transition or a
ProtocolError that leaves the machine exactly as it was."""

from __future__ import annotations

from itertools import product

import pytest

from wavecore.statemachines import (
    CoordinatorMachine,
    CoordinatorPhase,
    CoordinatorResized,
    Drained,
    FirstRequest,
    GroupLeft,
    GroupLost,
    PauseMode,
    PauseRequested,
    PauseState,
    ProtocolError,
    RankMachine,
    RankPhase,
    RanksLost,
    RanksPaused,
    RanksReady,
    RankStartedWave,
    RankStats,
    Reconfigured,
    RequestArrived,
    Resize,
    Resumed,
    ResumeRequested,
    ResumeSynced,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScalingMachine,
    SleepRequested,
    StartWave,
    StepDone,
    SwitchDone,
    SwitchRequested,
    SyncDone,
    WakeUpRequested,
    WaveCompleted,
)
from wavecore.statemachines.coordinator import CoordinatorSnapshot, RankLoad
from wavecore.statemachines.rank import RankSnapshot
from wavecore.statemachines.scaling import ScalingSnapshot

RANK_EVENTS = [
    RequestArrived(request_id="a", wave=0),
    RequestArrived(request_id="b", wave=3),
    StartWave(wave=1, exclude_rank=0),
    StartWave(wave=2, exclude_rank=1),
    StepDone(executed=True, has_unfinished=True, has_admitted=True),
    StepDone(executed=False, has_unfinished=True, has_admitted=True),
    StepDone(executed=False, has_unfinished=True, has_admitted=False),
    StepDone(executed=False, has_unfinished=False, has_admitted=False),
    SyncDone(any_unfinished=True, pausing_ranks=0),
    SyncDone(any_unfinished=False, pausing_ranks=0),
    SyncDone(any_unfinished=False, pausing_ranks=2),
    SyncDone(any_unfinished=False, pausing_ranks=1, step_counter_span=(0, 5)),
    *(PauseRequested(mode=mode) for mode in PauseMode),
    ResumeRequested(),
    ResumeSynced(any_unfinished=True),
    ResumeSynced(any_unfinished=False),
    *(SleepRequested(level=level, mode=mode) for level in (0, 1, 2) for mode in PauseMode),
    WakeUpRequested(),
    WakeUpRequested(tags=frozenset({"weights"})),
    WakeUpRequested(tags=frozenset({"scheduling"})),
    SwitchRequested(dp_size=3),
    Reconfigured(rank=1, dp_size=3, wave=2, running=False, step_counter=1),
    Reconfigured(rank=1, dp_size=3, wave=2, running=True, step_counter=1),
    GroupLost(),
]


def _consistent(
    lockstep: bool, phase: RankPhase, pause: PauseState, running: bool, asleep: bool
) -> bool:
    """The combinations a rank can actually reach (the others are not states at all)."""
    if running != (phase in (RankPhase.RUNNING, RankPhase.SYNCING)):
        return False
    if asleep and pause is not PauseState.PAUSED:
        return False
    if pause is PauseState.PAUSED and phase not in (RankPhase.IDLE, RankPhase.SWITCHING):
        return False
    if phase is RankPhase.SWITCHING and pause is not PauseState.PAUSED:
        return False
    if phase is RankPhase.BARRIER and (pause is not PauseState.UNPAUSED or not lockstep):
        return False
    if lockstep and pause is PauseState.PENDING and not running:
        return False
    return not (not lockstep and phase is RankPhase.SYNCING)


def _rank_states() -> list[tuple[bool, RankSnapshot]]:
    states = []
    for lockstep, phase, pause, running, asleep in product(
        (True, False), RankPhase, PauseState, (False, True), (frozenset(), frozenset({"weights"}))
    ):
        if not _consistent(lockstep, phase, pause, running, bool(asleep)):
            continue
        snapshot = RankSnapshot(
            phase=phase,
            rank=0,
            dp_size=2,
            wave=1,
            running=running,
            step_counter=1,
            pause_state=pause,
            pause_mode=None if pause is PauseState.UNPAUSED else PauseMode.KEEP,
            ignore_start_wave=pause is PauseState.PAUSED,
            has_work=running,
            asleep=asleep,
        )
        states.append((lockstep, snapshot))
    return states


@pytest.mark.parametrize(("lockstep", "snapshot"), _rank_states())
def test_rank_machine_every_state_and_event(lockstep: bool, snapshot: RankSnapshot) -> None:
    for event in RANK_EVENTS:
        machine = RankMachine(0, 2, sync_interval=2, lockstep=lockstep)
        machine.restore(snapshot)
        transition = RankMachine.TRANSITIONS.get((snapshot.phase, type(event)))
        try:
            machine.handle(event)
        except ProtocolError as error:
            assert machine.snapshot() == snapshot, f"{event} changed the state before refusing"
            assert "RankMachine" in str(error) and snapshot.phase.name in str(error)
            continue
        assert transition is not None, f"{event} accepted in {snapshot.phase} without a row"
        assert machine.phase in transition.targets, f"{event}: {snapshot.phase} -> {machine.phase}"


COORDINATOR_EVENTS = [
    FirstRequest(rank=0, wave=0),
    FirstRequest(rank=5, wave=0),
    RankStartedWave(rank=1, wave=1),
    RankStartedWave(rank=1, wave=3),
    RankStartedWave(rank=1, wave=0),
    WaveCompleted(wave=0),
    WaveCompleted(wave=2),
    RankStats(rank=1, waiting=2, running=1, kv_usage=0.5),
    RankStats(rank=4, waiting=2, running=1, kv_usage=0.5),
    Resize(dp_size=3),
]


@pytest.mark.parametrize("phase", list(CoordinatorPhase))
def test_coordinator_every_state_and_event(phase: CoordinatorPhase) -> None:
    snapshot = CoordinatorSnapshot(phase=phase, wave=1, loads=(RankLoad(), RankLoad()))
    for event in COORDINATOR_EVENTS:
        machine = CoordinatorMachine(2)
        machine.restore(snapshot)
        transition = CoordinatorMachine.TRANSITIONS.get((phase, type(event)))
        try:
            machine.handle(event)
        except ProtocolError:
            assert machine.snapshot() == snapshot
            continue
        assert transition is not None
        assert machine.snapshot().phase in transition.targets
        assert machine.wave >= snapshot.wave


SCALING_EVENTS = [
    ScaleRequested(old_dp_size=2, dp_size=3),
    ScaleRequested(old_dp_size=2, dp_size=1),
    RanksReady(),
    Drained(),
    RanksPaused(),
    SwitchDone(),
    CoordinatorResized(),
    Resumed(),
    ScaleAborted(reason="test"),
    RanksLost(old_dp_size=2, lost=(0,)),
    RanksLost(old_dp_size=3, lost=(2,)),
    GroupLeft(),
]


@pytest.mark.parametrize(("phase", "old", "new"), list(product(ScalePhase, (2,), (1, 3))))
def test_scaling_every_state_and_event(phase: ScalePhase, old: int, new: int) -> None:
    snapshot = ScalingSnapshot(phase=phase, old_dp_size=old, dp_size=new)
    for event in SCALING_EVENTS:
        machine = ScalingMachine()
        machine.restore(snapshot)
        transition = ScalingMachine.TRANSITIONS.get((phase, type(event)))
        try:
            machine.handle(event)
        except ProtocolError as error:
            assert machine.snapshot() == snapshot
            assert "ScalingMachine" in str(error) and phase.name in str(error)
            continue
        assert transition is not None
        assert machine.phase in transition.targets


def test_a_vote_with_drift_fails_loudly() -> None:
    machine = RankMachine(0, 2, sync_interval=4)
    machine.handle(RequestArrived(request_id="r", wave=0))
    machine.handle(StepDone(executed=True, has_unfinished=True, has_admitted=True))  # starts vote 1
    machine.handle(
        StepDone(executed=True, has_unfinished=True, has_admitted=True)
    )  # starts 2, awaits 1
    before = machine.snapshot()
    with pytest.raises(ProtocolError, match=r"step_counter 1 here, 1\.\.3"):
        machine.handle(SyncDone(any_unfinished=True, pausing_ranks=0, step_counter_span=(1, 3)))
    assert machine.snapshot() == before


def test_resume_is_refused_while_a_pause_is_pending() -> None:
    machine = RankMachine(0, 2)
    machine.handle(PauseRequested(mode=PauseMode.KEEP))
    with pytest.raises(ProtocolError, match="pause is still pending"):
        machine.handle(ResumeRequested())
    assert machine.pause_state is PauseState.PENDING


def test_bad_event_fields_get_specific_errors() -> None:
    with pytest.raises(ValueError, match="level must be 0, 1 or 2"):
        SleepRequested(level=5)
    with pytest.raises(ValueError, match="unknown"):
        WakeUpRequested(tags=frozenset({"gpu"}))
    with pytest.raises(ValueError, match="wave must be >= 0"):
        RequestArrived(request_id="r", wave=-1)
