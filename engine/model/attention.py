"""Attention that reads keys and values through block tables.

A forward pass's tokens are ordered decodes first (one token per sequence), then each
prefill chunk's tokens. The two kinds are computed differently, because their costs
differ:

- Decodes are batched into a few groups of similar context length (`decode_groups`
  in `batch_plan.py` chooses them). Each group's blocks are gathered into a
  `[sequences, longest context]` key/value tensor (short tables padded with the
  scratch block), and a boolean mask hides the padding and any slot past a
  sequence's length; when all contexts in a group are equally long (always at batch
  1) there is no mask. Decode attention reads every cached key and value of every
  sequence, so on the CPU it is bound by memory traffic: one group padded to the
  longest context would gather and read up to twice the bytes when lengths are
  mixed, while a group per sequence would pay per-call overhead many times over.
- Each prefill chunk gathers its own blocks and runs fused scaled-dot-product
  attention with a causal mask offset by its start position (query `i` sits at
  position `start + i` and sees keys `0..start + i`). The loop is over sequences,
  never tokens; a chunk already carries enough work to amortize the call, and
  batching chunks of different lengths would pad to the longest.

Over a bfloat16 cache on the CPU, decodes instead run the C kernel of
`native_attention.py`: each sequence read from its blocks in place to its own length,
in float32, no group, padding or mask (its rule 1 says where it applies).

Grouped-query attention is handled by viewing the query heads as
`[kv_heads, group]`, so keys and values are never repeated in memory. A decode's
queries of one KV head are all at the same position, so they are passed to the
fused kernel as a query *sequence* of length `group` under that single KV head:
each key block is then read once per KV head, not once per query head.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from wavecore.engine.model import native_attention

# On a GPU, cuDNN's fused attention builds an execution plan for every new shape, and a
# decode's context grows by one token a step: measured on an H200, 40 ms a step for
# plans against 8 ms for the whole step without them. The other fused kernels take any
# length as it comes.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeAttention:
    """Tokens `[token_start, token_start + num_tokens)`: one decode each, batched."""

    token_start: int
    num_tokens: int
    block_tables: torch.Tensor  # [num_tokens, max_blocks] int64, padded with the scratch block
    context_len: int  # the longest context of any of these sequences
    context_lens: torch.Tensor  # [num_tokens] int64: each sequence's context
    mask: torch.Tensor | None  # [num_tokens, 1, 1, context_len] bool, True: visible


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillAttention:
    """One prefill chunk: tokens `[token_start, token_start + num_tokens)` of the pass."""

    token_start: int
    num_tokens: int
    context_len: int  # start_pos + num_tokens
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64
    mask: torch.Tensor | None  # [num_tokens, context_len] bool; None: plain causal from 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionPlan:
    decodes: tuple[DecodeAttention, ...]
    prefills: tuple[PrefillAttention, ...]


def paged_attention(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """`queries` `[tokens, heads, head_dim]` -> outputs of the same shape and dtype.

    The pools must already hold this pass's keys and values. Decodes over a bfloat16
    cache on the CPU run the C kernel (`native_attention.py`), in float32; the rest runs
    torch's fused kernels in the pools' dtype (the queries rounded to it: they take one
    dtype), widened back to the queries' dtype at the end.
    """
    dtype = queries.dtype
    native = native_attention.usable(queries, key_pool)
    if native and len(plan.decodes) == 1 and not plan.prefills:
        return _native_decode(queries, key_pool, value_pool, plan.decodes[0], scale)
    rounded = queries.to(key_pool.dtype)
    with sdpa_kernel(_CUDA_BACKENDS) if queries.is_cuda else nullcontext():
        if len(plan.decodes) == 1 and not plan.prefills:
            return _decode(rounded, key_pool, value_pool, plan.decodes[0], scale).to(dtype)
        # The kernel's float32 decodes are kept as they are (a prefill's output widens
        # exactly), so a decode gives the same alone as in any batch.
        out = torch.empty_like(queries if native else rounded)
        for decode in plan.decodes:
            rows = slice(decode.token_start, decode.token_start + decode.num_tokens)
            if native:
                out[rows] = _native_decode(queries[rows], key_pool, value_pool, decode, scale)
            else:
                out[rows] = _decode(rounded[rows], key_pool, value_pool, decode, scale)
        for prefill in plan.prefills:
            rows = slice(prefill.token_start, prefill.token_start + prefill.num_tokens)
            out[rows] = _prefill(rounded[rows], key_pool, value_pool, prefill, scale)
        return out.to(dtype)


def _native_decode(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    decode: DecodeAttention,
    scale: float,
) -> torch.Tensor:
    return torch.ops.wavecore.decode_attention(
        queries, key_pool, value_pool, decode.block_tables, decode.context_lens, scale
    )


def _decode(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    decode: DecodeAttention,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = queries.shape
    kv_heads = key_pool.shape[2]
    context = decode.context_len
    # [seqs, blocks, block_size, kv, d] -> [seqs, kv, context, d]
    # index_select copies whole blocks; advanced indexing (`pool[tables]`) is far slower.
    flat_tables = decode.block_tables.view(-1)
    keys = key_pool.index_select(0, flat_tables).view(num_seqs, -1, kv_heads, head_dim)
    values = value_pool.index_select(0, flat_tables).view(num_seqs, -1, kv_heads, head_dim)
    keys, values = keys[:, :context], values[:, :context]
    out = F.scaled_dot_product_attention(
        queries.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=decode.mask,
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    prefill: PrefillAttention,
    scale: float,
) -> torch.Tensor:
    kv_heads, head_dim = key_pool.shape[2], key_pool.shape[3]
    context = prefill.context_len
    keys = key_pool.index_select(0, prefill.block_ids).view(-1, kv_heads, head_dim)[:context]
    values = value_pool.index_select(0, prefill.block_ids).view(-1, kv_heads, head_dim)[:context]
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=prefill.mask,
        is_causal=prefill.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
