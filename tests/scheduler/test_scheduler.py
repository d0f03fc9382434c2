"""Scheduler unit tests: batching, budgets, stops, preemption, aborts, pause, errors."""

from __future__ import annotations

import pytest
from sched_helpers import EOS, VOCAB, Transcript, expected_outputs, make, run, step

from wavecore.engine.executors.batch import ModelOutput, SampledToken
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import (
    DuplicateRequestError,
    InvalidPromptError,
    OutputMismatchError,
    PromptTooLongError,
    Scheduler,
    SchedulerConfig,
    StepOrderError,
)
from wavecore.statemachines import PauseMode
from wavecore.statemachines.errors import ProtocolError
from wavecore.statemachines.request import FinishReason, RequestState


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + offset * 17 + 3) % VOCAB for offset in range(length)]


def test_requests_run_to_completion_with_the_executors_tokens() -> None:
    scheduler, executor = make()
    prompts = {f"r{i}": _prompt(i, 5 + i) for i in range(5)}
    for request_id, prompt in prompts.items():
        scheduler.add(request_id, prompt, SamplingParams(max_tokens=7))
    transcript = run(scheduler, executor)
    for request_id, prompt in prompts.items():
        assert transcript.tokens[request_id] == expected_outputs(prompt, 7)
        assert transcript.reasons[request_id] is FinishReason.LENGTH
    assert scheduler.block_manager.num_free_blocks == 64
    assert scheduler.num_running == scheduler.num_waiting == 0


def test_chunks_share_the_request_lists_and_decodes_are_one_tuples() -> None:
    scheduler, executor = make()
    scheduler.add("a", _prompt(1, 6), SamplingParams(max_tokens=4))
    first = scheduler.schedule()
    (chunk,) = first.batch.chunks
    request = scheduler.get_request("a")
    assert request is not None
    assert list(chunk.token_ids) == request.token_ids and chunk.start_pos == 0 and chunk.sample
    assert chunk.all_token_ids is request.token_ids
    assert chunk.block_table is request.block_table
    scheduler.update(first, executor.execute(first.batch))
    second = scheduler.schedule()
    (decode,) = second.batch.chunks
    assert decode.token_ids == (request.token_ids[-1],)
    assert decode.start_pos == 6 and decode.all_token_ids is request.token_ids


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    scheduler, executor = make(max_num_batched_tokens=8)
    scheduler.add("long", _prompt(2, 20), SamplingParams(max_tokens=3))
    transcript = Transcript()
    shapes = []
    for _ in range(3):
        output = scheduler.schedule()
        shapes.append([(c.start_pos, len(c.token_ids), c.sample) for c in output.batch.chunks])
        transcript.record(scheduler.update(output, executor.execute(output.batch)))
    assert shapes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert transcript.tokens == {"long": expected_outputs(_prompt(2, 20), 1)}


def test_decodes_come_first_and_prefills_take_the_remaining_budget() -> None:
    scheduler, executor = make(max_num_batched_tokens=10)
    transcript = Transcript()
    scheduler.add("old", _prompt(1, 4), SamplingParams(max_tokens=20))
    step(scheduler, executor, transcript)
    scheduler.add("new", _prompt(2, 30), SamplingParams(max_tokens=2))
    output = scheduler.schedule()
    assert [(c.request_id, len(c.token_ids)) for c in output.batch.chunks] == [
        ("old", 1),
        ("new", 9),
    ]
    assert output.stats.num_scheduled_tokens == 10


def test_max_num_seqs_caps_the_running_requests() -> None:
    scheduler, executor = make(max_num_seqs=2)
    for index in range(4):
        scheduler.add(f"r{index}", _prompt(index, 3), SamplingParams(max_tokens=3))
    output = scheduler.schedule()
    assert [c.request_id for c in output.batch.chunks] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
    scheduler.update(output, executor.execute(output.batch))
    assert set(run(scheduler, executor).reasons) == {"r0", "r1", "r2", "r3"}


