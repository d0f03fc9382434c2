"""What the scheduler hands the executor each step, and what comes back.

The scheduler (pure Python) builds a `ModelBatch`; an `Executor` runs it in the
engine's worker thread and returns a `ModelOutput`. Both sides live in the same
process, so token lists are shared by reference, never copied per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from wavecore.engine.sampling_params import SamplingParams

# What an executor can put to sleep and wake; the engine's third tag, "scheduling",
# is the rank machine's (`wavecore.statemachines.SLEEP_TAGS`).
EXECUTOR_TAGS = frozenset({"weights", "kv_cache"})


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceChunk:
    """One sequence's share of a forward pass: a prefill chunk or one decode token.

    `token_ids` are the tokens to run now; the first sits at position `start_pos`
    (that many tokens of this sequence are already in the KV cache). `block_table`
    covers positions `[0, start_pos + len(token_ids))`. When `sample` is true, one
    token is sampled after the last of `token_ids`. `all_token_ids` is the request's
    whole token list (prompt then outputs, `prompt_len` of the former), read by
    penalties, `min_tokens` and seeded sampling; the executor must not mutate it.

    A decode with speculative drafts carries them as the last `num_draft_tokens` of
    `token_ids` (not in `all_token_ids`): it samples at each of its last
    `1 + num_draft_tokens` positions, each as plain decoding would with the drafts
    before it as history (`sampling_rows`).

    `num_lookahead_tokens` (speculative decoding with a draft model, on a sampling
    chunk): how many drafts the executor proposes after sampling it, for the tokens
    that follow what the chunk's samples emit (the drafts accepted, then the token
    sampled after them). The block table covers that many positions past the chunk.
    `draft_start_pos`: where the draft model's run of this chunk starts (its KV for
    the request is valid before it; positions before `start_pos` are read from
    `all_token_ids`), or None when the draft model sits this step out.

    `lora` names the LoRA adapter the request runs under (None: the base model); the
    executor holds the adapter (`Executor` implementations without adapters refuse it).
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    sample: bool
    sampling: SamplingParams
    all_token_ids: Sequence[int]
    prompt_len: int
    num_draft_tokens: int = 0
    num_lookahead_tokens: int = 0
    draft_start_pos: int | None = None
    lora: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.prompt_len

    @property
    def num_samples(self) -> int:
        """Tokens sampled for this chunk: none, or one per verified position."""
        return 1 + self.num_draft_tokens if self.sample else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelBatch:
    chunks: tuple[SequenceChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    """The token sampled for one request, with log-probabilities when asked.

    `logprob` is the sampled token's log-probability (None unless the request set
    `logprobs`); `top_logprobs` holds the `logprobs` most likely (token, logprob)
    pairs, most likely first.
    """

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sampling_rows(chunks: Sequence[SequenceChunk]) -> list[SequenceChunk]:
    """One chunk per sampled position, in batch order: a sampling chunk as it is, a
    decode with k drafts as k + 1 chunks whose histories end with the drafts before
    their position (what plain decoding would see there had the drafts been sampled)."""
    rows: list[SequenceChunk] = []
    for chunk in chunks:
        if not chunk.sample:
            continue
        drafts = chunk.num_draft_tokens
        if not drafts:
            rows.append(chunk)
            continue
        history = list(chunk.all_token_ids)
        verified = list(chunk.token_ids[-drafts:])
        for position in range(drafts + 1):
            rows.append(
                replace(
                    chunk,
                    all_token_ids=(*history, *verified[:position]),
                    num_draft_tokens=0,
                )
            )
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelOutput:
    """One `SampledToken` per sampling row (`sampling_rows`), in batch order, and the
    drafts proposed for chunks that asked for them (`num_lookahead_tokens`), by request
    id (none when nothing could be proposed)."""

    sampled: tuple[SampledToken, ...]
    draft_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def accepted_drafts(drafts: Sequence[int], samples: Sequence[SampledToken]) -> int:
    """How many of a decode's drafts are accepted: those up to the first that differs
    from the token sampled before it. The scheduler emits them and the sample after
    them; a draft model continues from there."""
    accepted = 0
    while accepted < len(drafts) and samples[accepted].token_id == drafts[accepted]:
        accepted += 1
    return accepted


@dataclass(frozen=True, slots=True, kw_only=True)
class GrammarBitmask:
    """The tokens structured-output requests may sample this step.

    `rows` are indices among the batch's sampling rows (`sampling_rows`, the rows of
    the logits);
    `words[i]` packs the allowed tokens of row `rows[i]`, one bit per token id (bit
    `t % 32` of word `t // 32`). Rows not listed are unconstrained; token ids past the
    packed width are never allowed in a listed row.
    """

    rows: tuple[int, ...]
    words: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorMemory:
    """Bytes an executor holds now: its weights where it computes, weights kept in host
    memory while asleep (level 1), and its KV cache."""

    weights: int
    offloaded_weights: int
    kv_cache: int


class Executor(Protocol):
    """Runs forward passes. Every method is called from the engine's worker thread."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def execute_model(self, batch: ModelBatch) -> object:
        """The forward pass of `batch`; what it returns is handed to `sample_tokens`."""

    def sample_tokens(self, forward: object, bitmask: GrammarBitmask | None) -> ModelOutput:
        """Sample one token per sampling chunk of the forward's batch, only among the
        tokens `bitmask` allows in the rows it lists."""

    def execute(self, batch: ModelBatch) -> ModelOutput:
        """`execute_model` then `sample_tokens` without a bitmask."""

    def execute_dummy(self) -> None:
        """A forward on a tiny batch, so DP ranks with no work stay in step."""

    def sleep(self, level: int) -> None:
        """Level 1: offload weights, drop the KV cache. Level 2: drop both."""

    def wake_up(self, tags: frozenset[str]) -> None:
        """Restore what `tags` names among {"weights", "kv_cache"}."""

    def reset_kv_cache(self) -> None: ...

    def memory(self) -> ExecutorMemory: ...

    def close(self) -> None: ...
