"""Paged attention against dense float64 attention, on random block tables.

Sequences get shuffled, non-contiguous blocks; contexts end mid-block; decodes and
prefill chunks (from position 0 and from an offset into cached context) share a pass.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from model_test_helpers import attention_chunks

from wavecore.engine.model import batch_plan
from wavecore.engine.model.attention import paged_attention
from wavecore.engine.model.batch_plan import CacheGeometry, decode_groups, plan_forward

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q `[n, H, d]` at positions start.., k/v `[start + n, KV, d]`: causal attention."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    n, context = q.shape[0], k.shape[0]
    query_pos = torch.arange(start, start + n)[:, None]
    key_pos = torch.arange(context)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_chunks(rng: random.Random) -> list[tuple[int, int]]:
    """(start_pos, num_tokens) per sequence: decodes, fresh prefills, offset prefills."""
    shapes = [(rng.randint(0, 30), 1) for _ in range(rng.randint(1, 5))]
    shapes += [(0, rng.randint(2, 13)) for _ in range(rng.randint(0, 2))]
    shapes += [(rng.randint(1, 20), rng.randint(2, 9)) for _ in range(rng.randint(0, 2))]
    rng.shuffle(shapes)
    return shapes


@pytest.mark.parametrize("group_overhead", [batch_plan.GROUP_OVERHEAD_POSITIONS, 0])
@pytest.mark.parametrize("seed", range(8))
def test_paged_attention_matches_dense_float64(
    seed: int, group_overhead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no group overhead every distinct decode length gets its own group.
    monkeypatch.setattr(batch_plan, "GROUP_OVERHEAD_POSITIONS", group_overhead)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = random_chunks(rng)
    free_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(free_blocks)

    key_pool = torch.randn(
        NUM_BLOCKS + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64
    )
    value_pool = torch.randn(key_pool.shape, generator=gen, dtype=torch.float64)
    chunks = attention_chunks(shapes, free_blocks, BLOCK_SIZE)
    geometry = CacheGeometry(
        block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=64, vocab_size=1
    )
    plan = plan_forward(chunks, geometry, torch.device("cpu"))
    queries = torch.randn(plan.num_tokens, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)

    out = paged_attention(queries, key_pool, value_pool, plan.attention, HEAD_DIM**-0.5)

    flat_keys = key_pool.view(-1, KV_HEADS, HEAD_DIM)
    flat_values = value_pool.view(-1, KV_HEADS, HEAD_DIM)
    checked = 0
    for row, chunk in zip(plan.sample_rows.tolist(), chunks, strict=True):
        count = len(chunk.token_ids)
        rows = slice(row - count + 1, row + 1)
        context = chunk.start_pos + count
        slots = torch.tensor(
            [
                chunk.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(context)
            ]
        )
        # The plan's slot mapping for this chunk's tokens is where its new keys go.
        assert plan.slot_mapping[rows].tolist() == slots[chunk.start_pos :].tolist()
        assert plan.positions[rows].tolist() == list(range(chunk.start_pos, context))
        expected = dense_reference(
            queries[rows], flat_keys[slots], flat_values[slots], chunk.start_pos
        )
        torch.testing.assert_close(out[rows], expected, atol=1e-12, rtol=1e-12)
        checked += count
    assert checked == plan.num_tokens


def partition_cost(lengths: list[int], groups: list[tuple[int, int]]) -> int:
    return sum(
        (end - start) * lengths[end - 1] + batch_plan.GROUP_OVERHEAD_POSITIONS
        for start, end in groups
    )


@given(st.lists(st.integers(1, 2000), min_size=1, max_size=9).map(sorted))
def test_decode_groups_is_the_cheapest_partition(lengths: list[int]) -> None:
    groups = decode_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(groups))
    cheapest = min(
        partition_cost(lengths, list(itertools.pairwise((0, *cuts, len(lengths)))))
        for r in range(len(lengths))
        for cuts in itertools.combinations(range(1, len(lengths)), r)
    )
    assert partition_cost(lengths, groups) == cheapest


def test_decode_groups_split_mixed_lengths_and_keep_equal_ones_together() -> None:
    assert decode_groups([300] * 64) == [(0, 64)]
    assert decode_groups([16] * 32 + [512] * 32) == [(0, 32), (32, 64)]
