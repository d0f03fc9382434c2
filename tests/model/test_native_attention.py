"""Decode attention through the C kernel (`engine/model/native_attention.py`): float32
attention over a paged bfloat16 cache, each sequence to its own length, the same alone
as in any batch, usable under torch.compile, and torch's path wherever it does not
apply."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from wavecore.engine import native_build
from wavecore.engine.model import load_executor, native_attention
from wavecore.engine.model.attention import (
    AttentionPlan,
    DecodeAttention,
    PrefillAttention,
    paged_attention,
)

BLOCKS, BLOCK_SIZE = 40, 4
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_build() -> Iterator[None]:
    native_build.build.cache_clear()
    native_attention._kernel.cache_clear()
    yield
    native_build.build.cache_clear()
    native_attention._kernel.cache_clear()


@pytest.fixture
def built() -> None:
    if not native_attention._built():
        if shutil.which("cc") is not None and shutil.which("c++") is not None:
            pytest.fail(f"the attention kernel did not build: {native_attention.kernel_report()}")
        pytest.skip(native_attention.kernel_report())


def pools(kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BLOCKS + 1, BLOCK_SIZE, kv_heads, head_dim)
    return tuple(torch.randn(shape, generator=generator).to(BF16) for _ in range(2))  # type: ignore[return-value]


def decode_group(lengths: list[int], seed: int = 1, token_start: int = 0) -> DecodeAttention:
    """Sequences of `lengths`, each on its own shuffled blocks, tables padded to the
    longest with the scratch block (as `batch_plan` pads them)."""
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    width = -(-max(lengths) // BLOCK_SIZE)
    tables = []
    for length in lengths:
        needed = -(-length // BLOCK_SIZE)
        taken, order = order[:needed], order[needed:]
        tables.append(taken + [BLOCKS] * (width - needed))
    context_lens = torch.tensor(lengths)
    mask = None
    if min(lengths) < max(lengths):
        mask = (torch.arange(max(lengths))[None, :] < context_lens[:, None])[:, None, None, :]
    return DecodeAttention(
        token_start=token_start,
        num_tokens=len(lengths),
        block_tables=torch.tensor(tables),
        context_len=max(lengths),
        context_lens=context_lens,
        mask=mask,
    )


def reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, decode: DecodeAttention
) -> torch.Tensor:
    """float64 attention of each sequence over its own context, read block by block."""
    out = torch.empty(queries.shape, dtype=torch.float64)
    kv_heads = keys.shape[2]
    group = queries.shape[1] // kv_heads
    for s, length in enumerate(decode.context_lens.tolist()):
        rows = decode.block_tables[s]
        k = keys[rows].reshape(-1, kv_heads, keys.shape[3])[:length].double()
        v = values[rows].reshape(-1, kv_heads, keys.shape[3])[:length].double()
        for h in range(queries.shape[1]):
            scores = k[:, h // group] @ queries[s, h].double() * queries.shape[2] ** -0.5
            out[s, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "lengths"),
    [
        (4, 2, 16, [1]),
        (4, 2, 16, [5, 16, 17, 3]),  # inside a block, one full block, one past it
        (9, 3, 64, [40, 7]),  # SmolLM2's heads
        (8, 8, 32, [33, 1, 12]),  # no grouping
        (16, 1, 128, [60]),
    ],
)
def test_each_sequence_attends_over_its_own_context_in_float32(
    heads: int, kv_heads: int, head_dim: int, lengths: list[int]
) -> None:
    keys, values = pools(kv_heads, head_dim)
    decode = decode_group(lengths)
    queries = torch.randn(len(lengths), heads, head_dim)
    assert native_attention.usable(queries, keys)
    out = torch.ops.wavecore.decode_attention(
        queries, keys, values, decode.block_tables, decode.context_lens, head_dim**-0.5
    )
    # float32 sums of exactly widened bfloat16 keys and values (the fused bfloat16
    # path is off by about 1e-3 here)
    torch.testing.assert_close(
        out.double(), reference(queries, keys, values, decode), rtol=1e-5, atol=1e-5
    )


@pytest.mark.usefixtures("built")
def test_a_decode_gives_the_same_alone_as_in_a_batch_with_prefills() -> None:
    keys, values = pools(2, 16)
    lengths = [9, 30, 2]
    queries = torch.randn(len(lengths) + 5, 4, 16)
    batch = decode_group(lengths)
    prefill = PrefillAttention(
        token_start=3, num_tokens=5, context_len=5, block_ids=torch.tensor([38, 39]), mask=None
    )
    together = paged_attention(
        queries, keys, values, AttentionPlan(decodes=(batch,), prefills=(prefill,)), 0.25
    )
    for s, length in enumerate(lengths):
        alone = DecodeAttention(
            token_start=0,
            num_tokens=1,
            block_tables=batch.block_tables[s : s + 1, : -(-length // BLOCK_SIZE)],
            context_len=length,
            context_lens=batch.context_lens[s : s + 1],
            mask=None,
        )
        plan = AttentionPlan(decodes=(alone,), prefills=())
        assert torch.equal(
            paged_attention(queries[s : s + 1], keys, values, plan, 0.25), together[s : s + 1]
        )


@pytest.mark.usefixtures("built")
def test_the_op_is_one_kernel_under_torch_compile() -> None:
    keys, values = pools(2, 16)
    decode = decode_group([6, 11])
    queries = torch.randn(2, 4, 16)
    args = (queries, keys, values, decode.block_tables, decode.context_lens, 0.25)
    torch.library.opcheck(torch.ops.wavecore.decode_attention.default, args)
    # The operator checks shapes and dtypes itself (not the tables' block ids).
    with pytest.raises(RuntimeError, match="pools must be contiguous bfloat16"):
        torch.ops.wavecore.decode_attention(queries, keys.float(), *args[2:])
    with pytest.raises(RuntimeError, match="block_tables must be"):
        torch.ops.wavecore.decode_attention(*args[:3], decode.block_tables.int(), *args[4:])


def test_torch_runs_where_the_kernel_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, _ = pools(2, 16)
    queries = torch.randn(1, 4, 16)
    assert not native_attention.usable(queries, keys.float())  # a float32 cache
    assert not native_attention.usable(queries.to(BF16), keys)
    assert not native_attention.usable(torch.randn(1, 4, 8), pools(2, 8)[0])  # head size 8
    monkeypatch.setenv(native_attention.ATTENTION_KERNEL.env, "torch")
    assert not native_attention.usable(queries, keys)
    assert native_attention.kernel_report() == "torch sdpa (WAVECORE_ATTENTION_KERNEL=torch)"


def test_an_executor_with_a_bfloat16_cache_says_what_runs_its_attention(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def report(kv_cache_dtype: str) -> dict[str, str]:
        executor = load_executor(
            str(tiny_gguf), weights="float32", kv_cache_memory=2**16, kv_cache_dtype=kv_cache_dtype
        )
        try:
            return executor.path_report()
        finally:
            executor.close()

    assert "attention" not in report("float32")  # torch's, as always
    if native_attention._built():
        assert report("bfloat16")["attention"].startswith("native kernel for a bfloat16 cache")
    monkeypatch.setenv(native_attention.ATTENTION_KERNEL.env, "torch")
    native_build.build.cache_clear()
    native_attention._kernel.cache_clear()
    assert report("bfloat16")["attention"] == "torch sdpa (WAVECORE_ATTENTION_KERNEL=torch)"
