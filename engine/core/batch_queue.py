"""The batch queue (`EngineConfig(async_scheduling=True)`): a rank schedules its next
step while the current one runs, so the model never waits for the engine's Python.

Theory of operation:

1. The rank runner answers the loop's `RunStep` here. At most one step is in flight
   AHEAD of the loop: answering for step N, the queue schedules step N+1 and starts it
   on the model thread before it waits for N, so N+1 is queued there when N's forward
   ends, and the update of N, the outputs' flush, the next iteration's inputs and the
   scheduling of N+2 all overlap N+1's forward.
2. N+1 is scheduled before N's samples are known. The scheduler gives each request
   that samples in N a placeholder decode in N+1 (KV allocated, budget counted); the
   job of N+1 fills the placeholders from N's output on the model thread, right before
   its forward (jobs run in order there, so N's output exists). A request that N
   finishes (stop token, length) or that is aborted, stopped or preempted before N+1's
   update has its N+1 sample dropped by the scheduler's update: it is never emitted.
3. The machine needs no change: it gets one `StepDone` per forward, in order, as from
   the serial loop, so a lockstep rank's votes and dummy batches stay in step with its
   forwards. A step is started ahead only when a copy of the loop says that, if the
   current step leaves work, the loop steps again (the machine is pure, and nothing
   reaches it between that question and the real answer). When the current step
   leaves no work, the step ahead holds only finished requests: it is drained at once
   (waited for, its update applied, which emits nothing) and never reported, so the
   loop goes on as if it never ran.
4. Everything that is not another step (a dummy batch, a collective, a sleep or wake,
   a rank call, blocking for input) is preceded by `drain()`, so it finds the state
   of the serial loop: no forward in flight, every sample applied.
5. Aborts still win over the step that was running when they arrived (the runner's
   rule 4): they are taken after each forward, before its update.
6. Structured output: the step ahead starts its forward at once, but its grammar
   bitmask depends on the current step's tokens, so it is computed after the current
   step's update has advanced the matchers (upstream's deferred sampling); the step
   ahead's sampling waits for it on the model thread, its forward does not. Outputs
   are those of the serial loop. A step started with nothing ahead of it gets its
   bitmask at once.
7. Speculative decoding: drafts follow known tokens, and how many of a step's drafts
   are kept decides where a request's next token goes, so a request that drafts
   alternates: it verifies drafts in one step and sits out the step ahead, scheduled
   before they are known (the scheduler decides, while its drafts are accepted, or,
   with a draft model, when the draft model was asked to propose after its sample).
   Requests without drafts decode in every step, as in rule 2. Outputs are those of
   the serial loop.
8. Every other input takes effect from the next step scheduled after it, which under
   the queue is one step later than in the serial loop: a KEEP or WAIT pause may let
   one more step's tokens land before it completes. What a stream carries does not
   change: a request's tokens do not depend on when they are computed, and what a
   KEEP pause holds back, the resume gives.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelJob, ModelThread
from wavecore.engine.executors.batch import GrammarBitmask, ModelOutput
from wavecore.engine.scheduler import RequestUpdate, SchedulerOutput
from wavecore.statemachines import (
    NotifyStartWave,
    NotifyWaveComplete,
    PauseMode,
    ProtocolError,
    RankLoop,
    RankMachine,
    RunStep,
    StartVote,
    StepDone,
)

# What the copy of the loop is asked: the current step ran and left work.
_WORK_LEFT = StepDone(executed=True, has_unfinished=True, has_admitted=True)


@dataclass(slots=True)
class InFlight:
    """A started step; `slot` is where its grammar bitmask goes (None: it needs none)."""

    step: SchedulerOutput
    job: ModelJob[ModelOutput]
    slot: Future[GrammarBitmask | None] | None


class BatchQueue:
    """One rank's queue of at most one step ahead; see the module docstring. `emit`
    takes a step's updates (the runner's effects), `counts` are the runner's counters,
    `on_step` is told of each step that ran and its time (iteration details)."""

    def __init__(
        self,
        *,
        core: EngineCore,
        thread: ModelThread,
        loop: RankLoop,
        counts: dict[str, int],
        emit: Callable[[list[RequestUpdate]], None],
        on_step: Callable[[SchedulerOutput, float], None] | None = None,
    ) -> None:
        self._core = core
        self._thread = thread
        self._loop = loop
        self._counts = counts
        self._emit = emit
        self._on_step = on_step
        self._ahead: InFlight | None = None

    async def step(self, take_aborts: Callable[[], None]) -> StepDone:
        """Answer the loop's `RunStep` (rule 1); `take_aborts` applies the aborts waiting
        in the inbox."""
        core = self._core
        current = self._ahead
        if current is None:
            step = self._schedule(self._loop.machine)
            if step is None:
                return StepDone(
                    executed=False,
                    has_unfinished=core.has_unfinished(),
                    has_admitted=core.has_admitted(),
                )
            slot = core.bitmask_slot(step)
            current = InFlight(step, self._thread.start(core.execute, step, slot), slot)
            if slot is not None:
                core.fill_bitmask(step, slot)  # nothing is ahead of it: rule 6
        self._ahead = self._start_next(current.job)
        await self._finish(current, take_aborts)
        done = StepDone(
            executed=True, has_unfinished=core.has_unfinished(), has_admitted=core.has_admitted()
        )
        if not done.has_unfinished:
            await self.drain(take_aborts)  # rule 3: only finished requests in it
        return done

    async def drain(self, take_aborts: Callable[[], None]) -> None:
        """Wait for the step ahead, if any, and apply its update (rule 4)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await self._finish(ahead, take_aborts)

    def _start_next(self, previous: ModelJob[ModelOutput]) -> InFlight | None:
        """Schedule and start the step after `previous` if the loop will want it."""
        predicted = self._loop.copy()
        try:
            predicted.complete(_WORK_LEFT, _NO_EFFECTS)
        except ProtocolError:
            return None  # the machine refuses a step now; the real answer will tell why
        if not isinstance(predicted.pending, RunStep):
            return None
        step = self._schedule(predicted.machine)  # its step count after the current step
        if step is None:
            return None
        slot = self._core.bitmask_slot(step)
        return InFlight(step, self._thread.start(self._execute_after, step, previous, slot), slot)

    def _schedule(self, machine: RankMachine) -> SchedulerOutput | None:
        # Lockstep ranks admit prefills on the same steps: those of their shared count.
        step = self._core.schedule(machine.step_counter if machine.lockstep else None)
        self._emit(self._core.take_finished_early())
        return step

    def _execute_after(
        self,
        step: SchedulerOutput,
        previous: ModelJob[ModelOutput],
        slot: Future[GrammarBitmask | None] | None,
    ) -> ModelOutput:
        """On the model thread, after `previous` ran: resolve, then run the forward."""
        step.resolve_placeholders(previous.result())
        return self._core.execute(step, slot)

    async def _finish(self, in_flight: InFlight, take_aborts: Callable[[], None]) -> None:
        ahead = self._ahead
        slot = None if ahead is None else ahead.slot
        try:
            output = await in_flight.job.wait()
            take_aborts()
            self._emit(self._core.update(in_flight.step, output))
        except BaseException:
            if slot is not None:  # the step ahead's sampling fails instead of waiting
                slot.set_exception(RuntimeError("the step before this one did not complete"))
            raise
        if ahead is not None and slot is not None:
            self._core.fill_bitmask(ahead.step, slot)  # rule 6: the matchers are current
        self._counts["real_steps"] += 1
        if self._on_step is not None:
            self._on_step(in_flight.step, in_flight.job.elapsed_s)


class _NoEffects:
    """The `RankEffects` of the loop's copy that `_start_next` questions: it does
    nothing, the real loop performs the same actions a moment later."""

    def add_request(self, request_id: str, payload: object) -> None:
        pass

    def abort_requests(self, request_ids: tuple[str, ...]) -> None:
        pass

    def stop_requests(self, request_ids: tuple[str, ...]) -> None:
        pass

    def pause_scheduler(self, mode: PauseMode) -> None:
        pass

    def resume_scheduler(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass

    def notify_coordinator(self, message: NotifyStartWave | NotifyWaveComplete) -> None:
        pass

    def start_vote(self, vote: StartVote) -> None:
        pass

    def announce_held(self, request_ids: tuple[str, ...], reason: str) -> None:
        pass

    def report(self) -> object:
        return None

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        pass


_NO_EFFECTS = _NoEffects()
