"""Deliberately broken variants of the protocol, one per guarded rule.

They exist to prove the guards work: the explorer (``--break NAME`` on the command
line) and the regression tests run each one and must find a violation that the real
machines never produce. Each variant changes exactly one rule hook of a real machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..coordinator import CoordinatorMachine, CoordinatorSnapshot
from ..rank import RankMachine, RankSnapshot
from ..rank_events import (
    EnterSleep,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    PauseState,
    RankPhase,
    Reconfigured,
    RequestArrived,
    ResumeBarrier,
    SleepRequested,
    StartVote,
    StartWave,
    StepDone,
    SyncDone,
)
from ..scaling import (
    RanksLost,
    RanksPaused,
    RouteTo,
    ScaleAborted,
    ScalePhase,
    ScaleRequested,
    ScalingMachine,
    ScalingSnapshot,
    StopRanks,
)


class AcceptsStaleCompletion(CoordinatorMachine):
    """Failure mode 1: a duplicate or stale wave_complete moves the wave."""

    def completion_applies(self, state: CoordinatorSnapshot, wave: int) -> bool:
        return True


class SkipsDummyWhileStalled(RankMachine):
    """Failure mode 2: no dummy forward when the step scheduled nothing but work remains."""

    def needs_dummy(self, state: RankSnapshot, event: StepDone) -> bool:
        return not event.executed and not event.has_unfinished


class CountsOnlyRealSteps(RankMachine):
    """Failure mode 3: the step counter drifts (dummy forwards are not counted)."""

    def counts_step(self, event: StepDone) -> bool:
        return event.executed


class ObeysStaleStartWave(RankMachine):
    """Failure mode 4: START_DP_WAVE re-arms a paused rank."""

    def start_wave_ignored(self, state: RankSnapshot, event: StartWave) -> bool:
        return event.wave < state.wave or state.running


class WakesOnLateRequest(RankMachine):
    """Failure mode 4: a request arriving after the pause re-arms the rank."""

    def wakes_on_request(self, state: RankSnapshot, event: RequestArrived) -> bool:
        return not state.asleep


class LeavesOwnWakeToBroadcast(RankMachine):
    """Failure mode 5: the rank that asks for a wave does not run it itself."""

    def runs_own_wake(self) -> bool:
        return False


class LatchesRunningOnFirstRequest(CoordinatorMachine):
    """Failure mode 6: the coordinator marks the engines running on its own broadcast."""

    def marks_running_on_first_request(self) -> bool:
        return True


class BarrierOnDuplicateResume(RankMachine):
    """Failure mode 7: a duplicate resume sends the rank into the barrier again."""

    def duplicate_resume_actions(
        self, state: RankSnapshot
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        barrier = ResumeBarrier(has_unfinished=state.has_work)
        return replace(state, phase=RankPhase.BARRIER), (barrier,)


class RepliesToPauseEarly(RankMachine):
    """Failure mode 8: the pause is reported done before the consensus forward ended."""

    def on_pause(
        self, state: RankSnapshot, event: PauseRequested
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        new_state, actions = super().on_pause(state, event)
        if state.pause_state is PauseState.PAUSED:
            return new_state, actions
        return new_state, (*actions, PauseComplete())


class VotesOnlyEveryOtherInterval(RankMachine):
    """Failure mode 9: no vote on steps 1 and 2 of a wave, and one vote only every other
    ``sync_interval`` steps (upstream synced every 32), so a pause costs more forwards
    than rank rule 7 allows."""

    def vote_due(self, step_counter: int) -> bool:
        return step_counter % (2 * self.sync_interval) == 0


class WaitsSilently(RankMachine):
    """Failure mode 10: a request reaching a sleeping or paused rank waits unannounced."""

    def held(self, state: RankSnapshot, event: RequestArrived) -> tuple[object, ...]:
        return ()


class IgnoresRequestForCurrentWave(RankMachine):
    """Failure mode 11: a request stamped with the rank's own wave does not start it."""

    def wakes_on_request(self, state: RankSnapshot, event: RequestArrived) -> bool:
        return super().wakes_on_request(state, event) and event.wave != state.wave


