"""An old rank killed or stopped at each phase of a scale up and a scale down
(issue 15, `on_rank_failure="shrink"`): the scale fails naming the phase, the rank and
the cause; the engine goes on with every healthy member (`ScalingMachine` rule 10);
requests on healthy ranks finish exactly, the lost rank's end with finish reason
"error" naming it, and a new request completes on every rank afterwards. With "fail"
a stopped rank ends the engine, named. Null-executor ranks in processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from dp_helpers import (
    HANG_GUARD,
    client_of,
    collect,
    expected_tokens,
    null_config,
    tokens_of,
    wiring_of,
)

from wavecore.engine import messages as m
from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.dp.process_state import is_stopped
from wavecore.engine.errors import EngineDeadError, ScalingFailedError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

TOKENS = 5000  # in flight across the whole scale
# collective_timeout: a stopped rank is named within 2 * this; 2 s was too short for a
# new group's rendezvous on 2 cores shared with other jobs.
TIMEOUT = 3.0
VICTIM = 1


class _Load:
    """Requests pinned to ranks, each collected by a task of `tg`; `start` returns once
    every one streamed (so the victim's has output when it is hit)."""

    def __init__(self, engine: Engine, tg: anyio.abc.TaskGroup) -> None:
        self.engine = engine
        self.tg = tg
        self.deltas: dict[str, list[Any]] = {}
        self.prompts: dict[str, int] = {}
        self._starting = anyio.Lock()  # a scale calls ranks concurrently

    async def start(self, ranks: range) -> None:
        async with self._starting:
            if not self.deltas:
                await self._start(ranks)

    async def _start(self, ranks: range) -> None:
        for rank in ranks:
            prompt = f"on rank {rank}"
            self.prompts[prompt] = rank
            self.deltas[prompt] = []
            streaming = anyio.Event()
            self.tg.start_soon(self._run, prompt, rank, streaming)
            await streaming.wait()

    async def _run(self, prompt: str, rank: int, streaming: anyio.Event) -> None:
        params = SamplingParams(max_tokens=TOKENS)
        async for delta in self.engine.generate(prompt, params, dp_rank=rank):
            self.deltas[prompt].append(delta)
            streaming.set()

    def check(self, lost: str) -> None:
        """The victim's request ends with `lost` in its error; every other is exact."""
        for prompt, stream in self.deltas.items():
            last = stream[-1]
            if self.prompts[prompt] == VICTIM:
                assert last.finish_reason == "error", prompt
                assert lost in last.error
            else:
                assert (last.finish_reason, last.error) == ("length", None), prompt
                assert tokens_of(stream) == expected_tokens(prompt, TOKENS)


def _hit(engine: Engine, how: signal.Signals, at: list[float]) -> bool:
    """Hit the victim; True when the scale is to see a death."""
    os.kill(wiring_of(engine).processes[f"rank {VICTIM}"].pid, how)
    at.append(anyio.current_time())
    return how is signal.SIGKILL


async def _serves_on_every_rank(engine: Engine) -> None:
    for rank in range(engine.dp_size):
        prompt = f"after {rank}"
        deltas = await collect(engine, prompt, SamplingParams(max_tokens=5), dp_rank=rank)
        assert tokens_of(deltas) == expected_tokens(prompt, 5)


def _hook(
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    load: _Load,
    phase: str,
    fault: Callable[[], bool],
) -> None:
    """Start the load on ranks 0 and 1, then hit the victim, as the scale enters
    `phase`: at its first call to ranks there, or as it starts new ranks, drains, or
    resizes the coordinator. Ranks that pause hold new requests, so the load starts at
    the pause at the latest. A death is awaited until the scale took it, so that the
    phase it cuts into is the one it was hit in."""
    call_ranks = engine.call_ranks  # type: ignore[attr-defined]
    scaler = client_of(engine).scaler
    done: list[bool] = []
    taken = anyio.Event()
    take_loss = scaler.take_loss

    def taking(*args: Any, **kwargs: Any) -> None:
        take_loss(*args, **kwargs)
        taken.set()

    monkeypatch.setattr(scaler, "take_loss", taking)

    async def strike() -> None:
        if not done:
            done.append(True)
            if fault():
                await taken.wait()  # the loss then cuts into this very call

    async def calling(ranks: Any, message: Any) -> None:
        call = message(0)
        if isinstance(call, m.UtilityCall) and call.method == "pause":
            await load.start(range(2))
        kind = {m.SwitchGroup: "SWITCHING"}.get(type(call))
        if isinstance(call, m.UtilityCall):
            kind = {"pause": "PAUSING", "resume": "RESUMING"}.get(call.method)
        if kind == phase:
            await strike()
        await call_ranks(ranks, message)

    monkeypatch.setattr(engine, "call_ranks", calling)

    def before(original: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            await load.start(range(2))
            await strike()
            return await original(*args, **kwargs)

        return wrapped

    if phase == "STARTING":
        monkeypatch.setattr(scaler, "_start_ranks", before(scaler._start_ranks))
    elif phase == "DRAINING":
        monkeypatch.setattr(scaler, "_drain", before(scaler._drain))
    elif phase == "RESIZING":
        coordinator_size = engine.coordinator_size  # type: ignore[attr-defined]
        monkeypatch.setattr(engine, "coordinator_size", before(coordinator_size))


WHERE = {
    "STARTING": "during startup",
    "DRAINING": "while the leaving ranks drained",
    "PAUSING": "while pausing the ranks",
    "SWITCHING": "while switching to the new group",
    "RESIZING": "while resizing the coordinator",
    "RESUMING": "while resuming the ranks",
}
KILLED = "rank 1 lost (rank 1 died (killed by SIGKILL))"


# One phase each way and both signals (a stop while resuming a scale down) run in
# `make test`; the other cases of the matrix (about 8 s each on 2 cores) run in
# `make soak`.
_SOAK_ONLY = pytest.mark.skipif(not os.environ.get("SOAK_SEEDS"), reason="make soak runs it")


@pytest.mark.parametrize(
    ("old", "new", "phase", "how", "survivors"),
    [
        # Up 2 -> 3: the old group without rank 1 until the switch succeeded, the new
        # group without it after.
        (2, 3, "STARTING", signal.SIGKILL, 1),
        pytest.param(2, 3, "PAUSING", signal.SIGKILL, 1, marks=_SOAK_ONLY),
        pytest.param(2, 3, "PAUSING", signal.SIGSTOP, 1, marks=_SOAK_ONLY),
        pytest.param(2, 3, "SWITCHING", signal.SIGKILL, 1, marks=_SOAK_ONLY),
        pytest.param(2, 3, "RESIZING", signal.SIGKILL, 2, marks=_SOAK_ONLY),
        pytest.param(2, 3, "RESUMING", signal.SIGKILL, 2, marks=_SOAK_ONLY),
        # Down 3 -> 2: every old rank but 1 until the leaving rank stopped, then the
        # new group without it.
        pytest.param(3, 2, "DRAINING", signal.SIGKILL, 2, marks=_SOAK_ONLY),
        pytest.param(3, 2, "PAUSING", signal.SIGKILL, 2, marks=_SOAK_ONLY),
        pytest.param(3, 2, "SWITCHING", signal.SIGKILL, 1, marks=_SOAK_ONLY),
        pytest.param(3, 2, "RESIZING", signal.SIGKILL, 1, marks=_SOAK_ONLY),
        pytest.param(3, 2, "RESUMING", signal.SIGKILL, 1, marks=_SOAK_ONLY),
        (3, 2, "RESUMING", signal.SIGSTOP, 1),
    ],
)
async def test_an_old_rank_lost_during_a_scale_leaves_the_healthy_ones_serving(
    monkeypatch: pytest.MonkeyPatch,
    old: int,
    new: int,
    phase: str,
    how: signal.Signals,
    survivors: int,
) -> None:
    config = null_config(dp_size=old, on_rank_failure="shrink", collective_timeout=TIMEOUT)
    hit_at: list[float] = []
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            victim = wiring_of(engine).processes[f"rank {VICTIM}"]
            async with anyio.create_task_group() as tg:
                load = _Load(engine, tg)
                if phase == "DRAINING":  # the leaving rank holds a request to drain
                    await load.start(range(old))
                _hook(engine, monkeypatch, load, phase, lambda: _hit(engine, how, hit_at))
                with pytest.raises(ScalingFailedError) as failed:
                    await engine.scale(new)
                serving = anyio.current_time()
                monkeypatch.undo()
            message = str(failed.value)
            assert f"scaling from {old} to {new} ranks failed {WHERE[phase]}: " in message
            assert f"the engine goes on with {survivors} ranks" in message
            if how is signal.SIGKILL:
                assert KILLED in message
                load.check(KILLED)
            else:
                assert "rank 1 lost (rank 1 " in message and "stopped" in message
                load.check("rank 1 lost (rank 1 ")
            assert engine.dp_size == survivors
            await _serves_on_every_rank(engine)
            print(f"{old}->{new} {phase} {how.name}: serving {serving - hit_at[0]:.2f} s after")
        assert victim.exitcode == -signal.SIGKILL


@pytest.mark.parametrize(
    ("dp_mode", "named"),
    [
        # Pausing ranks vote: the vote names the stopped rank first.
        ("lockstep", "the engine ended: EngineDeadError: rank 1 is stopped (SIGSTOP"),
        # No collective: only the scale's bounded call notices it.
        pytest.param(
            "independent",
            "the engine cannot go on: RanksUnanswered: rank 1 did not answer ",
            marks=_SOAK_ONLY,
        ),
    ],
)
async def test_with_fail_a_rank_stopped_during_a_scale_ends_the_engine_named(
    monkeypatch: pytest.MonkeyPatch, dp_mode: str, named: str
) -> None:
    """on_rank_failure="fail": the scale neither hangs nor claims a rollback; the
    engine ends, naming the stopped rank, as a rank stuck outside a scale ends it."""
    config = null_config(dp_size=2, dp_mode=dp_mode, collective_timeout=TIMEOUT)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            call_ranks = engine.call_ranks  # type: ignore[attr-defined]
            victim = wiring_of(engine).processes[f"rank {VICTIM}"]

            async def stop_first(ranks: Any, message: Any) -> None:
                if victim.pid is not None and not is_stopped(victim.pid):
                    os.kill(victim.pid, signal.SIGSTOP)
                await call_ranks(ranks, message)

            monkeypatch.setattr(engine, "call_ranks", stop_first)
            with pytest.raises(ScalingFailedError) as failed:
                await engine.scale(1)
            monkeypatch.undo()
            message = str(failed.value)
            assert "scaling from 2 to 1 ranks failed while pausing the ranks" in message
            assert named in message
            with pytest.raises(EngineDeadError, match="rank 1"):
                await collect(engine, "after", SamplingParams(max_tokens=5))


async def test_a_second_loss_during_a_shrink_restarts_it_with_the_smaller_survivor_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dp 3: rank 1 is killed; while the survivors leave the broken group, the old
    rank 2 (now rank 1) is killed too. The shrink goes on with rank 0 alone instead of
    failing after `2 * collective_timeout`."""
    config = null_config(dp_size=3, on_rank_failure="shrink", collective_timeout=TIMEOUT)
    client_seconds: list[float] = []
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            client = client_of(engine)
            processes = wiring_of(engine).processes
            first, second = processes["rank 1"], processes["rank 2"]
            call_ranks = engine.call_ranks  # type: ignore[attr-defined]
            taken = anyio.Event()
            take_loss = client.scaler.take_loss

            def taking(*args: Any, **kwargs: Any) -> None:
                take_loss(*args, **kwargs)
                taken.set()

            async def leaving(ranks: Any, message: Any) -> None:
                if isinstance(message(0), m.LeaveGroup) and second.is_alive():
                    os.kill(second.pid, signal.SIGKILL)
                    await taken.wait()  # the loss then cuts into this very call
                await call_ranks(ranks, message)

            monkeypatch.setattr(engine, "call_ranks", leaving)
            monkeypatch.setattr(client.scaler, "take_loss", taking)
            async with anyio.create_task_group() as tg:
                load = _Load(engine, tg)
                await load.start(range(3))
                shrunk = client.shrunk
                os.kill(first.pid, signal.SIGKILL)
                await shrunk.wait()
            monkeypatch.undo()
            client_seconds = client.shrink_seconds
            assert engine.dp_size == 1
            lost = "rank 1 lost (rank 1 died (killed by SIGKILL))"
            for prompt, stream in load.deltas.items():
                last = stream[-1]
                if load.prompts[prompt] == 0:
                    assert tokens_of(stream) == expected_tokens(prompt, TOKENS)
                else:
                    assert last.finish_reason == "error" and lost in last.error, prompt
            await _serves_on_every_rank(engine)
            print(f"two losses: serving {client_seconds[0]:.2f} s after the first")
        assert first.exitcode == second.exitcode == -signal.SIGKILL
