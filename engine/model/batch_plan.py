"""From a `ModelBatch` to the tensors of one forward pass, after checking the batch.

Every check happens here, before the forward pass writes a single KV slot, so a bad
batch is refused whole (`InvalidBatchError`) and leaves the cache as it was.

Tokens are reordered: the batch's single-token chunks (decodes) first, sorted by
context length and cut into groups (`decode_groups`), then the prefill chunks' tokens
(grouped by LoRA adapter when they name adapters). Only attention cares about the
order (see `attention.py`); `sample_rows` maps each sampling chunk, in batch order, to
the row of its last token.
`lora_runs`, `lora_mixed` and `lora_owner` say which rows run under which LoRA adapter
(empty in a step of the base model only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from wavecore.engine.executors.batch import SequenceChunk
from wavecore.engine.model.attention import AttentionPlan, DecodeAttention, PrefillAttention
from wavecore.engine.model.errors import InvalidBatchError


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardPlan:
    token_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64, flat KV slot each token is written to
    sample_rows: torch.Tensor  # [sampling chunks] int64
    attention: AttentionPlan
    # LoRA adapters: contiguous runs of rows `(name, start, end)` (prefill chunks, or the
    # decodes when they are all of one adapter), and the decodes' adapters when they
    # mix (decodes are ordered by context length): `lora_mixed`, with `lora_owner`
    # giving each decode row's index among them (-1: the base model).
    lora_runs: tuple[tuple[str, int, int], ...] = ()
    lora_mixed: tuple[str, ...] = ()
    lora_owner: torch.Tensor | None = None

    @property
    def lora_names(self) -> tuple[str, ...]:
        """Every adapter the step names, once each."""
        return tuple(dict.fromkeys([*self.lora_mixed, *(run[0] for run in self.lora_runs)]))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheGeometry:
    block_size: int
    num_blocks: int  # usable blocks; `num_blocks` itself is the scratch block
    max_model_len: int
    vocab_size: int


# What one more decode group costs (a gather and a fused-attention call per pool and
# layer), in units of key positions attended. On a 2-core x86 CPU a group's fixed cost
# was 60-100 us per layer and a padded position about 0.3 us (SmolLM2's 3 KV heads).
GROUP_OVERHEAD_POSITIONS = 256


def decode_groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Cut ascending context `lengths` into `[start, end)` groups of least total cost.

    A group pads every member to its longest context, so its cost is
    `size * longest + GROUP_OVERHEAD_POSITIONS`; dynamic programming over the cut
    points finds the cheapest partition exactly.
    """
    count = len(lengths)
    longest = np.asarray(lengths, dtype=np.int64)
    best = np.zeros(count + 1, dtype=np.int64)
    cut = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        starts = np.arange(end)
        costs = best[:end] + (end - starts) * longest[end - 1] + GROUP_OVERHEAD_POSITIONS
        cut[end] = int(np.argmin(costs))
        best[end] = costs[cut[end]]
    groups = []
    end = count
    while end > 0:
        groups.append((int(cut[end]), end))
        end = int(cut[end])
    return groups[::-1]


