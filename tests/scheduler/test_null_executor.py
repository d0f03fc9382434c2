"""NullExecutor: deterministic tokens, the shadow KV check, sleep and close bookkeeping."""

from __future__ import annotations

import pytest

from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.executors.errors import ExecutorAsleepError, ExecutorClosedError
from wavecore.engine.executors.null_executor import (
    KVCacheMismatchError,
    NullExecutor,
    null_next_token,
)
from wavecore.engine.sampling_params import SamplingParams


def _executor(**overrides: object) -> NullExecutor:
    settings: dict[str, object] = dict(
        num_kv_blocks=8, block_size=4, max_model_len=64, vocab_size=100, eos_token_id=0
    )
    settings.update(overrides)
    return NullExecutor(**settings)  # type: ignore[arg-type]


def _chunk(
    tokens: list[int], start: int, end: int, table: list[int], request_id: str = "r"
) -> SequenceChunk:
    return SequenceChunk(
        request_id=request_id,
        token_ids=tokens[start:end],
        start_pos=start,
        block_table=table,
        sample=end == len(tokens),
        sampling=SamplingParams(),
        all_token_ids=tokens,
        prompt_len=len(tokens),
    )


def test_the_executor_reports_its_geometry() -> None:
    executor = _executor()
    assert (executor.block_size, executor.num_kv_blocks, executor.max_model_len) == (4, 8, 64)


def test_tokens_depend_on_the_last_token_and_position_only() -> None:
    executor = _executor()
    tokens = [5, 6, 7, 8, 9]
    whole = executor.execute(ModelBatch(chunks=(_chunk(tokens, 0, 5, [0, 1]),)))
    split = executor.execute(ModelBatch(chunks=(_chunk(tokens, 4, 5, [0, 1]),)))
    assert whole.sampled[0].token_id == split.sampled[0].token_id == null_next_token(9, 5, 100)
    assert whole.sampled[0].request_id == "r"
    assert executor.num_steps == 2 and executor.num_tokens == 6


def test_eos_is_skipped_unless_configured() -> None:
    # Find a (last token, position) whose plain next token is the EOS id 0.
    last = next(t for t in range(100) if null_next_token(t, 1, 100) == 0)
    executor = _executor()
    chunk = _chunk([last], 0, 1, [0])
    assert executor.execute(ModelBatch(chunks=(chunk,))).sampled[0].token_id == 1
    eager = _executor(eos_at_output=0)
    assert eager.execute(ModelBatch(chunks=(_chunk([3], 0, 1, [0]),))).sampled[0].token_id == 0


def test_a_table_that_does_not_cover_the_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="does not cover position 4"):
        _executor().execute(ModelBatch(chunks=(_chunk([1, 2, 3, 4, 5], 0, 5, [0]),)))


def test_track_kv_catches_a_block_that_lost_its_contents() -> None:
    executor = _executor(track_kv=True)
    first = [1, 2, 3, 4, 5]
    executor.execute(ModelBatch(chunks=(_chunk(first, 0, 5, [0, 1]),)))
    # Another request overwrites block 0, then the first one decodes on it.
    executor.execute(ModelBatch(chunks=(_chunk([9, 9, 9, 9, 9], 0, 5, [0, 2], "other"),)))
    with pytest.raises(KVCacheMismatchError, match="position 0"):
        executor.execute(ModelBatch(chunks=(_chunk([*first, 6], 5, 6, [0, 1]),)))


def test_track_kv_accepts_a_shared_prefix_block() -> None:
    executor = _executor(track_kv=True)
    executor.execute(ModelBatch(chunks=(_chunk([1, 2, 3, 4, 5], 0, 5, [0, 1]),)))
    out = executor.execute(ModelBatch(chunks=(_chunk([1, 2, 3, 4, 7], 4, 5, [0, 3], "b"),)))
    assert out.sampled[0].token_id == null_next_token(7, 5, 100)


def test_sleep_wake_and_close() -> None:
    executor = _executor()
    executor.execute_dummy()
    executor.sleep(1)
    with pytest.raises(ExecutorAsleepError, match="weights, kv_cache"):
        executor.execute(ModelBatch(chunks=()))
    executor.wake_up(frozenset({"weights"}))
    with pytest.raises(ExecutorAsleepError, match="kv_cache"):
        executor.execute_dummy()
    executor.wake_up(frozenset({"kv_cache"}))
    executor.execute_dummy()
    assert executor.num_dummy_steps == 2
    with pytest.raises(ValueError, match="sleep level"):
        executor.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        executor.wake_up(frozenset({"scheduling"}))
    executor.reset_kv_cache()
    executor.close()
    executor.close()
    with pytest.raises(ExecutorClosedError):
        executor.execute_dummy()
    with pytest.raises(ExecutorClosedError):
        executor.wake_up(frozenset())


@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 1), ("num_kv_blocks", 0), ("eos_token_id", 100), ("block_size", True)],
)
def test_bad_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _executor(**{field: value})


def test_eos_at_output_needs_an_eos_id() -> None:
    with pytest.raises(ValueError, match="eos_at_output needs"):
        _executor(eos_token_id=None, eos_at_output=1)
