"""The scheduler's side of LoRA adapters: at most `max_loras` adapters among the running
requests and the pinned ones, admission in order (a request held back for its adapter
is the next admitted, never overtaken), and prefix-cache chains rooted per adapter."""

from __future__ import annotations

import pytest
from sched_helpers import Transcript, make, step

from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import InvalidPromptError

PARAMS = SamplingParams(max_tokens=3)


def run_recording_adapters(scheduler, executor) -> tuple[list[set[str | None]], list[str]]:
    """Each step's adapters among the running requests, and the order of admission."""
    transcript = Transcript()
    per_step: list[set[str | None]] = []
    admitted: list[str] = []
    while scheduler.has_unfinished():
        step(scheduler, executor, transcript)
        running, _ = scheduler.queues()
        per_step.append({request.lora for request in running})
        admitted += [r.request_id for r in running if r.request_id not in admitted]
        assert transcript.steps < 1000
    return per_step, admitted


def test_one_slot_admits_in_order_and_never_runs_two_adapters() -> None:
    scheduler, executor = make(max_loras=1)
    for request_id, lora in [("a1", "A"), ("b1", "B"), ("a2", "A"), ("base", None)]:
        scheduler.add(request_id, [1, 2, 3, 4, 5], PARAMS, lora=lora)
    per_step, admitted = run_recording_adapters(scheduler, executor)
    assert all(len(adapters - {None}) <= 1 for adapters in per_step)
    # b1 waited for A's slot; a2, behind it, did not overtake it.
    assert admitted == ["a1", "b1", "a2", "base"]


def test_pinned_adapters_hold_slots() -> None:
    scheduler, executor = make(max_loras=2)
    scheduler.set_pinned_loras({"P"})
    for request_id, lora in [("a", "A"), ("b", "B"), ("p", "P")]:
        scheduler.add(request_id, [1, 2, 3, 4, 5], PARAMS, lora=lora)
    per_step, admitted = run_recording_adapters(scheduler, executor)
    assert all(len(adapters - {None, "P"}) <= 1 for adapters in per_step)
    assert admitted == ["a", "b", "p"]


def test_prefix_cache_blocks_are_shared_only_within_an_adapter() -> None:
    scheduler, executor = make(max_loras=2)
    prompt = list(range(1, 14))  # three full blocks of 4
    transcript = Transcript()
    hits = []
    for request_id, lora in [("a", "A"), ("b", "B"), ("base", None), ("a-again", "A")]:
        before = scheduler.block_manager.prefix_cache_hits
        scheduler.add(request_id, prompt, PARAMS, lora=lora)
        while scheduler.has_unfinished():
            step(scheduler, executor, transcript)
        hits.append(scheduler.block_manager.prefix_cache_hits - before)
    assert hits == [0, 0, 0, 12]


def test_an_adapter_without_lora_enabled_is_refused() -> None:
    scheduler, _ = make()
    with pytest.raises(InvalidPromptError, match="LoRA is not enabled"):
        scheduler.add("r", [1, 2, 3], PARAMS, lora="A")
