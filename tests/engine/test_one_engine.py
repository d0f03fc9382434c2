"""One behavioural suite for every engine: one rank in this process, and two rank
processes in lockstep and in independent mode, each on asyncio and on trio. The same
calls must give the same results and refuse the same way on all of them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from wavecore.engine.api import Engine, open_engine
from wavecore.engine.config import EngineConfig
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
HANG_GUARD = 60  # seconds; only ever reached if an engine hangs
TOKENIZER = ByteTokenizer()

ENGINES = {
    "one-rank": {"dp_size": 1},
    "dp2-lockstep": {"dp_size": 2, "dp_mode": "lockstep", "sync_interval": 4},
    "dp2-independent": {"dp_size": 2, "dp_mode": "independent"},
}


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=list(ENGINES))
async def engine(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Engine]:
    config = EngineConfig(
        executor="null", max_num_seqs=8, max_model_len=512, **ENGINES[request.param]
    )
    async with open_engine(config) as opened:
        yield opened
    # Every engine refuses every call once its block has ended.
    with pytest.raises(EngineClosedError):
        await opened.stats()
    with pytest.raises(EngineClosedError):
        await collect(opened, "late", SamplingParams())


def expected(prompt: str, count: int) -> list[int]:
    return null_continuation(
        list(prompt.encode()),
        count,
        vocab_size=TOKENIZER.vocab_size,
        eos_token_id=TOKENIZER.eos_token_id,
    )


async def collect(engine: Engine, prompt: Any, params: SamplingParams, **kwargs: Any) -> list[Any]:
    return [delta async for delta in engine.generate(prompt, params, **kwargs)]


def tokens(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


async def started(engine: Engine, prompt: str, max_tokens: int, request_id: str) -> Any:
    """A stream that has produced its first delta."""
    stream = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id=request_id)
    first = await stream.__anext__()
    return stream, first


async def rest_of(stream: Any, first: Any) -> list[Any]:
    """`first` (a delta, or the deltas read so far) and the rest of the stream."""
    read = first if isinstance(first, list) else [first]
    return [*read, *[delta async for delta in stream]]


async def until(engine: Engine, condition: Any) -> Any:
    """Poll `stats()` (each call a round trip to every rank) until `condition(stats)`."""
    while not condition(stats := await engine.stats()):
        pass
    return stats


# -- requests ---------------------------------------------------------------------------


async def test_generate_streams_every_requests_own_tokens(engine: Engine) -> None:
    prompts = [f"prompt {i} " * (1 + i % 3) for i in range(12)]
    results: dict[str, list[Any]] = {}

    async def run(prompt: str) -> None:
        results[prompt] = await collect(engine, prompt, SamplingParams(max_tokens=7))

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(run, prompt)
        stats = await engine.stats()
    for prompt, deltas in results.items():
        assert tokens(deltas) == expected(prompt, 7)
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].usage.prompt_tokens == len(prompt.encode())
    assert len(stats.ranks) == engine.dp_size == len(stats.requests_per_rank)
    assert (stats.num_running, stats.num_waiting) == (0, 0)


async def test_abort_ends_the_stream_with_abort(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream, first = await started(engine, "abort me", 10**6, "to-abort")
        await engine.abort("to-abort")
        deltas = await rest_of(stream, first)
        assert deltas[-1].finish_reason == "abort"
        with pytest.raises(UnknownRequestError, match="to-abort"):
            await engine.abort("to-abort")
        await until(engine, lambda s: s.num_running == 0)


# -- pause and resume -------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(PauseMode))
async def test_pause_in_each_mode_then_resume(engine: Engine, mode: PauseMode) -> None:
    # ABORT and KEEP pauses must find their requests running: 60 null-executor tokens
    # can all be produced between the first one's arrival and the pause on a loaded
    # machine. So those requests are endless: KEEP's are read on after the resume,
    # then aborted. WAIT's finish during the pause whatever their length.
    count = 60 if mode is PauseMode.WAIT else 10**6
    with anyio.fail_after(HANG_GUARD):
        streams = [await started(engine, f"run {i}", count, f"{mode.value}-{i}") for i in range(2)]
        await engine.pause(mode)
        assert await engine.is_paused()
        paused = await engine.stats()
        assert paused.paused == mode.value
        running_while_paused = paused.num_running
        async with anyio.create_task_group() as tg:
            late: list[Any] = []

            async def late_request() -> None:
                late.extend(await collect(engine, "late", SamplingParams(max_tokens=4)))

            tg.start_soon(late_request)
            await until(engine, lambda s: len(s.held) == 1)
            await engine.resume()
        if mode is PauseMode.KEEP:  # kept: they go on after the resume
            streams = [(s, [first, await s.__anext__()]) for s, first in streams]
            for i in range(2):
                await engine.abort(f"keep-{i}")
        finished = [await rest_of(stream, first) for stream, first in streams]
    assert not await engine.is_paused()
    assert tokens(late) == expected("late", 4)
    if mode is PauseMode.WAIT:
        for i, deltas in enumerate(finished):
            assert tokens(deltas) == expected(f"run {i}", 60)
    else:
        assert [deltas[-1].finish_reason for deltas in finished] == ["abort", "abort"]
    if mode is PauseMode.KEEP:  # every token of the run's own, none lost or repeated
        for i, deltas in enumerate(finished):
            assert tokens(deltas) == expected(f"run {i}", len(tokens(deltas)))
    assert running_while_paused == (2 if mode is PauseMode.KEEP else 0)


async def test_a_pause_in_progress_refuses_resume_and_another_mode(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream, first = await started(engine, "drain", 300, "drain")
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.pause, PauseMode.WAIT)
            await until(engine, lambda s: any(r.core.paused for r in s.ranks))
            with pytest.raises(PauseInProgressError):
                await engine.resume()
            with pytest.raises(PauseInProgressError):
                await engine.pause(PauseMode.KEEP)
            with pytest.raises(PauseInProgressError):
                await engine.sleep(1)
        await engine.resume()
        assert tokens(await rest_of(stream, first)) == expected("drain", 300)


# -- sleep and wake ---------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("mode", list(PauseMode))
async def test_sleep_at_each_level_in_each_mode(
    engine: Engine, level: int, mode: PauseMode
) -> None:
    name = f"sleep-{level}-{mode.value}"
    with anyio.fail_after(HANG_GUARD):
        stream, first = await started(engine, name, 40, name)
        await engine.sleep(level, mode=mode)
        assert await engine.is_sleeping() and await engine.is_paused()
        stats = await engine.stats()
        asleep = ("scheduling",) if level == 0 else ("kv_cache", "scheduling", "weights")
        assert stats.asleep == asleep
        with pytest.raises(EngineAsleepError, match="wake_up first"):
            await engine.resume()
        async with anyio.create_task_group() as tg:
            late: list[Any] = []

            async def late_request() -> None:
                late.extend(await collect(engine, "while asleep", SamplingParams(max_tokens=3)))

            tg.start_soon(late_request)
            held = await until(engine, lambda s: len(s.held) == 1)
            assert "asleep" in next(iter(held.held.values()))
            await engine.wake_up()
        deltas = await rest_of(stream, first)
    assert not await engine.is_sleeping() and not await engine.is_paused()
    assert tokens(late) == expected("while asleep", 3)
    if mode is PauseMode.ABORT:
        # Aborted where it ran, unless its rank finished it before the sleep reached it
        # (a loaded machine can hold this task back that long).
        finished = deltas[-1].finish_reason == "length" and tokens(deltas) == expected(name, 40)
        assert deltas[-1].finish_reason == "abort" or finished
    else:
        # Kept (or drained) requests are recomputed after a sleep dropped their KV cache.
        assert tokens(deltas) == expected(name, 40)
        assert deltas[-1].finish_reason == "length"


async def test_a_partial_wake_keeps_scheduling_paused(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        await engine.sleep(1)
        await engine.wake_up(["weights"])
        assert (await engine.stats()).asleep == ("kv_cache", "scheduling")
        await engine.wake_up(["kv_cache"])
        assert (await engine.stats()).asleep == ("scheduling",)
        assert await engine.is_sleeping()
        with pytest.raises(EngineAsleepError):
            await engine.resume()
        await engine.wake_up(["scheduling"])
        stats = await engine.stats()
        assert stats.asleep == () and stats.paused is None
        assert tokens(await collect(engine, "awake", SamplingParams(max_tokens=3))) == expected(
            "awake", 3
        )


# -- refused calls ----------------------------------------------------------------------


async def test_every_bad_call_is_refused_with_its_own_error(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream, first = await started(engine, "bystander", 30, "bystander")
        with pytest.raises(InvalidRequestError, match="sleep level"):
            await engine.sleep(3)
        with pytest.raises(InvalidRequestError, match="pause mode"):
            await engine.pause("frozen")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="pause mode"):
            await engine.sleep(1, mode="later")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="unknown wake_up tag"):
            await engine.wake_up(["brain"])
        with pytest.raises(InvalidRequestError, match="not the string"):
            await engine.wake_up("weights")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="dp_rank"):
            await collect(engine, "x", SamplingParams(), dp_rank=engine.dp_size)
        with pytest.raises(DuplicateRequestError):
            await collect(engine, "x", SamplingParams(), request_id="bystander")
        with pytest.raises(EmptyPromptError):
            await collect(engine, "", SamplingParams())
        with pytest.raises(PromptTooLongError):
            await collect(engine, "y" * 600, SamplingParams())
        with pytest.raises(ScalingRefusedError, match="new_dp_size"):
            await engine.scale(0)
        await engine.pause(PauseMode.KEEP)
        with pytest.raises(ScalingRefusedError):
            await engine.scale(engine.dp_size + 1)
        await engine.resume()
        # None of it disturbed the request in flight.
        assert tokens(await rest_of(stream, first)) == expected("bystander", 30)


# What a careless or hostile caller passes, and the engine's own error for it: the same at
# every dp size (text crosses the wire between processes as UTF-8, so a lone surrogate
# must be refused before it gets there, and in one rank's process too).
LONE = "\ud800"
BAD_CALLS: dict[str, tuple[Any, type[Exception], str]] = {
    "bytes prompt": (lambda e: collect(e, b"hi", SamplingParams()), InvalidRequestError, "bytes"),
    "bytearray prompt": (
        lambda e: collect(e, bytearray(b"hi"), SamplingParams()),
        InvalidRequestError,
        "bytearray",
    ),
    "list request id": (
        lambda e: collect(e, "x", SamplingParams(), request_id=["a"]),
        InvalidRequestError,
        "request_id",
    ),
    "int request id": (
        lambda e: collect(e, "x", SamplingParams(), request_id=5),
        InvalidRequestError,
        "request_id",
    ),
    "surrogate request id": (
        lambda e: collect(e, "x", SamplingParams(), request_id="a" + LONE),
        InvalidRequestError,
        "request_id is not valid Unicode",
    ),
    "surrogate prompt": (
        lambda e: collect(e, "bad " + LONE, SamplingParams()),
        InvalidRequestError,
        "the prompt is not valid Unicode",
    ),
    "surrogate chat message": (
        lambda e: collect(e, [{"role": "user", "content": LONE}], SamplingParams()),
        InvalidRequestError,
        "chat message 0 'content'",
    ),
    "surrogate stop string": (
        lambda e: collect(e, "x", SamplingParams(stop=["ok", LONE])),
        InvalidRequestError,
        r"params.stop\[1\]",
    ),
    "list abort": (lambda e: e.abort(["a"]), InvalidRequestError, "request_id"),
    "surrogate abort": (lambda e: e.abort(LONE), InvalidRequestError, "not valid Unicode"),
    "text drain timeout": (
        lambda e: e.scale(3, drain_timeout="x"),
        ScalingRefusedError,
        "drain_timeout",
    ),
    "nan drain timeout": (
        lambda e: e.scale(3, drain_timeout=float("nan")),
        ScalingRefusedError,
        "drain_timeout",
    ),
    "wake_up tags not a list": (lambda e: e.wake_up(5), InvalidRequestError, "list of tags"),
    "text rpc timeout": (
        lambda e: e.collective_rpc("echo", timeout="y"),
        InvalidRequestError,
        "timeout",
    ),
}


async def test_bad_arguments_are_refused_alike_at_every_dp_size(engine: Engine) -> None:
    with anyio.fail_after(HANG_GUARD):
        stream, first = await started(engine, "onlooker", 30, "onlooker")
        for call, error, match in BAD_CALLS.values():
            with pytest.raises(error, match=match):
                await call(engine)
        # None of it disturbed the request in flight, nor the engine.
        assert tokens(await rest_of(stream, first)) == expected("onlooker", 30)
        assert tokens(await collect(engine, "after", SamplingParams(max_tokens=5))) == expected(
            "after", 5
        )
