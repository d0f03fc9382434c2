"""LoRA adapters through the engine, one rank in this process, on a tiny random model:
mixed batches, the prefix cache, adapters swapped through fewer slots than adapters,
pins, bad adapters refused with the engine serving on, removal, a base weight update
and a level-2 sleep. Each output is checked against the adapter's greedy output alone
on a bare executor (`greedy_alone`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
import torch
from lora_helpers import (
    HANG_GUARD,
    SHAPES,
    build_lora_core,
    greedy_alone,
    write_adapter,
    write_tiny_model,
)
from safetensors.torch import save_file

from wavecore.engine.api import open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import InvalidRequestError, LoRAError, UnknownLoRAError
from wavecore.engine.interface import Engine
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model.executor import ModelExecutor
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs

pytestmark = pytest.mark.anyio

TOKENS = 8
# Longer than two KV blocks of 16, so that their blocks enter the prefix cache.
PROMPTS = [
    "The same prompt, long enough to fill two blocks: 0123456789",
    "A second prompt of its own, also filling two blocks: abcdefgh",
    "Short one",
    # Repeats, so that n-gram speculative decoding finds drafts.
    "abc abc abc abc abc abc abc abc abc abc",
]
ADAPTERS = ("A", "B", "C")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    made = {"model": write_tiny_model(root / "model")}
    made["A"] = write_adapter(root / "A", seed=1)
    made["B"] = write_adapter(root / "B", seed=2, rank=8, targets=("q_proj", "v_proj"), rslora=True)
    made["C"] = write_adapter(root / "C", seed=3, targets=("o_proj", "down_proj", "up_proj"))
    return made


@pytest.fixture(scope="module")
def reference(files: dict[str, Path]) -> Iterator[dict[tuple[str, str | None], list[int]]]:
    """Each prompt's greedy tokens under each adapter and the base, alone."""
    executor = ModelExecutor(
        resolve_model_source(files["model"]),
        device="cpu",
        dtype="float32",
        weights="float32",
        kv_cache_memory=2**20,
        enable_lora=True,
        max_loras=1,
    )
    for name in ADAPTERS:
        executor.add_lora(LoRARequest(name, str(files[name])))
    table = {
        (prompt, lora): greedy_alone(executor, list(prompt.encode()), TOKENS, lora)
        for prompt in PROMPTS
        for lora in (None, *ADAPTERS)
    }
    executor.close()
    # Each adapter changes the output, or the comparisons below could not fail.
    for prompt in PROMPTS[:2]:
        outputs = [table[(prompt, lora)] for lora in (None, *ADAPTERS)]
        assert len({tuple(output) for output in outputs}) == len(outputs)
    yield table


