"""The in-process async engine, end to end over the null executor, on both backends."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest

from wavecore.engine.api import open_engine
from wavecore.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineAsleepError,
    EngineClosedError,
    InvalidRequestError,
    PauseInProgressError,
    PromptTooLongError,
    ScalingRefusedError,
    UnknownRequestError,
)
from wavecore.engine.executors.null_executor import null_continuation
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import PauseMode

pytestmark = pytest.mark.anyio
HANG_GUARD = 30  # seconds; only ever reached if the engine hangs
VOCAB = ByteTokenizer().vocab_size


def expected_tokens(prompt: str, count: int) -> list[int]:
    """What the null executor produces for a byte-tokenized prompt."""
    return null_continuation(
        list(prompt.encode()), count, vocab_size=VOCAB, eos_token_id=ByteTokenizer().eos_token_id
    )


async def collect(engine, prompt, params, **kwargs):
    deltas = [d async for d in engine.generate(prompt, params, **kwargs)]
    return deltas


async def test_generate_streams_the_executors_tokens_in_order() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine:
            deltas = await collect(engine, "hello", SamplingParams(max_tokens=9, temperature=0))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == expected_tokens("hello", 9)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage.prompt_tokens == 5
    assert deltas[-1].usage.output_tokens == 9


async def test_many_concurrent_requests_each_get_their_own_output() -> None:
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(40)]
    results: dict[str, list[int]] = {}

    async def run(prompt: str) -> None:
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=5 + len(prompt) % 7))
        results[prompt] = [t for d in deltas for t in d.token_ids]

    with anyio.fail_after(HANG_GUARD):
        async with (
            open_engine(executor="null", max_num_seqs=8) as engine,
            anyio.create_task_group() as tg,
        ):
            for prompt in prompts:
                tg.start_soon(run, prompt)
    for prompt in prompts:
        assert results[prompt] == expected_tokens(prompt, 5 + len(prompt) % 7)


async def test_abort_ends_the_stream_with_abort_and_frees_the_request() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine:
            stream = engine.generate("x", SamplingParams(max_tokens=10_000), request_id="long")
            first = await stream.__anext__()
            assert first.finish_reason is None
            await engine.abort("long")
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "abort"
            stats = await engine.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            with pytest.raises(UnknownRequestError, match="long"):
                await engine.abort("long")


async def test_a_cancelled_consumer_aborts_its_request() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine:
            with anyio.CancelScope() as scope:
                async for _delta in engine.generate("y", SamplingParams(max_tokens=10_000)):
                    scope.cancel()
            stats = await engine.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            # The engine still serves.
            deltas = await collect(engine, "z", SamplingParams(max_tokens=3))
            assert deltas[-1].finish_reason == "length"


async def test_bad_input_raises_on_its_own_call_and_spares_requests_in_flight() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null", max_model_len=64) as engine:
            survivor = engine.generate("keep going", SamplingParams(max_tokens=40), request_id="ok")
            first = await survivor.__anext__()
            with pytest.raises(EmptyPromptError):
                await collect(engine, "", SamplingParams())
            with pytest.raises(PromptTooLongError, match="64"):
                await collect(engine, "a" * 64, SamplingParams())
            with pytest.raises(DuplicateRequestError, match="ok"):
                await collect(engine, "again", SamplingParams(), request_id="ok")
            with pytest.raises(InvalidRequestError, match="token ids"):
                await collect(engine, [1, 2, VOCAB + 5], SamplingParams())
            with pytest.raises(InvalidRequestError, match="SamplingParams"):
                await collect(engine, "p", {"max_tokens": 3})  # type: ignore[arg-type]
            with pytest.raises(UnknownRequestError):
                await engine.abort("nobody")
            with pytest.raises(ValueError, match="temperature"):
                SamplingParams(temperature=-1)
            rest = [d async for d in survivor]
    tokens = [t for d in [first, *rest] for t in d.token_ids]
    assert tokens == expected_tokens("keep going", 40)
    assert rest[-1].finish_reason == "length"


async def test_stop_strings_cut_the_text_and_finish_the_request() -> None:
    expected_text = bytes(expected_tokens("abc", 30)).decode("utf-8", errors="replace")
    # A stop string made of output that appears well after the start.
    stop = expected_text[10:13]
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine:
            deltas = await collect(engine, "abc", SamplingParams(max_tokens=30, stop=(stop,)))
            stats = await engine.stats()
    text = "".join(d.text for d in deltas)
    assert text == expected_text[: expected_text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert stats.num_running == 0


async def test_closing_right_after_a_stop_string_finish_is_clean() -> None:
    """The front end aborts a request its stop string finished; closing the engine at
    once used to close the rank's output stream while the rank was mid-step, and the
    step's outputs then failed the close with BrokenResourceError."""
    expected_text = bytes(expected_tokens("abc", 30)).decode("utf-8", errors="replace")
    stop = expected_text[3:6]
    for _ in range(5):
        with anyio.fail_after(HANG_GUARD):
            async with open_engine(executor="null") as engine:
                deltas = await collect(engine, "abc", SamplingParams(max_tokens=30, stop=(stop,)))
                # Keep the rank busy so that the close finds it in a step.
                busy = SamplingParams(max_tokens=10_000, ignore_eos=True)
                async with aclosing(engine.generate("busy", busy)) as stream:
                    await anext(stream)
        assert deltas[-1].finish_reason == "stop"


