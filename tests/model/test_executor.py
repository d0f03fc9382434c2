"""`ModelExecutor` on a tiny model: invariance, validation, dummy passes, sleep and wake."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_test_helpers import ArgmaxSampler, GreedyRunner, greedy_alone

from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.executors.errors import ExecutorAsleepError, ExecutorClosedError
from wavecore.engine.model import (
    InvalidBatchError,
    ModelExecutor,
    load_executor,
)
from wavecore.engine.sampling_params import SamplingParams

NEW_TOKENS = 12


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture
def roomy_executor(tiny_gguf: Path):
    executor = load_executor(
        str(tiny_gguf), device="cpu", kv_cache_memory=2**22, sampler=ArgmaxSampler()
    )
    yield executor
    executor.close()


def test_greedy_output_is_batch_invariant(roomy_executor: ModelExecutor) -> None:
    batch_prompts = prompts(32)
    alone = [greedy_alone(roomy_executor, p, NEW_TOKENS) for p in batch_prompts[:4]]

    runner = GreedyRunner(roomy_executor, seed=1)
    together = [runner.add(p, NEW_TOKENS) for p in batch_prompts]
    runner.run(together)
    assert [r.output for r in together[:4]] == alone

    for chunk_size in (1, 3, 16):
        runner = GreedyRunner(roomy_executor, seed=chunk_size)
        chunked = [runner.add(p, NEW_TOKENS) for p in batch_prompts[:4]]
        runner.run(chunked, chunk_size=chunk_size)
        assert [r.output for r in chunked] == alone, chunk_size


def test_prefix_served_from_shared_blocks(roomy_executor: ModelExecutor) -> None:
    prompt = prompts(1, seed=7)[0] + prompts(1, seed=8)[0] + [9] * 20
    expected = greedy_alone(roomy_executor, prompt, NEW_TOKENS)
    runner = GreedyRunner(roomy_executor, seed=3)
    first = runner.add(prompt, NEW_TOKENS)
    runner.run([first])
    full_blocks = len(prompt) // roomy_executor.block_size
    assert full_blocks >= 2
    second = runner.add(prompt, NEW_TOKENS, share_prefix_of=first, shared_blocks=full_blocks)
    assert second.computed == full_blocks * roomy_executor.block_size
    runner.run([second])
    assert first.output == expected
    assert second.output == expected


def chunk(**overrides) -> SequenceChunk:
    fields = {
        "request_id": "r",
        "token_ids": [1, 2, 3],
        "start_pos": 0,
        "block_table": [0],
        "sample": True,
        "sampling": SamplingParams(temperature=0.0),
        "all_token_ids": [1, 2, 3],
        "prompt_len": 3,
    }
    return SequenceChunk(**(fields | overrides))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (chunk(token_ids=[]), "has no tokens"),
        (chunk(block_table=[]), "needs 1 blocks"),
        (chunk(block_table=[8]), r"names a block outside \[0, 8\)"),
        (chunk(block_table=[-1]), "names a block outside"),
        (chunk(token_ids=[1, 256]), r"token id outside \[0, 256\)"),
        (chunk(start_pos=126, block_table=list(range(8))), "past max_model_len 128"),
        (chunk(start_pos=-1), "invalid start_pos"),
    ],
)
def test_bad_batches_are_refused_before_any_write(
    tiny_executor: ModelExecutor, bad: SequenceChunk, message: str
) -> None:
    good = chunk(request_id="ok", block_table=[1])
    cache = tiny_executor._cache
    before = [pool.clone() for pool in (*cache.keys, *cache.values)]
    with pytest.raises(InvalidBatchError, match=message):
        tiny_executor.execute(ModelBatch(chunks=(good, bad)))
    after = [*cache.keys, *cache.values]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_duplicate_request_in_one_batch_is_refused(tiny_executor: ModelExecutor) -> None:
    with pytest.raises(InvalidBatchError, match="two chunks"):
        tiny_executor.execute(ModelBatch(chunks=(chunk(), chunk(block_table=[1]))))


def test_kv_blocks_follow_the_byte_budget(tiny_executor: ModelExecutor) -> None:
    # 2 layers x (K and V) x 16 slots x 2 KV heads x 16 dims x 4 bytes = 8 KiB per block.
    assert tiny_executor.num_kv_blocks == (64 * 2**10) // 8192
    assert tiny_executor.block_size == 16
    # The context (512) exceeds what 8 blocks hold, so the cache bounds the length.
    assert tiny_executor.max_model_len == 8 * 16


def test_kv_budget_as_fraction_and_too_small(tiny_gguf: Path) -> None:
    executor = load_executor(
        str(tiny_gguf), device="cpu", kv_cache_memory=1e-6, sampler=ArgmaxSampler()
    )
    assert executor.num_kv_blocks >= 1
    executor.close()
    with pytest.raises(ValueError, match="less than one KV block"):
        load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=1000, sampler=ArgmaxSampler())
    with pytest.raises(ValueError, match="fraction"):
        load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=1.5, sampler=ArgmaxSampler())


def test_dummy_pass_touches_only_the_scratch_block(tiny_executor: ModelExecutor) -> None:
    cache = tiny_executor._cache
    before = [pool[: cache.scratch_block].clone() for pool in cache.keys]
    tiny_executor.execute_dummy()
    assert all(
        torch.equal(b, pool[: cache.scratch_block])
        for b, pool in zip(before, cache.keys, strict=True)
    )
    assert any(pool[cache.scratch_block].abs().sum() > 0 for pool in cache.keys)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_restore_the_same_model(tiny_executor: ModelExecutor, level: int) -> None:
    batch = ModelBatch(chunks=(chunk(),))
    before = tiny_executor.compute_logits(batch)
    tiny_executor.sleep(level)
    with pytest.raises(ExecutorAsleepError, match="weights, kv_cache"):
        tiny_executor.execute(batch)
    tiny_executor.wake_up(frozenset({"kv_cache"}))
    with pytest.raises(ExecutorAsleepError, match="weights"):
        tiny_executor.execute_dummy()
    tiny_executor.wake_up(frozenset({"weights"}))
    assert torch.equal(tiny_executor.compute_logits(batch), before)


def test_bad_sleep_and_wake_arguments(tiny_executor: ModelExecutor) -> None:
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        tiny_executor.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        tiny_executor.wake_up(frozenset({"optimizer"}))
    tiny_executor.close()
    with pytest.raises(ExecutorClosedError):
        tiny_executor.execute(ModelBatch(chunks=(chunk(),)))


def test_reset_kv_cache_clears_every_block(tiny_executor: ModelExecutor) -> None:
    tiny_executor.execute(ModelBatch(chunks=(chunk(),)))
    cache = tiny_executor._cache
    assert any(pool.abs().sum() > 0 for pool in cache.keys)
    tiny_executor.reset_kv_cache()
    assert all(pool.abs().sum() == 0 for pool in (*cache.keys, *cache.values))


def test_real_sampler_is_called_for_sampling_rows_only(tiny_gguf: Path) -> None:
    executor = load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=2**20)
    silent = chunk(request_id="silent", block_table=[2], sample=False)
    batch = ModelBatch(
        chunks=(chunk(), silent, chunk(request_id="b", token_ids=[4], block_table=[1]))
    )
    logits = executor.compute_logits(batch)
    output = executor.execute(batch)
    assert [s.request_id for s in output.sampled] == ["r", "b"]
    assert [s.token_id for s in output.sampled] == logits.argmax(dim=1).tolist()
    assert executor.execute(ModelBatch(chunks=(silent,))).sampled == ()
    executor.close()
