"""Heartbeats (issue 15, `engine/dp/heartbeat.py`): a rank that goes silent (stopped,
hung, unreachable) is lost as a dead one, in independent mode too, where no collective
would notice; a rank stopped for less than the timeout, or busy in a long forward, is
not; a headless rank exits, saying why, when its front end is gone; and the front end
names a headless rank that stops answering. Null-executor ranks in processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from dp_helpers import (
    HANG_GUARD,
    collect,
    expected_tokens,
    null_config,
    start_headless_rank,
    stop_for,
    tokens_of,
    wiring_of,
)

from wavecore.engine.api import open_dp_engine
from wavecore.engine.cli.main import _engine_config, build_parser
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.heartbeat import FRONT_END_LOST_EXIT
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.executors.batch import ModelBatch
from wavecore.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("shared_channel_key")]

# Short enough for quick tests, long enough that a healthy rank on a loaded machine
# never reads as silent.
QUICK = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
SILENT = r"rank 1 sent no heartbeat for \d+\.\d s \(stopped, hung, or unreachable\)"
SLOW_STEP_S = 2.5  # longer than QUICK's timeout


def test_heartbeat_settings_are_validated() -> None:
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="heartbeat_interval must be positive"):
            EngineConfig(heartbeat_interval=bad)  # type: ignore[arg-type]
    for bad in (True, "5", None):
        with pytest.raises(ValueError, match="heartbeat_timeout must be a number"):
            EngineConfig(heartbeat_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heartbeat_timeout \(1.5 s\) must be at least twice"):
        EngineConfig(heartbeat_interval=1.0, heartbeat_timeout=1.5)
    assert EngineConfig(heartbeat_interval=0.5, heartbeat_timeout=1.0).heartbeat_timeout == 1.0


@pytest.mark.parametrize("command", ["generate", "serve", "rank"])
def test_heartbeat_flags_reach_the_engine_configuration(command: str) -> None:
    rank_args = ["--dp-rank", "0", "--dp-size", "2", "--master", "h:1"] if command == "rank" else []
    flags = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"]
    config = _engine_config(build_parser().parse_args([command, *rank_args, *flags]))
    assert (config.heartbeat_interval, config.heartbeat_timeout) == (0.5, 3.0)
    default = _engine_config(build_parser().parse_args([command, *rank_args]))
    assert (default.heartbeat_interval, default.heartbeat_timeout) == (1.0, 5.0)


class _SlowExecutor:
    """The null executor, but a step holding a "slow" request sleeps SLOW_STEP_S first
    (releasing the GIL, as a long forward on a GPU would)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute_model(self, batch: ModelBatch) -> object:
        if any(chunk.request_id.startswith("slow") for chunk in batch.chunks):
            time.sleep(SLOW_STEP_S)
        return self._inner.execute_model(batch)


def build_slow_core(config: EngineConfig) -> EngineCore:
    core = EngineCore.from_config(config)
    core.executor = _SlowExecutor(core.executor)  # type: ignore[assignment]
    return core


# trio's case runs in `make soak` (make test's time budget).
@pytest.mark.parametrize("anyio_backend", ["asyncio", pytest.param("trio", marks=pytest.mark.soak)])
async def test_a_stopped_rank_in_independent_mode_is_named_and_dropped(
    anyio_backend: str,
) -> None:
    """No collective runs in independent mode: only the silence shows the stop. Rank 1's
    requests (each streamed already) end with an error naming it; rank 0's finish."""
    config = null_config(dp_mode="independent", on_rank_failure="shrink", **QUICK)
    deltas: dict[str, list[Any]] = {}
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            stopped = wiring_of(engine).processes["rank 1"]
            streaming = {rank: anyio.Event() for rank in (0, 1)}

            async def run(rank: int, prompt: str, tokens: int) -> None:
                deltas[prompt] = []
                params = SamplingParams(max_tokens=tokens)
                async for delta in engine.generate(prompt, params, dp_rank=rank):
                    deltas[prompt].append(delta)
                    streaming[rank].set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 1, "stopped", 10**6)  # in flight when the rank stops
                await streaming[1].wait()
                for index in range(2):
                    tg.start_soon(run, 0, f"healthy {index}", 400)
                await streaming[0].wait()
                os.kill(stopped.pid, signal.SIGSTOP)
            last = deltas["stopped"][-1]
            assert last.finish_reason == "error"
            assert last.error is not None
            assert last.error.startswith("rank 1 lost (rank 1 sent no heartbeat for ")
            for index in range(2):
                prompt = f"healthy {index}"
                assert tokens_of(deltas[prompt]) == expected_tokens(prompt, 400)
            assert engine.dp_size == 1
            after = await collect(engine, "after", SamplingParams(max_tokens=5))
            assert tokens_of(after) == expected_tokens("after", 5)
    assert stopped.exitcode == -signal.SIGKILL


async def test_a_stopped_rank_fails_every_request_naming_it_before_any_collective() -> None:
    """With the default policy ("fail") the silence is the engine's death, in lockstep
    mode too, long before the collective timeout (60 s) would name anything."""
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(**QUICK)) as engine:
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=0)
            await stream.__anext__()
            pid = wiring_of(engine).processes["rank 1"].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(EngineDeadError, match=SILENT):
                    async for _ in stream:
                        pass
            finally:
                os.kill(pid, signal.SIGCONT)  # rank 0, in a vote with it, ends sooner


