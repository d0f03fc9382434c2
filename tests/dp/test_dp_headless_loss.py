"""A lost headless rank shrinks the group too (issue 15, `on_rank_failure="shrink"`): a
rank that joined with `wavecore rank` has no process here to watch or kill, so its
death shows only as its silence (and, in lockstep mode, first as a survivor's broken
collective, which waits for that silence to name its cause); the loss names the rank's
member id, not a process. Once dropped, a stopped headless rank that is continued
reports its broken group under its old number, which now names a survivor: that report
is ignored, and the dropped rank exits. Null-executor ranks: rank 0 spawned here, rank
1 headless over tcp."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.abc import Process
from dp_helpers import (
    HANG_GUARD,
    check_rank_1_lost,
    collect,
    expected_tokens,
    load_then,
    start_headless_rank,
    tokens_of,
)

from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.dp.heartbeat import FRONT_END_LOST_EXIT
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.interface import Engine
from wavecore.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("shared_channel_key")]

QUICK = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
LOST = "rank 1 lost (rank 1 sent no heartbeat for "


@asynccontextmanager
async def _engine_with_headless_rank(
    dp_mode: str, on_rank_failure: str = "shrink"
) -> AsyncIterator[tuple[Engine, Process]]:
    config = EngineConfig(
        transport="tcp",
        executor="null",
        dp_size=2,
        dp_mode=dp_mode,  # type: ignore[arg-type]
        on_rank_failure=on_rank_failure,  # type: ignore[arg-type]
        **QUICK,  # type: ignore[arg-type]
    )
    flags = ["--executor", "null", "--dp-mode", dp_mode, "--on-rank-failure", on_rank_failure]
    flags += ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
    joined: list[Process] = []
    async with anyio.create_task_group() as tg:

        def start_rank(address: str) -> None:
            async def start() -> None:
                joined.append(await start_headless_rank(address, 1, 2, *flags))

            tg.start_soon(start)

        try:
            async with open_dp_engine(
                config, master="127.0.0.1:0", local_ranks=[0], on_listening=start_rank
            ) as engine:
                yield engine, joined[0]
        finally:
            for process in joined:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def _serves(engine: Engine, prompt: str) -> None:
    deltas = await collect(engine, prompt, SamplingParams(max_tokens=8))
    assert tokens_of(deltas) == expected_tokens(prompt, 8)


# Independent mode runs in `make soak`: lockstep's broken collective is the harder case.
@pytest.mark.parametrize(
    "dp_mode", [pytest.param("independent", marks=pytest.mark.soak), "lockstep"]
)
async def test_a_killed_headless_rank_is_dropped_and_the_survivor_serves_on(dp_mode: str) -> None:
    """In lockstep mode rank 0's collective breaks at once; its report waits for rank
    1's silence, which is the cause the requests' errors name."""
    with anyio.fail_after(HANG_GUARD):
        async with _engine_with_headless_rank(dp_mode) as (engine, headless):
            deltas = await load_then(engine, range(2), headless.kill)
            check_rank_1_lost(deltas, LOST)
            assert engine.dp_size == 1
            await _serves(engine, "after the loss")
            assert await headless.wait() == -signal.SIGKILL


async def test_a_dropped_headless_rank_that_comes_back_is_ignored_and_exits() -> None:
    """Stopped, rank 1 is dropped by its silence; continued, it finds its group broken
    and reports so as rank 1, the number of no member now (and of the next rank a scale
    adds): the engine goes on serving, scales up again, and the old rank exits."""
    with anyio.fail_after(HANG_GUARD):
        async with _engine_with_headless_rank("lockstep") as (engine, headless):
            stop = lambda: headless.send_signal(signal.SIGSTOP)  # noqa: E731
            deltas = await load_then(engine, range(2), stop)
            check_rank_1_lost(deltas, LOST)
            assert engine.dp_size == 1
            await engine.scale(2)
            headless.send_signal(signal.SIGCONT)
            assert await headless.wait() in (0, FRONT_END_LOST_EXIT)
            for rank in (0, 1):
                prompt = f"after the return {rank}"
                params = SamplingParams(max_tokens=8)
                deltas_after = await collect(engine, prompt, params, dp_rank=rank)
                assert tokens_of(deltas_after) == expected_tokens(prompt, 8)
            assert engine.dp_size == 2


@pytest.mark.soak  # test_dp_heartbeat names a silent headless rank in make test
async def test_a_killed_headless_rank_is_named_as_the_cause_when_the_engine_fails() -> None:
    """With "fail", rank 0's broken collective shows first ("connection reset" or the
    like); the error every caller sees names rank 1's silence, the cause, because the
    report waits for it as long as a headless peer's death takes to show."""
    with anyio.fail_after(HANG_GUARD):
        async with _engine_with_headless_rank("lockstep", "fail") as (engine, headless):
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=0)
            await stream.__anext__()
            headless.kill()
            with pytest.raises(EngineDeadError, match=r"^rank 1 sent no heartbeat for "):
                async for _ in stream:
                    pass
