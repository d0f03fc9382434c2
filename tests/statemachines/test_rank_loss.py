"""Rank loss (`on_rank_failure="shrink"`): `RankMachine` rule 13 (`GroupLost`), the
loop's `group_lost` (rule 6), `ScalingMachine` rule 9 (`RanksLost`), and a death in
the simulated world (its rule 5)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wavecore.statemachines import (
    AwaitVote,
    Call,
    Collective,
    CoordinatorResized,
    DropRanks,
    GroupLeft,
    GroupLost,
    Idle,
    LeaveGroup,
    NotifyWaveComplete,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    PauseState,
    ProtocolError,
    RankLoop,
    RankMachine,
    RankPhase,
    RanksLost,
    Reconfigured,
    ReconfigureFinished,
    ResizeCoordinator,
    ResizeTables,
    Resumed,
    ResumeRanks,
    ScaleAbandoned,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScalingMachine,
    StepDone,
    SwitchDone,
    SwitchGroup,
    SwitchRequested,
    WaitForInput,
)
from wavecore.statemachines.harness.world import RequestSpec, World, WorldConfig
from wavecore.statemachines.rank import RankSnapshot
from wavecore.statemachines.rank_events import GroupSwitched

LEFT = (PauseScheduler(mode=PauseMode.KEEP), PauseComplete(), Idle())


def _state(phase: RankPhase, **fields: object) -> RankSnapshot:
    running = phase in (RankPhase.RUNNING, RankPhase.SYNCING)
    return replace(
        RankSnapshot(phase=phase, rank=2, dp_size=3, wave=4, step_counter=3),
        running=running,
        has_work=running,
        **fields,
    )


@pytest.mark.parametrize(
    ("phase", "fields"),
    [
        (RankPhase.IDLE, {}),
        (RankPhase.RUNNING, {"open_votes": 1}),
        (RankPhase.SYNCING, {"open_votes": 2}),
        (
            RankPhase.SYNCING,
            {"open_votes": 1, "pause_state": PauseState.PENDING, "pause_mode": PauseMode.WAIT},
        ),
        (RankPhase.BARRIER, {}),
    ],
)
def test_a_lost_group_pauses_the_rank_keep_without_a_vote(
    phase: RankPhase, fields: dict[str, object]
) -> None:
    machine = RankMachine(2, 3)
    before = _state(phase, **fields)
    machine.restore(before)
    assert machine.handle(GroupLost()) == LEFT
    after = machine.snapshot()
    assert (after.phase, after.running, after.open_votes) == (RankPhase.IDLE, False, 0)
    assert (after.pause_state, after.pause_mode) == (PauseState.PAUSED, PauseMode.KEEP)
    assert after.ignore_start_wave and after.has_work == before.has_work  # work is kept
    # Again while so paused: nothing changes.
    assert machine.handle(GroupLost()) == LEFT
    assert machine.snapshot() == after


def test_an_abort_pause_stays_abort_when_the_group_is_lost() -> None:
    machine = RankMachine(2, 3)
    pending = dict(pause_state=PauseState.PENDING, pause_mode=PauseMode.ABORT, open_votes=1)
    machine.restore(_state(RankPhase.SYNCING, **pending))
    machine.handle(GroupLost())
    assert machine.snapshot().pause_mode is PauseMode.ABORT


def test_a_switching_rank_refuses_a_lost_group_and_changes_nothing() -> None:
    machine = RankMachine(2, 3)
    machine.restore(_state(RankPhase.SWITCHING, pause_state=PauseState.PAUSED))
    before = machine.snapshot()
    with pytest.raises(ProtocolError, match="SWITCHING"):
        machine.handle(GroupLost())
    assert machine.snapshot() == before


def test_a_survivor_switches_to_the_smaller_group_under_its_new_number() -> None:
    machine = RankMachine(2, 3)
    machine.restore(_state(RankPhase.SYNCING, open_votes=2))
    machine.handle(GroupLost())
    machine.handle(SwitchRequested(dp_size=2))
    machine.handle(Reconfigured(rank=1, dp_size=2, wave=4, running=False, step_counter=3))
    after = machine.snapshot()
    assert (after.rank, after.dp_size, after.phase) == (1, 2, RankPhase.IDLE)
    assert after.pause_state is PauseState.PAUSED  # until the shrink resumes it


@pytest.mark.parametrize(("rank", "notify"), [(0, (NotifyWaveComplete(wave=4),)), (1, ())])
def test_the_switch_after_a_loss_ends_the_lost_groups_wave(
    rank: int, notify: tuple[object, ...]
) -> None:
    # No vote ended the wave the survivors left: the coordinator may believe it runs,
    # and its START_DP_WAVE may still be in flight. The new rank 0 reports it complete.
    machine = RankMachine(2, 3)
    machine.restore(_state(RankPhase.RUNNING, open_votes=1))
    machine.handle(GroupLost())
    machine.handle(SwitchRequested(dp_size=2))
    agreed = Reconfigured(rank=rank, dp_size=2, wave=4, running=False, step_counter=3)
    assert machine.handle(agreed) == (*notify, GroupSwitched(dp_size=2))
    after = machine.snapshot()
    assert (after.wave, after.step_counter, after.left_group) == (5, 0, False)


def test_a_switch_without_a_loss_keeps_the_agreed_wave() -> None:
    machine = RankMachine(1, 2)
    machine.restore(_state(RankPhase.IDLE, rank=1, dp_size=2, pause_state=PauseState.PAUSED))
    machine.handle(SwitchRequested(dp_size=3))
    agreed = Reconfigured(rank=1, dp_size=3, wave=4, running=False, step_counter=3)
    assert machine.handle(agreed) == (GroupSwitched(dp_size=3),)
    assert (machine.snapshot().wave, machine.snapshot().step_counter) == (4, 3)


def _shrink_to_the_end(world: World) -> None:
    """Deliver and step (first move first), and take the shrink's next part whenever
    nothing else can move, until nothing can."""
    while moves := world.network_moves() or world.scale_moves():
        world.apply(moves[0])


@pytest.mark.parametrize(("dead", "failed"), [(1, {0}), (0, set())])
def test_a_dead_ranks_requests_end_with_an_error_and_the_survivors_are_renumbered(
    dead: int, failed: set[int]
) -> None:
    world = World.start(WorldConfig(dp_size=3, duplicate_wave_complete=False, deaths=1))
    world.submit(RequestSpec(rank=1, steps=2))
    world.apply(("deliver", "client", 1))  # the request reaches rank 1
    world.apply(("die", dead))
    assert world.scaler.phase is ScalePhase.LEAVING
    assert world.death_moves() == [], "one death in this run"
    _shrink_to_the_end(world)
    world.check_quiescent()
    assert not world.scaler.active and world.client.group == 2
    assert [loop.machine.rank for loop in world.loops] == [0, 1]
    assert {loop.machine.dp_size for loop in world.loops} == {2}
    assert world.client.failed == failed and world.client.done == {0}


def test_no_rank_dies_where_the_engine_cannot_shrink() -> None:
    world = World.start(WorldConfig(dp_size=2, deaths=1))
    assert world.death_moves() == [("die", 0), ("die", 1)]
    world.client_op(("pause", PauseMode.KEEP))
    assert world.death_moves() == [], "a death while pausing ends the engine"
    assert World.start(WorldConfig(dp_size=2)).death_moves() == [], "none unless asked"


class _Effects:
    """Records what the loop does to the world."""

    def __init__(self) -> None:
        self.replies: list[int] = []
        self.paused: list[PauseMode] = []
        self.votes = 0

    def start_vote(self, vote: object) -> None:
        self.votes += 1

    def pause_scheduler(self, mode: PauseMode) -> None:
        self.paused.append(mode)

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        self.replies.append(call_id)

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


def test_the_loop_gives_up_a_broken_collective_and_answers_a_waiting_pause() -> None:
    loop = RankLoop(RankMachine(0, 2, sync_interval=1))
    effects = _Effects()
    loop.start(effects)  # type: ignore[arg-type]
    loop.machine.restore(_state(RankPhase.RUNNING, rank=0, dp_size=2, open_votes=1))
    loop.deliver(Call(call_id=7, request=PauseRequested(mode=PauseMode.KEEP)), effects)  # type: ignore[arg-type]
    loop.complete(StepDone(executed=True, has_unfinished=True, has_admitted=True), effects)  # type: ignore[arg-type]
    assert loop.pending == Collective(action=AwaitVote())
    loop.group_lost(effects)  # type: ignore[arg-type]
    assert loop.pending == WaitForInput()
    assert effects.replies == [7] and effects.paused[-1] is PauseMode.KEEP
    assert loop.machine.pause_state is PauseState.PAUSED


def test_the_client_tells_an_idle_rank_with_a_call() -> None:
    loop = RankLoop(RankMachine(1, 2))
    effects = _Effects()
    loop.start(effects)  # type: ignore[arg-type]
    loop.deliver(Call(call_id=3, request=GroupLost()), effects)  # type: ignore[arg-type]
    assert effects.replies == [3] and loop.pending == WaitForInput()
    assert loop.machine.pause_state is PauseState.PAUSED


def test_a_loss_shrinks_through_the_switch_of_a_scale_down() -> None:
    machine = ScalingMachine()
    actions = machine.handle(RanksLost(old_dp_size=3, lost=(1,)))
    assert actions == (DropRanks(ranks=(1,), survivors=(0, 2)), LeaveGroup(ranks=(0, 1)))
    assert machine.phase is ScalePhase.LEAVING and machine.target_dp_size == 2
    with pytest.raises(ProtocolError):
        machine.handle(ScaleRequested(old_dp_size=3, dp_size=4))  # one at a time
    assert machine.handle(GroupLeft()) == (SwitchGroup(dp_size=2),)
    assert machine.handle(SwitchDone()) == (ResizeCoordinator(dp_size=2),)
    assert machine.handle(CoordinatorResized()) == (
        ResizeTables(dp_size=2),
        ResumeRanks(ranks=(0, 1)),
    )
    assert machine.handle(Resumed()) == (ReconfigureFinished(dp_size=2),)
    assert machine.phase is ScalePhase.IDLE


@pytest.mark.parametrize("phase", [ScalePhase.LEAVING, ScalePhase.SWITCHING])
def test_a_failed_shrink_cannot_be_rolled_back(phase: ScalePhase) -> None:
    machine = ScalingMachine()
    machine.handle(RanksLost(old_dp_size=3, lost=(0,)))
    if phase is ScalePhase.SWITCHING:
        machine.handle(GroupLeft())
    (action,) = machine.handle(ScaleAborted(reason="a second rank died"))
    assert isinstance(action, ScaleAbandoned) and machine.phase is ScalePhase.IDLE


def test_a_loss_of_a_rank_a_scale_is_still_starting_is_refused_and_changes_nothing() -> None:
    """Rule 10: only members can be lost; a new rank's failure is the scale's (rule 8)."""
    machine = ScalingMachine()
    machine.handle(ScaleRequested(old_dp_size=2, dp_size=3))
    before = machine.snapshot()
    with pytest.raises(ProtocolError, match="STARTING: the group has 2 members"):
        machine.handle(RanksLost(old_dp_size=3, lost=(2,)))
    assert machine.snapshot() == before


def test_bad_losses_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="must name ranks"):
        RanksLost(old_dp_size=2, lost=(2,))
    with pytest.raises(ValueError, match="every rank"):
        RanksLost(old_dp_size=2, lost=(0, 1))