@pytest.mark.parametrize("mode", list(PauseMode))
async def test_pause_then_resume_under_load(mode: PauseMode) -> None:
    finished: dict[str, str | None] = {}

    async def run(name: str, tokens: int) -> None:
        deltas = await collect(engine, name, SamplingParams(max_tokens=tokens), request_id=name)
        finished[name] = deltas[-1].finish_reason

    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine, anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, f"before-{i}", 200)
            await wait_until_running(engine, 4)
            await engine.pause(mode)
            paused = await engine.stats()
            tg.start_soon(run, "during", 5)
            await wait_until_waiting(engine, 1)
            await engine.resume()
    assert paused.paused == mode.value
    if mode is PauseMode.ABORT:
        assert paused.num_running == 0
        assert {finished[f"before-{i}"] for i in range(4)} == {"abort"}
    else:
        assert {finished[f"before-{i}"] for i in range(4)} == {"length"}
    if mode is PauseMode.WAIT:
        assert paused.num_running == 0
    if mode is PauseMode.KEEP:
        assert paused.num_running == 4
    assert finished["during"] == "length"


async def test_resume_is_refused_while_a_wait_pause_drains() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine, anyio.create_task_group() as tg:
            tg.start_soon(collect, engine, "drain me", SamplingParams(max_tokens=300))
            await wait_until_running(engine, 1)
            tg.start_soon(engine.pause, PauseMode.WAIT)
            await wait_for_pause_pending(engine)
            with pytest.raises(PauseInProgressError):
                await engine.resume()
            with pytest.raises(PauseInProgressError):
                await engine.pause(PauseMode.KEEP)


async def test_a_request_during_sleep_waits_visibly_and_runs_after_wake_up() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine, anyio.create_task_group() as tg:
            results = []

            async def run() -> None:
                results.append(await collect(engine, "sleepy", SamplingParams(max_tokens=4)))

            await engine.sleep(1)
            tg.start_soon(run)
            await wait_until_waiting(engine, 1)
            stats = await engine.stats()
            assert stats.asleep == ("kv_cache", "scheduling", "weights")
            await engine.wake_up(["weights", "kv_cache"])
            assert (await engine.stats()).asleep == ("scheduling",)
            await engine.wake_up(["scheduling"])
    assert [t for d in results[0] for t in d.token_ids] == expected_tokens("sleepy", 4)


async def test_resume_while_asleep_is_refused_and_the_engine_keeps_serving() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(executor="null") as engine:
            await engine.sleep(2)
            with pytest.raises(EngineAsleepError, match="wake_up first"):
                await engine.resume()
            await engine.wake_up()
            deltas = await collect(engine, "awake", SamplingParams(max_tokens=3))
    assert [t for d in deltas for t in d.token_ids] == expected_tokens("awake", 3)


async def test_bad_utility_arguments_are_refused() -> None:
    async with open_engine(executor="null") as engine:
        with pytest.raises(InvalidRequestError, match="sleep level"):
            await engine.sleep(3)
        with pytest.raises(InvalidRequestError, match="unknown wake_up tag"):
            await engine.wake_up(["brain"])
        with pytest.raises(InvalidRequestError, match="pause mode"):
            await engine.pause("frozen")  # type: ignore[arg-type]


async def test_a_one_rank_engine_refuses_to_scale() -> None:
    async with open_engine(executor="null") as engine:
        with pytest.raises(ScalingRefusedError, match="dp_size >= 2"):
            await engine.scale(2)
        assert engine.dp_size == 1


async def test_calls_after_the_block_ends_raise_engine_closed() -> None:
    async with open_engine(executor="null") as engine:
        pass
    with pytest.raises(EngineClosedError):
        await collect(engine, "late", SamplingParams())
    with pytest.raises(EngineClosedError):
        await engine.stats()


# -- waiting on engine state without sleeping ------------------------------------------
# `stats()` is applied between steps, in order with earlier calls, so each call is a
# loop iteration: polling it waits for progress without timers.


async def wait_until_running(engine, count: int) -> None:
    while (await engine.stats()).num_running < count:
        pass


async def wait_until_waiting(engine, count: int) -> None:
    while (await engine.stats()).num_waiting < count:
        pass


async def wait_for_pause_pending(engine) -> None:
    while (await engine.stats()).paused is None:
        pass
