"""The real driver of the rank loop: `statemachines.rank_loop.RankLoop` over real I/O.

Theory of operation:

1. The loop's recipe and the performing of every machine action live in `RankLoop`
   (the simulation runs the same code over modelled effects). This module only
   answers what the loop waits for; `core_effects.CoreEffects` is its `RankEffects`
   on an `EngineCore`. Forwards, dummy batches, collectives, sleeps and wakes run on
   the `ModelThread`, in order; the scheduler is touched only between them, on the
   event loop. A vote is started there too (gloo runs it in the background) and
   awaited on the model thread one step later.
2. Inputs are the client's messages (`engine.messages`); each becomes one loop input
   (`rank_inputs`). They arrive on one in-memory stream, from the channels of a rank
   process or straight from an in-process front end.
3. What the effects buffered is flushed before the runner blocks: the iteration's
   token updates go out as ONE `StepOutputs`.
4. An abort that arrives while a step runs wins over that step's output: after the
   forward and before the scheduler's update, aborts already waiting at the head of
   the inbox are applied, so an aborted request never gets another token.
5. If anything raises, the rank reports `RankFailed` (naming itself) and waits for
   its input to close; the client fails every request.
6. With `survive_lost_group` (`on_rank_failure="shrink"`) a collective that fails (a
   peer died or is stuck) is reported the same way but the rank lives on: its loop
   gives the collective up (`RankLoop.group_lost`), paused KEEP out of the broken
   group, and waits for the client's shrink (`LeaveGroup`, then a switch that may
   give it a new number).
7. With `async_scheduling` a `RunStep` is answered by the `BatchQueue`
   (`core.batch_queue`), which keeps one step in flight ahead of the loop; it is
   drained before anything else runs or the runner blocks for input.
8. A collective blocked on a peer the client dropped fails as soon as the client's
   `LeaveGroup`, or the end of the rank's input, reaches the rank, not after
   collective_timeout (`interrupt_collective`).
9. A step's forward starts on the model thread before its grammar bitmask is computed
   here (structured output); the forward's sampling waits for it. A rank whose only
   schedulable work waits for grammars to compile waits for the next compile to end
   or the next input, whichever comes first, instead of spinning.
10. A step whose forward or sampling raised fails the rank with a dump of the step
   (`core.step_failure`): its index, the wave, its requests and their token counts,
   in the `RankFailed` and logged once here.
11. With `log_iteration_details` each forward (a step, or a dummy batch) is recorded
   once its update is applied (`core.iteration_details`); the details go out with the
   rank's outputs, held while it has none until it waits for input.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from wavecore.engine import messages as m
from wavecore.engine.core.batch_queue import BatchQueue
from wavecore.engine.core.core_effects import COUNTERS, CoreEffects
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.iteration_details import IterationRecorder
from wavecore.engine.core.model_thread import ModelThread, loop_call_soon
from wavecore.engine.core.rank_calls import RankCalls
from wavecore.engine.core.rank_inputs import BadCall, loop_input_of
from wavecore.engine.core.step_failure import StepFailed
from wavecore.engine.errors import InvalidRequestError
from wavecore.engine.executors.batch import EXECUTOR_TAGS
from wavecore.engine.interface import RankCounters, RankStats
from wavecore.engine.weight_messages import RANK_CALLS
from wavecore.statemachines import (
    AwaitVote,
    Call,
    Collective,
    DrainVote,
    JoinGroup,
    PauseRequested,
    ProtocolError,
    RankLoop,
    RankMachine,
    Reconfigured,
    ResumeBarrier,
    ResumeSynced,
    RunDummy,
    RunStep,
    Sleep,
    StartVote,
    StepDone,
    SyncDone,
    WaitForInput,
)

_log = logging.getLogger(__name__)

# How long a rank waits for its broken group's connections to close.
_ABORT_BOUND_S = 1.0
# How long an idle rank waits for a grammar compile before it looks at the clock.
_GRAMMAR_WAIT_S = 1.0


class Shutdown:
    """The input closed: leave the loop."""


class Sink(Protocol):
    """Where a rank's messages go: a channel's sender, or an in-process stream."""

    async def send(self, item: Any) -> None: ...

    async def flush(self) -> None: ...


class DPGroupHandle(Protocol):
    size: int

    def start_vote(
        self, *, has_unfinished: bool, pending_pause: bool, wave: int, step_counter: int
    ) -> None: ...

    def await_vote(self) -> Any: ...

    def barrier(self, *, has_unfinished: bool) -> bool: ...

    def abort(self) -> None: ...


class GroupJoiner(Protocol):
    """Builds the group a scale's commit switches to; returns it with the group's max of
    (running, wave, step_counter). Blocking: runs on the model thread."""

    def __call__(
        self, *, prefix: str, dp_size: int, rank: int, running: bool, wave: int, step_counter: int
    ) -> tuple[DPGroupHandle | None, tuple[bool, int, int]]: ...


class CollectiveFailed(RuntimeError):
    """A collective of the DP group failed (its cause is chained): as often the sign of
    a peer that died as a fault of this rank."""


class RankRunner:
    """Drives one `RankLoop` over an `EngineCore`; see the module docstring."""

    def __init__(
        self,
        *,
        core: EngineCore,
        machine: RankMachine,
        model_thread: ModelThread,
        group: DPGroupHandle | None,
        outputs: Sink,
        coordinator: Sink | None,
        on_invalid: Callable[[object], None],
        join_group: GroupJoiner | None = None,
        survive_lost_group: bool = False,
        member: int = 0,
        dropped_frames: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.core = core
        self._dropped_frames = dropped_frames
        self._member = member
        self.loop = RankLoop(machine)
        self.rank = machine.rank
        self._thread = model_thread
        self._group = group
        self._join_group = join_group
        self._outputs = outputs
        self._coordinator = coordinator
        self._on_invalid = on_invalid
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._effects = CoreEffects(core, self.rank, self.counts, self.stats, self._start_vote)
        self._iterations = (
            IterationRecorder(self._effects.record_iteration)
            if core.log_iteration_details
            else None
        )
        self._queue = (
            BatchQueue(
                core=core,
                thread=model_thread,
                loop=self.loop,
                counts=self.counts,
                emit=self._effects.emit,
                on_step=None if self._iterations is None else self._iterations.step,
            )
            if core.async_scheduling
            else None
        )
        self._backlog: deque[Any] = deque()
        # The coordinator starts every rank at zero load, so a rank reports only a change
        # from that: a rank a scale adds gets no request before the coordinator knows the
        # new size, so it sends nothing until then (an early report, before the
        # coordinator's resize, would name a rank outside its group).
        self._last_load: tuple[int, int, float] = (0, 0, 0.0)
        # A switch's group prefix, kept from its message until the collective runs.
        self._switch_prefix = ""
        self._switch_call = -1
        self._survive_lost_group = survive_lost_group
        # Groups that broke: kept, never destroyed, since tearing one down may wait for
        # a collective that a stuck peer never finishes.
        self._broken_groups: list[DPGroupHandle] = []
        # Weight updates, collective RPC and the profiler, answered outside the machine.
        self._calls = RankCalls(
            core, self.rank, model_thread, self.loop.machine.snapshot, member=member
        )
        # Set (from the event loop) when a grammar compile ends: rule 9.
        self._grammar_event: anyio.Event | None = None

    # -- the loop --------------------------------------------------------------------

    async def run(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        call_soon = loop_call_soon()
        self.core.grammars.listener = lambda: call_soon(self._grammar_compiled)
        try:
            self.loop.start(self._effects)
            await self._flush()
            while True:
                try:
                    await self._drive(inbox)
                    return
                except CollectiveFailed as error:
                    if not self._survive_lost_group:
                        raise
                    await self._leave_group(error)
        except Exception as error:
            cause = error.__cause__ if isinstance(error, CollectiveFailed) else error
            if isinstance(cause, StepFailed):  # rule 10
                detail = cause.dump(wave=self.loop.machine.wave)
            else:
                detail = f"{type(cause).__name__}: {cause}"
            message = f"rank {self.rank} (pid {os.getpid()}) failed: {detail}"
            if isinstance(cause, StepFailed):
                _log.error("%s", message, exc_info=cause)
            failure = m.RankFailed(
                rank=self.rank,
                error=message,
                in_collective=isinstance(error, CollectiveFailed),
                member=self._member,
            )
            await self._flush()
            await self._outputs.send(failure)
            await self._outputs.flush()
            async for item in inbox:  # wait for the client to close this rank's input
                if isinstance(item, Shutdown):
                    return

    async def _leave_group(self, error: CollectiveFailed) -> None:
        """Rule 6: report the broken collective (the client finds the cause and
        shrinks the group) and give it up, paused out of the group."""
        await self._abandon_group()
        cause = error.__cause__
        await self._flush()
        await self._outputs.send(
            m.RankFailed(
                rank=self.rank,
                error=f"rank {self.rank} (pid {os.getpid()}) left its broken DP group: "
                f"{type(cause).__name__}: {cause}",
                in_collective=True,
                member=self._member,
            )
        )
        self.loop.group_lost(self._effects)
        await self._flush()

    async def interrupt_collective(self) -> None:
        """Rule 8: this rank is leaving its group (a `LeaveGroup` is on its way to the
        inbox, or the client closed its input), and the channel's reader calls this as
        the news passes. A collective the rank is blocked in waits on the model thread,
        not reading the inbox, for a peer that may be gone for good: a stopped headless
        peer, which the client cannot kill to break it, would hold it for the whole
        collective_timeout. Aborting the group now makes it fail at once; the group
        object stays until the message itself is handled, so a collective started
        meanwhile fails too, and nothing finds the group missing."""
        group = self._group
        if group is not None:
            with anyio.move_on_after(_ABORT_BOUND_S):
                await anyio.to_thread.run_sync(group.abort, abandon_on_cancel=True)

    async def _abandon_group(self) -> None:
        """Close the broken group's connections, so that a peer waiting in one of its
        collectives fails at once (told to leave, or failed here)."""
        broken, self._group = self._group, None
        if broken is not None:
            self._broken_groups.append(broken)
            # Bounded and abandoned if it blocks: the peers' own timeouts still apply.
            with anyio.move_on_after(_ABORT_BOUND_S):
                await anyio.to_thread.run_sync(broken.abort, abandon_on_cancel=True)

    def _renumber(self, rank: int) -> None:
        self.rank = rank
        self._effects.renumber(rank)
        self._calls.renumber(rank)
        self._last_load = (-1, -1, -1.0)  # the coordinator knows nothing of the new number

    async def _drive(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        loop = self.loop
        while True:
            pending = loop.pending
            if isinstance(pending, WaitForInput | RunStep):
                item = self._next_input(inbox)
                if item is None and isinstance(pending, WaitForInput):
                    await self._drain(inbox)
                    await self._flush(idle=True)
                    item = await inbox.receive()
                if isinstance(item, Shutdown):
                    await self._drain(inbox)  # no forward outlives the runner
                    return
                if isinstance(item, RANK_CALLS):
                    await self._drain(inbox)
                    await self._answer(item)
                    continue
                if isinstance(item, m.LeaveGroup):
                    await self._abandon_group()
                if item is not None:
                    self._deliver(item)
                    continue
                await self._publish_load()
                done = await self._step(inbox)
                loop.complete(done, self._effects)
                await self._flush()  # the iteration's updates: one StepOutputs
                if not done.executed:
                    await self._idle_step(inbox)
                continue
            await self._drain(inbox)
            await self._flush()
            if isinstance(pending, RunDummy):
                dummy = self._thread.start(self.core.executor.execute_dummy)
                await dummy.wait()
                self.counts["dummy_steps"] += 1
                if self._iterations is not None:
                    self._iterations.dummy(dummy.elapsed_s)
                loop.complete(None, self._effects)
            elif isinstance(pending, Collective):
                loop.complete(await self._collective(pending.action), self._effects)
            elif isinstance(pending, Sleep):
                await self._sleep(pending)
                loop.complete(None, self._effects)
            else:
                executor_tags = pending.tags & EXECUTOR_TAGS
                if executor_tags:
                    await self._thread.run(self.core.executor.wake_up, executor_tags)
                loop.complete(None, self._effects)

    async def _idle_step(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        """Nothing ran. Usually (e.g. the prefill cadence skipped this step) letting the
        inputs' tasks run is all there is to do before the next try; when the next
        step can only wait for grammars to compile, wait for a compile or an input
        (rule 9). The event is made new before the question, so a compile that ends
        after it sets the event waited on."""
        self._grammar_event = anyio.Event()
        if not (isinstance(self.loop.pending, RunStep) and self.core.grammars_compiling()):
            await anyio.lowlevel.checkpoint()
            return
        compiled = self._grammar_event
        # Bounded: a compile past its timeout ends no wait by itself (rule 3 of
        # `structured.compiler`), so the rank looks again every so often.
        with anyio.move_on_after(_GRAMMAR_WAIT_S):
            async with anyio.create_task_group() as group:

                async def take_input() -> None:
                    self._backlog.append(await inbox.receive())
                    group.cancel_scope.cancel()

                group.start_soon(take_input)
                await compiled.wait()
                group.cancel_scope.cancel()

    def _grammar_compiled(self) -> None:  # on the event loop
        if self._grammar_event is not None:
            self._grammar_event.set()

    def _next_input(self, inbox: MemoryObjectReceiveStream[Any]) -> Any:
        if self._backlog:
            return self._backlog.popleft()
        try:
            return inbox.receive_nowait()
        except anyio.WouldBlock:
            return None

    async def _step(self, inbox: MemoryObjectReceiveStream[Any]) -> StepDone:
        if self._queue is not None:
            return await self._queue.step(lambda: self._take_waiting_aborts(inbox))
        core = self.core
        machine = self.loop.machine
        # Lockstep ranks admit prefills on the same steps: those of their shared count.
        step = core.schedule(machine.step_counter if machine.lockstep else None)
        self._effects.emit(core.take_finished_early())
        if step is not None:
            slot = core.bitmask_slot(step)
            job = self._thread.start(core.execute, step, slot)
            if slot is not None:
                core.fill_bitmask(step, slot)  # rule 9: while the forward runs
            output = await job.wait()
            self._take_waiting_aborts(inbox)
            self._effects.emit(core.update(step, output))
            self.counts["real_steps"] += 1
            if self._iterations is not None:
                self._iterations.step(step, job.elapsed_s)
        return StepDone(
            executed=step is not None,
            has_unfinished=core.has_unfinished(),
            has_admitted=core.has_admitted(),
        )

    async def _drain(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        """Rule 7: finish the step in flight ahead of the loop, if any."""
        if self._queue is not None:
            await self._queue.drain(lambda: self._take_waiting_aborts(inbox))

    def _take_waiting_aborts(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        """Rule 4: apply the aborts at the head of the inbox now; keep the rest, in
        order, for the top of the next iteration."""
        while True:
            try:
                item = inbox.receive_nowait()
            except anyio.WouldBlock:
                return
            if self._backlog or not isinstance(item, m.AbortRequests):
                self._backlog.append(item)
                continue
            self._deliver(item)

    def _start_vote(self, vote: StartVote) -> None:
        group = self._current_group(vote)
        try:
            group.start_vote(
                has_unfinished=vote.has_unfinished,
                pending_pause=vote.pending_pause,
                wave=vote.wave,
                step_counter=vote.step_counter,
            )
        except Exception as error:
            raise CollectiveFailed from error

    def _current_group(self, action: object) -> DPGroupHandle:
        if self._group is None:
            raise RuntimeError(f"rank {self.rank} has no DP group for {action}")
        return self._group

    async def _collective(
        self, action: AwaitVote | DrainVote | ResumeBarrier | JoinGroup
    ) -> object:
        try:
            return await self._collective_of(action)
        except Exception as error:
            raise CollectiveFailed from error

    async def _collective_of(
        self, action: AwaitVote | DrainVote | ResumeBarrier | JoinGroup
    ) -> object:
        if isinstance(action, JoinGroup):
            return await self._join(action)
        group = self._current_group(action)
        if isinstance(action, ResumeBarrier):
            synced = await self._thread.run(
                lambda: group.barrier(has_unfinished=action.has_unfinished)
            )
            return ResumeSynced(any_unfinished=synced)
        result = await self._thread.run(group.await_vote)
        if isinstance(action, AwaitVote):
            self.counts["votes"] += 1
        return SyncDone(
            any_unfinished=result.any_unfinished,
            pausing_ranks=result.pausing_ranks,
            wave_span=result.wave_span,
            step_counter_span=result.step_counter_span,
        )

    async def _join(self, action: JoinGroup) -> Reconfigured:
        agreed = (action.running, action.wave, action.step_counter)
        dp_size = action.dp_size
        if self._join_group is not None:
            joiner, prefix, rank = self._join_group, self._switch_prefix, self.rank
            try:
                self._group, agreed = await self._thread.run(
                    lambda: joiner(
                        prefix=prefix,
                        dp_size=action.dp_size,
                        rank=rank,
                        running=action.running,
                        wave=action.wave,
                        step_counter=action.step_counter,
                    )
                )
            except Exception as error:
                dp_size = self._keep_group(action, error)
        running, wave, step_counter = agreed
        return Reconfigured(
            rank=self.rank,
            dp_size=dp_size,
            wave=wave,
            running=running,
            step_counter=step_counter,
        )

    def _keep_group(self, action: JoinGroup, error: Exception) -> int:
        """The new group did not form (a member died or never joined within the
        collective timeout): this rank stays in its old group, paused, with its own
        wave and step (its peers there kept theirs too), and its answer to the switch
        carries the error, so the client rolls the scale back instead of serving on a
        group that does not exist. Returns the size it stays at."""
        self._effects.fail_call(
            self._switch_call,
            f"rank {self.rank} could not join the new group of {action.dp_size} ranks "
            f"({type(error).__name__}: {error}); it stays in its old group",
        )
        # Out of a broken group (none left), its own size stays what it was.
        return self.loop.machine.dp_size if self._group is None else self._group.size

    async def _sleep(self, pending: Sleep) -> None:
        if "kv_cache" in pending.tags:
            self.core.drop_kv_cache()
        if pending.level > 0:
            await self._thread.run(self.core.executor.sleep, pending.level)

    # -- inputs ------------------------------------------------------------------------

    def _deliver(self, item: Any) -> None:
        loop_input = self._as_loop_input(item)
        if loop_input is None:
            return
        try:
            self.loop.deliver(loop_input, self._effects)
        except (InvalidRequestError, ProtocolError):
            # A request the core refuses, or an input the machines refuse as impossible
            # here: no front end sends either, and both are refused before anything
            # changed (the loop only moved on to its next step, as after any input).
            self._on_invalid(item)

    def _as_loop_input(self, item: Any) -> object | None:
        try:
            loop_input = loop_input_of(item)
        except BadCall as error:
            self._effects.reply(error.call_id, error=str(error))
            return None
        if loop_input is None:
            self._on_invalid(item)
        elif isinstance(item, m.SwitchGroup):
            self._switch_prefix = item.group_prefix
            self._switch_call = item.call_id
        elif isinstance(item, m.LeaveGroup):
            self._renumber(item.rank)
        elif isinstance(loop_input, Call) and isinstance(loop_input.request, PauseRequested):
            self._effects.pause_started(loop_input.call_id)
        return loop_input

    async def _answer(self, item: Any) -> None:
        reply = await self._calls.handle(item)
        if reply is not None:
            await self._flush()  # what this rank produced before the call goes first
            await self._outputs.send(reply)

    # -- outputs -----------------------------------------------------------------------

    async def _flush(self, *, idle: bool = False) -> None:
        effects = self._effects
        for message in effects.take_outputs(idle=idle):
            await self._outputs.send(message)
        notices = effects.take_notices()
        if self._coordinator is not None:
            for notice in notices:
                await self._coordinator.send(notice)

    async def _publish_load(self) -> None:
        if self._coordinator is None:
            return
        stats = self.core.scheduler.stats()
        load = (stats.num_waiting, stats.num_running, round(stats.kv_usage, 2))
        if load != self._last_load:
            self._last_load = load
            await self._coordinator.send(
                m.LoadReport(
                    rank=self.rank, waiting=load[0], running=load[1], kv_usage=min(1.0, load[2])
                )
            )

    def stats(self) -> RankStats:
        machine = self.loop.machine.snapshot()
        counters = RankCounters(
            wave=machine.wave,
            step_counter=machine.step_counter,
            running=machine.running,
            **self.counts,
        )
        core = self.core.stats(paused=machine.pause_mode, asleep=machine.asleep)
        return RankStats(
            rank=self.rank, core=core, counters=counters, dropped_frames=self._dropped_frames()
        )
