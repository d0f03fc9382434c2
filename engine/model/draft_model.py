"""A draft model for speculative decoding: a smaller model of the target's vocabulary
that proposes the next tokens of each request right after the target samples them.

Theory of operation:

1. One cache geometry. The draft keeps a paged KV cache of its own with the target's
   block size and block count, addressed by the same block tables: the KV of a
   request's token `p` sits at the same block and offset in both caches. The scheduler
   therefore manages one set of blocks, and the prefix cache, preemption, recompute and
   freeing hold for the draft's KV as they hold for the target's.
2. Following the target (`follow`, after each step's sampling). The draft runs, in
   one forward, every token the step computed and kept: a prefill chunk's tokens, a
   decode's token and its accepted drafts (`accepted_drafts`; the rejected ones are
   not run). So its cache holds valid KV for a request's positions, written where the
   target's is; the scheduler tracks up to where (`draft_start_pos`, rule 4).
3. Proposals. A sampling chunk that asks for `num_lookahead_tokens` adds the token
   the step sampled after its kept tokens to that forward, at its position; the
   argmax there is the first draft, which the next forward runs at the next position,
   and so on: k greedy steps, all drafting requests of the step batched in each (k
   forwards of the draft a step, the first also doing rule 2's work). They write KV
   at the k positions from the sampled token's on, which the scheduler added blocks
   for (the lookahead); what the target keeps of them the next step writes again.
4. Only when it may draft. In a step where no request may be asked for drafts (the
   step holds more requests than `speculative_token_budget` allows drafts for), the
   draft does not run at all: at large batches it costs nothing. Each chunk says
   where the draft's KV for its request stops (`draft_start_pos`): after steps it sat
   out, or for a request just admitted (its prefix-cache blocks may have been
   computed in such a step), the draft's first pass runs the tokens it lacks from
   there (read from the chunk's `all_token_ids`) before the chunk's own.
5. Greedy drafts are exact for every request, sampled ones too: the scheduler's
   verification samples each position as plain decoding would and accepts a draft
   only where it equals that sample (`engine/scheduler/speculative.py`, rule 2).
6. The draft follows the target's sleeps, wakes and cache resets. Weight updates
   change the target only: the draft proposes from its own weights, so acceptance may
   change, never the outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from wavecore.engine.executors.batch import (
    ExecutorMemory,
    ModelBatch,
    SampledToken,
    SequenceChunk,
    accepted_drafts,
)
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.dtypes import DTypeSpec, dtype_name
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.executor import ModelExecutor, WeightFormat, load_executor
from wavecore.engine.model.kv_cache import bytes_per_block
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling.sampler import argmax_rows

# A sentence both tokenizers must split alike (a draft must share the target's tokens).
_PROBE = "The draft model's tokenizer must match: 12 + 30 = 42, naïve café."


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (named, with the reason)."""


