"""Regressions for bugs the randomized simulation found on the sleep and scale paths,
and for rank rules fixed late. Each bug gets the smallest deterministic scenario that
failed before its fix; rules of a machine are also run against the broken variant that
restores the old behaviour, which must be caught."""

from __future__ import annotations

import pytest
from guarded import assert_guarded

from wavecore.statemachines import (
    CoordinatorMachine,
    PauseMode,
    PauseState,
    ProtocolError,
    RankStartedWave,
    Resize,
    WaveCompleted,
)
from wavecore.statemachines.harness.explore import (
    ExploreConfig,
    death_configs,
    default_configs,
    explore,
    repause_configs,
    scale_configs,
    scale_script,
)
from wavecore.statemachines.harness.world import CLIENT, RequestSpec, World, WorldConfig


def _settle(world: World) -> None:
    """Perform the first enabled network move until none is left."""
    while moves := world.network_moves():
        world.apply(moves[0])


# -- sleep -------------------------------------------------------------------------------


def test_a_wake_reply_does_not_answer_the_next_sleep() -> None:
    # The client used to count any reply as the answer to its pending call: the two
    # wake replies "answered" the sleep sent right after, so it believed the engines
    # paused while their pause was still pending (forwards after the reply, a resume
    # reaching a pausing rank, a commit of ranks still holding requests).
    world = World.start(WorldConfig(dp_size=2))
    world.client_op(("sleep", 1))
    _settle(world)
    assert world.client.paused and not world.client.awaiting
    world.client_op(("wake",))
    world.client_op(("sleep", 0))
    for rank in (0, 1):
        world.apply(("deliver", CLIENT, rank))  # the wake; the sleep is still queued
    assert not world.client.paused
    assert world.client.awaiting == {0, 1}
    _settle(world)
    assert world.client.paused and not world.client.awaiting
    assert all(rank.asleep == {"scheduling"} for rank in world.ranks)


@pytest.mark.parametrize("dp_size", [2, 3])
def test_a_paused_rank_that_answers_a_sleep_without_sleeping_is_caught(dp_size: int) -> None:
    # pause-modes: KEEP, then ABORT while KEEP holds, then a WAIT sleep while ABORT holds.
    config = dict(default_configs(dp_size))["pause-modes"]
    assert_guarded(config, "paused_rank_ignores_sleep", {"asleep_view"}, depth=40)


def test_a_wake_with_nothing_asleep_leaves_the_client_paused() -> None:
    # The client used to believe any wake resumed the engines: after a pause and a wake
    # with nothing asleep its view said "unpaused" while every rank stayed paused.
    world = World.start(WorldConfig(dp_size=2))
    world.client_op(("pause", PauseMode.KEEP))
    _settle(world)
    world.client_op(("wake",))
    _settle(world)
    assert world.client.paused
    assert all(rank.pause_state is PauseState.PAUSED for rank in world.ranks)
    world.check_quiescent()


# -- scaling -----------------------------------------------------------------------------


def _finish_scale(world: World) -> None:
    """Deliver and step, and take the scale's next part whenever nothing else moves."""
    while True:
        _settle(world)
        moves = world.scale_moves()
        if not moves:
            return
        world.apply(moves[0])


def test_a_joining_rank_holds_requests_until_the_resume() -> None:
    world = World.start(WorldConfig(dp_size=2))
    world.client_op(("scale", 3))
    # The joining rank's machine starts paused, and its first action pauses its
    # scheduler too.
    assert world.toys[2].scheduler_pause is PauseMode.KEEP
    # Until the tables grow (after the coordinator confirmed the new group) the client
    # does not use the new rank: its messages would reach a coordinator without it.
    world.submit(RequestSpec(rank=2))
    assert (CLIENT, 0) in world.network and (CLIENT, 2) not in world.network
    _finish_scale(world)
    assert world.client.group == 3 and not world.scaler.active
    world.submit(RequestSpec(rank=2, steps=2))
    _settle(world)
    world.check_quiescent()
    assert world.client.done == {0, 1}


def test_a_scale_down_drains_or_aborts_the_leaving_rank() -> None:
    for timeout in (False, True):
        world = World.start(WorldConfig(dp_size=2))
        world.submit(RequestSpec(rank=1, steps=3))
        world.client_op(("scale", 1))
        if timeout:
            world.apply(("drain_timeout",))
        _finish_scale(world)
        world.check_quiescent()
        assert world.client.done == {0} and world.client.group == 1 and len(world.loops) == 1


def test_coordinator_ignores_late_news_from_a_departed_rank() -> None:
    coordinator = CoordinatorMachine(3)
    coordinator.handle(WaveCompleted(wave=0))
    coordinator.handle(Resize(dp_size=2))
    # Rank 2 announced a wave before the scale's pause; the news arrives after it left.
    assert coordinator.handle(RankStartedWave(rank=2, wave=1)) == ()
    assert not coordinator.engines_running
    with pytest.raises(ProtocolError, match="rank 3 outside dp_size 2"):
        coordinator.handle(RankStartedWave(rank=3, wave=1))
    coordinator.handle(Resize(dp_size=3))
    assert coordinator.handle(RankStartedWave(rank=2, wave=1)) != ()


@pytest.mark.parametrize("dp_size", [2, 3])
def test_every_interleaving_of_a_scale_holds(dp_size: int) -> None:
    for name, config in scale_configs(dp_size):
        result = explore(config, 40)
        assert result.violation is None, result.violation.report() if result.violation else ""
        assert result.depth < 40, f"{name} was not explored to the end"


def test_a_switch_that_keeps_its_own_wave_is_caught() -> None:
    (_, scale_up), *_ = scale_configs(2)
    broken = explore(scale_up.broken("switch_keeps_own_wave"), 40)
    assert broken.violation is not None
    assert broken.violation.rule == "coordinator_wave", broken.violation.report()


