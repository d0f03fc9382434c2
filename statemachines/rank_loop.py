"""The rank loop's recipe, written once: the engine runs it with real I/O, the
simulation with modelled effects, so the explorer checks the loop that runs.

Theory of operation:

1. ``RankLoop`` wraps one ``RankMachine``. It is pure and synchronous like the
   machine: its whole state is the machine's snapshot plus one frozen ``LoopSnapshot``,
   so the simulation can copy and hash it.
2. A driver asks ``pending`` what the loop waits for, and answers it:

   - ``WaitForInput``: block until an input arrives, then ``deliver`` it;
   - ``RunStep``: first ``deliver`` every input that already arrived (the top of an
     iteration), then run one scheduler step and ``complete`` it with its ``StepDone``;
   - ``RunDummy``: one dummy forward, ``complete(None)``;
   - ``Collective``: the vote, barrier or group join its ``action`` names, ``complete``
     it with the machine event that carries the result (``SyncDone``, ``ResumeSynced``,
     ``Reconfigured``); a drained vote's result is dropped here, the machine has
     already decided without it;
   - ``Sleep`` / ``Wake``: free or restore the executor's memory, ``complete(None)``.

   While anything but ``WaitForInput`` or ``RunStep`` is pending, ``deliver`` is
   refused: inputs wait in the driver's queue (a rank in a collective takes nothing).
3. Inputs: ``NewRequest`` (added to the scheduler, then ``RequestArrived``),
   ``AbortRequests``, ``StopRequests``, the coordinator's ``StartWave``, and ``Call``:
   a client's call carrying a machine event (pause, resume, sleep, wake-up, switch,
   group lost) or a local query (``ResetPrefixCache``, ``ReportStats``).
4. The machine's actions are performed in order: the cheap ones at once through the
   driver's ``RankEffects`` (scheduler, messages, replies, starting a vote), the
   blocking ones by making them ``pending``; the actions after a blocking one wait in ``queued`` until
   it completes. When no action asked to go idle, the next iteration steps.
5. Calls are answered when their protocol says: a pause at ``PauseComplete``, a sleep
   once the executor slept (``EnterSleep``), a switch at ``GroupSwitched``, every other
   call once all of its actions were performed. A call the machine refuses is answered
   with the error and changes nothing.
6. A collective that fails because the group broke (a peer died or is stuck) is
   given up with ``group_lost``: what it and the actions queued behind it would have
   done belonged to the broken group, so they are dropped, and the machine takes
   ``GroupLost`` (its rule 13) from whatever it was doing.
7. A resume that reaches a rank whose pause is still pending waits, with every input
   after it (in order), until the pause is no longer pending, and is delivered then:
   exactly as if it had arrived later. Only a scale's rollback sends one (scaling
   rule 8: it resumes the ranks whose pause it abandoned; the client refuses a resume
   while its own pause is in flight), and the machine would refuse it (rank rule 9),
   leaving the rank paused for good once its pause completes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from .errors import ProtocolError
from .rank import RankMachine, RankSnapshot
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
)

# -- inputs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequest:
    """A request for this rank; ``payload`` is what the effects add to the scheduler."""

    request_id: str
    wave: int
    payload: object = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequests:
    """The client matched a stop string: these requests are done."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportStats:
    pass


