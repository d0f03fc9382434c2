"""Failures: a rank killed, a model step raising, bad configuration, bad startup, bad
bytes on the wire. Each must end with a clear error and every process reaped."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal

import anyio
import pynng
import pytest
from dp_helpers import (
    HANG_GUARD,
    build_exploding_core,
    build_failing_core,
    build_hanging_core,
    collect,
    expected_tokens,
    null_config,
    tokens_of,
    wiring_of,
)

from wavecore.engine.api import Engine, open_dp_engine, open_engine_core
from wavecore.engine.core.step_failure import StepFailed
from wavecore.engine.dp.launcher import ConfigMismatchError, DPStartupError
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


def assert_all_reaped(engine: Engine) -> None:
    for name, process in wiring_of(engine).processes.items():
        assert not process.is_alive(), name
        assert process.exitcode is not None, name
    directory = wiring_of(engine).ipc_directory
    assert directory is not None and not os.path.exists(directory)


async def test_a_killed_rank_fails_every_request_and_later_calls() -> None:
    errors: list[BaseException] = []

    async def run(rank: int) -> None:
        try:
            await collect(
                engine, f"long {rank}", SamplingParams(max_tokens=1_000_000), dp_rank=rank
            )
        except EngineDeadError as error:
            errors.append(error)

    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config()) as engine, anyio.create_task_group() as tg:
            for rank in (0, 0, 1, 1):
                tg.start_soon(run, rank)
            while sum(r.core.num_running for r in (await engine.stats()).ranks) < 4:
                pass
            os.kill(wiring_of(engine).processes["rank 1"].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            await collect(engine, "later", SamplingParams())
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            await engine.stats()
    assert len(errors) == 4
    assert all("rank 1 died" in str(error) for error in errors)
    assert_all_reaped(engine)


async def test_an_exception_in_a_model_step_reaches_the_client_with_the_rank() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(), build_core=build_exploding_core) as engine:
            healthy = await collect(engine, "fine", SamplingParams(max_tokens=3), dp_rank=0)
            assert tokens_of(healthy) == expected_tokens("fine", 3)
            with pytest.raises(EngineDeadError) as failure:
                await collect(engine, "boom", SamplingParams(), request_id="explode-1", dp_rank=1)
            message = str(failure.value)
            assert "rank 1" in message and "injected failure in the model step" in message
            with pytest.raises(EngineDeadError):
                await engine.pause()
    assert_all_reaped(engine)


async def test_a_rank_with_a_different_configuration_is_refused() -> None:
    config = null_config()
    odd = dataclasses.replace(config, max_num_seqs=4)
    with anyio.fail_after(HANG_GUARD), pytest.raises(ConfigMismatchError) as refused:
        async with open_dp_engine(config, rank_configs={1: odd}):
            pass
    assert "rank 1" in str(refused.value)
    assert "max_num_seqs: client 8, rank 4" in str(refused.value)


async def test_a_model_that_fails_to_load_names_the_rank_and_the_error() -> None:
    with (
        anyio.fail_after(HANG_GUARD),
        pytest.raises(DPStartupError, match="failed to start") as failed,
    ):
        async with open_dp_engine(null_config(), build_core=build_failing_core):
            pass
    assert "FileNotFoundError: no such model" in str(failed.value)


async def test_startup_timeout_names_the_ranks_that_did_not_come_up() -> None:
    config = null_config(startup_timeout=4.0, dp_mode="independent")
    with anyio.fail_after(HANG_GUARD), pytest.raises(DPStartupError) as late:
        async with open_dp_engine(config, build_core=build_hanging_core):
            pass
    assert "rank 0, rank 1 did not report ready within 4.0 s" in str(late.value)


async def test_malformed_frames_are_dropped_logged_once_and_harmless(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="wavecore.engine.dp")
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_mode="independent")) as engine:
            targets = [
                wiring_of(engine).addresses["outputs"],
                wiring_of(engine).addresses["coordinator_input"],
            ]
            for address in targets:
                with pynng.Push0(dial=address) as rogue:
                    for garbage in (b"\xff\x00garbage", b"\x9f\x9f\x9f"):
                        await rogue.asend(garbage)
            log = wiring_of(engine).invalid_frames[0]
            while log.count < 2:
                await engine.stats()
            deltas = await collect(engine, "still fine", SamplingParams(max_tokens=5))
            assert tokens_of(deltas) == expected_tokens("still fine", 5)
    warnings = [r for r in caplog.records if "client outputs" in r.getMessage()]
    assert len(warnings) == 1
    assert_all_reaped(engine)


async def test_cancelling_the_block_shuts_everything_down() -> None:
    with anyio.fail_after(HANG_GUARD):
        with anyio.CancelScope() as scope:
            async with open_dp_engine(null_config()) as engine, anyio.create_task_group() as tg:
                tg.start_soon(collect, engine, "forever", SamplingParams(max_tokens=1_000_000))
                while not sum(r.core.num_running for r in (await engine.stats()).ranks):
                    pass
                scope.cancel()
    assert scope.cancelled_caught
    assert_all_reaped(engine)


def _step_dump(rank: int, phase: str, step: int, wave: int, scheduled: str) -> re.Pattern[str]:
    """The dump a rank's failed step must give (`core.step_failure`), the pid aside."""
    return re.compile(
        rf"rank {rank} \(pid \d+\) failed: the {phase} of step {step} \(wave {wave}\) "
        rf"failed with RuntimeError: injected failure in the {_INJECTED[phase]}; "
        rf"it scheduled {re.escape(scheduled)}$"
    )


