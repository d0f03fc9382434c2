"""LoRA adapters through the server (in this process, httpx's ASGI transport) with the
official `openai` client: `/v1/models` lists them with their base as parent, a
request's `model` picks one, the admin API loads and unloads them, `/metrics` counts
running requests per adapter."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from lora_helpers import HANG_GUARD, build_lora_core, write_adapter, write_tiny_model

from wavecore.engine.api import open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.interface import Engine
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.serve.app import build_app
from wavecore.engine.serve.options import ServeOptions
from wavecore.engine.serve.state import ServerState

pytestmark = pytest.mark.anyio
PROMPT = "Tell me something: "


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # openai's AsyncStream is asyncio's (tests/serve/conftest.py)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serve")
    return {
        "model": write_tiny_model(root / "model"),
        "A": write_adapter(root / "A", seed=1),
        "B": write_adapter(root / "B", seed=2),
    }


@pytest.fixture(scope="module")
async def served(
    files: dict[str, Path], anyio_backend: str
) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, openai.AsyncOpenAI]]:
    config = EngineConfig(
        model=str(files["model"]),
        enable_lora=True,
        kv_cache_memory=2**20,
        max_model_len=256,
        lora_modules=(LoRARequest("A", str(files["A"])),),
    )
    state = ServerState(ServeOptions(model_name="tiny", enable_admin_api=True))
    async with open_engine_core(functools.partial(build_lora_core, config), config=config) as e:
        state.set_ready(e, max_num_seqs=config.max_num_seqs)
        transport = httpx.ASGITransport(app=build_app(state))
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://serve") as http,
            openai.AsyncOpenAI(
                base_url="http://serve/v1", api_key="unused", http_client=http, max_retries=0
            ) as client,
        ):
            yield e, http, client


async def engine_text(engine: Engine, lora: str | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return "".join([d.text async for d in engine.generate(PROMPT, params, lora=lora)])


async def complete(client: openai.AsyncOpenAI, model: str) -> str:
    answer = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return answer.choices[0].text


async def test_models_list_the_adapters_and_model_picks_one(served, files) -> None:
    engine, _, client = served
    with anyio.fail_after(HANG_GUARD):
        models = {model.id: model for model in (await client.models.list()).data}
        assert set(models) == {"tiny", "A"}
        assert models["A"].model_extra == {"root": str(files["A"]), "parent": "tiny"}
        assert await complete(client, "A") == await engine_text(engine, "A")
        assert await complete(client, "tiny") == await engine_text(engine, None)
        assert await engine_text(engine, "A") != await engine_text(engine, None)
        with pytest.raises(openai.BadRequestError, match="the model 'B' does not exist") as bad:
            await complete(client, "B")
        assert bad.value.code == "model_not_found"


async def test_the_admin_api_loads_and_unloads_adapters(served, files) -> None:
    engine, http, client = served
    with anyio.fail_after(HANG_GUARD):
        loaded = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": str(files["B"])}
        )
        assert loaded.status_code == 200, loaded.text
        assert await complete(client, "B") == await engine_text(engine, "B")
        bad = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": str(files["model"])}
        )
        assert bad.status_code == 400 and "no adapter_config.json" in bad.text
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "B"})
        assert unloaded.status_code == 200, unloaded.text
        assert (
            await http.post("/v1/unload_lora_adapter", json={"lora_name": "B"})
        ).status_code == 404
        missing = await http.post("/v1/load_lora_adapter", json={"lora_name": "C"})
        assert missing.status_code == 400 and "lora_path" in missing.text
    assert {model.id for model in (await client.models.list()).data} == {"tiny", "A"}


async def test_metrics_count_running_requests_per_adapter(served) -> None:
    engine, http, _ = served
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with anyio.fail_after(HANG_GUARD):
        streams = [engine.generate(PROMPT, params, lora="A") for _ in range(2)]
        for stream in streams:
            await anext(stream)
        text = (await http.get("/metrics")).text
        for stream in streams:
            await stream.aclose()
    assert 'wavecore:lora_requests_running{engine="0",lora_name="A",model_name="tiny"} 2.0' in text
