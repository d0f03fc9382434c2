"""The scheduler's side of the batch queue: a step scheduled while the previous one is
in flight decodes that step's sample through a placeholder, resolved from its output."""

from __future__ import annotations

import pytest

from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import Scheduler, SchedulerConfig, StepOrderError
from wavecore.engine.scheduler.pending_tokens import PLACEHOLDER
from wavecore.statemachines import FinishReason


def scheduler_and_executor(
    *, async_scheduling: bool, blocks: int = 64
) -> tuple[Scheduler, NullExecutor]:
    executor = NullExecutor(
        num_kv_blocks=blocks, block_size=4, max_model_len=256, vocab_size=1000, track_kv=True
    )
    config = SchedulerConfig.for_executor(executor, async_scheduling=async_scheduling)
    return Scheduler(config), executor


def test_the_step_ahead_decodes_the_sample_in_flight_once_resolved() -> None:
    scheduler, executor = scheduler_and_executor(async_scheduling=True)
    scheduler.add("a", [5, 6, 7], SamplingParams(max_tokens=10))
    first = scheduler.schedule()
    ahead = scheduler.schedule()  # before `first` has a sample
    (chunk,) = ahead.batch.chunks
    assert list(chunk.token_ids) == [PLACEHOLDER] and chunk.start_pos == 3 and chunk.sample
    first_output = executor.execute(first.batch)
    ahead.resolve_placeholders(first_output)
    sampled = first_output.sampled[0].token_id
    assert list(chunk.token_ids) == [sampled]
    assert list(chunk.all_token_ids) == [5, 6, 7, sampled] and chunk.num_output_tokens == 1
    assert chunk.all_token_ids[chunk.prompt_len :] == [sampled]  # what penalties read
    ahead_output = executor.execute(ahead.batch)  # track_kv: the history it holds is right
    # Updates come in schedule order; the step ahead's sample follows the first one's.
    assert [u.new_token_ids for u in scheduler.update(first, first_output)] == [(sampled,)]
    (update,) = scheduler.update(ahead, ahead_output)
    assert scheduler.get_request("a").token_ids == [5, 6, 7, sampled, *update.new_token_ids]


def test_a_request_whose_sample_in_flight_finishes_it_is_not_scheduled_again() -> None:
    scheduler, executor = scheduler_and_executor(async_scheduling=True)
    scheduler.add("short", [1, 2], SamplingParams(max_tokens=1))
    scheduler.add("long", [3, 4], SamplingParams(max_tokens=5))
    first = scheduler.schedule()
    ahead = scheduler.schedule()
    assert [c.request_id for c in ahead.batch.chunks] == ["long"]
    output = executor.execute(first.batch)
    ahead.resolve_placeholders(output)
    updates = scheduler.update(first, output)
    assert [u.finish_reason for u in updates] == [FinishReason.LENGTH, None]
    assert [u.request_id for u in scheduler.update(ahead, executor.execute(ahead.batch))] == [
        "long"
    ]


def test_a_sample_of_a_request_finished_by_the_step_before_is_dropped() -> None:
    scheduler, executor = scheduler_and_executor(async_scheduling=True)
    scheduler.add("a", [1, 2], SamplingParams(max_tokens=5))
    first = scheduler.schedule()
    ahead = scheduler.schedule()
    output = executor.execute(first.batch)
    ahead.resolve_placeholders(output)
    scheduler.update(first, output)
    assert scheduler.abort(["a"]) == ["a"]
    assert scheduler.update(ahead, executor.execute(ahead.batch)) == []


def test_preempting_a_request_with_a_sample_in_flight_recomputes_it_exactly() -> None:
    # Two requests, blocks for barely more than one: the second is preempted while the
    # first one's step ahead is in flight, and both still get the serial loop's tokens.
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6]}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for async_scheduling in (False, True):
        scheduler, executor = scheduler_and_executor(async_scheduling=async_scheduling, blocks=5)
        for request_id, prompt in prompts.items():
            scheduler.add(request_id, prompt, params)
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        in_flight = []
        preempted = 0
        previous = None
        while scheduler.has_unfinished() or in_flight:
            if scheduler.has_work() and len(in_flight) < (2 if async_scheduling else 1):
                step = scheduler.schedule()
                preempted += step.num_preempted
                if not step.is_empty:
                    if previous is not None:
                        step.resolve_placeholders(previous)
                    previous = executor.execute(step.batch)
                    in_flight.append((step, previous))
                    continue
            step, output = in_flight.pop(0)
            for update in scheduler.update(step, output):
                tokens[update.request_id] += update.new_token_ids
        outputs[async_scheduling] = (tokens, preempted > 0)
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][1], "the test meant to preempt while a step ran ahead"


def test_only_async_scheduling_takes_a_second_step_before_the_update() -> None:
    serial, _ = scheduler_and_executor(async_scheduling=False)
    queued, _ = scheduler_and_executor(async_scheduling=True)
    for scheduler in (serial, queued):
        scheduler.add("a", [1, 2], SamplingParams(max_tokens=5))
        scheduler.schedule()
    with pytest.raises(StepOrderError):
        serial.schedule()
    queued.schedule()
    with pytest.raises(StepOrderError):
        queued.schedule()