def config_for(files: dict[str, Path], **settings: object) -> EngineConfig:
    return EngineConfig(
        model=str(files["model"]),
        enable_lora=True,
        max_loras=2,
        kv_cache_memory=2**20,
        max_model_len=256,
        **settings,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Both backends, each with its own module-scoped engines."""
    return request.param


@pytest.fixture(scope="module")
async def engine(files: dict[str, Path], anyio_backend: str) -> AsyncIterator[Engine]:
    config = config_for(files, lora_modules=(LoRARequest("A", str(files["A"])),))
    async with open_engine_core(functools.partial(build_lora_core, config), config=config) as e:
        yield e


async def tokens_of(engine: Engine, prompt: str, lora: str | LoRARequest | None) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for delta in engine.generate(prompt, params, lora=lora):
        tokens.extend(delta.token_ids)
    return tokens


async def run_all(
    engine: Engine, asks: list[tuple[str, str | None]]
) -> dict[tuple[str, str | None], list[int]]:
    """Every (prompt, adapter) at once, in one batch where they fit."""
    results: dict[tuple[str, str | None], list[int]] = {}

    async def one(ask: tuple[str, str | None]) -> None:
        results[ask] = await tokens_of(engine, *ask)

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for ask in asks:
                tg.start_soon(one, ask)
    return results


async def ensure_loaded(engine: Engine, files: dict[str, Path], *names: str) -> None:
    for name in names:
        await engine.add_lora(LoRARequest(name, str(files[name])))


async def test_a_mixed_batch_gives_each_request_its_own_output(engine, files, reference) -> None:
    await ensure_loaded(engine, files, "B")
    asks = [(prompt, lora) for prompt in PROMPTS for lora in (None, "A", "B")]
    results = await run_all(engine, asks)
    assert results == {ask: reference[ask] for ask in asks}
    assert [lora.name for lora in await engine.list_loras()] == ["A", "B"]


async def test_no_prefix_cache_block_is_shared_across_adapters(engine, files, reference) -> None:
    await ensure_loaded(engine, files, "B")
    prompt = PROMPTS[0]
    before = (await engine.stats()).ranks[0].core.prefix_cache_hits
    for lora in ("A", "B", None, "A"):
        assert await tokens_of(engine, prompt, lora) == reference[(prompt, lora)], lora
    # The last run under A found A's blocks: the cache works, and separates adapters.
    assert (await engine.stats()).ranks[0].core.prefix_cache_hits > before


async def test_a_lora_request_is_loaded_on_first_use(engine, files, reference) -> None:
    request = LoRARequest("C", str(files["C"]))
    assert await tokens_of(engine, PROMPTS[1], request) == reference[(PROMPTS[1], "C")]
    assert "C" in [lora.name for lora in await engine.list_loras()]
    with pytest.raises(LoRAError, match="already loaded from"):
        await engine.add_lora(LoRARequest("C", str(files["A"])))


async def test_unknown_adapters_are_refused_at_once(engine) -> None:
    with pytest.raises(UnknownLoRAError, match="no LoRA adapter 'nope'"):
        await tokens_of(engine, "hello", "nope")
    with pytest.raises(InvalidRequestError, match="lora must be a str"):
        await tokens_of(engine, "hello", 3)  # type: ignore[arg-type]
    with pytest.raises(UnknownLoRAError):
        await engine.remove_lora("nope")
    with pytest.raises(UnknownLoRAError):
        await engine.pin_lora("nope")


def bad_adapters(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """Each broken adapter, with the words its refusal must hold."""
    cases: dict[str, tuple[Path, str]] = {
        "unknown target": (
            write_adapter(root / "target", seed=4, targets=("q_proj",)),
            "not projections this model has",
        ),
        "rank too large": (write_adapter(root / "rank", seed=4, rank=80), "above max_lora_rank"),
        "wrong shape": (
            write_adapter(
                root / "shape",
                seed=4,
                targets=("q_proj",),
                shapes={"q_proj": (32, SHAPES["q_proj"][1])},
            ),
            "the base model needs",
        ),
        "missing directory": (root / "absent", "no such directory"),
    }
    config = root / "target" / "adapter_config.json"
    config.write_text(config.read_text().replace('"q_proj"', '"lm_head"'))
    no_weights = write_adapter(root / "bin", seed=4)
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    cases[".bin only"] = (no_weights, "is a pickle, which is refused")
    truncated = write_adapter(root / "truncated", seed=4)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, "truncated or corrupt")
    no_config = write_adapter(root / "noconfig", seed=4)
    (no_config / "adapter_config.json").unlink()
    cases["no config"] = (no_config, "no adapter_config.json")
    extra = write_adapter(root / "extra", seed=4)
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
        str(extra / "adapter_model.safetensors"),
    )
    cases["lm_head tensor"] = (extra, "is not a LoRA matrix")
    return cases


async def test_every_bad_adapter_is_refused_and_the_engine_serves_on(
    engine, files, reference, tmp_path: Path
) -> None:
    for case, (path, words) in bad_adapters(tmp_path, files["A"]).items():
        with anyio.fail_after(HANG_GUARD), pytest.raises(LoRAError, match=words) as raised:
            await engine.add_lora(LoRARequest(f"bad-{case}", str(path)))
        assert "rank 0" in str(raised.value), case
        assert f"bad-{case}" not in [lora.name for lora in await engine.list_loras()]
    assert await tokens_of(engine, PROMPTS[0], "A") == reference[(PROMPTS[0], "A")]


async def test_remove_is_refused_in_flight_then_drops_the_adapter(engine, files) -> None:
    await ensure_loaded(engine, files, "C")
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with anyio.fail_after(HANG_GUARD):
        stream = engine.generate("keep going", params, lora="C")
        await anext(stream)
        with pytest.raises(LoRAError, match=r"in\s+flight"):
            await engine.remove_lora("C")
        await stream.aclose()  # aborts it
        await engine.remove_lora("C")
    with pytest.raises(UnknownLoRAError):
        await tokens_of(engine, "hello", "C")


async def test_adapters_survive_a_base_update_and_a_level_2_sleep(
    engine, files, reference, tmp_path: Path
) -> None:
    await ensure_loaded(engine, files, "B")
    prompt = PROMPTS[1]
    with anyio.fail_after(HANG_GUARD):
        await engine.sleep(2)
        await engine.wake_up()
        assert await tokens_of(engine, prompt, "B") == reference[(prompt, "B")]
        # A new base (another seed): the adapter applies to it.
        other = write_tiny_model(tmp_path / "other", seed=9)
        await engine.pause("keep")
        await engine.update_weights(str(other / "model.safetensors"))
        await engine.resume()
        updated = await tokens_of(engine, prompt, "B")
        await engine.pause("keep")
        await engine.update_weights(str(files["model"] / "model.safetensors"))
        await engine.resume()
    executor = ModelExecutor(
        resolve_model_source(other),
        device="cpu",
        dtype="float32",
        weights="float32",
        kv_cache_memory=2**20,
        enable_lora=True,
    )
    executor.add_lora(LoRARequest("B", str(files["B"])))
    assert updated == greedy_alone(executor, list(prompt.encode()), TOKENS, "B")
    assert updated != reference[(prompt, "B")]


@pytest.fixture(scope="module")
async def one_slot(files: dict[str, Path], anyio_backend: str) -> AsyncIterator[Engine]:
    config = dataclasses.replace(config_for(files), max_loras=1, max_num_seqs=8)
    async with open_engine_core(functools.partial(build_lora_core, config), config=config) as e:
        await ensure_loaded(e, files, *ADAPTERS)
        yield e


async def test_one_slot_serves_three_adapters_round_robin(one_slot, reference) -> None:
    asks = [(PROMPTS[i % 2], ADAPTERS[i % 3]) for i in range(9)]
    results = await run_all(one_slot, asks)
    assert results == {ask: reference[ask] for ask in asks}
    (slots,) = await one_slot.collective_rpc("resident_loras")
    assert slots["swaps"] >= 3  # every adapter was swapped into the one slot


async def test_a_pinned_adapter_stays_resident(files, reference) -> None:
    config = config_for(files)  # two slots
    async with open_engine_core(functools.partial(build_lora_core, config), config=config) as e:
        await ensure_loaded(e, files, *ADAPTERS)
        await e.pin_lora("A")
        for lora in ("B", "C", "B", "C"):
            assert await tokens_of(e, PROMPTS[0], lora) == reference[(PROMPTS[0], lora)]
            (slots,) = await e.collective_rpc("resident_loras")
            assert slots["pinned"] == ["A"] and set(slots["resident"]) == {"A", lora}
        assert await tokens_of(e, PROMPTS[0], "A") == reference[(PROMPTS[0], "A")]
        await e.pin_lora("B")
        with pytest.raises(LoRAError, match="slots hold pinned adapters"):
            await tokens_of(e, PROMPTS[0], "C")


async def test_structured_output_and_speculative_decoding_under_adapters(
    engine, files, reference
) -> None:
    choices = ("lighthouse", "harbour", "tide")
    params = SamplingParams(
        max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(choice=choices)
    )
    with anyio.fail_after(HANG_GUARD):
        for lora in ("A", "B"):
            await ensure_loaded(engine, files, lora)
            text = "".join([d.text async for d in engine.generate("Pick: ", params, lora=lora)])
            assert text in choices
    config = config_for(files, speculative_method="ngram", num_speculative_tokens=4)
    async with open_engine_core(functools.partial(build_lora_core, config), config=config) as e:
        await ensure_loaded(e, files, *ADAPTERS)
        asks = [(PROMPTS[3], lora) for lora in (None, "A", "B")]
        assert await run_all(e, asks) == {ask: reference[ask] for ask in asks}
        assert (await e.stats()).ranks[0].core.spec_decode_num_drafts > 0
