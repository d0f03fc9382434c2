"""The KV cache's dtype: bfloat16 beside a plan that rounds, the compute dtype
otherwise, an explicit name always; what a bfloat16 cache stores and how attention
reads it; the quality judgment made beside it."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_test_helpers import ArgmaxSampler, attention_chunks

from wavecore.engine.model import auto_weights, load_executor
from wavecore.engine.model.attention import paged_attention
from wavecore.engine.model.batch_plan import CacheGeometry, plan_forward
from wavecore.engine.model.dtypes import pick_kv_cache_dtype
from wavecore.engine.model.kernel_plan import FORCE_ENV
from wavecore.engine.model.kv_cache import PagedKVCache

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16
BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 4, 16, 2, 6, 8


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)


def test_auto_follows_the_plan_and_an_explicit_name_wins() -> None:
    assert pick_kv_cache_dtype("auto", compute=F32, rounds_to_bf16=True) == BF16
    assert pick_kv_cache_dtype("auto", compute=F32, rounds_to_bf16=False) == F32
    assert pick_kv_cache_dtype("auto", compute=BF16, rounds_to_bf16=False) == BF16
    assert pick_kv_cache_dtype("auto", compute=torch.float16, rounds_to_bf16=True) == torch.float16
    assert pick_kv_cache_dtype("float32", compute=F32, rounds_to_bf16=True) == F32
    assert pick_kv_cache_dtype("bfloat16", compute=F32, rounds_to_bf16=False) == BF16
    for bad in ("fp8", "", None, BF16, 16):
        with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
            pick_kv_cache_dtype(bad, compute=F32, rounds_to_bf16=False)


def test_a_bfloat16_cache_stores_rounded_values_and_attends_in_bfloat16() -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    config = SimpleNamespace(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    caches = {
        dtype: PagedKVCache(
            config,  # type: ignore[arg-type]
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            device=CPU,
            dtype=dtype,
        )
        for dtype in (F32, BF16)
    }
    geometry = CacheGeometry(
        block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=64, vocab_size=32
    )
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    # Two decodes of different contexts and a prefill from an offset.
    chunks = attention_chunks([(9, 1), (5, 1), (3, 6)], free, BLOCK_SIZE)
    plan = plan_forward(tuple(chunks), geometry, CPU)
    # Every slot a sequence attends to: the cached context and this pass's tokens.
    slots = torch.arange((NUM_BLOCKS + 1) * BLOCK_SIZE)
    keys = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
    values = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
    caches[BF16].write(0, slots, keys, values)
    # The float32 cache holds what the bfloat16 one rounded to, exactly.
    caches[F32].write(0, slots, keys.to(BF16).float(), values.to(BF16).float())
    assert caches[BF16].keys[0].dtype == BF16
    assert torch.equal(caches[BF16].keys[0].float(), caches[F32].keys[0])
    assert torch.equal(caches[BF16].values[0].float(), caches[F32].values[0])

    queries = torch.randn(plan.num_tokens, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5

    def attend(dtype: torch.dtype, q: torch.Tensor) -> torch.Tensor:
        cache = caches[dtype]
        return paged_attention(q, cache.keys[0], cache.values[0], plan.attention, scale)

    rounded = attend(BF16, queries)
    assert rounded.dtype == F32 and rounded.shape == queries.shape  # the queries' dtype back
    # The float32 attention of the rounded queries, keys and values, to bfloat16's output
    # rounding (8 bits of mantissa).
    reference = attend(F32, queries.to(BF16).float())
    torch.testing.assert_close(rounded, reference, rtol=2**-7, atol=2**-7)


@pytest.mark.usefixtures("needs_bf16_kernel")
def test_a_plan_that_rounds_keeps_its_cache_in_bfloat16(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_ENV, "onednn-bf16")
    rounded, float32_cache = (
        load_executor(
            str(tiny_gguf),
            device="cpu",
            kv_cache_memory=2**20,
            kv_cache_dtype=kv,
            sampler=ArgmaxSampler(),
        )
        for kv in ("auto", "float32")
    )
    try:
        assert rounded.kv_cache_dtype == BF16 and float32_cache.kv_cache_dtype == F32
        assert rounded.path_report()["kv_cache"] == "bfloat16"
        # The same memory holds twice the blocks (the budget's remainder may fit one more).
        blocks = float32_cache.num_kv_blocks
        assert rounded.num_kv_blocks in (2 * blocks, 2 * blocks + 1)
        tokens = [(7 * i) % 256 for i in range(40)]
        a, b = rounded.score(tokens), float32_cache.score(tokens)
        assert not torch.equal(a, b)
        assert float((a - b).norm() / b.norm()) < 0.02
    finally:
        rounded.close()
        float32_cache.close()


def test_float32_weights_keep_a_float32_cache_unless_told(tiny_gguf: Path) -> None:
    exact, told = (
        load_executor(
            str(tiny_gguf),
            device="cpu",
            weights="float32",
            kv_cache_memory=2**20,
            kv_cache_dtype=kv,
            sampler=ArgmaxSampler(),
        )
        for kv in ("auto", "bfloat16")
    )
    try:
        assert exact.kv_cache_dtype == F32 and exact.path_report()["kv_cache"] == "float32"
        assert told.kv_cache_dtype == BF16
        tokens = [(5 * i) % 256 for i in range(24)]
        a, b = told.score(tokens), exact.score(tokens)
        assert float((a - b).norm() / b.norm()) < 0.02
    finally:
        exact.close()
        told.close()


def test_a_bad_kv_cache_dtype_is_refused_before_the_load(tiny_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be 'auto'.*got 'fp8'"):
        load_executor(str(tiny_gguf), device="cpu", kv_cache_dtype="fp8")  # type: ignore[arg-type]


def test_rounding_kernels_are_judged_beside_the_cache_they_bring(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference scores with a float32 cache, each judged kernel with the cache
    the plan would give it."""
    caches: list[torch.dtype] = []
    real = auto_weights.score_sequences

    def recording(weights, config, sequences, kv_cache_dtype=F32):  # type: ignore[no-untyped-def]
        caches.append(kv_cache_dtype)
        return real(weights, config, sequences, kv_cache_dtype)

    monkeypatch.setattr(auto_weights, "score_sequences", recording)
    executor = load_executor(str(tiny_gguf), device="cpu", weights="float32", kv_cache_memory=2**20)
    try:
        judge = auto_weights.AutoWeights(
            executor.model_weights,
            executor.config,
            lambda text: [b % 256 for b in text.encode()],
            None,
            kv_cache_dtype=BF16,
        )
        # "blas" runs anywhere; which kernel is judged does not matter here.
        judge.quality(["blas"])
    finally:
        executor.close()
    assert caches == [F32, BF16]
