"""Shared helpers of the DP tests: expected null-executor output, collection, cores
that fail on purpose (module-level so that spawned rank processes can unpickle them)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import anyio

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.client import DPClient
from wavecore.engine.dp.launcher import DPWiring
from wavecore.engine.executors.batch import ModelBatch, ModelOutput
from wavecore.engine.executors.null_executor import null_continuation
from wavecore.engine.frontend.engine import FrontEnd
from wavecore.engine.interface import Engine
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

HANG_GUARD = 60
VOCAB = ByteTokenizer().vocab_size


def null_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "executor": "null",
        "dp_size": 2,
        "max_num_seqs": 8,
        "sync_interval": 4,
        "startup_timeout": 60.0,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def wiring_of(engine: Engine) -> DPWiring:
    """The processes and channels behind a DP engine, for tests that kill or inspect them."""
    assert isinstance(engine, FrontEnd)
    client = engine.core_client
    assert isinstance(client, DPClient)
    return client.wiring


def expected_tokens(prompt: str, count: int) -> list[int]:
    """What the null executor produces for a byte-tokenized prompt."""
    return null_continuation(
        list(prompt.encode()), count, vocab_size=VOCAB, eos_token_id=ByteTokenizer().eos_token_id
    )


async def collect(engine: Any, prompt: str, params: Any, **kwargs: Any) -> list[Any]:
    return [delta async for delta in engine.generate(prompt, params, **kwargs)]


def tokens_of(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


class _ExplodingExecutor:
    """Delegates to the null executor, but fails any batch holding an "explode" request."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, batch: ModelBatch) -> ModelOutput:
        if any(chunk.request_id.startswith("explode") for chunk in batch.chunks):
            raise RuntimeError("injected failure in the model step")
        return self._inner.execute(batch)


def build_exploding_core(config: EngineConfig) -> EngineCore:
    core = EngineCore.from_config(config)
    core.executor = _ExplodingExecutor(core.executor)  # type: ignore[assignment]
    return core


def build_hanging_core(config: EngineConfig) -> EngineCore:
    """A model load that never finishes (the startup timeout must name this rank)."""
    threading.Event().wait()
    raise AssertionError("unreachable")


def build_failing_core(config: EngineConfig) -> EngineCore:
    raise FileNotFoundError("no such model: /nowhere.gguf")


async def stop_for(engine: Engine, rank: int, seconds: float) -> None:
    """Stop the process of `rank` (SIGSTOP), keep it stopped `seconds`, continue it."""
    pid = wiring_of(engine).processes[f"rank {rank}"].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    await anyio.to_thread.run_sync(os.waitpid, pid, os.WUNTRACED)  # stopped now
    await anyio.sleep(seconds)  # how long it stays stopped: the scenario, not a guard
    os.kill(pid, signal.SIGCONT)