_INJECTED = {"forward": "model step", "sampling": "sampling"}


@pytest.mark.parametrize(
    ("phase", "async_scheduling"),
    [("forward", False), ("sampling", False), ("forward", True), ("sampling", True)],
)
async def test_a_failed_step_at_dp_1_names_its_rank_step_wave_and_requests(
    phase: str, async_scheduling: bool, caplog
) -> None:
    caplog.set_level(logging.ERROR, logger="wavecore.engine.core")
    config = null_config(dp_size=1, async_scheduling=async_scheduling)
    chosen = "explode-at-3" if phase == "forward" else "explode-sampling-at-3"
    with anyio.fail_after(HANG_GUARD):
        async with open_engine_core(lambda: build_exploding_core(config)) as engine:
            wave = (await engine.stats()).ranks[0].counters.wave
            with pytest.raises(EngineDeadError) as failure:
                # A lone request's step 3 is its fourth: the prefill, then decodes that
                # find 1, 2 and 3 output tokens.
                await collect(engine, "boom", SamplingParams(max_tokens=8), request_id=chosen)
    dump = _step_dump(0, phase, 3, wave, f"1 request, 1 token: {chosen} (1 decode)")
    assert dump.search(str(failure.value))
    logged = [r for r in caplog.records if dump.search(r.getMessage())]
    assert len(logged) == 1
    assert logged[0].exc_info is not None  # with the executor's traceback


async def test_a_failed_step_at_dp_2_names_its_rank_step_wave_and_requests() -> None:
    chosen = "explode-sampling-at-3"
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(), build_core=build_exploding_core) as engine:
            wave = (await engine.stats()).ranks[1].counters.wave
            with pytest.raises(EngineDeadError) as failure:
                await collect(engine, "boom", SamplingParams(), request_id=chosen, dp_rank=1)
    dump = _step_dump(1, "sampling", 3, wave, f"1 request, 1 token: {chosen} (1 decode)")
    assert dump.search(str(failure.value))
    assert_all_reaped(engine)


def test_the_dump_names_every_scheduled_request_with_its_tokens() -> None:
    core = build_exploding_core(null_config(dp_size=1))
    for request_id, prompt in (("calm", b"abcdef"), ("explode-at-0", b"xyz")):
        core.add_request(
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=tuple(prompt),
                params=SamplingParams(max_tokens=4),
            )
        )
    with pytest.raises(StepFailed) as failure:
        core.step()
    dump = failure.value.dump(wave=7)
    assert dump == (
        "the forward of step 0 (wave 7) failed with RuntimeError: injected failure in the "
        "model step; it scheduled 2 requests, 9 tokens: calm (6 prefill), explode-at-0 "
        "(3 prefill)"
    )
