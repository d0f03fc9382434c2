"""Shared helpers of the DP tests: expected null-executor output, collection, cores
that fail on purpose (module-level so that spawned rank processes can unpickle them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from wavecore.channels import ChannelKey
from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.client import DPClient
from wavecore.engine.dp.collective import DPGroup
from wavecore.engine.dp.launcher import DPStartupError, DPWiring
from wavecore.engine.executors.batch import ModelBatch
from wavecore.engine.executors.null_executor import null_continuation
from wavecore.engine.frontend.engine import FrontEnd
from wavecore.engine.interface import Engine
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams

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


def client_of(engine: Engine) -> DPClient:
    """The core client of a DP engine (its losses, shrinks and restarts)."""
    assert isinstance(engine, FrontEnd)
    client = engine.core_client
    assert isinstance(client, DPClient)
    return client


def wiring_of(engine: Engine) -> DPWiring:
    """The processes and channels behind a DP engine, for tests that kill or inspect them."""
    return client_of(engine).wiring


def expected_tokens(prompt: str, count: int) -> list[int]:
    """What the null executor produces for a byte-tokenized prompt."""
    return null_continuation(
        list(prompt.encode()), count, vocab_size=VOCAB, eos_token_id=ByteTokenizer().eos_token_id
    )


async def collect(engine: Any, prompt: str, params: Any, **kwargs: Any) -> list[Any]:
    return [delta async for delta in engine.generate(prompt, params, **kwargs)]


def tokens_of(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


# "explode-at-3" fails the forward of the step where that request has 3 output tokens,
# "explode-sampling-at-3" that step's sampling; any other "explode" request fails the
# forward of its first step.
_EXPLODE_AT = re.compile(r"explode(-sampling)?-at-(\d+)$")


class _ExplodingExecutor:
    """Delegates to the null executor, but fails the steps "explode" requests choose."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute_model(self, batch: ModelBatch) -> object:
        if _explodes(batch, "forward"):
            raise RuntimeError("injected failure in the model step")
        return self._inner.execute_model(batch)

    def sample_tokens(self, forward: Any, bitmask: Any) -> Any:
        if _explodes(forward, "sampling"):  # the null executor's forward is its batch
            raise RuntimeError("injected failure in the sampling")
        return self._inner.sample_tokens(forward, bitmask)


def _explodes(batch: ModelBatch, phase: str) -> bool:
    for chunk in batch.chunks:
        if not chunk.request_id.startswith("explode"):
            continue
        chosen = _EXPLODE_AT.match(chunk.request_id)
        if chosen is None:
            return phase == "forward"
        sampling, tokens = chosen.groups()
        if (phase == "sampling") == bool(sampling) and chunk.num_output_tokens == int(tokens):
            return True
    return False


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


async def start_headless_rank(
    address: str, rank: int, dp_size: int, *flags: str, stderr: int | None = None
) -> Process:
    """`wavecore rank` in a process of its own, joining the front end listening at
    `address` as `rank` of `dp_size`, with these command-line flags. Its stderr is this
    process's unless a test reads it (`stderr=subprocess.PIPE`: an unread pipe that
    fills would block the rank)."""
    argv = ["rank", "--dp-rank", str(rank), "--dp-size", str(dp_size), "--master"]
    argv += [address.removeprefix("tcp://"), *flags]
    code = f"import sys; from wavecore.engine.cli.main import main; sys.exit(main({argv!r}))"
    return await anyio.open_process([sys.executable, "-c", code], stdout=None, stderr=stderr)


LOAD_TOKENS = 400  # long enough for a request to be in flight when its rank is lost


async def load_then(
    engine: Engine, ranks: range, fault: Callable[[], object]
) -> dict[str, list[Any]]:
    """Two requests pinned to each rank (LOAD_TOKENS each); once every rank streams,
    `fault()` runs. Returns each request's deltas, by prompt."""
    deltas: dict[str, list[Any]] = {}
    streaming = {rank: anyio.Event() for rank in ranks}

    async def run(rank: int, prompt: str) -> None:
        deltas[prompt] = []
        params = SamplingParams(max_tokens=LOAD_TOKENS)
        async for delta in engine.generate(prompt, params, dp_rank=rank):
            deltas[prompt].append(delta)
            streaming[rank].set()

    async with anyio.create_task_group() as tg:
        for rank in ranks:
            for index in range(2):
                tg.start_soon(run, rank, f"rank {rank} request {index}")
        for event in streaming.values():
            await event.wait()
        fault()
    return deltas


