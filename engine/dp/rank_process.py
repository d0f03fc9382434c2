"""One DP engine rank: its process entry point, its startup and its busy loop.

Theory of operation:

1. `rank_main` is what the launcher spawns. The rank dials the client's handshake
   socket, says `RankHello`, receives its `RankAssignment` (addresses, DP group), opens
   its channels, loads its model on its `ModelThread`, joins the gloo group (lockstep
   only), and reports `RankReady` with its configuration hash. A refusal ends it.
2. One anyio task group runs: a receiver per inbound channel (client PULL, coordinator
   SUB), each pouring messages into one in-memory stream, and `RankLoop.run`. Senders
   are `MessageSender`s, which batch everything sent in one tick into one frame.
3. `RankLoop` is the busy loop of `wavecore.statemachines.rank` (read its docstring):
   every input, step result and collective result becomes an event for the
   `RankMachine`, and the loop performs the actions it returns, looked up by type. The
   loop makes no protocol decision of its own; it only blocks for input after `Idle`.
4. Forwards, dummy batches and collectives all run on the model thread, in order.
5. The token updates of one iteration go out as ONE `StepOutputs` frame.
6. If anything in the loop raises, the rank reports `RankFailed` (naming itself) and
   waits for the client to close its input; the client fails every request.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from wavecore.channels import (
    MessageReceiver,
    MessageSender,
    config_hash,
    open_pull,
    open_push,
    open_req,
    open_sub,
)
from wavecore.engine.config import EngineConfig
from wavecore.engine.core import EngineCore
from wavecore.engine.dp import messages as m
from wavecore.engine.dp.invalid_frames import InvalidFrameLog
from wavecore.engine.input_processor import EngineRequest
from wavecore.engine.model_thread import ModelThread
from wavecore.engine.scheduler import RequestUpdate
from wavecore.statemachines.errors import ProtocolError
from wavecore.statemachines.rank import (
    EnterSleep,
    Idle,
    NotifyStartWave,
    NotifyWaveComplete,
    PauseComplete,
    PauseMode,
    PauseRequested,
    PauseScheduler,
    PauseState,
    RankMachine,
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
    StartWave,
    StepDone,
    SyncDone,
    SyncDP,
    WakeUp,
    WakeUpRequested,
)

BuildCore = Callable[[EngineConfig], EngineCore]


class _Shutdown:
    """The client closed this rank's input: leave the loop."""


# How a rank was reached and how long it may take to start change nothing it computes.
_DEPLOYMENT_FIELDS = frozenset({"transport", "startup_timeout"})


def describe_config(config: EngineConfig) -> dict[str, str]:
    """The configuration a rank reports; every rank of a group must report the same."""
    return {
        name: repr(value)
        for name, value in asdict(config).items()
        if name not in _DEPLOYMENT_FIELDS
    }


def rank_main(
    handshake_address: str, rank: int, config: EngineConfig, build_core: BuildCore
) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    anyio.run(_run_rank, handshake_address, rank, config, build_core)


