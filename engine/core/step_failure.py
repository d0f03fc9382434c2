"""What a failed step held: upstream's `log_error_detail`, the dump of a step whose
forward or sampling raised.

`EngineCore.execute` wraps the executor's error in `StepFailed`, which knows the step
(its index, its scheduled requests and their token counts) and the phase that
raised; the rank runner, which knows the rank and the wave, makes the one line that
its `RankFailed` carries to the client (every request of the engine sees it, in
the `EngineDeadError` it gets) and logs it once, with the traceback.
"""

from __future__ import annotations

from typing import Literal

from wavecore.engine.scheduler import SchedulerOutput

# A step of hundreds of requests names the first ones and counts the rest: the dump
# travels in one error message.
_NAMED_REQUESTS = 32

Phase = Literal["forward", "sampling"]


class StepFailed(RuntimeError):
    """The executor raised in a step's `phase`; the executor's error is chained."""

    def __init__(self, step: SchedulerOutput, phase: Phase) -> None:
        self.step_index = step.step
        self.phase = phase
        self.scheduled = scheduled_requests(step)
        super().__init__(f"{phase} of step {step.step} failed")

    def dump(self, *, wave: int) -> str:
        """The step, named by index and wave, its error, and what it scheduled (the
        rank runner puts the rank in front)."""
        cause = self.__cause__
        error = "" if cause is None else f" with {type(cause).__name__}: {cause}"
        return (
            f"the {self.phase} of step {self.step_index} (wave {wave}) failed{error}; "
            f"{describe_scheduled(self.scheduled)}"
        )


def scheduled_requests(step: SchedulerOutput) -> tuple[tuple[str, int, bool], ...]:
    """(request id, tokens scheduled, whether those are prompt tokens) per request."""
    return tuple(
        (chunk.request_id, len(chunk.token_ids), chunk.start_pos < chunk.prompt_len)
        for chunk in step.batch.chunks
    )


def describe_scheduled(scheduled: tuple[tuple[str, int, bool], ...]) -> str:
    tokens = sum(count for _, count, _ in scheduled)
    named = ", ".join(
        f"{request_id} ({count} {'prefill' if prefill else 'decode'})"
        for request_id, count, prefill in scheduled[:_NAMED_REQUESTS]
    )
    more = len(scheduled) - _NAMED_REQUESTS
    rest = f" and {more} more" if more > 0 else ""
    return f"it scheduled {_count(len(scheduled), 'request')}, {_count(tokens, 'token')}: {named}{rest}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