def check_rank_1_lost(deltas: dict[str, list[Any]], error: str) -> None:
    """Rank 1 was lost under `load_then`: a request of its that had streamed ends with
    `error`, one that had not was sent again whole; every other request finishes
    exactly."""
    errors = 0
    for prompt, stream in deltas.items():
        last = stream[-1]
        if prompt.startswith("rank 1") and last.finish_reason == "error":
            assert error in last.error
            errors += 1
        else:
            assert last.finish_reason == "length" and last.error is None
            assert tokens_of(stream) == expected_tokens(prompt, LOAD_TOKENS)
    assert errors >= 1  # rank 1 streamed before it was lost


class SteadyLoad:
    """Submits requests one after another from a few workers; checks each output."""

    def __init__(self, engine: Engine, workers: int = 4) -> None:
        self.engine = engine
        self.workers = workers
        self.stop = anyio.Event()
        self.finished: dict[str, list] = {}
        self.started = 0
        self._finished_one = anyio.Event()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for worker in range(self.workers):
                tg.start_soon(self._worker, worker)

    async def _worker(self, worker: int) -> None:
        number = 0
        while not self.stop.is_set():
            request_id = f"w{worker}-{number}"
            prompt = f"steady {worker} {number}"
            number += 1
            self.started += 1
            stream = self.engine.generate(
                prompt, SamplingParams(max_tokens=12), request_id=request_id
            )
            deltas = []
            async for delta in stream:
                deltas.append(delta)
            assert request_id not in self.finished
            self.finished[request_id] = deltas
            assert tokens_of(deltas) == expected_tokens(prompt, 12), request_id
            assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
            assert deltas[-1].finish_reason == "length"
            self._finished_one.set()
            self._finished_one = anyio.Event()

    async def wait_for(self, count: int) -> None:
        target = len(self.finished) + count
        while len(self.finished) < target:
            await self._finished_one.wait()


class FakeRankProcess:
    """A rank process as the DP client sees it, for unit tests of the client: alive
    until the test sets its `exitcode`."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a running process, so never seen as stopped
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


def in_two_ranks(
    calls: list[Callable[[DPGroup], Any]],
    *,
    port: int,
    prefix: str,
    timeout_s: float = 20,
    key: ChannelKey | None = None,
) -> list[Any]:
    """Join a two-rank group over the store at `port` in a thread per rank and run
    `calls[r](group)` there: each rank's result, or the exception it raised."""
    key = key if key is not None else ChannelKey.generate()
    results: list[Any] = [None, None]

    def rank_thread(rank: int) -> None:
        try:
            group = DPGroup.join(
                host="127.0.0.1",
                port=port,
                prefix=prefix,
                rank=rank,
                size=2,
                timeout_s=timeout_s,
                key=key,
            )
            results[rank] = calls[rank](group)
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


async def headless_rank_is_refused(
    config: EngineConfig, rank_argv: list[str], env: dict[str, str] | None = None
) -> str:
    """Start a one-local-rank front end expecting rank 1 headless, run `wavecore rank`
    with `rank_argv` (the master's address added) in a subprocess as it listens, and
    return the startup error, which must say rank 1 never said hello."""
    joined: list[subprocess.Popen[bytes]] = []

    def start(address: str) -> None:
        argv = [*rank_argv, "--master", address.removeprefix("tcp://")]
        code = f"import sys; from wavecore.engine.cli.main import main; sys.exit(main({argv!r}))"
        joined.append(subprocess.Popen([sys.executable, "-c", code], env=env))

    try:
        with anyio.fail_after(HANG_GUARD), pytest.raises(DPStartupError) as failed:
            async with open_dp_engine(
                config, master="127.0.0.1:0", local_ranks=[0], on_listening=start
            ):
                pass
    finally:
        for process in joined:
            process.kill()
            process.wait()
    assert "(rank 1 never said hello)" in str(failed.value)
    return str(failed.value)