async def test_a_rank_stopped_for_less_than_the_timeout_recovers() -> None:
    config = null_config(
        dp_mode="independent",
        on_rank_failure="shrink",
        heartbeat_interval=0.2,
        heartbeat_timeout=4.0,
    )
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            stream = engine.generate("paused", SamplingParams(max_tokens=10**6), dp_rank=1)
            await stream.__anext__()
            await stop_for(engine, 1, seconds=1.0)
            assert (await stream.__anext__()).error is None  # rank 1 produces again
            await stream.aclose()
            assert engine.dp_size == 2  # not dropped; and both ranks serve:
            for rank in (0, 1):
                prompt = f"after the stop {rank}"
                deltas = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
                assert tokens_of(deltas) == expected_tokens(prompt, 8)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_front_end_that_stood_still_judges_no_rank_on_waking(anyio_backend: str) -> None:
    """The front end's own event loop blocked past the timeout (a debugger, a blocking
    call): the ranks' beats wait unread in its buffers, so they are not silent. (Trio
    may run the judging task first on waking: without the late-tick rule it dropped a
    rank in 2 of 3 tries.)"""
    config = null_config(dp_mode="independent", on_rank_failure="shrink", **QUICK)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            await collect(engine, "before", SamplingParams(max_tokens=2))
            # The scenario: the whole loop stands still past the timeout.
            time.sleep(3.0)  # noqa: ASYNC251 (blocking on purpose)
            for rank in (0, 1):
                prompt = f"after standing still {rank}"
                deltas = await collect(engine, prompt, SamplingParams(max_tokens=8), dp_rank=rank)
                assert tokens_of(deltas) == expected_tokens(prompt, 8)
            assert engine.dp_size == 2


async def test_a_forward_longer_than_the_timeout_is_no_silence() -> None:
    """The beat comes from the rank's event loop, not its model thread."""
    config = null_config(dp_mode="independent", on_rank_failure="shrink", **QUICK)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config, build_core=build_slow_core) as engine:
            params = SamplingParams(max_tokens=1)  # one step, SLOW_STEP_S long
            deltas = await collect(engine, "slow", params, request_id="slow", dp_rank=1)
            assert tokens_of(deltas) == expected_tokens("slow", 1)
            assert engine.dp_size == 2


# -- headless ranks ---------------------------------------------------------------------

HEADLESS_FLAGS = ["--executor", "null", "--dp-mode", "independent"]
HEADLESS_FLAGS += ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
HEADLESS_CONFIG = {"executor": "null", "dp_size": 2, "dp_mode": "independent", **QUICK}

# A front end whose headless rank 1 streams (its outputs back up once the front end is
# gone) when it says "serving".
FRONT_END = f"""
import anyio

from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams


async def main() -> None:
    config = EngineConfig(transport="tcp", **{HEADLESS_CONFIG!r})
    listening = lambda address: print(address, flush=True)
    async with open_dp_engine(
        config, master="127.0.0.1:0", local_ranks=[0], on_listening=listening
    ) as engine:
        params = SamplingParams(max_tokens=10**6)
        async for _ in engine.generate("endless", params, dp_rank=1):
            print("serving", flush=True)
            await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
"""


async def test_a_headless_rank_exits_saying_why_when_its_front_end_is_killed(
    tmp_path: Path,
) -> None:
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    processes: list[Process] = []
    try:
        with anyio.fail_after(HANG_GUARD):
            front = await anyio.open_process([sys.executable, str(script)], stderr=None)
            processes.append(front)
            assert front.stdout is not None
            lines = BufferedByteReceiveStream(front.stdout)
            address = (await lines.receive_until(b"\n", 1024)).decode()
            rank = await start_headless_rank(address, 1, 2, *HEADLESS_FLAGS, stderr=subprocess.PIPE)
            processes.append(rank)
            assert await lines.receive_until(b"\n", 1024) == b"serving"  # rank 1 streams
            front.kill()
            await front.wait()
            assert await rank.wait() == FRONT_END_LOST_EXIT
            assert rank.stderr is not None
            stderr = b"".join([chunk async for chunk in rank.stderr]).decode()
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
    said = [line for line in stderr.splitlines() if "the front end sent nothing" in line]
    assert len(said) == 1, stderr
    assert said[0].startswith("rank 1 (pid ")
    assert "restart this rank to join a new front end" in said[0]


async def test_the_front_end_names_a_headless_rank_that_stops_answering() -> None:
    config = EngineConfig(transport="tcp", **HEADLESS_CONFIG)  # type: ignore[arg-type]
    joined: list[Process] = []
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            def start_rank(address: str) -> None:
                async def start() -> None:
                    joined.append(await start_headless_rank(address, 1, 2, *HEADLESS_FLAGS))

                tg.start_soon(start)

            try:
                async with open_dp_engine(
                    config, master="127.0.0.1:0", local_ranks=[0], on_listening=start_rank
                ) as engine:
                    stream = engine.generate("far", SamplingParams(max_tokens=10**6), dp_rank=1)
                    await stream.__anext__()
                    joined[0].send_signal(signal.SIGSTOP)
                    with pytest.raises(EngineDeadError, match=SILENT):
                        async for _ in stream:
                            pass
            finally:
                for process in joined:
                    process.kill()
                    await process.wait()