def _blocks_needed(length: int, block_size: int) -> int:
    return -(-length // block_size)


def check_chunk(chunk: SequenceChunk, geometry: CacheGeometry) -> None:
    name = f"chunk of request {chunk.request_id!r}"
    count = len(chunk.token_ids)
    if count == 0:
        raise InvalidBatchError(f"{name} has no tokens")
    start = chunk.start_pos
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidBatchError(f"{name} has invalid start_pos {start!r}")
    end = start + count
    if end > geometry.max_model_len:
        raise InvalidBatchError(
            f"{name} reaches position {end}, past max_model_len {geometry.max_model_len}"
        )
    needed = _blocks_needed(end, geometry.block_size)
    if len(chunk.block_table) < needed:
        raise InvalidBatchError(
            f"{name} needs {needed} blocks for {end} positions, its block table has "
            f"{len(chunk.block_table)}"
        )
    used = chunk.block_table[:needed]
    if min(used) < 0 or max(used) >= geometry.num_blocks:
        raise InvalidBatchError(
            f"{name} names a block outside [0, {geometry.num_blocks}): {list(used)}"
        )
    if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= geometry.vocab_size:
        raise InvalidBatchError(f"{name} has a token id outside [0, {geometry.vocab_size})")


def plan_forward(
    chunks: Sequence[SequenceChunk], geometry: CacheGeometry, device: torch.device
) -> ForwardPlan:
    seen: set[str] = set()
    for chunk in chunks:
        check_chunk(chunk, geometry)
        if chunk.request_id in seen:
            raise InvalidBatchError(f"request {chunk.request_id!r} has two chunks in one batch")
        seen.add(chunk.request_id)

    block_size = geometry.block_size
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    prefills = [c for c in chunks if len(c.token_ids) > 1]
    if any(c.lora is not None for c in prefills):
        # Each adapter's chunks side by side: one run per adapter (`lora_runs`), not one
        # per chunk. Attention takes each chunk alone, so their order is free.
        prefills.sort(key=lambda c: "" if c.lora is None else "\x00" + c.lora)

    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    last_row: dict[str, int] = {}

    decode_plans: list[DecodeAttention] = []
    if decodes:
        decodes.sort(key=lambda c: c.start_pos)
        decode_positions = [c.start_pos for c in decodes]
        token_ids.extend(c.token_ids[0] for c in decodes)
        positions.append(np.asarray(decode_positions, dtype=np.int64))
        slots.append(
            np.asarray(
                [
                    c.block_table[p // block_size] * block_size + p % block_size
                    for c, p in zip(decodes, decode_positions, strict=True)
                ],
                dtype=np.int64,
            )
        )
        for row, chunk in enumerate(decodes):
            last_row[chunk.request_id] = row
        decode_plans = [
            _decode_plan(start, decodes[start:end], geometry, device)
            for start, end in decode_groups([p + 1 for p in decode_positions])
        ]

    prefill_plans = []
    row = len(decodes)
    for chunk in prefills:
        count = len(chunk.token_ids)
        start = chunk.start_pos
        context = start + count
        table = np.asarray(chunk.block_table[: _blocks_needed(context, block_size)], dtype=np.int64)
        chunk_positions = np.arange(start, context, dtype=np.int64)
        token_ids.extend(chunk.token_ids)
        positions.append(chunk_positions)
        slots.append(
            table[chunk_positions // block_size] * block_size + chunk_positions % block_size
        )
        mask = None
        if start > 0:
            mask = torch.ones(count, context, dtype=torch.bool, device=device).tril_(diagonal=start)
        prefill_plans.append(
            PrefillAttention(
                token_start=row,
                num_tokens=count,
                context_len=context,
                block_ids=torch.from_numpy(table).to(device),
                mask=mask,
            )
        )
        row += count
        last_row[chunk.request_id] = row - 1

    # A decode with drafts samples at each of its last 1 + num_draft_tokens positions.
    sample_rows = [
        row
        for c in chunks
        if c.sample
        for row in range(last_row[c.request_id] - c.num_draft_tokens, last_row[c.request_id] + 1)
    ]
    lora_runs, lora_mixed, lora_owner = _lora_rows(decodes, prefills, device)
    return ForwardPlan(
        token_ids=torch.tensor(token_ids, dtype=torch.int64).to(device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64).to(device),
        attention=AttentionPlan(decodes=tuple(decode_plans), prefills=tuple(prefill_plans)),
        lora_runs=lora_runs,
        lora_mixed=lora_mixed,
        lora_owner=lora_owner,
    )


def _decode_plan(
    token_start: int,
    decodes: Sequence[SequenceChunk],
    geometry: CacheGeometry,
    device: torch.device,
) -> DecodeAttention:
    block_size = geometry.block_size
    lengths = [c.start_pos + 1 for c in decodes]
    max_blocks = _blocks_needed(max(lengths), block_size)
    scratch = geometry.num_blocks
    tables = [
        [*c.block_table[: _blocks_needed(n, block_size)], *([scratch] * max_blocks)][:max_blocks]
        for c, n in zip(decodes, lengths, strict=True)
    ]
    context = max(lengths)
    context_lens = torch.tensor(lengths, dtype=torch.int64).to(device)
    mask = None
    if min(lengths) < context:
        slots = torch.arange(context, device=device)
        mask = (slots[None, :] < context_lens[:, None])[:, None, None, :]
    return DecodeAttention(
        token_start=token_start,
        num_tokens=len(decodes),
        block_tables=torch.tensor(tables, dtype=torch.int64).to(device),
        context_len=context,
        context_lens=context_lens,
        mask=mask,
    )


def _lora_rows(
    decodes: Sequence[SequenceChunk], prefills: Sequence[SequenceChunk], device: torch.device
) -> tuple[tuple[tuple[str, int, int], ...], tuple[str, ...], torch.Tensor | None]:
    """The LoRA rows as `ForwardPlan` holds them: runs, and the decodes' mixed block."""
    if not any(c.lora is not None for c in decodes) and not any(
        c.lora is not None for c in prefills
    ):
        return (), (), None
    runs: list[tuple[str, int, int]] = []
    mixed: tuple[str, ...] = ()
    owner = None
    decode_rows: dict[str, list[int]] = {}
    for row, chunk in enumerate(decodes):
        if chunk.lora is not None:
            decode_rows.setdefault(chunk.lora, []).append(row)
    if len(decode_rows) == 1:
        ((name, taken),) = decode_rows.items()
        if taken[-1] + 1 - taken[0] == len(taken):  # ascending: contiguous
            runs.append((name, taken[0], taken[-1] + 1))
            decode_rows = {}
    if decode_rows:
        mixed = tuple(sorted(decode_rows))
        owners = [-1] * len(decodes)
        for index, name in enumerate(mixed):
            for row in decode_rows[name]:
                owners[row] = index
        owner = torch.tensor(owners, dtype=torch.int64).to(device)
    row = len(decodes)
    for chunk in prefills:
        count = len(chunk.token_ids)
        if chunk.lora is not None:
            if runs and runs[-1][0] == chunk.lora and runs[-1][2] == row:
                runs[-1] = (chunk.lora, runs[-1][1], row + count)  # the same adapter goes on
            else:
                runs.append((chunk.lora, row, row + count))
        row += count
    return tuple(runs), mixed, owner
