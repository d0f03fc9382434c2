"""Steps that fail or block: the engine dies loudly, and aborts beat in-flight outputs."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest
from engine_helpers import ControlledExecutor, core_with

from wavecore.engine.api import open_engine_core
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
HANG_GUARD = 30


async def test_a_failing_step_fails_every_request_and_later_calls() -> None:
    executor = ControlledExecutor()
    errors: list[BaseException] = []

    async def run(name: str) -> None:
        try:
            async for _ in engine.generate(name, SamplingParams(max_tokens=500)):
                pass
        except EngineDeadError as error:
            errors.append(error)

    with anyio.fail_after(HANG_GUARD):
        async with open_engine_core(lambda: core_with(executor)) as engine:
            executor.gate.clear()
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "a")
                tg.start_soon(run, "b")
                await anyio.to_thread.run_sync(executor.entered.wait)
                executor.fail_with = RuntimeError("device on fire")
                executor.gate.set()
            with pytest.raises(EngineDeadError, match="device on fire"):
                await engine.stats()
    assert len(errors) == 2
    assert all("device on fire" in str(error) for error in errors)


async def test_an_abort_during_a_step_wins_over_that_steps_output() -> None:
    executor = ControlledExecutor()
    with anyio.fail_after(HANG_GUARD):
        async with open_engine_core(lambda: core_with(executor)) as engine:
            stream = engine.generate("abc", SamplingParams(max_tokens=100), request_id="r")
            first = await stream.__anext__()
            executor.entered.clear()
            executor.gate.clear()
            await anyio.to_thread.run_sync(executor.entered.wait)
            # A step that holds "r" is running on the model thread now; each step before
            # it gave "r" one token.
            tokens_before = executor.num_steps
            await engine.abort("r")
            executor.gate.set()
            rest = [delta async for delta in stream]
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"
    assert sum(len(delta.token_ids) for delta in (first, *rest)) == tokens_before
