"""Decode attention through the C kernel (`decode_attention.c`), read straight from the
paged KV cache.

Why: the torch path gathers each decode group's cached keys and values into a padded
copy (`index_select` of whole blocks) and runs the fused attention on it, in bfloat16
with the queries rounded to it. The kernel reads the blocks where they lie, one
sequence at a time to its own length, in float32. Measured on the 2 vCPU AMD EPYC of
the README, batch-1 compiled decode steps in alternating rounds (the same graph but
for attention): 1.18x at context 1,024, 1.02x at 128.

Rules:
1. Decodes only (a prefill chunk's many queries are what the fused kernel is for), and
   only where the kernel applies (`usable`): a bfloat16 cache on the CPU, float32
   queries, a head size that is a multiple of 16 up to 256, query heads a multiple of
   KV heads, and the kernel built (`engine/native_build.py`;
   `WAVECORE_ATTENTION_KERNEL=torch` turns it off). Elsewhere torch's path runs, and
   `path_report()["attention"]` says which runs and why.
2. Each sequence attends over exactly its own context (`DecodeAttention.context_lens`):
   no padding and no mask, so a sequence's output does not depend on the batch around
   it, and a group of mixed lengths reads no padded blocks.
3. Float32 throughout from the cached bfloat16 keys and values (widening them is
   exact); the queries are not rounded, so it is closer to float32 attention than the
   fused bfloat16 path it replaces.
4. A torch operator (`wavecore::decode_attention`, its CPU kernel registered in C++ by
   `decode_attention_op.cpp` through torch's stable ABI), so that a graph torch.compile
   makes of the forward pass (`compiled_decode.py`) calls it as one kernel, not a
   break, and neither it nor eager code goes through Python for it.
5. The kernel trusts the block tables and lengths: `batch_plan.check_chunk` has checked
   every block id against the cache and every table against its context.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from wavecore.engine.native_build import KernelSource, build

ATTENTION_KERNEL = KernelSource(
    Path(__file__).with_name("decode_attention.c"),
    "decode_attention",
    "WAVECORE_ATTENTION_KERNEL",
    torch_ops=Path(__file__).with_name("decode_attention_op.cpp"),
)
_MAX_HEAD_DIM = 256  # the kernel's MAX_CHUNKS * 16

# `queries` `[seqs, heads, head_dim]` float32, one token each, attending over their
# sequences' cached keys and values `[blocks, block_size, kv_heads, head_dim]`;
# `block_tables` `[seqs, max_blocks]` and `context_lens` `[seqs]` int64. `usable` must hold
# for `queries` and both pools. The CPU kernel comes with the library
# (`decode_attention_op.cpp`, rule 4).
torch.library.define(
    "wavecore::decode_attention",
    "(Tensor queries, Tensor key_pool, Tensor value_pool, Tensor block_tables, "
    "Tensor context_lens, float scale) -> Tensor",
)


@torch.library.register_fake("wavecore::decode_attention")
def _(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(queries)


@cache
def _kernel() -> tuple[bool, str]:
    """Whether the operator runs here (its library loaded, which registers its CPU
    kernel); with what runs decode attention, in words."""
    built = build(ATTENTION_KERNEL)
    if built.library is None:
        return False, f"torch sdpa ({built.reason})"
    return True, f"native kernel for a bfloat16 cache ({built.reason})"


def kernel_report() -> str:
    """What runs a bfloat16 cache's decode attention on the CPU, for `path_report`."""
    return _kernel()[1]


@torch.compiler.assume_constant_result  # a fact about the process, not traced
def _built() -> bool:
    return _kernel()[0]


def usable(queries: torch.Tensor, key_pool: torch.Tensor) -> bool:
    """Whether the kernel runs decode attention of `queries` over `key_pool` (rule 1)."""
    heads, head_dim = queries.shape[1], queries.shape[2]
    return (
        key_pool.device.type == "cpu"
        and key_pool.dtype == torch.bfloat16
        and key_pool.is_contiguous()
        and queries.dtype == torch.float32
        and head_dim % 16 == 0
        and head_dim <= _MAX_HEAD_DIM
        and heads % key_pool.shape[2] == 0
        and _built()
    )
