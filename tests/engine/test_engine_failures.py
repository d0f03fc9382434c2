"""Steps that fail or block: the engine dies loudly, and aborts beat in-flight outputs."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest

from wavecore.engine.api import open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.errors import EngineDeadError
from wavecore.engine.executors.batch import ModelBatch, ModelOutput
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio
HANG_GUARD = 30


class ControlledExecutor(NullExecutor):
    """A null executor whose steps can be held at a gate, or made to fail."""

    def __init__(self) -> None:
        tokenizer = ByteTokenizer()
        super().__init__(
            num_kv_blocks=256,
            max_model_len=1024,
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
        )
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    def execute(self, batch: ModelBatch) -> ModelOutput:
        self.entered.set()
        self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return super().execute(batch)


def core_with(executor: ControlledExecutor) -> EngineCore:
    tokenizer = ByteTokenizer()
    return EngineCore(
        executor=executor,
        tokenizer=tokenizer,
        config=EngineConfig(executor="null"),
        eos_token_id=tokenizer.eos_token_id,
    )


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