CallRequest = (
    PauseRequested
    | ResumeRequested
    | SleepRequested
    | WakeUpRequested
    | SwitchRequested
    | GroupLost
    | ResetPrefixCache
    | ReportStats
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    call_id: int
    request: CallRequest


# -- what the loop waits for ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitForInput:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStep:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDummy:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    action: AwaitVote | DrainVote | ResumeBarrier | JoinGroup


@dataclass(frozen=True, slots=True, kw_only=True)
class Sleep:
    level: int
    tags: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Wake:
    tags: frozenset[str]


Pending = WaitForInput | RunStep | RunDummy | Collective | Sleep | Wake


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reply:
    """Answer this call once every action before it was performed."""

    call_id: int


class RankEffects(Protocol):
    """What a loop does to the world without waiting; the driver implements it."""

    def add_request(self, request_id: str, payload: object) -> None: ...

    def abort_requests(self, request_ids: tuple[str, ...]) -> None: ...

    def stop_requests(self, request_ids: tuple[str, ...]) -> None: ...

    def pause_scheduler(self, mode: PauseMode) -> None: ...

    def resume_scheduler(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def notify_coordinator(self, message: NotifyStartWave | NotifyWaveComplete) -> None: ...

    def start_vote(self, vote: StartVote) -> None:
        """Start the vote's all-reduce without waiting; ``AwaitVote`` and ``DrainVote``
        wait for the started votes, oldest first."""

    def announce_held(self, request_ids: tuple[str, ...], reason: str) -> None: ...

    def report(self) -> object: ...

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopSnapshot:
    pending: Pending = WaitForInput()
    queued: tuple[object, ...] = ()
    pause_calls: tuple[int, ...] = ()
    sleep_calls: tuple[int, ...] = ()
    switch_calls: tuple[int, ...] = ()
    # Rule 7: a resume that came while the pause was pending, and the inputs after it.
    deferred: tuple[object, ...] = ()


_TAKES_INPUT = (WaitForInput, RunStep)
_RESULTS = {
    RunStep: StepDone,
    RunDummy: type(None),
    Sleep: type(None),
    Wake: type(None),
}
_COLLECTIVE_RESULTS = {
    AwaitVote: SyncDone,
    DrainVote: SyncDone,
    ResumeBarrier: ResumeSynced,
    JoinGroup: Reconfigured,
}


class RankLoop:
    """One rank's busy loop around its machine; see the module docstring."""

    def __init__(self, machine: RankMachine) -> None:
        self.machine = machine
        self._state = LoopSnapshot()

    def start(self, effects: RankEffects) -> None:
        """Perform the machine's initial actions; call once, before anything else."""
        self._run(self.machine.initial_actions(), effects)

    # -- value semantics ------------------------------------------------------------------

    @property
    def pending(self) -> Pending:
        return self._state.pending

    def snapshot(self) -> tuple[RankSnapshot, LoopSnapshot]:
        return self.machine.snapshot(), self._state

    def copy(self) -> RankLoop:
        twin = object.__new__(RankLoop)
        twin.machine = self.machine.copy()  # type: ignore[assignment]
        twin._state = self._state
        return twin

    def restore(self, snapshot: tuple[RankSnapshot, LoopSnapshot]) -> None:
        self.machine.restore(snapshot[0])
        self._state = snapshot[1]

    # -- driving ------------------------------------------------------------------------

    def deliver(self, item: object, effects: RankEffects) -> None:
        """One input, at the top of an iteration (rule 2)."""
        if not isinstance(self._state.pending, _TAKES_INPUT):
            raise ProtocolError("RankLoop", type(self._state.pending).__name__, item)
        if self._state.deferred or self._defers(item):
            self._state = replace(self._state, deferred=(*self._state.deferred, item))
            return
        self._take(item, effects)

    def _defers(self, item: object) -> bool:
        """Rule 7."""
        return (
            isinstance(item, Call)
            and isinstance(item.request, ResumeRequested)
            and self.machine.resume_waits()
        )

    def _release_deferred(self, effects: RankEffects) -> None:
        """Rule 7: once the pause is no longer pending, the inputs that waited for it."""
        while (
            self._state.deferred
            and isinstance(self._state.pending, _TAKES_INPUT)
            and self.machine.pause_state is not PauseState.PENDING
        ):
            item, *rest = self._state.deferred
            self._state = replace(self._state, deferred=tuple(rest))
            self._take(item, effects)

    def _take(self, item: object, effects: RankEffects) -> None:
        self._state = replace(self._state, pending=RunStep())
        if isinstance(item, NewRequest):
            effects.add_request(item.request_id, item.payload)
            event = RequestArrived(request_id=item.request_id, wave=item.wave)
            self._run(self.machine.handle(event), effects)
        elif isinstance(item, AbortRequests):
            effects.abort_requests(item.request_ids)
        elif isinstance(item, StopRequests):
            effects.stop_requests(item.request_ids)
        elif isinstance(item, StartWave):
            self._run(self.machine.handle(item), effects)
        elif isinstance(item, Call):
            self._call(item, effects)
        else:
            raise ProtocolError("RankLoop", "input", item, "not an input of the rank loop")

    def complete(self, result: object, effects: RankEffects) -> None:
        """The pending blocking operation finished with ``result``."""
        pending = self._state.pending
        expected = (
            _COLLECTIVE_RESULTS[type(pending.action)]
            if isinstance(pending, Collective)
            else _RESULTS.get(type(pending))
        )
        if expected is None or not isinstance(result, expected):
            raise ProtocolError("RankLoop", type(pending).__name__, result, "not its result")
        queued = self._state.queued
        self._state = replace(self._state, pending=RunStep(), queued=())
        actions: tuple[object, ...] = ()
        if isinstance(pending, RunStep) or (
            isinstance(pending, Collective) and not isinstance(pending.action, DrainVote)
        ):
            actions = self.machine.handle(result)
        elif isinstance(pending, Sleep):
            calls = self._state.sleep_calls
            self._state = replace(self._state, sleep_calls=())
            actions = tuple(_Reply(call_id=call_id) for call_id in calls)
        self._run((*actions, *queued), effects)
        self._release_deferred(effects)

    def group_lost(self, effects: RankEffects) -> None:
        """Rule 6: the group broke under the pending operation; give it up. Refused (and
        nothing changes) while joining a new group: a failed join keeps the old one."""
        actions = self.machine.handle(GroupLost())
        self._state = replace(self._state, pending=RunStep(), queued=())
        self._run(actions, effects)
        self._release_deferred(effects)

    # -- calls ---------------------------------------------------------------------------

    def _call(self, call: Call, effects: RankEffects) -> None:
        request = call.request
        if isinstance(request, ResetPrefixCache):
            effects.reset_prefix_cache()
            effects.reply(call.call_id)
            return
        if isinstance(request, ReportStats):
            effects.reply(call.call_id, result=effects.report())
            return
        try:
            actions = self.machine.handle(request)
        except ProtocolError as error:
            effects.reply(call.call_id, error=str(error))
            return
        state = self._state
        if isinstance(request, PauseRequested):
            self._state = replace(state, pause_calls=(*state.pause_calls, call.call_id))
        elif isinstance(request, SleepRequested):
            self._state = replace(state, sleep_calls=(*state.sleep_calls, call.call_id))
        elif isinstance(request, SwitchRequested):
            self._state = replace(state, switch_calls=(*state.switch_calls, call.call_id))
        else:
            actions = (*actions, _Reply(call_id=call.call_id))
        self._run(actions, effects)

    # -- actions -------------------------------------------------------------------------

    def _run(self, actions: tuple[object, ...], effects: RankEffects) -> None:
        for index, action in enumerate(actions):
            blocking = self._perform(action, effects)
            if blocking is not None:
                rest = actions[index + 1 :]
                self._state = replace(self._state, pending=blocking, queued=rest)
                return

    def _perform(self, action: object, effects: RankEffects) -> Pending | None:
        """Do one action; return what to wait for when it blocks."""
        if isinstance(action, RunDummyBatch):
            return RunDummy()
        if isinstance(action, AwaitVote | DrainVote | ResumeBarrier | JoinGroup):
            return Collective(action=action)
        if isinstance(action, EnterSleep):
            return Sleep(level=action.level, tags=action.tags)
        if isinstance(action, WakeUp):
            return Wake(tags=action.tags) if action.tags else None
        if isinstance(action, Idle):
            self._state = replace(self._state, pending=WaitForInput())
        elif isinstance(action, StartVote):
            effects.start_vote(action)
        elif isinstance(action, NotifyStartWave | NotifyWaveComplete):
            effects.notify_coordinator(action)
        elif isinstance(action, PauseScheduler):
            effects.pause_scheduler(action.mode)
        elif isinstance(action, ResumeScheduler):
            effects.resume_scheduler()
        elif isinstance(action, RequestHeld):
            effects.announce_held(action.request_ids, action.reason)
        elif isinstance(action, PauseComplete):
            self._answer("pause_calls", effects)
        elif isinstance(action, GroupSwitched):
            self._answer("switch_calls", effects)
        elif isinstance(action, _Reply):
            effects.reply(action.call_id)
        else:
            raise ProtocolError("RankLoop", "performing", action, "an action it does not know")
        return None

    def _answer(self, calls: str, effects: RankEffects) -> None:
        call_ids: tuple[int, ...] = getattr(self._state, calls)
        self._state = replace(self._state, **{calls: ()})
        for call_id in call_ids:
            effects.reply(call_id)
