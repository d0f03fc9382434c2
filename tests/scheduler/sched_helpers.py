"""Shared helpers for the scheduler tests: drive a scheduler with the NullExecutor."""

from __future__ import annotations

from dataclasses import dataclass, field

from wavecore.engine.executors.null_executor import NullExecutor, null_continuation
from wavecore.engine.scheduler import Scheduler, SchedulerConfig
from wavecore.statemachines.request import FinishReason

VOCAB = 1000
EOS = 2


@dataclass
class Transcript:
    """Tokens and finish reasons collected from `update()` results."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason] = field(default_factory=dict)
    steps: int = 0

    def record(self, updates: list) -> None:
        for update in updates:
            if update.request_id in self.reasons:
                raise AssertionError(f"{update.request_id} produced a token after finishing")
            self.tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                self.reasons[update.request_id] = update.finish_reason


def make(
    *,
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    eos_at_output: int | None = None,
    **limits: object,
) -> tuple[Scheduler, NullExecutor]:
    executor = NullExecutor(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        eos_at_output=eos_at_output,
        track_kv=True,
    )
    limits.setdefault("eos_token_id", EOS)
    scheduler = Scheduler(SchedulerConfig.for_executor(executor, **limits))
    return scheduler, executor


def step(scheduler: Scheduler, executor: NullExecutor, transcript: Transcript) -> None:
    output = scheduler.schedule()
    if output.stats.num_scheduled_tokens > scheduler.config.max_num_batched_tokens:
        raise AssertionError("token budget exceeded")
    transcript.record(scheduler.update(output, executor.execute(output.batch)))
    transcript.steps += 1


def run(scheduler: Scheduler, executor: NullExecutor, max_steps: int = 10_000) -> Transcript:
    transcript = Transcript()
    while scheduler.has_unfinished():
        if transcript.steps >= max_steps:
            raise AssertionError(f"not finished after {max_steps} steps: {scheduler.stats()}")
        step(scheduler, executor, transcript)
    return transcript


def expected_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    """What the NullExecutor produces for an unpreempted request that never sees EOS."""
    return null_continuation(prompt, max_tokens, vocab_size=VOCAB, eos_token_id=EOS)