@pytest.mark.parametrize("dp_size", [2, 3])
def test_a_scale_down_that_never_stops_the_leaving_ranks_is_caught(dp_size: int) -> None:
    _, scale_down = scale_configs(dp_size)[1]
    assert_guarded(scale_down, "scale_keeps_leaving_ranks", {"scale_roles"}, depth=40)


# -- rank death ----------------------------------------------------------------------------


def test_a_loss_during_a_scale_that_undoes_nothing_is_caught() -> None:
    # Scaling rule 10: a scale up cut before its switch must stop its new ranks.
    _, scales = death_configs(2)[1]
    assert_guarded(scales, "shrink_without_undo", {"shrink_survivors"}, depth=60)


def test_a_shrink_that_keeps_the_lost_groups_wave_is_caught() -> None:
    # Found by the explorer: the survivors of a loss resumed in the wave their lost
    # group never ended, which the coordinator still believed running, counting its
    # steps from 0 again (and whose START_DP_WAVE, still in flight, started one
    # survivor alone at dp 3: a deadlock).
    _, request = death_configs(2)[0]
    rules = {"coordinator_running", "coordinator_wave", "lockstep"}
    assert_guarded(request, "shrink_keeps_lost_wave", rules, depth=60)


def test_a_request_for_the_new_rank_during_a_scale_up() -> None:
    # rank=2 goes to rank 0 while the client's table has two ranks, to the new rank
    # once the coordinator confirmed three.
    world = WorldConfig(dp_size=2, duplicate_wave_complete=False)
    config = ExploreConfig(world=world, requests=(RequestSpec(rank=2),), script=scale_script(3))
    result = explore(config, 14)
    assert result.violation is None, result.violation.report() if result.violation else ""
    assert result.states > 1000, "the scale with a request explored suspiciously little"


# -- rank rules fixed late ---------------------------------------------------------------

_NO_DUPLICATES = WorldConfig(dp_size=2, duplicate_wave_complete=False)


def test_a_pause_while_paused_does_not_loosen_the_frozen_scheduler() -> None:
    config = ExploreConfig(
        world=_NO_DUPLICATES,
        requests=(RequestSpec(rank=1, steps=3),),
        script=(("pause", PauseMode.KEEP), ("pause", PauseMode.WAIT)),
    )
    # Caught when the loosened rank answers (its admitted requests may run again), or
    # by the forward that follows.
    rules = {"call_contract", "forward_after_pause"}
    assert_guarded(config, "repause_loosens_scheduler", rules, depth=14)


def test_a_draining_wait_pause_rank_does_not_vote_for_the_pause() -> None:
    config = ExploreConfig(
        world=_NO_DUPLICATES,
        requests=(RequestSpec(rank=1, steps=4),),
        script=(("pause", PauseMode.WAIT),),
    )
    assert_guarded(config, "draining_rank_votes", {"call_contract"}, depth=12)


def test_an_independent_rank_answers_a_wait_pause_after_its_last_request() -> None:
    config = ExploreConfig(
        world=WorldConfig(dp_size=2, lockstep=False, duplicate_wave_complete=False),
        requests=(RequestSpec(rank=1, steps=2),),
        script=(("pause", PauseMode.WAIT),),
    )
    assert_guarded(config, "independent_wait_pause_idles", {"call_unanswered"}, depth=14)


# -- found by the scenarios of issue 29 ---------------------------------------------------


@pytest.mark.parametrize("lockstep", [True, False])
def test_a_wait_pause_waits_for_a_request_that_stalls_after_its_admission(
    lockstep: bool,
) -> None:
    # A WAIT-pausing rank took a step that ran nothing for the end of its drain: with a
    # request stalled after admission (the real scheduler's preempted request waiting
    # for a prefill step) it voted for the pause, or reached it on its own, and the
    # pause was answered with that request frozen half done.
    name = (
        "request-stalls-and-pause-wait" if lockstep else "independent-request-stalls-and-pause-wait"
    )
    config = dict(default_configs(2))[name]
    variant = "stalled_rank_votes" if lockstep else "independent_pause_on_stall"
    assert_guarded(config, variant, {"call_contract"}, depth=14)


def test_an_abort_pause_under_a_keep_pause_drops_the_frozen_request() -> None:
    config = dict(repause_configs(2))["request-pause-keep-then-pause-abort"]
    assert_guarded(config, "abort_repause_keeps_requests", {"call_contract"}, depth=40)


def test_an_abort_sleep_under_an_abort_pause_drops_the_request_held_since() -> None:
    # An ABORT sleep reaching a rank paused ABORT dropped nothing, so a request that
    # arrived during the pause (held) outlived the sleep that its caller believed had
    # aborted everything sent before it.
    config = dict(repause_configs(2))["request-pause-abort-then-sleep-abort"]
    assert_guarded(config, "abort_sleep_keeps_held", {"call_contract"}, depth=40)


@pytest.mark.parametrize("sync_interval", [1, 2, 3])
def test_a_drift_ends_the_run_with_the_named_error(sync_interval: int) -> None:
    world = World.start(WorldConfig(dp_size=2, sync_interval=sync_interval, drift=True))
    world.submit(RequestSpec(rank=1, steps=6))
    while moves := world.drift_moves() or world.network_moves():
        world.apply(moves[0])
    assert world.drifted and world.halted == "LockstepDriftError"
    world.check_quiescent()  # nothing more is asked of an engine that ended


def test_a_rank_that_takes_a_drifted_vote_is_caught() -> None:
    config = dict(default_configs(2, 2))["request-and-drift"]
    assert_guarded(config, "ignores_drift", {"drift_unnoticed"}, depth=30)
