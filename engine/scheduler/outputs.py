"""What the scheduler hands back: the step to run, per-request results, statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from wavecore.engine.executors.batch import ModelBatch, ModelOutput, SampledToken
from wavecore.statemachines.request import FinishReason

from .errors import StepOrderError

if TYPE_CHECKING:
    from .request import Request


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStats:
    """A snapshot taken at the end of one `schedule()`.

    `kv_usage` is the fraction of KV blocks referenced by requests; the prefix-cache
    hit rate counts tokens found cached over tokens looked up at admission.
    """

    step: int
    num_waiting: int
    num_running: int
    num_scheduled_seqs: int
    num_scheduled_tokens: int
    num_preempted: int
    kv_usage: float
    prefix_cache_hit_rate: float
    # Tokens looked up in and found in the prefix cache since start (never reset).
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """One step: the batch to execute and what `update` needs to apply its result.

    `requests[i]` is the scheduler's record for `batch.chunks[i]`; treat it as opaque.
    `num_sampled` chunks sample, so the executor returns that many `SampledToken`s.

    `placeholders` (async scheduling only) pairs the one-token list of each decode whose
    input is the previous step's sample, not known when this step was scheduled, with
    its request id: `resolve_placeholders` fills them in before the forward.
    """

    step: int
    batch: ModelBatch
    requests: tuple[Request, ...]
    num_sampled: int
    num_preempted: int
    stats: SchedulerStats
    placeholders: tuple[tuple[list[int], str], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.batch.chunks

    def resolve_placeholders(self, previous: ModelOutput) -> None:
        """Put the previous step's samples into this step's placeholder slots (on the
        model thread, after that step's forward and before this one's)."""
        if not self.placeholders:
            return
        sampled = {sample.request_id: sample.token_id for sample in previous.sampled}
        for slot, request_id in self.placeholders:
            token_id = sampled.get(request_id)
            if token_id is None:
                raise StepOrderError(
                    f"request {request_id!r} waits for a sample of the previous step, "
                    "which has none for it"
                )
            slot[0] = token_id


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestUpdate:
    """What one step produced for one request.

    `new_token_ids` are the tokens appended to the request this step (a stop or EOS
    token included), `sampled` the matching `SampledToken`s (log-probabilities).
    `finish_reason` is set when the request finished this step; it then holds no KV
    blocks any more and will not appear again. `error` says why a request finished
    with `FinishReason.ERROR` (its grammar failed).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    sampled: tuple[SampledToken, ...]
    finish_reason: FinishReason | None
    error: str | None = None
