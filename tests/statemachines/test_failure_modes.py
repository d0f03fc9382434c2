"""One regression per numbered failure mode of protocol.md (1-11, 15).

Each test runs the real machines and a deliberately broken variant of the rule it
guards (``wavecore.statemachines.harness.variants``) through the same exhaustive exploration
or simulation: the real protocol must pass, the broken one must be caught.
"""

from __future__ import annotations

import pytest
from guarded import assert_guarded

from wavecore.statemachines import (
    PauseMode,
    RanksReady,
    ReconfigurationActiveError,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScalingMachine,
)
from wavecore.statemachines.harness.explore import ExploreConfig
from wavecore.statemachines.harness.invariants import Violation
from wavecore.statemachines.harness.world import RequestSpec, WorldConfig
from wavecore.statemachines.scaling import ScalingSnapshot
from wavecore.statemachines.sim import Simulation

ONE_REQUEST = (RequestSpec(rank=1, steps=1),)
PAUSE_KEEP = ("pause", PauseMode.KEEP)


def _config(
    requests: tuple[RequestSpec, ...] = ONE_REQUEST,
    script: tuple[tuple[object, ...], ...] = (),
    *,
    duplicate: bool = False,
) -> ExploreConfig:
    world = WorldConfig(dp_size=2, duplicate_wave_complete=duplicate)
    return ExploreConfig(world=world, requests=requests, script=script)


def _assert_guarded(config: ExploreConfig, variant: str, rules: set[str], depth: int = 16) -> None:
    assert_guarded(config, variant, rules, depth)


def test_duplicate_or_stale_wave_complete_is_idempotent() -> None:
    config = _config(requests=(), script=(PAUSE_KEEP, ("resume",), PAUSE_KEEP), duplicate=True)
    _assert_guarded(config, "stale_wave_complete", {"coordinator_wave"}, depth=22)


def test_zero_token_step_with_work_still_runs_a_dummy_forward() -> None:
    config = _config(requests=(RequestSpec(rank=1, steps=1, stalls=1),))
    _assert_guarded(config, "no_dummy_batch", {"lockstep", "drift"})


def test_step_counter_drift_is_detected_before_it_hangs() -> None:
    _assert_guarded(_config(), "step_counter_drift", {"lockstep", "drift"})


def test_stale_start_wave_does_not_rearm_a_paused_rank() -> None:
    _assert_guarded(
        _config(script=(PAUSE_KEEP,)),
        "stale_start_wave",
        {"forward_after_pause", "forward_after_pause_reply"},
    )


def test_request_after_pause_does_not_rearm_a_paused_rank() -> None:
    _assert_guarded(
        _config(script=(PAUSE_KEEP,)),
        "late_request_wakes",
        {"forward_after_pause", "forward_after_pause_reply", "silent_wait"},
    )


def test_rank_that_asks_for_a_wave_runs_it_itself() -> None:
    _assert_guarded(
        _config(),
        "no_self_wake",
        {"deadlock", "request_lost", "protocol_error", "coordinator_running"},
    )


def test_coordinator_does_not_latch_running_after_a_discarded_wake() -> None:
    # The latched coordinator ignores the wave rank 0 announces, so rank 1 is never
    # woken: the ranks hang (caught as a deadlock once the ignored announcement is gone,
    # por rule 9), or the search ends with the coordinator alone believing it runs.
    rules = {"coordinator_running", "deadlock"}
    _assert_guarded(_config(script=(PAUSE_KEEP,)), "coordinator_latches", rules)


def test_duplicate_resume_does_not_deadlock() -> None:
    config = _config(script=(PAUSE_KEEP, ("resume",), ("resume",)))
    _assert_guarded(config, "duplicate_resume_barrier", {"deadlock"})


def test_pause_completes_only_after_the_last_forward() -> None:
    _assert_guarded(
        _config(requests=(), script=(PAUSE_KEEP,)),
        "early_pause_reply",
        # Caught as the reply arrives (the rank is not paused yet), or by the forward after.
        {"call_contract", "forward_after_pause_reply"},
    )


def test_pause_of_an_idle_engine_costs_two_forwards() -> None:
    sim = Simulation(2, seed=7)
    sim.pause(PauseMode.KEEP)
    sim.run()
    assert sim.world.client.paused
    assert [toy.forwards for toy in sim.world.toys] == [2, 2]
    slow = Simulation(2, seed=7, variant="slow_votes")
    slow.pause(PauseMode.KEEP)
    with pytest.raises(Violation, match="slow_pause"):
        slow.run()


def test_a_pause_that_reached_every_rank_is_done_within_two_forwards() -> None:
    _assert_guarded(_config(script=(PAUSE_KEEP,)), "slow_votes", {"slow_pause"})


def test_request_during_sleep_waits_visibly() -> None:
    config = _config(script=(("sleep", 1),))
    _assert_guarded(config, "silent_wait", {"silent_wait"})


def test_first_request_for_the_current_wave_starts_a_wave() -> None:
    _assert_guarded(_config(), "equal_wave_no_wake", {"deadlock", "request_lost", "protocol_error"})


class _StuckAfterAbort(ScalingMachine):
    """Failure mode 15 broken: an aborted scale stays 'active'."""

    def on_aborted(
        self, state: ScalingSnapshot, event: ScaleAborted
    ) -> tuple[ScalingSnapshot, tuple[object, ...]]:
        _, actions = super().on_aborted(state, event)
        return state, actions


@pytest.mark.parametrize(
    ("machine_class", "recovers"), [(ScalingMachine, True), (_StuckAfterAbort, False)]
)
def test_failed_scale_does_not_stay_active_forever(
    machine_class: type[ScalingMachine], recovers: bool
) -> None:
    machine = machine_class()
    machine.handle(ScaleRequested(old_dp_size=2, dp_size=3))
    machine.handle(RanksReady())
    machine.handle(ScaleAborted(reason="new rank failed to load"))
    retry = ScaleRequested(old_dp_size=2, dp_size=3)
    if recovers:
        machine.handle(retry)
        assert machine.phase is ScalePhase.STARTING
    else:
        with pytest.raises(ReconfigurationActiveError):
            machine.handle(retry)
