"""Each forward's iteration details (`EngineConfig.log_iteration_details`): upstream's
`capture_iteration_details`, made on the rank and sent with its outputs.

The runner (serial steps, dummy batches) and the batch queue tell the recorder of
each forward once its update is applied, with the time the forward and its sampling
took on the model thread (`ModelJob.elapsed_s`); the details join the rank's next
`StepOutputs` (`CoreEffects.record_iteration`). The front end logs them at debug
level and counts them for `/metrics` (`frontend.iteration_stats`).
"""

from __future__ import annotations

from collections.abc import Callable

from wavecore.engine.messages import IterationDetails
from wavecore.engine.scheduler import SchedulerOutput


class IterationRecorder:
    """Numbers one rank's forwards from 0 and hands each one's details to `record`."""

    def __init__(self, record: Callable[[IterationDetails], None]) -> None:
        self._record = record
        self._next = 0

    def step(self, step: SchedulerOutput, elapsed_s: float) -> None:
        """A real step: a chunk that starts inside the prompt is context (prefill), any
        other is generation (a decode, or the recompute of a preempted request's
        outputs)."""
        context_requests = context_tokens = generation_requests = generation_tokens = 0
        for chunk in step.batch.chunks:
            if chunk.start_pos < chunk.prompt_len:
                context_requests += 1
                context_tokens += len(chunk.token_ids)
            else:
                generation_requests += 1
                generation_tokens += len(chunk.token_ids)
        self._record(
            IterationDetails(
                iteration=self._number(),
                context_requests=context_requests,
                context_tokens=context_tokens,
                generation_requests=generation_requests,
                generation_tokens=generation_tokens,
                elapsed_ms=elapsed_s * 1e3,
            )
        )

    def dummy(self, elapsed_s: float) -> None:
        """A dummy batch (a lockstep rank with no work of its own)."""
        self._record(
            IterationDetails(
                iteration=self._number(),
                context_requests=0,
                context_tokens=0,
                generation_requests=0,
                generation_tokens=0,
                elapsed_ms=elapsed_s * 1e3,
                dummy=True,
            )
        )

    def _number(self) -> int:
        number, self._next = self._next, self._next + 1
        return number
