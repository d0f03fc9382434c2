"""The trusted builders make objects equal to what the dataclass constructors make."""

from __future__ import annotations

import dataclasses

import pytest

from wavecore.engine.executors.batch import SampledToken, SequenceChunk
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import RequestUpdate
from wavecore.engine.scheduler.fast_build import (
    _slot_setters,
    build_chunk,
    build_sampled,
    build_update,
)
from wavecore.statemachines.request import FinishReason


def test_builders_match_the_constructors() -> None:
    sampling = SamplingParams(max_tokens=3)
    tokens = [1, 2, 3]
    table = [4]
    assert build_chunk("r", (3,), 2, table, True, sampling, tokens, 2) == SequenceChunk(
        request_id="r",
        token_ids=(3,),
        start_pos=2,
        block_table=table,
        sample=True,
        sampling=sampling,
        all_token_ids=tokens,
        prompt_len=2,
    )
    sampled = build_sampled("r", 9)
    assert sampled == SampledToken(request_id="r", token_id=9)
    assert build_update("r", (9,), (sampled,), FinishReason.STOP) == RequestUpdate(
        request_id="r", new_token_ids=(9,), sampled=(sampled,), finish_reason=FinishReason.STOP
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampled.token_id = 1  # type: ignore[misc]


def test_a_builder_that_misses_a_field_fails_at_import() -> None:
    with pytest.raises(TypeError, match="declares"):
        _slot_setters(SampledToken, ("request_id", "token_id"))