async def _run_rank(
    handshake_address: str, rank: int, config: EngineConfig, build_core: BuildCore
) -> None:
    async with open_req(dial=handshake_address) as handshake:
        await handshake.send(m.RankHello(rank=rank, pid=os.getpid()))
        reply = await handshake.receive()
        if not reply.accepted or reply.assignment is None:
            return
        assignment: m.RankAssignment = reply.assignment
        if config.executor == "model":
            _share_cpu_threads(assignment.dp_size)
        with ModelThread(f"wavecore-rank{rank}") as model_thread:
            async with AsyncExitStack() as stack:
                invalid = InvalidFrameLog(f"rank {rank} input")
                inputs = await stack.enter_async_context(
                    open_pull(dial=assignment.input_address, on_invalid=invalid)
                )
                waves = await stack.enter_async_context(
                    open_sub(
                        dial=assignment.coordinator_publish_address,
                        topics=[m.WAVE_TOPIC],
                        on_invalid=InvalidFrameLog(f"rank {rank} wave subscription"),
                    )
                )
                outputs = await stack.enter_async_context(
                    open_push(dial=assignment.output_address, linger=0.5)
                )
                coordinator = await stack.enter_async_context(
                    open_push(dial=assignment.coordinator_input_address, linger=0.5)
                )
                try:
                    core = await model_thread.run(build_core, config)
                    group = None
                    if assignment.lockstep and not assignment.joining:
                        from wavecore.engine.dp.collective import DPGroup

                        group = await model_thread.run(
                            lambda: DPGroup.join(
                                host=assignment.store_host,
                                port=assignment.store_port,
                                prefix=assignment.group_prefix,
                                rank=rank,
                                size=assignment.dp_size,
                                timeout_s=assignment.collective_timeout_s,
                            )
                        )
                except Exception as error:
                    await handshake.send(
                        m.RankStartupFailed(rank=rank, error=f"{type(error).__name__}: {error}")
                    )
                    await handshake.receive()
                    return
                await waves.wait_connected()
                items = describe_config(config)
                await handshake.send(
                    m.RankReady(
                        rank=rank,
                        config_hash=config_hash(items),
                        config_items=items,
                        max_model_len=core.executor.max_model_len,
                    )
                )
                verdict = await handshake.receive()
                if not verdict.accepted:
                    return
                machine = RankMachine(
                    rank,
                    assignment.dp_size,
                    sync_interval=assignment.sync_interval,
                    lockstep=assignment.lockstep,
                    joining=assignment.joining,
                )
                if assignment.joining:
                    # Rule 11 of the rank machine: a joining rank's scheduler starts
                    # frozen (KEEP), as its machine does.
                    core.pause(PauseMode.KEEP)
                loop = RankLoop(
                    core=core,
                    machine=machine,
                    model_thread=model_thread,
                    group=group,
                    outputs=outputs,
                    coordinator=coordinator,
                    invalid=invalid,
                    assignment=assignment,
                )
                try:
                    await _serve(loop, inputs, waves)
                finally:
                    await model_thread.run(core.close)


