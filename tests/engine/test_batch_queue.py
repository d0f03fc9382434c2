"""The batch queue (`EngineConfig(async_scheduling=True)`) streams exactly what the
serial loop streams: with stop tokens, stop strings, max_tokens, preemption, and
aborts, stops and pauses that race the step in flight ahead of the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from engine_helpers import TOKENIZER
from test_rank_runner import Outputs, add, rank_serving

from wavecore.engine import messages as m
from wavecore.engine.api import open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.executors.batch import ModelBatch
from wavecore.engine.executors.null_executor import NullExecutor, null_continuation
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import RankMachine, StepDone

pytestmark = pytest.mark.anyio
HANG_GUARD = 30


class RecordingExecutor(NullExecutor):
    """A null executor that checks its KV history (`track_kv`) and runs
    `hooks[(request_id, k)]` on the model thread in the forward that samples that
    request's output number k (0-based), once."""

    def __init__(self, *, num_kv_blocks: int = 256, eos_at_output: int | None = None) -> None:
        super().__init__(
            num_kv_blocks=num_kv_blocks,
            block_size=4,
            max_model_len=256,
            vocab_size=TOKENIZER.vocab_size,
            eos_token_id=TOKENIZER.eos_token_id,
            eos_at_output=eos_at_output,
            track_kv=True,
        )
        self.hooks: dict[tuple[str, int], Callable[[], None]] = {}

    def execute_model(self, batch: ModelBatch) -> object:
        for chunk in batch.chunks:
            hook = self.hooks.pop((chunk.request_id, chunk.num_output_tokens), None)
            if chunk.sample and hook is not None:
                hook()
        return super().execute_model(batch)


def core_of(executor: NullExecutor, *, queue: bool, **config: Any) -> EngineCore:
    """A core over `executor` that counts its preemptions in `core.preempted`."""
    core = EngineCore(
        executor=executor,
        tokenizer=TOKENIZER,
        config=EngineConfig(executor="null", async_scheduling=queue, **config),
        eos_token_id=TOKENIZER.eos_token_id,
    )
    core.preempted = 0  # type: ignore[attr-defined]
    schedule = core.schedule

    def counting_schedule(step_counter: int | None = None) -> Any:
        step = schedule(step_counter)
        core.preempted += core.scheduler.last_stats.num_preempted  # type: ignore[attr-defined]
        return step

    core.schedule = counting_schedule  # type: ignore[method-assign]
    return core


# -- through the public API ----------------------------------------------------------------

PROMPTS = [f"prompt {i}: " + "xyz" * (i % 4) for i in range(10)]


def workload() -> list[SamplingParams]:
    """Lengths, EOS (every request's output 9 is EOS) and a stop string per request,
    taken from what the null executor will write (so that it matches)."""
    params = []
    for index, prompt in enumerate(PROMPTS):
        text = TOKENIZER.decode(
            null_continuation(
                list(prompt.encode()),
                6,
                vocab_size=TOKENIZER.vocab_size,
                eos_token_id=TOKENIZER.eos_token_id,
            )
        )
        stop = (text[4:6],) if index % 3 == 0 and len(text) >= 6 else ()
        params.append(SamplingParams(max_tokens=4 + index, stop=stop))
    return params


async def stream_all(
    engine: Any, between: Callable[[Any], Any] | None = None
) -> dict[str, list[tuple[str, tuple[int, ...], str | None]]]:
    """Every request's deltas; `between(engine)` runs once the first request streamed."""
    results: dict[str, list[tuple[str, tuple[int, ...], str | None]]] = {}
    first = anyio.Event()

    async def run(index: int, params: SamplingParams) -> None:
        request_id = f"r{index}"
        results[request_id] = []
        async for delta in engine.generate(PROMPTS[index], params, request_id=request_id):
            results[request_id].append((delta.text, delta.token_ids, delta.finish_reason))
            first.set()

    async with anyio.create_task_group() as tg:
        for index, params in enumerate(workload()):
            tg.start_soon(run, index, params)
        if between is not None:
            await first.wait()
            await between(engine)
    return results


async def served(
    queue: bool, between: Callable[[Any], Any] | None = None, **executor: Any
) -> tuple[dict[str, Any], EngineCore]:
    core = core_of(RecordingExecutor(**executor), queue=queue, max_num_seqs=8)
    with anyio.fail_after(HANG_GUARD):
        async with open_engine_core(lambda: core) as engine:
            return await stream_all(engine, between), core


def flattened(results: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...], str | None]]:
    """Each request's whole text, tokens and finish reason (delta boundaries are timing)."""
    return {
        request_id: (
            "".join(text for text, _, _ in deltas),
            tuple(token for _, tokens, _ in deltas for token in tokens),
            deltas[-1][2],
        )
        for request_id, deltas in results.items()
    }


async def test_the_queue_streams_what_the_serial_loop_streams_under_preemption() -> None:
    # 14 blocks of 4 tokens for 8 running requests of up to 32 tokens: they preempt.
    serial, _ = await served(False, num_kv_blocks=14, eos_at_output=9)
    queued, core = await served(True, num_kv_blocks=14, eos_at_output=9)
    assert flattened(queued) == flattened(serial)
    reasons = {deltas[-1][2] for deltas in serial.values()}
    assert reasons == {"stop", "length"}
    assert core.preempted, "the test meant to preempt requests"  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["keep", "wait"])
