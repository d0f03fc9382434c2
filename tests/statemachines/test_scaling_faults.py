"""`ScalingMachine` rule 10: a rank lost during a reconfiguration (a scale up, a scale
down, or a shrink: a second loss). Every active phase, both directions: what is
undone, who survives, and that the shrink then runs to the end."""

from __future__ import annotations

import pytest

from wavecore.statemachines import (
    CoordinatorResized,
    Drained,
    DropRanks,
    GroupLeft,
    LeaveGroup,
    ProtocolError,
    RanksLost,
    RanksPaused,
    RanksReady,
    ReconfigureFinished,
    ResizeCoordinator,
    ResizeTables,
    Resumed,
    ResumeRanks,
    RouteTo,
    ScalePhase,
    ScaleRequested,
    ScalingMachine,
    StopRanks,
    SwitchDone,
    SwitchGroup,
)

P = ScalePhase
# The events that take a scale to each of its active phases, from IDLE.
UP = {  # 2 -> 3
    P.STARTING: (),
    P.PAUSING: (RanksReady(),),
    P.SWITCHING: (RanksReady(), RanksPaused()),
    P.RESIZING: (RanksReady(), RanksPaused(), SwitchDone()),
    P.RESUMING: (RanksReady(), RanksPaused(), SwitchDone(), CoordinatorResized()),
}
DOWN = {  # 3 -> 2
    P.DRAINING: (),
    P.PAUSING: (Drained(),),
    P.SWITCHING: (Drained(), RanksPaused()),
    P.RESIZING: (Drained(), RanksPaused(), SwitchDone()),
    P.RESUMING: (Drained(), RanksPaused(), SwitchDone(), CoordinatorResized()),
}


def _scaled(old: int, new: int, events: tuple[object, ...]) -> ScalingMachine:
    machine = ScalingMachine()
    machine.handle(ScaleRequested(old_dp_size=old, dp_size=new))
    for event in events:
        machine.handle(event)
    return machine


def _finish_shrink(machine: ScalingMachine, size: int) -> None:
    """From LEAVING, the rest of rule 9: the survivors' switch, then serving."""
    assert machine.handle(GroupLeft()) == (SwitchGroup(dp_size=size),)
    assert machine.handle(SwitchDone()) == (ResizeCoordinator(dp_size=size),)
    assert machine.handle(CoordinatorResized()) == (
        ResizeTables(dp_size=size),
        ResumeRanks(ranks=tuple(range(size))),
    )
    assert machine.handle(Resumed()) == (ReconfigureFinished(dp_size=size),)
    assert not machine.active


# (phase, members, what is undone first) for a scale up 2 -> 3 and down 3 -> 2.
UP_CASES = [
    (P.STARTING, 2, (StopRanks(ranks=(2,)),)),
    (P.PAUSING, 2, (StopRanks(ranks=(2,)),)),
    (P.SWITCHING, 2, (StopRanks(ranks=(2,)),)),
    (P.RESIZING, 3, (ResizeTables(dp_size=3),)),
    (P.RESUMING, 3, (ResizeTables(dp_size=3),)),
]
DOWN_CASES = [
    (P.DRAINING, 3, (RouteTo(dp_size=3),)),
    (P.PAUSING, 3, (RouteTo(dp_size=3),)),
    (P.SWITCHING, 2, ()),
    (P.RESIZING, 2, ()),
    (P.RESUMING, 2, ()),
]


@pytest.mark.parametrize(
    ("old", "new", "phase", "members", "undo"),
    [(2, 3, *case) for case in UP_CASES] + [(3, 2, *case) for case in DOWN_CASES],
)
def test_a_member_lost_in_every_phase_of_a_scale_shrinks_the_members(
    old: int, new: int, phase: ScalePhase, members: int, undo: tuple[object, ...]
) -> None:
    machine = _scaled(old, new, (UP if new > old else DOWN)[phase])
    assert machine.phase is phase and machine.members == members
    actions = machine.handle(RanksLost(old_dp_size=members, lost=(0,)))
    survivors = tuple(range(1, members))
    assert actions == (
        *undo,
        DropRanks(ranks=(0,), survivors=survivors),
        LeaveGroup(ranks=tuple(range(len(survivors)))),
    )
    assert machine.phase is P.LEAVING and machine.members == len(survivors)
    _finish_shrink(machine, len(survivors))


@pytest.mark.parametrize(
    ("old", "new", "phase", "members"),
    [(2, 3, phase, members) for phase, members, _ in UP_CASES]
    + [(3, 2, phase, members) for phase, members, _ in DOWN_CASES],
)
def test_a_loss_counted_in_another_group_is_refused_and_changes_nothing(
    old: int, new: int, phase: ScalePhase, members: int
) -> None:
    machine = _scaled(old, new, (UP if new > old else DOWN)[phase])
    before = machine.snapshot()
    other = 3 if members == 2 else 2
    with pytest.raises(ProtocolError, match=f"the group has {members} members"):
        machine.handle(RanksLost(old_dp_size=other, lost=(0,)))
    assert machine.snapshot() == before


SHRINK = {
    P.LEAVING: (),
    P.SWITCHING: (GroupLeft(),),
    P.RESIZING: (GroupLeft(), SwitchDone()),
    P.RESUMING: (GroupLeft(), SwitchDone(), CoordinatorResized()),
}


@pytest.mark.parametrize("phase", list(SHRINK))
def test_a_second_loss_restarts_the_shrink_with_the_smaller_survivor_set(
    phase: ScalePhase,
) -> None:
    machine = ScalingMachine()
    machine.handle(RanksLost(old_dp_size=4, lost=(1,)))  # ranks 0, 2, 3 are now 0, 1, 2
    for event in SHRINK[phase]:
        machine.handle(event)
    assert machine.members == 3
    actions = machine.handle(RanksLost(old_dp_size=3, lost=(2,)))
    assert actions == (DropRanks(ranks=(2,), survivors=(0, 1)), LeaveGroup(ranks=(0, 1)))
    assert machine.phase is P.LEAVING
    _finish_shrink(machine, 2)


def test_members_is_none_while_idle() -> None:
    assert ScalingMachine().members is None
