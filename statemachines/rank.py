"""The engine rank's protocol: waves, pipelined lockstep votes, two-phase pause, sleep.

Theory of operation (numbers are referred to by tests and by the engine loop):

1. The machine owns the protocol; the busy loop owns nothing but I/O. One loop
   iteration is:

   a. deliver every input that arrived, in order: ``RequestArrived`` (after adding the
      request to the scheduler), ``StartWave``, ``PauseRequested``, ``ResumeRequested``,
      ``SleepRequested``, ``WakeUpRequested``; perform the actions each returns;
   b. run one scheduler step (the scheduler itself honours ``PauseScheduler``) and feed
      ``StepDone(executed, has_unfinished)``; perform the actions in order:
      ``RunDummyBatch`` (one dummy forward), ``StartVote`` (start the non-blocking
      all-reduce of this step's vote), ``AwaitVote`` (wait for the previous vote's
      result and feed it as ``SyncDone``, whose actions are performed too), and
      ``DrainVote`` (wait for a vote whose result no longer matters);
   c. if the last action of the iteration was ``Idle``, block until the next input,
      otherwise start the next iteration at once.

   ``ResumeBarrier`` asks for the barrier all-reduce of the resume; feed its result as
   ``ResumeSynced``. While a collective is awaited (phases SYNCING, BARRIER and
   SWITCHING, and a drain) the machine takes nothing but its result: inputs wait in
   the loop's queue. ``rank_loop.RankLoop`` is that loop, written once for the engine
   and the simulation.
2. Lockstep mode: while a wave runs every iteration issues exactly one forward (a real
   step, else ``RunDummyBatch``) and ``step_counter`` counts them. The ranks vote on
   steps 1 and 2 of a wave and every ``sync_interval`` steps (1 by default: every
   step). Votes are pipelined: a vote is started after the forward that it describes
   and read at the next vote point, after that point's forward, so the all-reduce
   overlaps a forward instead of stopping every rank. Every rank reads the same result
   for the same vote, so their decisions stay identical. Only a vote stops a wave.
3. Independent mode: no votes, no dummy batches, no waves; the rank runs while it has
   work and pauses on its own (a WAIT pause after the step that left nothing it
   admitted unfinished).
4. A wake not decided by a collective is announced with ``NotifyStartWave``: a request
   reaching an idle unpaused rank (whatever its wave), or a ``StartWave`` acted upon.
   ``StartWave`` is ignored while ``ignore_start_wave`` is set, for an older wave, by
   the rank it excludes, and by a rank already running.
5. A vote that says nobody had work and nobody was pausing is confirmed by the vote
   started after this iteration's forward (every rank of the wave started it before
   reading the older one, so it completes): work or a pause that arrived in between is
   in it, and the wave goes on. When the newest vote says so too, the wave ends with no
   vote open: rank 0 sends ``NotifyWaveComplete``, and every rank does ``wave += 1``
   and ``step_counter = 0``.
6. Pause phase 1 (PENDING): the scheduler is paused in the requested mode and a
   lockstep rank is forced running, so it keeps serving peers. It votes for the pause
   at each vote (a WAIT pause only once nothing of its own executes any more and
   nothing it admitted is left, ``StepDone.has_admitted``: the real scheduler can run
   nothing for several steps while a preempted request waits for a prefill step; until
   then it reports work, so the wave cannot end under it).
7. Pause phase 2: when every rank voted for it, the wave ends, the vote still open is
   drained, ``ignore_start_wave`` is set, a WAIT scheduler is frozen (KEEP) and
   ``PauseComplete`` is returned, after the last forward of that iteration: a pause
   that reached every rank completes within two forwards (``2 * sync_interval`` in
   general). A pause while paused answers at once and only an ABORT touches the
   frozen scheduler.
8. Requests reaching a paused or sleeping rank wait and say so (``RequestHeld``).
9. Resume while PENDING waits: the loop keeps it, and every input after it, until the
   pause completes (``rank_loop`` rule 7; a scale's rollback resumes ranks whose pause
   it abandoned), and the machine refuses one handed to it while PENDING; resume
   while unpaused is a harmless no-op (a
   duplicate resume never sends one rank into the barrier alone); resume while paused
   clears the pause and ``ignore_start_wave`` and asks for the barrier, after which the
   ranks run if any of them holds work (rank 0 announces that wave).
10. Sleep pauses first, in the sleep's mode (ABORT drops the requests in flight, WAIT
    lets them finish, KEEP freezes them; requests kept across a sleep that drops the
    KV cache are recomputed on wake), then ``EnterSleep``: level 0 puts "scheduling"
    to sleep, levels 1 and 2 "weights", "kv_cache" and "scheduling". A sleep while
    paused sleeps at once (an ABORT one drops the requests the pause kept or held,
    under an earlier ABORT pause too).
    ``WakeUpRequested`` wakes the given parts; the rank resumes (rule 9) only when
    nothing is asleep any more. Resume while asleep is refused.
11. Elastic scaling: ``SwitchRequested`` is taken only while paused and idle; the rank
    answers ``JoinGroup`` (a collective over the new group, phase SWITCHING) and takes
    its result as ``Reconfigured``: its new group size and the group's max of
    (running, wave, step_counter), then ``GroupSwitched``. A rank built ``joining``
    (scale up) starts paused (KEEP) with ``ignore_start_wave``, and
    ``initial_actions()`` freezes its scheduler before the loop takes any input.
12. ``SyncDone`` may carry the spans (min, max) of the voters' wave and step counter;
    any difference from the vote this rank started raises ``LockstepDriftError``
    instead of hanging later.
13. Rank loss (``on_rank_failure="shrink"``): ``GroupLost`` says the DP group is
    broken (a peer died or is stuck): a collective that failed, or the client's call
    that tells a rank not in a collective. It is taken in every phase but SWITCHING (a
    switch that fails keeps the old group, rule 11): the votes still open are dropped
    with the group, the rank pauses KEEP at once without a vote (nobody to vote with),
    with ``ignore_start_wave`` (its requests stay frozen, none is lost), answers a
    pause call still waiting (``PauseComplete``: it is paused) and goes idle. That is
    the state a switch starts from (rule 11): the survivors form their new group
    through a scale's switch. Taken again while so paused it changes nothing. That
    switch ends the lost group's wave, which no vote ended (the coordinator may still
    believe it runs, and its broadcasts may still be in flight): every survivor goes
    on in the next wave with step 0, and the new rank 0 reports the old one complete,
    as a pause's consensus does (rule 7).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import LockstepDriftError
from .rank_events import (
    AwaitVote,
    DrainVote,
    EnterSleep,
    GroupLost,
    GroupSwitched,
    Idle,
    JoinGroup,
    NotifyStartWave,
    NotifyWaveComplete,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    PauseState,
    RankPhase,
    Reconfigured,
    RequestArrived,
    RequestHeld,
    ResumeBarrier,
    ResumeRequested,
    ResumeScheduler,
    ResumeSynced,
    RunDummyBatch,
    SleepRequested,
    StartVote,
    StartWave,
    StepDone,
    SwitchRequested,
    SyncDone,
    WakeUp,
    WakeUpRequested,
    sleep_tags,
)
from .table import TableMachine, Transition

# -- state --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSnapshot:
    phase: RankPhase
    rank: int
    dp_size: int
    wave: int = 0
    running: bool = False
    step_counter: int = 0
    pause_state: PauseState = PauseState.UNPAUSED
    pause_mode: PauseMode | None = None
    ignore_start_wave: bool = False
    has_work: bool = False
    asleep: frozenset[str] = frozenset()
    sleep_level: int | None = None
    # Votes started and not read yet (lockstep, rule 2): at most two.
    open_votes: int = 0
    # Rule 13: it left a broken group; the switch that follows ends that group's wave.
    left_group: bool = False


_IDLE, _RUNNING, _SYNCING, _BARRIER, _SWITCHING = RankPhase
_LOSABLE = (_IDLE, _RUNNING, _SYNCING, _BARRIER)


def _rows() -> dict[tuple[RankPhase, type], Transition]:
    def row(handler: str, *targets: RankPhase) -> Transition:
        return Transition(handler=handler, targets=targets)

    return {
        (_IDLE, RequestArrived): row("on_request", _IDLE, _RUNNING),
        (_IDLE, StartWave): row("on_start_wave", _IDLE, _RUNNING),
        (_IDLE, StepDone): row("on_step_done", _IDLE, _RUNNING),
        (_IDLE, PauseRequested): row("on_pause", _IDLE, _RUNNING),
        (_IDLE, SleepRequested): row("on_sleep", _IDLE, _RUNNING),
        (_IDLE, ResumeRequested): row("on_resume", _IDLE, _RUNNING, _BARRIER),
        (_IDLE, WakeUpRequested): row("on_wake_up", _IDLE, _RUNNING, _BARRIER),
        (_IDLE, SwitchRequested): row("on_switch_requested", _SWITCHING),
        (_RUNNING, RequestArrived): row("on_request", _RUNNING),
        (_RUNNING, StartWave): row("on_start_wave", _RUNNING),
        (_RUNNING, StepDone): row("on_step_done", _IDLE, _RUNNING, _SYNCING),
        (_RUNNING, PauseRequested): row("on_pause", _RUNNING),
        (_RUNNING, SleepRequested): row("on_sleep", _RUNNING),
        (_RUNNING, ResumeRequested): row("on_resume", _RUNNING),
        (_RUNNING, WakeUpRequested): row("on_wake_up", _RUNNING),
        (_SYNCING, SyncDone): row("on_sync_done", _IDLE, _RUNNING, _SYNCING),
        (_BARRIER, ResumeSynced): row("on_resume_synced", _IDLE, _RUNNING),
        (_SWITCHING, Reconfigured): row("on_reconfigured", _IDLE),
        # Rule 13: everywhere but SWITCHING, whose failed join keeps the old group.
        **{(phase, GroupLost): row("on_group_lost", _IDLE) for phase in _LOSABLE},
    }


Result = tuple[RankSnapshot, tuple[object, ...]]


class RankMachine(TableMachine[RankSnapshot]):
    """One DP rank's protocol state; see the module docstring for how a loop drives it."""

    TRANSITIONS = _rows()

    def __init__(
        self,
        rank: int,
        dp_size: int,
        *,
        sync_interval: int = 1,
        lockstep: bool = True,
        joining: bool = False,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not 0 <= rank < dp_size:
            raise ValueError(f"rank {rank} outside dp_size {dp_size}")
        if sync_interval < 1:
            raise ValueError(f"sync_interval must be >= 1, got {sync_interval}")
        self.sync_interval = sync_interval
        self.lockstep = lockstep
        # A rank joining a running group (scale up) waits, paused, for the switch.
        self._state = RankSnapshot(
            phase=_IDLE,
            rank=rank,
            dp_size=dp_size,
            pause_state=PauseState.PAUSED if joining else PauseState.UNPAUSED,
            pause_mode=PauseMode.KEEP if joining else None,
            ignore_start_wave=joining,
        )

    # -- read-only view -------------------------------------------------------------

    @property
    def phase(self) -> RankPhase:
        return self._state.phase

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def dp_size(self) -> int:
        return self._state.dp_size

    @property
    def wave(self) -> int:
        return self._state.wave

    @property
    def running(self) -> bool:
        return self._state.running

    @property
    def step_counter(self) -> int:
        return self._state.step_counter

    @property
    def pause_state(self) -> PauseState:
        return self._state.pause_state

    @property
    def ignore_start_wave(self) -> bool:
        return self._state.ignore_start_wave

    @property
    def asleep(self) -> frozenset[str]:
        return self._state.asleep

    # -- rules that broken variants in the tests override ----------------------------

    def vote_due(self, step_counter: int) -> bool:
        """Rule 2: steps 1 and 2 of a wave (so a pause of an idle engine costs two
        forwards), and every ``sync_interval`` steps."""
        return step_counter <= 2 or step_counter % self.sync_interval == 0

    def voted_step(self, state: RankSnapshot) -> int:
        """The step of the oldest open vote: this step's own when it is the only one,
        else the previous vote point."""
        step = state.step_counter
        if state.open_votes < 2:
            return step
        step -= 1
        while step > 1 and not self.vote_due(step):
            step -= 1
        return step

    def needs_dummy(self, state: RankSnapshot, event: StepDone) -> bool:
        """Rule 2: one forward per iteration while the wave runs."""
        return not event.executed

    def counts_step(self, event: StepDone) -> bool:
        """Rule 2: every forward, real or dummy, counts."""
        return True

    def wakes_on_request(self, state: RankSnapshot, event: RequestArrived) -> bool:
        """Rules 4 and 8: an idle rank wakes for any request unless paused or asleep."""
        return state.pause_state is PauseState.UNPAUSED and not state.asleep

    def runs_own_wake(self) -> bool:
        """Rule 4: the rank that announces a wake runs it itself."""
        return True

    def start_wave_ignored(self, state: RankSnapshot, event: StartWave) -> bool:
        """Rule 4."""
        return state.ignore_start_wave or event.wave < state.wave or state.running

    def resume_waits(self) -> bool:
        """Rule 9: a resume arriving now waits in the loop until the pause completes."""
        return self._state.pause_state is PauseState.PENDING

    def duplicate_resume_actions(self, state: RankSnapshot) -> Result:
        """Rule 9: a resume while unpaused changes nothing."""
        return state, ()

    def held(self, state: RankSnapshot, event: RequestArrived) -> tuple[object, ...]:
        """Rule 8: a waiting request is announced."""
        reason = "asleep" if state.asleep else "paused"
        return (RequestHeld(request_ids=(event.request_id,), reason=reason),)

    def vote(self, state: RankSnapshot, event: StepDone, counter: int) -> StartVote:
        """Rules 6 and 7: a pausing rank votes, a WAIT pause only once nothing of its
        own executes any more and nothing it admitted is left (a step that ran nothing
        may leave a preempted request to finish). Until then it reports work, so the
        wave goes on until it can vote: a draining rank that reported none could end
        the wave with its pause still pending, leaving its peers to pause without it."""
        draining = state.pause_mode is PauseMode.WAIT and (event.executed or event.has_admitted)
        return StartVote(
            has_unfinished=event.has_unfinished or draining,
            pending_pause=state.pause_state is PauseState.PENDING and not draining,
            wave=state.wave,
            step_counter=counter,
        )

    def independent_pause_reached(self, state: RankSnapshot, event: StepDone) -> bool:
        """Rule 3: an independent rank reaches its pause on its own, a WAIT pause once
        nothing it admitted is left: after the step that finished its last admitted
        request (it would otherwise go idle with the pause pending, and never answer
        it), but not after a step that ran nothing while a preempted request waits."""
        return state.pause_state is PauseState.PENDING and (
            state.pause_mode is not PauseMode.WAIT or not event.has_admitted
        )

    def switched(self, state: RankSnapshot, event: Reconfigured) -> RankSnapshot:
        """Rule 11: the group's max of wave and step counter, so every rank of the new
        group meets the next all-reduce in lockstep."""
        return replace(
            state,
            rank=event.rank,
            dp_size=event.dp_size,
            wave=event.wave,
            step_counter=event.step_counter,
        )

    def sleep_aborts(self, state: RankSnapshot, event: SleepRequested) -> bool:
        """Rule 10: an ABORT sleep drops what the rank holds whenever it comes, the
        requests held since an earlier ABORT pause included (its caller believes every
        request it sent before aborted); the other modes keep what a pause already
        decided (a KEEP or WAIT pause never loosens, rule 7)."""
        return event.mode is PauseMode.ABORT

    def pause_while_paused(self, state: RankSnapshot, event: PauseRequested) -> Result:
        """Rule 7: answered at once. Past consensus nothing may run, so only an ABORT
        (dropping requests) touches the frozen scheduler: a WAIT would let admitted
        requests step again."""
        if event.mode is not PauseMode.ABORT:
            return state, (PauseComplete(),)
        return replace(state, pause_mode=event.mode), (
            PauseScheduler(mode=event.mode),
            PauseComplete(),
        )

    # -- handlers ----------------------------------------------------------------------

    def on_request(self, state: RankSnapshot, event: RequestArrived) -> Result:
        state = replace(state, has_work=True)
        if state.phase is _RUNNING:
            held = self.held(state, event) if state.pause_state is PauseState.PENDING else ()
            return state, held
        if not self.wakes_on_request(state, event):
            if state.pause_state is PauseState.UNPAUSED and not state.asleep:
                return state, ()
            return state, self.held(state, event)
        if not self.lockstep:
            return replace(state, phase=_RUNNING, running=True), ()
        wave = max(state.wave, event.wave)
        woken = replace(state, wave=wave)
        if self.runs_own_wake():
            woken = replace(woken, phase=_RUNNING, running=True)
        return woken, (NotifyStartWave(wave=wave),)

    def on_start_wave(self, state: RankSnapshot, event: StartWave) -> Result:
        if not self.lockstep or self.start_wave_ignored(state, event):
            return state, ()
        if event.exclude_rank == state.rank:
            return replace(state, wave=event.wave), ()
        started = replace(state, phase=_RUNNING, running=True, wave=event.wave)
        return started, (NotifyStartWave(wave=event.wave),)

    def on_step_done(self, state: RankSnapshot, event: StepDone) -> Result:
        state = replace(state, has_work=event.has_unfinished)
        if not self.lockstep:
            return self._independent_step(state, event)
        if state.phase is _IDLE:
            if event.executed:
                raise self.refuse(state, event, "a forward ran outside a running wave")
            if event.has_unfinished and state.pause_state is PauseState.UNPAUSED:
                raise self.refuse(state, event, "work appeared without a RequestArrived")
            return state, (Idle(),)
        actions: list[object] = []
        if self.needs_dummy(state, event):
            actions.append(RunDummyBatch())
        counter = state.step_counter + 1 if self.counts_step(event) else state.step_counter
        state = replace(state, step_counter=counter)
        if counter and self.vote_due(counter):
            actions.append(self.vote(state, event, counter))
            if state.open_votes:
                actions.append(AwaitVote())
                state = replace(state, phase=_SYNCING)
            state = replace(state, open_votes=state.open_votes + 1)
        return state, tuple(actions)

    def _independent_step(self, state: RankSnapshot, event: StepDone) -> Result:
        if self.independent_pause_reached(state, event):
            return self._pause_reached(state, ())
        if state.pause_state is PauseState.PAUSED or not event.has_unfinished:
            return replace(state, phase=_IDLE, running=False), (Idle(),)
        return replace(state, phase=_RUNNING, running=True), ()

    def on_sync_done(self, state: RankSnapshot, event: SyncDone) -> Result:
        if event.pausing_ranks > state.dp_size:
            raise self.refuse(state, event, f"more pausing ranks than dp_size {state.dp_size}")
        for name, span, own in (
            ("wave", event.wave_span, state.wave),
            ("step_counter", event.step_counter_span, self.voted_step(state)),
        ):
            if span is not None and span != (own, own):
                raise LockstepDriftError(
                    type(self).__name__,
                    state.phase.name,
                    event,
                    f"{name} {own} here, {span[0]}..{span[1]} across the group",
                )
        state = replace(state, open_votes=state.open_votes - 1)
        if event.pausing_ranks == state.dp_size:
            if state.pause_state is not PauseState.PENDING:
                raise self.refuse(state, event, "pause consensus but this rank is not pausing")
            drain = (DrainVote(),) * state.open_votes
            return self._pause_reached(state, (*drain, *self._end_wave_actions(state)))
        if event.any_unfinished or event.pausing_ranks:
            return replace(state, phase=_RUNNING), ()
        if state.open_votes:
            return state, (AwaitVote(),)  # rule 5: the newest vote confirms
        return self._end_wave(state), (*self._end_wave_actions(state), Idle())

    def _end_wave(self, state: RankSnapshot) -> RankSnapshot:
        return replace(
            state, phase=_IDLE, running=False, wave=state.wave + 1, step_counter=0, open_votes=0
        )

    def _end_wave_actions(self, state: RankSnapshot) -> tuple[object, ...]:
        return (NotifyWaveComplete(wave=state.wave),) if state.rank == 0 else ()

    def _pause_reached(self, state: RankSnapshot, actions: tuple[object, ...]) -> Result:
        paused = replace(
            self._end_wave(state) if self.lockstep else state,
            phase=_IDLE,
            running=False,
            pause_state=PauseState.PAUSED,
            ignore_start_wave=True,
        )
        sleep: tuple[object, ...] = ()
        if state.sleep_level is not None:
            tags = sleep_tags(state.sleep_level)
            paused = replace(paused, asleep=paused.asleep | tags, sleep_level=None)
            sleep = (EnterSleep(level=state.sleep_level, tags=tags),)
        # Past consensus nothing may run, not even what a WAIT pause let drain.
        freeze = (
            (PauseScheduler(mode=PauseMode.KEEP),) if state.pause_mode is PauseMode.WAIT else ()
        )
        return paused, (*actions, *freeze, PauseComplete(), *sleep, Idle())

    def on_pause(self, state: RankSnapshot, event: PauseRequested) -> Result:
        if state.pause_state is PauseState.PAUSED:
            return self.pause_while_paused(state, event)
        scheduler = (PauseScheduler(mode=event.mode),)
        pending = replace(state, pause_state=PauseState.PENDING, pause_mode=event.mode)
        if self.lockstep:
            pending = replace(pending, phase=_RUNNING, running=True)
        return pending, scheduler

    def on_sleep(self, state: RankSnapshot, event: SleepRequested) -> Result:
        abort = self.sleep_aborts(state, event)
        dropped: tuple[object, ...] = (PauseScheduler(mode=PauseMode.ABORT),) if abort else ()
        if state.pause_state is PauseState.PAUSED:
            tags = sleep_tags(event.level)
            asleep = replace(
                state,
                asleep=state.asleep | tags,
                pause_mode=PauseMode.ABORT if abort else state.pause_mode,
            )
            return asleep, (*dropped, EnterSleep(level=event.level, tags=tags))
        level = max(event.level, state.sleep_level or 0)
        if state.pause_state is PauseState.PENDING:
            mode = PauseMode.ABORT if abort else state.pause_mode
            return replace(state, sleep_level=level, pause_mode=mode), dropped
        pending, actions = self.on_pause(state, PauseRequested(mode=event.mode))
        return replace(pending, sleep_level=level), actions

    def on_wake_up(self, state: RankSnapshot, event: WakeUpRequested) -> Result:
        tags = state.asleep if event.tags is None else event.tags & state.asleep
        awake = replace(state, asleep=state.asleep - tags)
        if not state.asleep or awake.asleep:
            return awake, (WakeUp(tags=tags),)
        resumed, actions = self._resume(awake)
        return resumed, (WakeUp(tags=tags), *actions)

    def on_resume(self, state: RankSnapshot, event: ResumeRequested) -> Result:
        if state.pause_state is PauseState.PENDING:
            raise self.refuse(state, event, "a pause is still pending")
        if state.asleep:
            raise self.refuse(state, event, f"asleep ({sorted(state.asleep)}); wake up first")
        if state.pause_state is PauseState.UNPAUSED:
            return self.duplicate_resume_actions(state)
        return self._resume(state)

    def _resume(self, state: RankSnapshot) -> Result:
        resumed = replace(
            state, pause_state=PauseState.UNPAUSED, pause_mode=None, ignore_start_wave=False
        )
        if self.lockstep:
            barrier = ResumeBarrier(has_unfinished=state.has_work)
            return replace(resumed, phase=_BARRIER), (ResumeScheduler(), barrier)
        if state.has_work:
            return replace(resumed, phase=_RUNNING, running=True), (ResumeScheduler(),)
        return resumed, (ResumeScheduler(), Idle())

    def on_resume_synced(self, state: RankSnapshot, event: ResumeSynced) -> Result:
        if not event.any_unfinished:
            return replace(state, phase=_IDLE, running=False), (Idle(),)
        started = replace(state, phase=_RUNNING, running=True, step_counter=0)
        announce = (NotifyStartWave(wave=state.wave),) if state.rank == 0 else ()
        return started, announce

    def on_switch_requested(self, state: RankSnapshot, event: SwitchRequested) -> Result:
        if state.pause_state is not PauseState.PAUSED:
            raise self.refuse(state, event, "only a paused rank can switch groups")
        join = JoinGroup(
            dp_size=event.dp_size,
            running=state.running,
            wave=state.wave,
            step_counter=state.step_counter,
        )
        return replace(state, phase=_SWITCHING), (join,)

    def on_reconfigured(self, state: RankSnapshot, event: Reconfigured) -> Result:
        if event.wave < state.wave or event.step_counter < state.step_counter:
            raise self.refuse(state, event, "not the group's max of (running, wave, step)")
        if event.running:
            # Every member switches paused, so the agreed value is False; True means a
            # member that was not paused joined, and running on would hang its peers.
            raise self.refuse(state, event, "a member of the new group was running")
        switched = replace(self.switched(state, event), phase=_IDLE, running=event.running)
        if not state.left_group:
            return switched, (GroupSwitched(dp_size=event.dp_size),)
        # Rule 13: the lost group's wave may still run for the coordinator and its
        # broadcasts may still be in flight; the new group ends it, as a pause does.
        ended = replace(switched, wave=switched.wave + 1, step_counter=0, left_group=False)
        notify = (NotifyWaveComplete(wave=switched.wave),) if event.rank == 0 else ()
        return ended, (*notify, GroupSwitched(dp_size=event.dp_size))

    def on_group_lost(self, state: RankSnapshot, event: GroupLost) -> Result:
        """Rule 13: paused KEEP out of the broken group (an ABORT pause already dropped
        its requests and stays so), no vote open, idle until the switch."""
        mode = PauseMode.ABORT if state.pause_mode is PauseMode.ABORT else PauseMode.KEEP
        paused = replace(
            state,
            phase=_IDLE,
            running=False,
            pause_state=PauseState.PAUSED,
            pause_mode=mode,
            ignore_start_wave=True,
            sleep_level=None,
            open_votes=0,
            left_group=True,
        )
        return paused, (PauseScheduler(mode=PauseMode.KEEP), PauseComplete(), Idle())

    def initial_actions(self) -> tuple[object, ...]:
        """Rule 11: what the loop performs before its first input. A joining rank's
        scheduler starts frozen, as its machine does."""
        state = self._state
        if state.pause_state is PauseState.PAUSED and state.pause_mode is not None:
            return (PauseScheduler(mode=state.pause_mode),)
        return ()