class DraftModel:
    """A draft model beside a target `ModelExecutor`; see the module docstring."""

    def __init__(self, executor: ModelExecutor) -> None:
        self._executor = executor

    @classmethod
    def load(
        cls,
        model: str,
        *,
        target: ModelExecutor,
        weights: WeightFormat = "auto",
        dtype: DTypeSpec = "auto",
    ) -> DraftModel:
        """Load `model` as a draft for `target` (slow: off the event loop), with a KV
        cache of the target's geometry (rule 1); `weights` and `dtype` as for a model.
        `DraftModelError` when it cannot draft for it: another vocabulary or
        tokenizer, a shorter context, another compute dtype."""
        source_config = _draft_config(model)
        per_block = bytes_per_block(source_config, target.block_size, target.kv_cache_dtype)
        if source_config.context_length < target.max_model_len:
            raise DraftModelError(
                f"draft model {model!r} has a context of {source_config.context_length} "
                f"tokens, below the target's max_model_len {target.max_model_len}"
            )
        executor = load_executor(
            model,
            device=target.device,
            dtype=dtype,
            weights=weights,
            kv_cache_dtype=dtype_name(target.kv_cache_dtype),  # the geometry of rule 1
            kv_cache_memory=per_block * target.num_kv_blocks,
            block_size=target.block_size,
            max_model_len=target.max_model_len,
        )
        if executor.dtype != target.dtype:
            executor.close()
            raise DraftModelError(
                f"draft model {model!r} computes in {executor.dtype}, the target in "
                f"{target.dtype}: give both the same dtype"
            )
        if executor.num_kv_blocks != target.num_kv_blocks:  # rule 1's geometry
            executor.close()
            raise DraftModelError(
                f"draft model {model!r} got a KV cache of {executor.num_kv_blocks} blocks, "
                f"the target has {target.num_kv_blocks}"
            )
        try:
            _check_same_tokens(model, executor, target)
        except DraftModelError:
            executor.close()
            raise
        return cls(executor)

    @property
    def executor(self) -> ModelExecutor:
        return self._executor

    def follow(
        self, chunks: Sequence[SequenceChunk], sampled: Sequence[SampledToken]
    ) -> dict[str, tuple[int, ...]]:
        """After the target sampled `chunks`: write the draft's KV for what they computed
        and kept (rule 2), and propose for each chunk that asks (rule 3), by request id."""
        block_size = self._executor.block_size
        max_len = self._executor.max_model_len
        first: list[SequenceChunk] = []  # the first pass: kept tokens, then the sample
        drafting: list[tuple[str, int, int]] = []  # request, sample's position, drafts
        row = 0
        for chunk in chunks:
            tokens = chunk.token_ids
            kept = len(tokens) - chunk.num_draft_tokens
            samples: Sequence[SampledToken] = ()
            if chunk.sample:
                samples = sampled[row : row + chunk.num_samples]
                row += chunk.num_samples
            start = chunk.draft_start_pos
            if start is None:
                continue  # the draft sits this step out (rule 4)
            # What its KV lacks before this chunk, then what this chunk keeps.
            behind = list(chunk.all_token_ids[start : chunk.start_pos])
            if samples:
                accepted = accepted_drafts(tokens[kept:], samples)
                kept += accepted
                position = chunk.start_pos + kept
                room = min(len(chunk.block_table) * block_size, max_len) - position
                count = min(chunk.num_lookahead_tokens, room)
                if count > 0:
                    drafting.append((chunk.request_id, position, count))
                    run = (*behind, *tokens[:kept], samples[accepted].token_id)
                    first.append(_pass_chunk(chunk, run, start, sample=True))
                    continue
            if behind or kept:
                run = (*behind, *tokens[:kept])
                first.append(_pass_chunk(chunk, run, start, sample=False))
        proposals: dict[str, list[int]] = {request_id: [] for request_id, _, _ in drafting}
        by_id = {chunk.request_id: chunk for chunk in chunks}
        passes = first
        step = 0
        while passes:
            with torch.inference_mode():
                logits = self._executor.compute_logits(ModelBatch(chunks=tuple(passes)))
            if not drafting:
                break
            step += 1
            passes, following = [], []
            for (request_id, position, count), token in zip(
                drafting, argmax_rows(logits).tolist(), strict=True
            ):
                proposals[request_id].append(token)
                if step < count:
                    following.append((request_id, position, count))
                    passes.append(
                        _pass_chunk(by_id[request_id], (token,), position + step, sample=True)
                    )
            drafting = following
        return {request_id: tuple(tokens) for request_id, tokens in proposals.items()}

    def memory(self) -> ExecutorMemory:
        return self._executor.memory()

    def sleep(self, level: int) -> None:
        self._executor.sleep(level)

    def wake_up(self, tags: frozenset[str]) -> None:
        self._executor.wake_up(tags)

    def reset_kv_cache(self) -> None:
        self._executor.reset_kv_cache()

    def close(self) -> None:
        self._executor.close()


def _pass_chunk(
    chunk: SequenceChunk, tokens: Sequence[int], start_pos: int, *, sample: bool
) -> SequenceChunk:
    """`chunk`'s request running `tokens` from `start_pos` through the draft (its own
    drafts and adapter are the target's business)."""
    return dataclasses.replace(
        chunk,
        token_ids=tokens,
        start_pos=start_pos,
        sample=sample,
        num_draft_tokens=0,
        num_lookahead_tokens=0,
        lora=None,
    )


def _draft_config(model: str) -> ModelConfig:
    try:
        return resolve_model_source(model).config
    except (ModelLoadError, OSError, ValueError) as error:
        raise DraftModelError(f"draft model {model!r} cannot be loaded: {error}") from None


def _check_same_tokens(model: str, draft: ModelExecutor, target: ModelExecutor) -> None:
    """A draft proposes token ids: they must mean the target's tokens."""
    from wavecore.engine.sampling.errors import TokenizerLoadError
    from wavecore.engine.sampling.tokenizer import Tokenizer

    ours, theirs = draft.config.vocab_size, target.config.vocab_size
    if ours != theirs:
        raise DraftModelError(
            f"draft model {model!r} has a vocabulary of {ours} tokens, the target {theirs}: "
            "a draft model must share the target's tokenizer"
        )
    if draft.source.eos_token_id != target.source.eos_token_id:
        raise DraftModelError(
            f"draft model {model!r} ends text with token {draft.source.eos_token_id}, the "
            f"target with {target.source.eos_token_id}: it must share the target's tokenizer"
        )
    try:
        same = Tokenizer.from_source(draft.source).encode(_PROBE) == Tokenizer.from_source(
            target.source
        ).encode(_PROBE)
    except TokenizerLoadError:
        return  # without a tokenizer on either side, the vocabulary size is all to check
    if not same:
        raise DraftModelError(
            f"draft model {model!r} splits text into other tokens than the target: a draft "
            "model must share the target's tokenizer"
        )
