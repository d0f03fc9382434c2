"""Random interleavings: hypothesis drives a Simulation (dp 2 or 3, a vote every 1, 2
or 3 steps) with submits (requests that stall after admission included), deliveries,
pauses in every mode (a pause of one mode while another holds included), resumes
(duplicates included), sleeps, scaling and aborted scales.

``make test`` draws a few hundred examples; ``make check-protocol`` sets
``SIMULATION_EXAMPLES`` to thousands, long enough to find what a few hundred miss."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from wavecore.statemachines import PauseMode, PauseState
from wavecore.statemachines.sim import Simulation, Violation


class DeploymentRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Simulation(2, seed=0, sync_interval=3)

    @rule(
        seed=st.integers(0, 2**16),
        dp_size=st.sampled_from([2, 3]),
        sync_interval=st.sampled_from([1, 2, 3]),
    )
    @precondition(lambda self: self.sim.moves == 0 and self.sim.world.client.submitted == 0)
    def restart(self, seed: int, dp_size: int, sync_interval: int) -> None:
        self.sim = Simulation(dp_size, seed=seed, sync_interval=sync_interval)

    @rule(steps=st.integers(1, 4), stalls=st.integers(0, 3))
    def submit(self, steps: int, stalls: int) -> None:
        # Any time, a reconfiguration included: the client balances over the ranks
        # that stay and the coordinator knows.
        self.sim.submit(steps=steps, stalls=stalls)

    @rule(moves=st.integers(1, 25))
    def deliver_and_step(self, moves: int) -> None:
        for _ in range(moves):
            if not self.sim.step():
                break

    @rule(mode=st.sampled_from(PauseMode))
    def pause(self, mode: PauseMode) -> None:
        if self.sim.world.refusal(("pause", mode)) is None and not self.sim.reconfiguring:
            self.sim.pause(mode)

    @rule()
    def resume(self) -> None:
        if self.sim.world.refusal(("resume",)) is None and not self.sim.reconfiguring:
            self.sim.resume()

    @rule(level=st.sampled_from([0, 1]))
    def sleep_then_wake(self, level: int) -> None:
        if self.sim.world.refusal(("sleep", level)) is None and not self.sim.reconfiguring:
            self.sim.sleep(level)
            self.sim.run()
            self.sim.wake()

    @rule(dp_size=st.sampled_from([1, 2, 3]))
    def scale(self, dp_size: int) -> None:
        world = self.sim.world
        allowed = world.refusal(("scale", dp_size)) is None
        if dp_size != world.client.group and allowed and not self.sim.reconfiguring:
            self.sim.scale(dp_size)

    @rule()
    def abort_scale(self) -> None:
        self.sim.abort_scale()  # where the scale can be rolled back, else nothing

    @invariant()
    def ranks_agree_on_the_wave_when_idle(self) -> None:
        world = self.sim.world
        ranks = [world.ranks[r] for r in world.group]
        if world.quiescent() and all(m.pause_state is PauseState.UNPAUSED for m in ranks):
            assert len({m.wave for m in ranks}) == 1

    def teardown(self) -> None:
        # Finish the story: undo any pause and let everything drain; every invariant
        # of the world is checked on the way and at quiescence.
        self.sim.run()
        if self.sim.world.refusal(("resume",)) is None and not self.sim.reconfiguring:
            self.sim.resume()
        elif self.sim.world.client.asleep:
            self.sim.wake()
        self.sim.run()
        assert self.sim.quiescent()
        lost = set(range(self.sim.world.client.submitted)) - self.sim.world.client.done
        assert not lost


TestDeployment = DeploymentRules.TestCase
TestDeployment.settings = settings(
    max_examples=int(os.environ.get("SIMULATION_EXAMPLES", "300")), stateful_step_count=30
)


def test_a_run_that_never_settles_is_a_violation_not_a_success() -> None:
    sim = Simulation(2, seed=3, sync_interval=3)
    sim.submit(steps=50)
    with pytest.raises(Violation, match="livelock") as caught:
        sim.run(max_moves=10)
    assert caught.value.trace, "a violation must come with its trace"
    sim.run()  # with room to finish, the same run settles and holds every property
    assert sim.quiescent()