def _share_cpu_threads(dp_size: int) -> None:
    """Ranks on one machine split its cores instead of each oversubscribing all of them."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dp_size))


async def _serve(loop: RankLoop, inputs: MessageReceiver, waves: MessageReceiver) -> None:
    send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=1 << 16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pour, inputs, send.clone(), True)
        tg.start_soon(_pour, waves, send.clone(), False)
        send.close()
        await loop.run(receive)
        tg.cancel_scope.cancel()


async def _pour(
    channel: MessageReceiver, inbox: MemoryObjectSendStream[Any], ends_rank: bool
) -> None:
    async with inbox:
        try:
            async for message in channel:
                await inbox.send(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        if ends_rank:
            await inbox.send(_Shutdown())


class RankLoop:
    """The busy loop of one rank; see the module docstring."""

    def __init__(
        self,
        *,
        core: EngineCore,
        machine: RankMachine,
        model_thread: ModelThread,
        group: Any,
        outputs: MessageSender,
        coordinator: MessageSender,
        invalid: InvalidFrameLog,
        assignment: m.RankAssignment | None = None,
    ) -> None:
        self.core = core
        self._assignment = assignment
        self._invalid = invalid
        self.machine = machine
        self.rank = machine.rank
        self._thread = model_thread
        self._group = group
        self._outputs = outputs
        self._coordinator = coordinator
        # The current iteration's outputs, in StepOutputs' columns.
        self._out_ids: list[str] = []
        self._out_counts: list[int] = []
        self._out_tokens: list[int] = []
        self._out_finished: dict[str, str] = {}
        self._out_logprobs: list[m.RequestLogprobs] = []
        self._idle = True
        self._arriving: str | None = None
        self._pause_calls: list[int] = []
        self._sleep_calls: list[int] = []
        self._last_load: tuple[int, int, float] | None = None
        self._counts = dict.fromkeys(
            (
                "real_steps",
                "dummy_steps",
                "syncs",
                "waves_started",
                "waves_completed",
                "requests_added",
                "requests_held",
                "last_pause_forwards",
            ),
            0,
        )
        self._pause_started_at: int | None = None
        self._inputs: dict[type, Callable[[Any], Any]] = {
            m.AddRequest: self._on_add,
            m.AbortRequests: self._on_abort,
            m.StopRequests: self._on_stop,
            m.StartDPWave: self._on_start_wave,
            m.UtilityCall: self._on_utility,
            m.SwitchGroup: self._on_switch_group,
        }
        self._actions: dict[type, Callable[[Any], Any]] = {
            RunDummyBatch: self._run_dummy,
            SyncDP: self._sync,
            ResumeBarrier: self._barrier,
            NotifyStartWave: self._notify_start,
            NotifyWaveComplete: self._notify_complete,
            PauseComplete: self._pause_complete,
            PauseScheduler: self._pause_scheduler,
            ResumeScheduler: self._resume_scheduler,
            RequestHeld: self._held,
            EnterSleep: self._enter_sleep,
            WakeUp: self._wake_up,
            Idle: self._go_idle,
        }
        self._utilities: dict[str, Callable[[m.UtilityCall], Any]] = {
            "pause": self._utility_pause,
            "resume": self._utility_resume,
            "sleep": self._utility_sleep,
            "wake_up": self._utility_wake_up,
            "reset_prefix_cache": self._utility_reset_prefix_cache,
            "stats": self._utility_stats,
        }

    # -- the loop --------------------------------------------------------------------

    async def run(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        try:
            await self._iterate(inbox)
        except Exception as error:
            detail = f"{type(error).__name__}: {error}"
            failure = m.RankFailed(
                rank=self.rank, error=f"rank {self.rank} (pid {os.getpid()}) failed: {detail}"
            )
            await self._flush_outputs()
            await self._outputs.send(failure)
            await self._outputs.flush()
            async for item in inbox:  # wait for the client to close this rank
                if isinstance(item, _Shutdown):
                    return

    async def _iterate(self, inbox: MemoryObjectReceiveStream[Any]) -> None:
        while True:
            if self._idle:
                item = await inbox.receive()
                if isinstance(item, _Shutdown):
                    return
                await self._on_input(item)
            self._idle = False
            while True:
                try:
                    item = inbox.receive_nowait()
                except anyio.WouldBlock:
                    break
                if isinstance(item, _Shutdown):
                    return
                await self._on_input(item)
            await self._publish_load()
            await self._step()
            await self._flush_outputs()

    async def _step(self) -> None:
        step = self.core.schedule()
        if step is not None:
            output = await self._thread.run(self.core.execute, step)
            self._emit(self.core.update(step, output))
            self._counts["real_steps"] += 1
        done = StepDone(executed=step is not None, has_unfinished=self.core.has_unfinished())
        await self._perform(self.machine.handle(done))

    async def _perform(self, actions: tuple[Any, ...]) -> None:
        self._idle = False
        for action in actions:
            await self._actions[type(action)](action)

    async def _on_input(self, item: Any) -> None:
        handler = self._inputs.get(type(item))
        if handler is None:
            self._invalid.unexpected(item)
            return
        await handler(item)

    # -- inputs ------------------------------------------------------------------------

    async def _on_add(self, message: m.AddRequest) -> None:
        self.core.add_request(
            EngineRequest(
                request_id=message.request_id,
                prompt_token_ids=message.prompt_token_ids,
                params=message.params,
            )
        )
        self._counts["requests_added"] += 1
        self._arriving = message.request_id
        await self._perform(self.machine.handle(RequestArrived(wave=message.wave)))
        self._arriving = None

    async def _on_abort(self, message: m.AbortRequests) -> None:
        self._emit(self.core.abort_requests(message.request_ids))

    async def _on_stop(self, message: m.StopRequests) -> None:
        for request_id in message.request_ids:
            try:
                self.core.finish_stopped(request_id)
            except ProtocolError:
                # Preempted since its last token: it is not running, so abort it instead.
                self.core.abort_requests([request_id])

    async def _on_start_wave(self, message: m.StartDPWave) -> None:
        event = StartWave(wave=message.wave, exclude_rank=message.exclude_rank)
        await self._perform(self.machine.handle(event))

    async def _on_utility(self, call: m.UtilityCall) -> None:
        try:
            await self._utilities[call.method](call)
        except (ProtocolError, ValueError, KeyError) as error:
            await self._reply(call.call_id, error=f"{type(error).__name__}: {error}")

    async def _on_switch_group(self, message: m.SwitchGroup) -> None:
        """A scale's commit (rule 11): only while paused and idle, so no collective of
        the old group is outstanding; refused otherwise, before joining anything."""
        machine = self.machine
        if machine.pause_state is not PauseState.PAUSED or machine.phase is not RankPhase.IDLE:
            await self._reply(message.call_id, error="only a paused, idle rank can switch groups")
            return
        wave, step_counter = machine.wave, machine.step_counter
        assignment = self._assignment
        if machine.lockstep and assignment is not None:
            from wavecore.engine.dp.group_switch import join_and_agree

            group, agreed = await self._thread.run(
                lambda: join_and_agree(
                    host=assignment.store_host,
                    port=assignment.store_port,
                    prefix=message.group_prefix,
                    rank=self.rank,
                    size=message.dp_size,
                    timeout_s=assignment.collective_timeout_s,
                    running=machine.running,
                    wave=wave,
                    step_counter=step_counter,
                )
            )
            self._group = group
            wave, step_counter = agreed.wave, agreed.step_counter
        event = Reconfigured(
            rank=self.rank,
            dp_size=message.dp_size,
            wave=wave,
            running=False,
            step_counter=step_counter,
        )
        await self._perform(machine.handle(event))
        await self._reply(message.call_id)

    # -- utilities -----------------------------------------------------------------------

    async def _utility_pause(self, call: m.UtilityCall) -> None:
        mode = PauseMode(call.pause_mode)
        self._pause_calls.append(call.call_id)
        if self._pause_started_at is None:
            self._pause_started_at = self._forwards()
        try:
            await self._perform(self.machine.handle(PauseRequested(mode=mode)))
        except ProtocolError:
            self._pause_calls.remove(call.call_id)
            raise

    async def _utility_resume(self, call: m.UtilityCall) -> None:
        await self._perform(self.machine.handle(ResumeRequested()))
        await self._reply(call.call_id)

    async def _utility_sleep(self, call: m.UtilityCall) -> None:
        self._sleep_calls.append(call.call_id)
        try:
            await self._perform(self.machine.handle(SleepRequested(level=call.sleep_level or 1)))
        except (ProtocolError, ValueError):
            self._sleep_calls.remove(call.call_id)
            raise

    async def _utility_wake_up(self, call: m.UtilityCall) -> None:
        tags = None if call.wake_tags is None else frozenset(call.wake_tags)
        await self._perform(self.machine.handle(WakeUpRequested(tags=tags)))
        await self._reply(call.call_id)

    async def _utility_reset_prefix_cache(self, call: m.UtilityCall) -> None:
        self.core.reset_prefix_cache()
        await self._reply(call.call_id)

    async def _utility_stats(self, call: m.UtilityCall) -> None:
        await self._reply(call.call_id, stats=self.stats_report())

    def stats_report(self) -> m.RankStatsReport:
        counters = m.RankCounters(
            wave=self.machine.wave,
            step_counter=self.machine.step_counter,
            running=self.machine.running,
            **self._counts,
        )
        return m.RankStatsReport(rank=self.rank, engine=self.core.stats(), counters=counters)

    async def _reply(
        self, call_id: int, *, error: str | None = None, stats: m.RankStatsReport | None = None
    ) -> None:
        await self._flush_outputs()  # the call's own updates (e.g. aborts) go first
        await self._outputs.send(
            m.UtilityResult(rank=self.rank, call_id=call_id, error=error, stats=stats)
        )

    # -- actions -----------------------------------------------------------------------

    async def _run_dummy(self, action: RunDummyBatch) -> None:
        await self._thread.run(self.core.executor.execute_dummy)
        self._counts["dummy_steps"] += 1

    async def _sync(self, action: SyncDP) -> None:
        result = await self._thread.run(
            lambda: self._group.sync(
                has_unfinished=action.has_unfinished,
                pending_pause=action.pending_pause,
                wave=action.wave,
                step_counter=action.step_counter,
            )
        )
        self._counts["syncs"] += 1
        done = SyncDone(
            any_unfinished=result.any_unfinished,
            pausing_ranks=result.pausing_ranks,
            wave_span=result.wave_span,
            step_counter_span=result.step_counter_span,
        )
        await self._perform(self.machine.handle(done))

    async def _barrier(self, action: ResumeBarrier) -> None:
        any_unfinished = await self._thread.run(
            lambda: self._group.barrier(has_unfinished=action.has_unfinished)
        )
        await self._perform(self.machine.handle(ResumeSynced(any_unfinished=any_unfinished)))

    async def _notify_start(self, action: NotifyStartWave) -> None:
        self._counts["waves_started"] += 1
        await self._coordinator.send(m.WaveStarted(rank=self.rank, wave=action.wave))

    async def _notify_complete(self, action: NotifyWaveComplete) -> None:
        self._counts["waves_completed"] += 1
        await self._coordinator.send(m.WaveComplete(wave=action.wave))

    def _forwards(self) -> int:
        return self._counts["real_steps"] + self._counts["dummy_steps"]

    async def _pause_complete(self, action: PauseComplete) -> None:
        if self._pause_started_at is not None:
            self._counts["last_pause_forwards"] = self._forwards() - self._pause_started_at
            self._pause_started_at = None
        calls, self._pause_calls = self._pause_calls, []
        for call_id in calls:
            await self._reply(call_id)

    async def _pause_scheduler(self, action: PauseScheduler) -> None:
        self._emit(self.core.pause(action.mode))

    async def _resume_scheduler(self, action: ResumeScheduler) -> None:
        self.core.resume()

    async def _held(self, action: RequestHeld) -> None:
        self._counts["requests_held"] += 1
        held = () if self._arriving is None else (self._arriving,)
        await self._outputs.send(
            m.RequestsHeld(rank=self.rank, request_ids=held, reason=action.reason)
        )

    async def _enter_sleep(self, action: EnterSleep) -> None:
        self.core.prepare_sleep(action.level)
        await self._thread.run(self.core.executor.sleep, action.level)
        calls, self._sleep_calls = self._sleep_calls, []
        for call_id in calls:
            await self._reply(call_id)

    async def _wake_up(self, action: WakeUp) -> None:
        executor_tags = self.core.wake_executor_tags(action.tags)
        if executor_tags:
            await self._thread.run(self.core.executor.wake_up, executor_tags)
        self.core.finish_wake_up(action.tags)

    async def _go_idle(self, action: Idle) -> None:
        self._idle = True

    # -- outputs -------------------------------------------------------------------------

    def _emit(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            request_id = update.request_id
            self._out_ids.append(request_id)
            self._out_counts.append(len(update.new_token_ids))
            self._out_tokens.extend(update.new_token_ids)
            if update.finish_reason is not None:
                self._out_finished[request_id] = str(update.finish_reason)
            if update.sampled and update.sampled[0].logprob is not None:
                entries = tuple((s.token_id, s.logprob, s.top_logprobs) for s in update.sampled)
                self._out_logprobs.append(m.RequestLogprobs(request_id=request_id, entries=entries))

    async def _flush_outputs(self) -> None:
        if not self._out_ids:
            return
        outputs = m.StepOutputs(
            rank=self.rank,
            request_ids=tuple(self._out_ids),
            token_counts=tuple(self._out_counts),
            token_ids=tuple(self._out_tokens),
            finished=self._out_finished,
            logprobs=tuple(self._out_logprobs),
        )
        self._out_ids, self._out_counts, self._out_tokens = [], [], []
        self._out_finished, self._out_logprobs = {}, []
        await self._outputs.send(outputs)

    async def _publish_load(self) -> None:
        stats = self.core.scheduler.stats()
        load = (stats.num_waiting, stats.num_running, round(stats.kv_usage, 2))
        if load != self._last_load:
            self._last_load = load
            await self._coordinator.send(
                m.LoadReport(
                    rank=self.rank, waiting=load[0], running=load[1], kv_usage=min(1.0, load[2])
                )
            )
