"""The rank runner as a lockstep DP rank runs it (rank 0 of a one-rank group here, so
that the model thread's gates can hold a step): the prefill cadence follows the
machine's step counter, and an abort that arrives while a step runs wins over it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from engine_helpers import ControlledExecutor, core_with

from wavecore.engine import messages as m
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelThread
from wavecore.engine.core.rank_runner import RankRunner, Shutdown
from wavecore.engine.dp.collective import SyncResult
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import RankMachine

pytestmark = pytest.mark.anyio
HANG_GUARD = 30


class OneRankGroup:
    """The all-reduce of a group of one: every vote's result is this rank's own."""

    def __init__(self) -> None:
        self._votes: deque[SyncResult] = deque()

    def start_vote(
        self, *, has_unfinished: bool, pending_pause: bool, wave: int, step_counter: int
    ) -> None:
        result = SyncResult(
            any_unfinished=has_unfinished,
            pausing_ranks=int(pending_pause),
            wave_span=(wave, wave),
            step_counter_span=(step_counter, step_counter),
        )
        self._votes.append(result)

    def await_vote(self) -> SyncResult:
        return self._votes.popleft()

    def barrier(self, *, has_unfinished: bool) -> bool:
        return has_unfinished


class Outputs:
    """The runner's output sink: what the front end would receive."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.arrived = anyio.Event()

    async def send(self, item: Any) -> None:
        self.messages.append(item)
        self.arrived.set()
        self.arrived = anyio.Event()

    async def flush(self) -> None:
        pass

    async def answer(self, call_id: int) -> m.UtilityResult:
        """The reply to call `call_id`, once it came."""
        while True:
            for message in self.messages:
                if isinstance(message, m.UtilityResult) and message.call_id == call_id:
                    return message
            await self.arrived.wait()

    def tokens(self, request_id: str) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        reason = None
        for message in self.messages:
            if isinstance(message, m.StepOutputs):
                position = 0
                for rid, count in zip(message.request_ids, message.token_counts, strict=True):
                    if rid == request_id:
                        tokens += message.token_ids[position : position + count]
                    position += count
                reason = message.finished.get(request_id, reason)
        return tokens, reason


@asynccontextmanager
async def rank_serving(
    core: EngineCore, machine: RankMachine, group: Any = None, **options: Any
) -> AsyncIterator[tuple[MemoryObjectSendStream[Any], Outputs]]:
    """`core` served by a rank runner for the block (in `group`, a group of one unless
    said, with the runner's other `options`): its input stream and its outputs."""
    outputs = Outputs()
    to_rank, inbox = anyio.create_memory_object_stream[Any](math.inf)
    with ModelThread() as thread:
        runner = RankRunner(
            core=core,
            machine=machine,
            model_thread=thread,
            group=OneRankGroup() if group is None else group,
            outputs=outputs,
            coordinator=None,
            on_invalid=pytest.fail,
            **options,
        )
        async with to_rank, inbox, anyio.create_task_group() as tg:
            tg.start_soon(runner.run, inbox)
            yield to_rank, outputs
            await to_rank.send(Shutdown())


def add(request_id: str, prompt: str, max_tokens: int) -> m.AddRequest:
    return m.AddRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt.encode()),
        params=SamplingParams(max_tokens=max_tokens),
        wave=0,
    )


async def test_lockstep_prefills_are_admitted_on_the_machines_cadence() -> None:
    interval = 3
    core = core_with(ControlledExecutor(), prefill_interval=interval)
    machine = RankMachine(0, 1, sync_interval=4, lockstep=True)
    admissions: list[tuple[int, int]] = []  # (machine step counter, requests admitted)
    schedule = core.schedule

    def recording_schedule(step_counter: int | None = None) -> Any:
        before = core.scheduler.num_running
        step = schedule(step_counter)
        assert step_counter == machine.step_counter
        admissions.append((step_counter, core.scheduler.num_running - before))
        return step

    core.schedule = recording_schedule  # type: ignore[method-assign]
    with anyio.fail_after(HANG_GUARD):
        async with rank_serving(core, machine) as (to_rank, outputs):
            await to_rank.send(add("first", "a", 20))
            while len(outputs.tokens("first")[0]) < 5:
                await outputs.arrived.wait()
            # Mid-wave: the next admission waits for the cadence.
            await to_rank.send(add("late", "b", 4))
            while outputs.tokens("late")[1] is None:
                await outputs.arrived.wait()
    admitted = [counter for counter, count in admissions if count]
    assert admitted == [0, admitted[1]] and admitted[1] > 5
    assert all(counter % interval == 0 for counter in admitted)


async def test_an_abort_during_a_lockstep_ranks_step_wins_over_its_output() -> None:
    executor = ControlledExecutor()
    machine = RankMachine(0, 1, sync_interval=4, lockstep=True)
    with anyio.fail_after(HANG_GUARD):
        async with rank_serving(core_with(executor), machine) as (to_rank, outputs):
            await to_rank.send(add("r", "abc", 100))
            while not outputs.tokens("r")[0]:
                await outputs.arrived.wait()
            executor.entered.clear()
            executor.gate.clear()
            await anyio.to_thread.run_sync(executor.entered.wait)
            # A step that holds "r" runs on the model thread now; every step before it
            # gave "r" one token.
            steps_before = executor.num_steps
            await to_rank.send(m.AbortRequests(request_ids=("r",)))
            executor.gate.set()
            while outputs.tokens("r")[1] is None:
                await outputs.arrived.wait()
    tokens, reason = outputs.tokens("r")
    assert reason == "abort"
    assert len(tokens) == steps_before


class BreakableGroup(OneRankGroup):
    """A group of one that can be given up (``abort``) when it breaks."""

    size = 1

    def abort(self) -> None:
        pass


def join_that_fails(**_: object) -> tuple[None, tuple[bool, int, int]]:
    raise TimeoutError("a member never joined the new group")


async def test_a_rank_out_of_a_broken_group_keeps_its_size_when_the_next_group_fails() -> None:
    # Rank 0 of two leaves its broken group, then the shrink's group of one does not
    # form: it stays in its own group of two, as the explored model's failed join does
    # (its answer carries the error, and the client shrinks or rolls back from there).
    machine = RankMachine(0, 2, sync_interval=4, lockstep=True)
    serving = rank_serving(
        core_with(ControlledExecutor()),
        machine,
        BreakableGroup(),
        join_group=join_that_fails,
        survive_lost_group=True,
    )
    with anyio.fail_after(HANG_GUARD):
        async with serving as (to_rank, outputs):
            await to_rank.send(m.LeaveGroup(call_id=1, rank=0))
            assert (await outputs.answer(1)).error is None
            await to_rank.send(m.SwitchGroup(call_id=2, dp_size=1, group_prefix="shrunk"))
            switched = await outputs.answer(2)
    assert switched.error is not None and "could not join the new group of 1" in switched.error
    assert machine.dp_size == 2
