"""A stuck rank is named, not waited on forever (issue 15): a collective that a peer
never joins fails after `collective_timeout`, and the engine's error names the stopped
rank; a rank stopped for less than that and continued catches up unharmed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch.distributed as dist
from dp_helpers import (
    HANG_GUARD,
    collect,
    expected_tokens,
    null_config,
    stop_for,
    tokens_of,
    wiring_of,
)

from wavecore.channels import ChannelKey
from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.collective import CollectiveTimeoutError, DPGroup
from wavecore.engine.dp.process_state import is_stopped
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

SLOW_LOAD_MARKER_ENV = "WAVECORE_TEST_SLOW_LOAD_MARKER"


def build_core_one_rank_slow(config: EngineConfig) -> EngineCore:
    """The second rank to load takes 3 s longer (the first creates the marker file named
    by SLOW_LOAD_MARKER_ENV): a slow model load, at a known rank count."""
    try:
        os.close(os.open(os.environ[SLOW_LOAD_MARKER_ENV], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(3.0)  # the slow load itself
    return EngineCore.from_config(config)


def test_collective_timeout_is_validated() -> None:
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="collective_timeout must be positive"):
            EngineConfig(collective_timeout=bad)  # type: ignore[arg-type]


def test_a_vote_a_peer_never_joins_fails_naming_the_rank_and_its_peers() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    key = ChannelKey.generate()
    results: list[Any] = [None, None]
    rank_one_done = threading.Event()

    def rank_thread(rank: int) -> None:
        group = DPGroup.join(
            host="127.0.0.1",
            port=store.port,
            prefix="stuck",
            rank=rank,
            size=2,
            timeout_s=1.0,
            rendezvous_timeout_s=20.0,
            key=key,
        )
        if rank == 1:
            rank_one_done.wait(30)  # joins the group, never the vote
            return
        group.start_vote(has_unfinished=True, pending_pause=False, wave=0, step_counter=1)
        try:
            results[0] = group.await_vote()
        except Exception as error:
            results[0] = error
        rank_one_done.set()

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD)
    assert isinstance(results[0], CollectiveTimeoutError)
    assert "rank 0 waited 1 s (collective_timeout) in a vote for its peers (ranks 1)" in str(
        results[0]
    )


def test_a_stopped_process_is_told_from_a_running_one() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert not is_stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        os.waitpid(child.pid, os.WUNTRACED)  # returns once it is stopped
        assert is_stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        os.waitpid(child.pid, os.WCONTINUED)
        assert not is_stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not is_stopped(child.pid)  # gone: nothing to tell


async def test_a_rank_stopped_past_the_collective_timeout_is_named() -> None:
    with anyio.fail_after(HANG_GUARD):
        # The heartbeat would notice the stop too: here the collective must be first.
        config = null_config(dp_size=2, collective_timeout=5.0, heartbeat_timeout=60.0)
        async with open_dp_engine(config) as engine:
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=0)
            await stream.__anext__()
            pid = wiring_of(engine).processes["rank 1"].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(EngineDeadError) as dead:
                    async for _ in stream:
                        pass
            finally:
                os.kill(pid, signal.SIGCONT)
            message = str(dead.value)
            assert message.startswith("rank 1 is stopped (SIGSTOP or a debugger)"), message
            assert "collective_timeout (5 s)" in message
            assert "rank 0 waited 5 s (collective_timeout)" in message


async def test_a_rank_stopped_briefly_and_continued_catches_up() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_size=2, collective_timeout=30.0)) as engine:
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=0)
            await stream.__anext__()
            # Rank 0 steps on into its next vote and waits there for rank 1.
            await stop_for(engine, 1, seconds=1.0)
            await stream.__anext__()  # rank 0 produces again
            await stream.aclose()
            for rank in (0, 1):
                prompt = f"after the stop {rank}"
                deltas = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
                assert tokens_of(deltas) == expected_tokens(prompt, 8)


async def test_a_slow_model_load_is_bounded_by_the_startup_timeout_not_the_collective_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks meet at the store (startup_timeout) before the group connects
    (collective_timeout), so a peer loading 3 s longer is no stuck peer at 1 s."""
    monkeypatch.setenv(SLOW_LOAD_MARKER_ENV, str(tmp_path / "first-loaded"))
    config = null_config(dp_size=2, collective_timeout=1.0)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config, build_core=build_core_one_rank_slow) as engine:
            for rank in (0, 1):
                prompt = f"slow start {rank}"
                deltas = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
                assert tokens_of(deltas) == expected_tokens(prompt, 8)
