"""Trusted constructors for the frozen messages built once per request per step.

A frozen, slotted dataclass's `__init__` sets each field through `object.__setattr__`,
which costs about 0.4 us per field on this project's machines; a `SequenceChunk` then
costs more than all the rest of scheduling one decode. The builders here fill the slots
through their member descriptors instead (about 3x faster). They skip nothing but
`__init__`: the classes have no `__post_init__`, and at import each builder checks that
it sets exactly the class's fields, so adding a field to a contract fails loudly here
instead of leaving a slot unset. Use them only with values the scheduler or executor
produced itself; anything from outside goes through the real constructor.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from wavecore.engine.executors.batch import SampledToken, SequenceChunk
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.request import FinishReason

from .outputs import RequestUpdate


def _slot_setters(cls: type, names: tuple[str, ...]) -> tuple[Any, ...]:
    declared = tuple(field.name for field in fields(cls))
    if set(declared) != set(names) or len(declared) != len(names):
        raise TypeError(
            f"fast builder for {cls.__name__} sets {names}, but the class declares {declared}"
        )
    if "__post_init__" in vars(cls):
        raise TypeError(f"{cls.__name__} has a __post_init__; the fast builder would skip it")
    return tuple(vars(cls)[name].__set__ for name in names)


_new = object.__new__

(
    _chunk_id,
    _chunk_tokens,
    _chunk_start,
    _chunk_table,
    _chunk_sample,
    _chunk_sampling,
    _chunk_all,
    _chunk_prompt_len,
    _chunk_drafts,
    _chunk_lookahead,
    _chunk_draft_start,
    _chunk_lora,
) = _slot_setters(
    SequenceChunk,
    (
        "request_id",
        "token_ids",
        "start_pos",
        "block_table",
        "sample",
        "sampling",
        "all_token_ids",
        "prompt_len",
        "num_draft_tokens",
        "num_lookahead_tokens",
        "draft_start_pos",
        "lora",
    ),
)


def build_chunk(
    request_id: str,
    token_ids: Any,
    start_pos: int,
    block_table: list[int],
    sample: bool,
    sampling: SamplingParams,
    all_token_ids: list[int],
    prompt_len: int,
    num_draft_tokens: int = 0,
    lora: str | None = None,
    num_lookahead_tokens: int = 0,
    draft_start_pos: int | None = None,
) -> SequenceChunk:
    chunk = _new(SequenceChunk)
    _chunk_id(chunk, request_id)
    _chunk_tokens(chunk, token_ids)
    _chunk_start(chunk, start_pos)
    _chunk_table(chunk, block_table)
    _chunk_sample(chunk, sample)
    _chunk_sampling(chunk, sampling)
    _chunk_all(chunk, all_token_ids)
    _chunk_prompt_len(chunk, prompt_len)
    _chunk_drafts(chunk, num_draft_tokens)
    _chunk_lookahead(chunk, num_lookahead_tokens)
    _chunk_draft_start(chunk, draft_start_pos)
    _chunk_lora(chunk, lora)
    return chunk


_sampled_id, _sampled_token, _sampled_logprob, _sampled_top = _slot_setters(
    SampledToken, ("request_id", "token_id", "logprob", "top_logprobs")
)


def build_sampled(request_id: str, token_id: int) -> SampledToken:
    """A `SampledToken` without log-probabilities."""
    sampled = _new(SampledToken)
    _sampled_id(sampled, request_id)
    _sampled_token(sampled, token_id)
    _sampled_logprob(sampled, None)
    _sampled_top(sampled, ())
    return sampled


_update_id, _update_tokens, _update_sampled, _update_finish, _update_error = _slot_setters(
    RequestUpdate, ("request_id", "new_token_ids", "sampled", "finish_reason", "error")
)


def build_update(
    request_id: str,
    new_token_ids: tuple[int, ...],
    sampled: tuple[SampledToken, ...],
    finish_reason: FinishReason | None,
    error: str | None = None,
) -> RequestUpdate:
    update = _new(RequestUpdate)
    _update_id(update, request_id)
    _update_tokens(update, new_token_ids)
    _update_sampled(update, sampled)
    _update_finish(update, finish_reason)
    _update_error(update, error)
    return update
