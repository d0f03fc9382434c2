"""An `Executor` that runs no model: deterministic tokens at (almost) no cost.

It lets the scheduler, the engine loop and the benchmarks run without weights. The
token sampled after a chunk depends only on the chunk's last token and the position
of the new token, `next = (last * 1000003 + position * 7919 + 1) % vocab_size`
(moved one up if it hits `eos_token_id`), so a request's output does not depend on
its batch, its chunking or any preemption, and tests can recompute it.

Its one "weight" is `token_shift`, a float32 tensor of shape (1,) holding a whole
number (0 at start) added to every sampled token before the modulo: enough for
`update_weights` to change what it outputs, and for tests to see which weights serve.
EOS is emitted only when asked: with `eos_at_output=k`, every request's k-th output
token (0-based) is `eos_token_id`.

With `track_kv=True` the executor also keeps a shadow KV cache: each block slot
records the token whose KV would be there. Every chunk first checks that its block
table already holds the request's earlier tokens (which catches a wrong prefix-cache
hit, a block shared or freed too early, a bad block table), then writes its own.

With `repeat_period=p` the position in that rule is taken modulo p, so a request's
output falls into cycles, as a real model's copying from its input does: what
speculative decoding's prompt lookup is for (its tests use it).

Asked for drafts (a sampling chunk's `num_lookahead_tokens`, speculative decoding
with `speculative_method="draft_model"`), it proposes what it would sample next,
greedy as a draft model is, except that a draft for a position divisible by
`DRAFT_MISS_PERIOD` is one token off: verification then both accepts and rejects.

With `step_seconds=t` every `execute` lasts `t` seconds: it sleeps what its own work
left of them, releasing the GIL as a GPU's forward would. A stand-in for a model whose
step takes a fixed time, to measure what the engine's Python costs around it
(`bench/batch_queue.py`).

Sleep levels and wake tags follow the `Executor` protocol; running a batch while the
weights or the KV cache are asleep raises `ExecutorAsleepError`, and anything after
`close()` raises `ExecutorClosedError`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from wavecore.engine.errors import WeightUpdateError, WeightUpdateRefusedError
from wavecore.engine.executors.batch import (
    EXECUTOR_TAGS,
    ExecutorMemory,
    GrammarBitmask,
    ModelBatch,
    ModelOutput,
    SampledToken,
    SequenceChunk,
    accepted_drafts,
    sampling_rows,
)
from wavecore.engine.executors.errors import ExecutorAsleepError, ExecutorClosedError
from wavecore.engine.executors.rpc import remote_callable
from wavecore.engine.executors.weight_specs import check_update
from wavecore.engine.scheduler.fast_build import build_sampled

# `token_shift`, one float32.
_TOKEN_SHIFT_BYTES = 4
# One draft position in this many gets a wrong draft (see the module docstring).
DRAFT_MISS_PERIOD = 5


def _first_allowed(words: np.ndarray, token: int, vocab_size: int) -> int:
    """The first token at or after `token` (wrapping) that the packed row allows; `token`
    itself when the row allows none."""
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
    if allowed.size == 0:
        return token
    at = int(np.searchsorted(allowed, token))
    return int(allowed[at % allowed.size])


class KVCacheMismatchError(RuntimeError):
    """A chunk's block table does not hold the tokens its request claims (track_kv)."""


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"NullExecutor {name} must be an int >= {low}, got {value!r}")


def null_next_token(last_token: int, position: int, vocab_size: int, token_shift: int = 0) -> int:
    """The token the NullExecutor samples at `position` after `last_token`, before EOS rules."""
    return (last_token * 1000003 + position * 7919 + 1 + token_shift) % vocab_size


def _past_eos(token: int, vocab_size: int, eos_token_id: int | None) -> int:
    return (token + 1) % vocab_size if token == eos_token_id else token


def null_continuation(
    prompt_token_ids: list[int],
    count: int,
    *,
    vocab_size: int,
    eos_token_id: int | None,
    token_shift: int = 0,
) -> list[int]:
    """The first `count` tokens a NullExecutor (without `eos_at_output`) outputs after
    this prompt: what tests and benchmarks compare the engine's output with."""
    tokens = list(prompt_token_ids)
    for _ in range(count):
        token = null_next_token(tokens[-1], len(tokens), vocab_size, token_shift)
        tokens.append(_past_eos(token, vocab_size, eos_token_id))
    return tokens[len(prompt_token_ids) :]