def test_preempted_requests_finish_with_the_same_outputs() -> None:
    prompts = {f"r{i}": _prompt(i, 6 + 3 * i) for i in range(6)}

    def outputs(num_kv_blocks: int) -> tuple[Transcript, int]:
        scheduler, executor = make(num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16)
        for request_id, prompt in prompts.items():
            scheduler.add(request_id, prompt, SamplingParams(max_tokens=12))
        preempted = 0
        transcript = Transcript()
        while scheduler.has_unfinished():
            output = scheduler.schedule()
            preempted += output.num_preempted
            transcript.record(scheduler.update(output, executor.execute(output.batch)))
        assert scheduler.block_manager.num_free_blocks == num_kv_blocks
        return transcript, preempted

    roomy, roomy_preempted = outputs(256)
    tight, tight_preempted = outputs(9)
    assert roomy_preempted == 0 and tight_preempted > 0
    assert tight.tokens == roomy.tokens
    assert tight.reasons == roomy.reasons


def test_preemption_takes_the_newest_request_and_it_resumes_first() -> None:
    scheduler, executor = make(num_kv_blocks=4, block_size=2, max_num_batched_tokens=64)
    transcript = Transcript()
    scheduler.add("old", [1, 2, 3, 4], SamplingParams(max_tokens=4))
    scheduler.add("new", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    step(scheduler, executor, transcript)  # both prefilled: 2 blocks each, 5 tokens each
    output = scheduler.schedule()  # each needs a third block: "new" goes
    assert output.num_preempted == 1
    assert [c.request_id for c in output.batch.chunks] == ["old"]
    new = scheduler.get_request("new")
    assert new is not None and new.state is RequestState.PREEMPTED and new.block_table == []
    assert len(new.token_ids) == 5  # its output token is kept
    scheduler.update(output, executor.execute(output.batch))
    assert set(run(scheduler, executor).reasons) == {"old", "new"}


def test_eos_stops_unless_ignored_and_counts_as_an_output() -> None:
    scheduler, executor = make(eos_at_output=2)
    scheduler.add("stops", _prompt(1, 4), SamplingParams(max_tokens=10))
    scheduler.add("ignores", _prompt(2, 4), SamplingParams(max_tokens=5, ignore_eos=True))
    transcript = run(scheduler, executor)
    assert transcript.reasons == {"stops": FinishReason.STOP, "ignores": FinishReason.LENGTH}
    assert len(transcript.tokens["stops"]) == 3 and transcript.tokens["stops"][-1] == EOS
    assert len(transcript.tokens["ignores"]) == 5 and transcript.tokens["ignores"][2] == EOS


def test_min_tokens_defers_eos() -> None:
    scheduler, executor = make(eos_at_output=1)
    scheduler.add("early", _prompt(1, 4), SamplingParams(max_tokens=10, min_tokens=3))
    scheduler.add("late", _prompt(2, 4), SamplingParams(max_tokens=10, min_tokens=2))
    transcript = run(scheduler, executor)
    # The NullExecutor emits EOS only as output 1: below min_tokens 3, at min_tokens 2.
    assert transcript.reasons == {"early": FinishReason.LENGTH, "late": FinishReason.STOP}
    assert len(transcript.tokens["early"]) == 10 and transcript.tokens["early"][1] == EOS
    assert len(transcript.tokens["late"]) == 2


@pytest.mark.parametrize(("min_tokens", "stops_after"), [(0, 3), (3, 3), (4, None)])
def test_stop_token_ids_stop_even_with_ignore_eos(min_tokens: int, stops_after: int | None) -> None:
    scheduler, executor = make()
    prompt = _prompt(2, 4)
    stopper = expected_outputs(prompt, 3)[2]
    sampling = SamplingParams(
        max_tokens=8, min_tokens=min_tokens, stop_token_ids=[stopper], ignore_eos=True
    )
    scheduler.add("a", prompt, sampling)
    transcript = run(scheduler, executor)
    if stops_after is None:
        assert transcript.reasons["a"] is FinishReason.LENGTH
        assert transcript.tokens["a"] == expected_outputs(prompt, 8)
    else:
        assert transcript.reasons["a"] is FinishReason.STOP
        assert transcript.tokens["a"] == expected_outputs(prompt, stops_after)


def test_max_model_len_finishes_with_length() -> None:
    scheduler, executor = make(max_model_len=12)
    scheduler.add("a", _prompt(1, 9), SamplingParams(max_tokens=100))
    transcript = run(scheduler, executor)
    assert transcript.reasons == {"a": FinishReason.LENGTH}
    assert len(transcript.tokens["a"]) == 3


def test_abort_between_schedule_and_update_is_applied_first() -> None:
    scheduler, executor = make()
    transcript = Transcript()
    scheduler.add("keep", _prompt(1, 5), SamplingParams(max_tokens=5))
    scheduler.add("drop", _prompt(2, 5), SamplingParams(max_tokens=5))
    step(scheduler, executor, transcript)
    output = scheduler.schedule()
    table = list(scheduler.get_request("drop").block_table)  # type: ignore[union-attr]
    assert scheduler.abort(["drop", "unknown"]) == ["drop"]
    assert all(scheduler.block_manager.ref_count(block) == 0 for block in table)
    free = scheduler.block_manager.num_free_blocks
    updates = scheduler.update(output, executor.execute(output.batch))
    assert [u.request_id for u in updates] == ["keep"]
    assert scheduler.block_manager.num_free_blocks == free
    assert scheduler.abort(["drop"]) == []
    run(scheduler, executor)
    assert scheduler.block_manager.num_free_blocks == 64


def test_an_aborted_id_can_be_reused_while_its_step_is_in_flight() -> None:
    scheduler, executor = make()
    scheduler.add("x", _prompt(1, 5), SamplingParams(max_tokens=5))
    output = scheduler.schedule()
    scheduler.abort(["x"])
    scheduler.add("x", _prompt(9, 3), SamplingParams(max_tokens=2))
    assert scheduler.update(output, executor.execute(output.batch)) == []
    assert run(scheduler, executor).tokens == {"x": expected_outputs(_prompt(9, 3), 2)}


def test_abort_of_waiting_and_all_requests() -> None:
    scheduler, _ = make(max_num_seqs=1)
    for index in range(3):
        scheduler.add(f"r{index}", _prompt(index, 4), SamplingParams())
    scheduler.schedule()
    assert scheduler.abort(["r2"]) == ["r2"]
    assert sorted(scheduler.abort_all()) == ["r0", "r1"]
    assert not scheduler.has_unfinished() and scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(TypeError, match="iterable"):
        scheduler.abort("r0")


def test_finish_for_a_stop_string_and_its_errors() -> None:
    scheduler, executor = make(max_num_seqs=1)
    scheduler.add("run", _prompt(1, 4), SamplingParams(max_tokens=10))
    scheduler.add("wait", _prompt(2, 4), SamplingParams(max_tokens=10))
    step(scheduler, executor, Transcript())
    with pytest.raises(ProtocolError):
        scheduler.finish("wait", FinishReason.STOP)
    assert scheduler.get_request("wait").state is RequestState.WAITING  # type: ignore[union-attr]
    assert scheduler.finish("run", FinishReason.STOP)
    assert not scheduler.finish("run")
    assert scheduler.num_running == 0 and scheduler.num_waiting == 1


def test_bad_requests_are_refused_with_specific_errors() -> None:
    scheduler, _ = make(num_kv_blocks=4, block_size=4, max_model_len=100)
    scheduler.add("a", [1, 2], SamplingParams())
    with pytest.raises(DuplicateRequestError, match="'a'"):
        scheduler.add("a", [1, 2], SamplingParams())
    with pytest.raises(PromptTooLongError, match="KV pool 16 tokens"):
        scheduler.add("b", list(range(16)), SamplingParams())
    with pytest.raises(InvalidPromptError, match="empty"):
        scheduler.add("c", [], SamplingParams())
    with pytest.raises(InvalidPromptError, match="non-negative ints"):
        scheduler.add("d", [1, -1], SamplingParams())
    with pytest.raises(InvalidPromptError, match="not text"):
        scheduler.add("e", "hello", SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add("", [1], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        scheduler.add("f", [1], {"max_tokens": 3})  # type: ignore[arg-type]
    assert scheduler.num_waiting == 1
    short, _ = make(max_model_len=8)
    with pytest.raises(PromptTooLongError, match="max_model_len 8"):
        short.add("g", list(range(8)), SamplingParams())
    short.add("h", list(range(7)), SamplingParams())


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(num_kv_blocks=4, block_size=4, max_model_len=8, max_num_seqs=0)
    with pytest.raises(ValueError, match="eos_token_id"):
        SchedulerConfig(num_kv_blocks=4, block_size=4, max_model_len=8, eos_token_id=-1)
    with pytest.raises(TypeError, match="SchedulerConfig"):
        Scheduler({})  # type: ignore[arg-type]


def test_schedule_and_update_must_alternate() -> None:
    scheduler, executor = make()
    scheduler.add("a", _prompt(1, 4), SamplingParams(max_tokens=3))
    output = scheduler.schedule()
    with pytest.raises(StepOrderError):
        scheduler.schedule()
    model_output = executor.execute(output.batch)
    scheduler.update(output, model_output)
    with pytest.raises(StepOrderError):
        scheduler.update(output, model_output)


def test_a_mismatched_model_output_changes_nothing() -> None:
    scheduler, executor = make()
    scheduler.add("a", _prompt(1, 4), SamplingParams(max_tokens=3))
    scheduler.add("b", _prompt(2, 4), SamplingParams(max_tokens=3))
    output = scheduler.schedule()
    good = executor.execute(output.batch)
    for bad in (
        ModelOutput(sampled=good.sampled[:1]),
        ModelOutput(sampled=good.sampled[::-1]),
        ModelOutput(sampled=(*good.sampled, SampledToken(request_id="a", token_id=1))),
    ):
        with pytest.raises(OutputMismatchError):
            scheduler.update(output, bad)
    assert all(len(r.token_ids) == 4 for r in output.requests)
    assert len(scheduler.update(output, good)) == 2


def test_pause_states() -> None:
    scheduler, executor = make()
    transcript = Transcript()
    scheduler.add("running", _prompt(1, 4), SamplingParams(max_tokens=6))
    step(scheduler, executor, transcript)
    scheduler.add("new", _prompt(2, 4), SamplingParams(max_tokens=2))

    scheduler.set_pause(PauseMode.KEEP)
    output = scheduler.schedule()
    assert output.is_empty and not scheduler.has_work() and scheduler.has_unfinished()
    assert scheduler.update(output, executor.execute(output.batch)) == []

    scheduler.set_pause(PauseMode.WAIT)
    assert scheduler.has_work()
    while scheduler.has_work():
        step(scheduler, executor, transcript)
    assert transcript.reasons == {"running": FinishReason.LENGTH}
    assert scheduler.num_waiting == 1 and scheduler.has_unfinished()

    scheduler.set_pause(None)
    run(scheduler, executor)
    with pytest.raises(TypeError, match="PauseMode"):
        scheduler.set_pause("PAUSED_ALL")  # type: ignore[arg-type]


def test_paused_new_still_resumes_preempted_requests() -> None:
    scheduler, executor = make(num_kv_blocks=4, block_size=2)
    transcript = Transcript()
    scheduler.add("old", [1, 2, 3, 4], SamplingParams(max_tokens=4))
    scheduler.add("new", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    step(scheduler, executor, transcript)
    step(scheduler, executor, transcript)  # preempts "new"
    assert scheduler.get_request("new").state is RequestState.PREEMPTED  # type: ignore[union-attr]
    scheduler.add("fresh", [7, 8], SamplingParams(max_tokens=2))
    scheduler.set_pause(PauseMode.WAIT)
    while scheduler.has_work():
        step(scheduler, executor, transcript)
    assert set(transcript.reasons) == {"old", "new"}
    assert scheduler.num_waiting == 1


def test_an_admitted_request_can_wait_through_several_empty_steps_under_a_wait_pause() -> None:
    # Why the rank machine's StepDone carries has_admitted: a preempted request is
    # readmitted only on a prefill step, so a WAIT pause can see steps that run nothing
    # while the request it must let finish is still there, more than once in a row.
    scheduler, executor = make(num_kv_blocks=4, block_size=2, prefill_interval=3)
    transcript = Transcript()
    scheduler.add("old", [1, 2, 3, 4], SamplingParams(max_tokens=4))
    scheduler.add("new", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    step(scheduler, executor, transcript)
    step(scheduler, executor, transcript)  # preempts "new"
    assert scheduler.get_request("new").state is RequestState.PREEMPTED  # type: ignore[union-attr]
    scheduler.set_pause(PauseMode.WAIT)
    empty_while_admitted = 0
    while scheduler.has_admitted():
        output = scheduler.schedule()
        if output.is_empty:
            empty_while_admitted += 1
        scheduler.update(output, executor.execute(output.batch))
    assert empty_while_admitted >= 2
    assert not scheduler.has_unfinished()


def test_prefill_throttle_admits_only_on_interval_steps() -> None:
    scheduler, executor = make(prefill_interval=3)
    scheduler.add("a", _prompt(1, 4), SamplingParams(max_tokens=9))
    transcript = Transcript()
    admitted_at = []
    for step_number in range(7):
        if step_number == 1:
            scheduler.add("b", _prompt(2, 4), SamplingParams(max_tokens=2))
        output = scheduler.schedule()
        if any(c.start_pos == 0 for c in output.batch.chunks):
            admitted_at.append(step_number)
        transcript.record(scheduler.update(output, executor.execute(output.batch)))
    assert admitted_at == [0, 3]
    # A caller-supplied step counter drives the throttle instead of the internal one.
    scheduler.add("c", _prompt(3, 4), SamplingParams(max_tokens=2))
    assert scheduler.schedule(step=4).stats.num_scheduled_seqs == 1  # "a" only
    scheduler.abort_all()


def test_prefix_cache_reuses_blocks_across_requests() -> None:
    scheduler, executor = make()
    shared = _prompt(5, 12)
    scheduler.add("first", [*shared, 1], SamplingParams(max_tokens=2))
    run(scheduler, executor)
    scheduler.add("second", [*shared, 2], SamplingParams(max_tokens=2))
    output = scheduler.schedule()
    (chunk,) = output.batch.chunks
    assert chunk.start_pos == 12 and list(chunk.token_ids) == [2]
    assert output.stats.prefix_cache_hit_rate == pytest.approx(12 / 26)
    scheduler.update(output, executor.execute(output.batch))
    transcript = run(scheduler, executor)
    assert transcript.reasons == {"second": FinishReason.LENGTH}


def test_preempt_all_and_reset_prefix_cache_for_a_dropped_kv_cache() -> None:
    scheduler, executor = make()
    transcript = Transcript()
    prompts = {"a": _prompt(1, 9), "b": _prompt(2, 7)}
    for request_id, prompt in prompts.items():
        scheduler.add(request_id, prompt, SamplingParams(max_tokens=6))
    step(scheduler, executor, transcript)
    step(scheduler, executor, transcript)
    assert scheduler.preempt_all() == 2
    scheduler.reset_prefix_cache()
    executor.sleep(1)
    executor.wake_up(frozenset({"weights", "kv_cache"}))
    while scheduler.has_unfinished():
        step(scheduler, executor, transcript)
    for request_id, prompt in prompts.items():
        assert transcript.tokens[request_id] == expected_outputs(prompt, 6)


def test_stats_report_queues_usage_and_tokens() -> None:
    scheduler, executor = make(max_num_seqs=1)
    scheduler.add("a", _prompt(1, 6), SamplingParams(max_tokens=3))
    scheduler.add("b", _prompt(2, 6), SamplingParams(max_tokens=3))
    assert scheduler.stats().num_waiting == 2
    output = scheduler.schedule()
    stats = output.stats
    assert (stats.num_waiting, stats.num_running) == (1, 1)
    assert (stats.num_scheduled_seqs, stats.num_scheduled_tokens) == (1, 6)
    assert stats.kv_usage == pytest.approx(2 / 64)
    assert scheduler.last_stats is stats and scheduler.step_counter == 1
    scheduler.update(output, executor.execute(output.batch))