async def test_a_pause_and_resume_racing_the_queue_change_no_output(mode: str) -> None:
    async def pause_and_resume(engine: Any) -> None:
        await engine.pause(mode=mode)
        assert (await engine.stats()).paused == mode
        await engine.resume()

    serial, _ = await served(False)
    queued, _ = await served(True, pause_and_resume)
    assert flattened(queued) == flattened(serial)


# -- the rank runner, inputs sent from inside a forward -------------------------------------


class CountingMachine(RankMachine):
    """Counts the real forwards reported to it (a copy counts its own)."""

    reported = 0

    def handle(self, event: object) -> tuple[object, ...]:
        if isinstance(event, StepDone) and event.executed:
            self.reported += 1
        return super().handle(event)


MACHINES = {
    "independent": lambda: CountingMachine(0, 1, lockstep=False),
    "lockstep": lambda: CountingMachine(0, 1, sync_interval=3, lockstep=True),
}


async def race(queue: bool, machine: CountingMachine) -> dict[str, tuple[list[int], str | None]]:
    """Four requests in step; from inside the forward that samples a request's output
    k, once the rank streamed its first k tokens, an input is sent: an abort of "b" at
    3, a stop of "c" at 5 and an ABORT pause at "a"'s 8 (which ends "a" and "d")."""
    executor = RecordingExecutor()
    token = anyio.lowlevel.current_token()
    ids = ("a", "b", "c", "d")
    async with rank_serving(core_of(executor, queue=queue), machine) as (to_rank, outputs):

        def send_after(request_id: str, count: int, message: object) -> Callable[[], None]:
            async def when_streamed() -> None:
                while len(outputs.tokens(request_id)[0]) < count:
                    await outputs.arrived.wait()
                await to_rank.send(message)

            return lambda: anyio.from_thread.run(when_streamed, token=token)

        executor.hooks = {
            ("b", 3): send_after("b", 3, m.AbortRequests(request_ids=("b",))),
            ("c", 5): send_after("c", 5, m.StopRequests(request_ids=("c",))),
            ("a", 8): send_after(
                "a", 8, m.UtilityCall(call_id=1, method="pause", pause_mode="abort")
            ),
        }
        for request_id in ids:  # all at once, so that the first step admits them all
            to_rank.send_nowait(add(request_id, "same", 20))
        while not all(outputs.tokens(r)[1] for r in ("a", "b", "d")) or not replied(outputs):
            await outputs.arrived.wait()
    assert not executor.hooks, "every race was run"
    # Every forward was reported once (votes and dummies stay in step with forwards).
    assert machine.reported == executor.num_steps
    return {request_id: outputs.tokens(request_id) for request_id in ids}


def replied(outputs: Outputs) -> bool:
    return any(isinstance(message, m.UtilityResult) for message in outputs.messages)


@pytest.mark.parametrize("machine", list(MACHINES))
async def test_aborts_stops_and_an_abort_pause_racing_the_queue_land_where_serially(
    machine: str,
) -> None:
    with anyio.fail_after(HANG_GUARD):
        serial = await race(False, MACHINES[machine]())
        queued = await race(True, MACHINES[machine]())
    assert queued == serial
    # An abort wins over the step running when it arrives (rank_runner's rule 4); a stop
    # or a pause is taken after that step's update, so the step's token lands first. A
    # stop carries no finish reason back: the client that sent it knows.
    counts = {request_id: len(tokens) for request_id, (tokens, _) in serial.items()}
    assert counts == {"a": 9, "b": 3, "c": 6, "d": 9}
    assert [serial[r][1] for r in ("a", "b", "c", "d")] == ["abort", "abort", None, "abort"]


# -- the real model -------------------------------------------------------------------------


class Borrowed:
    """An executor lent to one engine: everything but `close`, so the next can use it."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def close(self) -> None:
        pass


@pytest.mark.model
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_queue_streams_what_the_serial_loop_streams_on_the_real_model() -> None:
    loaded = EngineCore.from_config(EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=256))
    prompts = ["The capital of France is", "def add(a, b):", "Three colours:"]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=7, temperature=1.0, seed=11, stop=(",",)),
    ]

    async def run(queue: bool) -> list[tuple[str, tuple[int, ...], str | None]]:
        core = EngineCore(
            executor=Borrowed(loaded.executor),  # type: ignore[arg-type]
            tokenizer=loaded.tokenizer,
            config=EngineConfig(max_num_seqs=4, async_scheduling=queue),
            eos_token_id=loaded.executor.source.eos_token_id,  # type: ignore[attr-defined]
        )
        async with open_engine_core(lambda: core) as engine:
            results = []
            for prompt, sampling in zip(prompts, params, strict=True):
                deltas = [delta async for delta in engine.generate(prompt, sampling)]
                results.append(
                    (
                        "".join(delta.text for delta in deltas),
                        tuple(token for delta in deltas for token in delta.token_ids),
                        deltas[-1].finish_reason,
                    )
                )
            return results

    try:
        with anyio.fail_after(120):
            serial = await run(False)
            queued = await run(True)
    finally:
        loaded.close()
    assert queued == serial
    assert all(tokens for _, tokens, _ in serial)