class NullExecutor:
    """A model-free `Executor`; see the module docstring."""

    def __init__(
        self,
        *,
        num_kv_blocks: int,
        block_size: int = 16,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None = None,
        eos_at_output: int | None = None,
        track_kv: bool = False,
        step_seconds: float = 0.0,
        repeat_period: int | None = None,
    ) -> None:
        _check_int("num_kv_blocks", num_kv_blocks, low=1)
        _check_int("block_size", block_size, low=1)
        _check_int("max_model_len", max_model_len, low=1)
        _check_int("vocab_size", vocab_size, low=2)
        if eos_token_id is not None:
            _check_int("eos_token_id", eos_token_id, low=0)
            if eos_token_id >= vocab_size:
                raise ValueError(
                    f"NullExecutor eos_token_id {eos_token_id} is outside the vocabulary "
                    f"of {vocab_size}"
                )
        if isinstance(step_seconds, bool) or not isinstance(step_seconds, int | float):
            raise ValueError(f"NullExecutor step_seconds must be a number, got {step_seconds!r}")
        if step_seconds < 0:
            raise ValueError(f"NullExecutor step_seconds must be >= 0, got {step_seconds!r}")
        if repeat_period is not None:
            _check_int("repeat_period", repeat_period, low=1)
        if eos_at_output is not None:
            _check_int("eos_at_output", eos_at_output, low=0)
            if eos_token_id is None:
                raise ValueError("NullExecutor eos_at_output needs an eos_token_id")
        self._num_kv_blocks = num_kv_blocks
        self._block_size = block_size
        self._max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_at_output = eos_at_output
        self.track_kv = track_kv
        self.step_seconds = step_seconds
        self.repeat_period = repeat_period
        self._weights_awake = True
        self._kv_awake = True
        self._token_shift = 0
        self._closed = False
        self._kv: list[list[int | None]] = self._empty_kv()
        self.num_steps = 0
        self.num_dummy_steps = 0
        self.num_tokens = 0

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_asleep(self) -> bool:
        return not (self._weights_awake and self._kv_awake)

    def next_token(self, chunk: SequenceChunk) -> int:
        """The token this executor samples after `chunk`, one of `sampling_rows`: it
        follows the last token of the chunk's history, at the history's length."""
        return self._next_after(chunk.all_token_ids, chunk.prompt_len)

    def _next_after(self, history: Sequence[int], prompt_len: int) -> int:
        if self.eos_at_output is not None and len(history) - prompt_len == self.eos_at_output:
            return self.eos_token_id  # type: ignore[return-value]
        position = len(history) % self.repeat_period if self.repeat_period else len(history)
        token = null_next_token(history[-1], position, self.vocab_size, self._token_shift)
        return _past_eos(token, self.vocab_size, self.eos_token_id)

    def execute(self, batch: ModelBatch) -> ModelOutput:
        return self.sample_tokens(self.execute_model(batch), None)

    def execute_model(self, batch: ModelBatch) -> ModelBatch:
        """Check (and with `track_kv` write) the batch's KV; the "logits" are the batch."""
        started = time.perf_counter()
        self._check_awake("execute")
        block_size = self._block_size
        num_tokens = 0
        for chunk in batch.chunks:
            position = chunk.start_pos + len(chunk.token_ids)
            num_tokens += len(chunk.token_ids)
            if len(chunk.block_table) * block_size < position:
                raise ValueError(
                    f"request {chunk.request_id!r}: block table of {len(chunk.block_table)} "
                    f"blocks does not cover position {position - 1}"
                )
            if self.track_kv:
                self._check_and_write_kv(chunk)
        self.num_steps += 1
        self.num_tokens += num_tokens
        if self.step_seconds:
            time.sleep(max(0.0, started + self.step_seconds - time.perf_counter()))
        return batch

    def sample_tokens(self, forward: object, bitmask: GrammarBitmask | None) -> ModelOutput:
        """Each sampling row's deterministic token (`next_token`); in a row `bitmask`
        constrains, the first allowed token at or after it (wrapping around)."""
        if not isinstance(forward, ModelBatch):
            raise TypeError(f"sample_tokens takes what execute_model returned, got {forward!r}")
        vocab_size = self.vocab_size
        eos = self.eos_token_id
        shift = self._token_shift + 1
        plain = self.eos_at_output is None and self.repeat_period is None
        sampled = []
        for chunk in forward.chunks:
            if not chunk.sample:
                continue
            if chunk.num_draft_tokens or not plain:
                for row in sampling_rows((chunk,)):
                    sampled.append(build_sampled(chunk.request_id, self.next_token(row)))
                continue
            # The common case inline (no drafts, no EOS rule): a chunk's last token is
            # its history's last, at its history's length.
            token_ids = chunk.token_ids
            position = chunk.start_pos + len(token_ids)
            token = (token_ids[-1] * 1000003 + position * 7919 + shift) % vocab_size
            if token == eos:
                token = (token + 1) % vocab_size
            sampled.append(build_sampled(chunk.request_id, token))
        if bitmask is not None:
            for row, words in zip(bitmask.rows, bitmask.words, strict=True):
                token = _first_allowed(words, sampled[row].token_id, vocab_size)
                sampled[row] = build_sampled(sampled[row].request_id, token)
        drafts = self._drafts(forward.chunks, sampled)
        return ModelOutput(sampled=tuple(sampled), draft_token_ids=drafts)

    def _drafts(
        self, chunks: Sequence[SequenceChunk], sampled: Sequence[SampledToken]
    ) -> dict[str, tuple[int, ...]]:
        """The drafts chunks asked for (module docstring): what this executor would
        sample after each chunk's emitted tokens, a few of them wrong on purpose."""
        proposals: dict[str, tuple[int, ...]] = {}
        row = 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            samples = sampled[row : row + chunk.num_samples]
            row += chunk.num_samples
            if not chunk.num_lookahead_tokens:
                continue
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
            accepted = accepted_drafts(drafts, samples)
            history = [*chunk.all_token_ids, *drafts[:accepted], samples[accepted].token_id]
            proposed = []
            for _ in range(chunk.num_lookahead_tokens):
                token = self._next_after(history, chunk.prompt_len)
                if len(history) % DRAFT_MISS_PERIOD == 0:
                    token = (token + 1) % self.vocab_size
                proposed.append(token)
                history.append(token)
            proposals[chunk.request_id] = tuple(proposed)
        return proposals

    def execute_dummy(self) -> None:
        self._check_awake("execute_dummy")
        self.num_dummy_steps += 1

    def sleep(self, level: int) -> None:
        self._check_open("sleep")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        # Level 1 would keep the weights in host memory and level 2 discard them; with
        # no weights both amount to the same flags.
        self._weights_awake = False
        self._kv_awake = False
        self._kv = []
        if level == 2:
            # The weights are dropped: waking reloads them as loaded, like the model's.
            self._token_shift = 0

    def wake_up(self, tags: frozenset[str]) -> None:
        self._check_open("wake_up")
        unknown = set(tags) - EXECUTOR_TAGS
        if unknown:
            raise ValueError(
                f"unknown wake_up tags {sorted(unknown)}; known: {sorted(EXECUTOR_TAGS)}"
            )
        if "weights" in tags:
            self._weights_awake = True
        if "kv_cache" in tags and not self._kv_awake:
            self._kv_awake = True
            self._kv = self._empty_kv()

    def memory(self) -> ExecutorMemory:
        """Its one weight while awake; it holds no KV cache (token lists at most)."""
        return ExecutorMemory(
            weights=_TOKEN_SHIFT_BYTES if self._weights_awake else 0,
            offloaded_weights=0,
            kv_cache=0,
        )

    def reset_kv_cache(self) -> None:
        self._check_open("reset_kv_cache")
        if self._kv_awake:
            self._kv = self._empty_kv()

    def close(self) -> None:
        self._closed = True
        self._kv = []

    # -- weight updates (`executors.weight_specs.UpdatableExecutor`) ---------------------

    @remote_callable
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"token_shift": (1,)}

    def stage_weights(self, tensors: Mapping[str, Any], *, partial: bool, origin: str) -> int:
        self._check_open("stage_weights")
        if not self._weights_awake:
            raise WeightUpdateRefusedError(
                "the weights are asleep: call wake_up(['weights']) before update_weights"
            )
        check_update(tensors, self.weight_shapes(), partial=partial, origin=origin)
        value = float(tensors["token_shift"][0])
        if not value.is_integer():
            raise WeightUpdateError(f"{origin}: tensor 'token_shift' must hold a whole number")
        return int(value)

    def commit_weights(self, staged: object) -> None:
        if not isinstance(staged, int):
            raise TypeError(f"commit_weights takes what stage_weights built, got {staged!r}")
        self._token_shift = staged

    def _empty_kv(self) -> list[list[int | None]]:
        if not self.track_kv:
            return []
        return [[None] * self._block_size for _ in range(self._num_kv_blocks)]

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ExecutorClosedError(f"NullExecutor.{what}() after close()")

    def _check_awake(self, what: str) -> None:
        self._check_open(what)
        if self.is_asleep:
            asleep = [
                name
                for name, awake in (("weights", self._weights_awake), ("kv_cache", self._kv_awake))
                if not awake
            ]
            raise ExecutorAsleepError(f"NullExecutor.{what}() while asleep: {', '.join(asleep)}")

    def _check_and_write_kv(self, chunk: SequenceChunk) -> None:
        size = self._block_size
        kv = self._kv
        table = chunk.block_table
        history = chunk.all_token_ids
        for position in range(chunk.start_pos):
            held = kv[table[position // size]][position % size]
            if held != history[position]:
                raise KVCacheMismatchError(
                    f"request {chunk.request_id!r}: position {position} holds token {held} "
                    f"in block {table[position // size]}, expected {history[position]}"
                )
        known = len(chunk.token_ids) - chunk.num_draft_tokens  # drafts are not history yet
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start_pos + offset
            if offset < known and token != history[position]:
                raise KVCacheMismatchError(
                    f"request {chunk.request_id!r}: chunk token {token} at position {position} "
                    f"is not the request's token {history[position]}"
                )
            kv[table[position // size]][position % size] = token