class LoosensFrozenScheduler(RankMachine):
    """Rank rule 7: a pause while paused re-pauses the scheduler in its own mode, so a
    WAIT lets requests admitted before the consensus step again."""

    def pause_while_paused(
        self, state: RankSnapshot, event: PauseRequested
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        return replace(state, pause_mode=event.mode), (
            PauseScheduler(mode=event.mode),
            PauseComplete(),
        )


class AbortWhilePausedKeeps(RankMachine):
    """Rank rule 7: an ABORT pause reaching a rank already paused is answered without
    dropping anything, so the requests an earlier KEEP pause froze (or held) stay,
    to be resumed later, while their caller believes them aborted."""

    def pause_while_paused(
        self, state: RankSnapshot, event: PauseRequested
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        return state, (PauseComplete(),)


class VotesWhileDraining(RankMachine):
    """Rank rule 6: a WAIT-pausing rank votes for the pause while its own requests still
    run, so the consensus can freeze them half done."""

    def vote(self, state: RankSnapshot, event: StepDone, counter: int) -> StartVote:
        contribution = super().vote(state, event, counter)
        return replace(contribution, pending_pause=state.pause_state is PauseState.PENDING)


class IdlesWithWaitPausePending(RankMachine):
    """Rank rule 3: an independent WAIT-pausing rank that finishes its last request goes
    idle with the pause pending and never answers it."""

    def independent_pause_reached(self, state: RankSnapshot, event: StepDone) -> bool:
        return state.pause_state is PauseState.PENDING and (
            state.pause_mode is not PauseMode.WAIT or not event.executed
        )


class VotesWhileStalled(RankMachine):
    """Rank rule 6: a WAIT-pausing rank votes for the pause after a step that ran
    nothing, though a request it admitted (preempted, waiting for a prefill step) is
    unfinished, so the consensus freezes it half done."""

    def vote(self, state: RankSnapshot, event: StepDone, counter: int) -> StartVote:
        return super().vote(state, replace(event, has_admitted=False), counter)


class PausesOnStall(RankMachine):
    """Rank rule 3: an independent WAIT-pausing rank takes a step that ran nothing for
    the end of its drain, and answers with an admitted request unfinished."""

    def independent_pause_reached(self, state: RankSnapshot, event: StepDone) -> bool:
        return state.pause_state is PauseState.PENDING and (
            state.pause_mode is not PauseMode.WAIT or not event.executed or not event.has_unfinished
        )


class KeepsOwnCountersOnSwitch(RankMachine):
    """Scaling: a rank switching groups keeps its own wave and step counter instead of
    the group's max, so a joining rank starts waves behind its peers."""

    def switched(self, state: RankSnapshot, event: Reconfigured) -> RankSnapshot:
        return replace(state, rank=event.rank, dp_size=event.dp_size)


class PausesOnlyStayingRanks(ScalingMachine):
    """Scaling rule 3: a scale down pauses only the ranks that stay, so the leaving ones
    never vote and the lockstep pause of the old group never reaches consensus."""

    def pause_targets(self, state: ScalingSnapshot) -> tuple[int, ...]:
        return tuple(range(min(state.old_dp_size or 0, state.dp_size or 0)))


class PausedRankIgnoresSleep(RankMachine):
    """Rank rule 10: a sleep reaching a rank that is already paused is answered, but
    nothing goes to sleep."""

    def on_sleep(
        self, state: RankSnapshot, event: SleepRequested
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        if state.pause_state is PauseState.PAUSED:
            return state, (EnterSleep(level=event.level, tags=frozenset()),)
        return super().on_sleep(state, event)


class AbortSleepKeepsHeld(RankMachine):
    """Rank rule 10: an ABORT sleep under an ABORT pause drops nothing, so a request
    held since that pause survives the sleep its caller believes aborted it."""

    def sleep_aborts(self, state: RankSnapshot, event: SleepRequested) -> bool:
        return event.mode is PauseMode.ABORT and state.pause_mode is not PauseMode.ABORT


class ResumeNeverWaits(RankMachine):
    """Rank rule 9: a resume reaching a rank whose pause is still pending is handed to
    the machine, which refuses it; the rank then completes the pause and stays paused
    for good (a scale's rollback resumes ranks whose pause it abandoned)."""

    def resume_waits(self) -> bool:
        return False


class AbortKeepsNarrowRouting(ScalingMachine):
    """Scaling rule 8: a scale down aborted while it drains or pauses does not route to
    its leaving ranks again: capacity is lost without a word."""

    def on_aborted(
        self, state: ScalingSnapshot, event: ScaleAborted
    ) -> tuple[ScalingSnapshot, tuple[object, ...]]:
        idle, actions = super().on_aborted(state, event)
        return idle, tuple(action for action in actions if not isinstance(action, RouteTo))


class IgnoresDrift(RankMachine):
    """Rank rule 12: a vote whose voters disagree on wave or step counter is taken as if
    they agreed, so a drift goes on until a later collective hangs."""

    def on_sync_done(
        self, state: RankSnapshot, event: SyncDone
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        blind = replace(event, wave_span=None, step_counter_span=None)
        return super().on_sync_done(state, blind)


class KeepsLeavingRanks(ScalingMachine):
    """Scaling rule 4: a scale down switches the staying ranks to the smaller group but
    never stops the leaving ones."""

    def on_paused(
        self, state: ScalingSnapshot, event: RanksPaused
    ) -> tuple[ScalingSnapshot, tuple[object, ...]]:
        _, actions = super().on_paused(state, event)
        kept = tuple(action for action in actions if not isinstance(action, StopRanks))
        return replace(state, phase=ScalePhase.SWITCHING), kept


class RestartsOnSecondScale(ScalingMachine):
    """Scaling rule 7: a second scale while one runs starts over from its request
    instead of being refused, abandoning the first one's script half done."""

    def on_second_request(
        self, state: ScalingSnapshot, event: ScaleRequested
    ) -> tuple[ScalingSnapshot, tuple[object, ...]]:
        return self.on_requested(state, event)


class ShrinksWithoutUndo(ScalingMachine):
    """Scaling rule 10: a loss during a scale shrinks at once, without undoing what the
    scale changed (a scale up's new ranks keep running outside the group)."""

    def on_lost_during(
        self, state: ScalingSnapshot, event: RanksLost
    ) -> tuple[ScalingSnapshot, tuple[object, ...]]:
        return self.on_lost(state, event)


class KeepsLostGroupWave(RankMachine):
    """Rank rule 13: the switch after a loss keeps the lost group's wave, which the
    coordinator may still believe runs and whose broadcasts may still arrive."""

    def on_reconfigured(
        self, state: RankSnapshot, event: Reconfigured
    ) -> tuple[RankSnapshot, tuple[object, ...]]:
        return super().on_reconfigured(replace(state, left_group=False), event)


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One broken rule; ``failure_mode`` numbers it in protocol.md (None: a rule of
    wavecore's own machines)."""

    failure_mode: int | None
    rank_class: type[RankMachine] = RankMachine
    coordinator_class: type[CoordinatorMachine] = CoordinatorMachine
    scaling_class: type[ScalingMachine] = ScalingMachine


VARIANTS: dict[str, Variant] = {
    "stale_wave_complete": Variant(failure_mode=1, coordinator_class=AcceptsStaleCompletion),
    "no_dummy_batch": Variant(failure_mode=2, rank_class=SkipsDummyWhileStalled),
    "step_counter_drift": Variant(failure_mode=3, rank_class=CountsOnlyRealSteps),
    "stale_start_wave": Variant(failure_mode=4, rank_class=ObeysStaleStartWave),
    "late_request_wakes": Variant(failure_mode=4, rank_class=WakesOnLateRequest),
    "no_self_wake": Variant(failure_mode=5, rank_class=LeavesOwnWakeToBroadcast),
    "coordinator_latches": Variant(failure_mode=6, coordinator_class=LatchesRunningOnFirstRequest),
    "duplicate_resume_barrier": Variant(failure_mode=7, rank_class=BarrierOnDuplicateResume),
    "early_pause_reply": Variant(failure_mode=8, rank_class=RepliesToPauseEarly),
    "slow_votes": Variant(failure_mode=9, rank_class=VotesOnlyEveryOtherInterval),
    "silent_wait": Variant(failure_mode=10, rank_class=WaitsSilently),
    "equal_wave_no_wake": Variant(failure_mode=11, rank_class=IgnoresRequestForCurrentWave),
    # Rules of wavecore's own machines, not numbered in protocol.md.
    "repause_loosens_scheduler": Variant(failure_mode=None, rank_class=LoosensFrozenScheduler),
    "abort_repause_keeps_requests": Variant(failure_mode=None, rank_class=AbortWhilePausedKeeps),
    "draining_rank_votes": Variant(failure_mode=None, rank_class=VotesWhileDraining),
    "independent_wait_pause_idles": Variant(
        failure_mode=None, rank_class=IdlesWithWaitPausePending
    ),
    "stalled_rank_votes": Variant(failure_mode=None, rank_class=VotesWhileStalled),
    "independent_pause_on_stall": Variant(failure_mode=None, rank_class=PausesOnStall),
    "switch_keeps_own_wave": Variant(failure_mode=None, rank_class=KeepsOwnCountersOnSwitch),
    "scale_pauses_staying_only": Variant(failure_mode=None, scaling_class=PausesOnlyStayingRanks),
    "paused_rank_ignores_sleep": Variant(failure_mode=None, rank_class=PausedRankIgnoresSleep),
    "abort_sleep_keeps_held": Variant(failure_mode=None, rank_class=AbortSleepKeepsHeld),
    "resume_never_waits": Variant(failure_mode=None, rank_class=ResumeNeverWaits),
    "abort_keeps_narrow_routing": Variant(failure_mode=None, scaling_class=AbortKeepsNarrowRouting),
    "ignores_drift": Variant(failure_mode=3, rank_class=IgnoresDrift),
    "scale_keeps_leaving_ranks": Variant(failure_mode=None, scaling_class=KeepsLeavingRanks),
    "second_scale_restarts": Variant(failure_mode=None, scaling_class=RestartsOnSecondScale),
    "shrink_without_undo": Variant(failure_mode=None, scaling_class=ShrinksWithoutUndo),
    "shrink_keeps_lost_wave": Variant(failure_mode=None, rank_class=KeepsLostGroupWave),
}
