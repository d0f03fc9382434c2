"""The fault-injection soak of `on_rank_failure="shrink"` (issue 15): a DP engine of
null-executor ranks under steady load while random ranks are killed, or stopped and
continued, at random moments of a seeded schedule.

What one run checks: no hang (a hang guard), every request ends exactly once, a
request that finished ("length") carries exactly the null executor's tokens, one that
ended with "error" names a rank the run killed, no exception reaches a caller, and
after the block no process is left. Used by `test_dp_rank_loss.py` (a few seeds) and
`make soak` (`SOAK_SEEDS` of them).
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field
from typing import Any

import anyio
from dp_helpers import client_of, expected_tokens, null_config, tokens_of, wiring_of

from wavecore.engine.api import open_dp_engine
from wavecore.engine.sampling_params import SamplingParams

HANG_GUARD = 60.0  # seconds for a whole run; reached only if something hangs
COLLECTIVE_TIMEOUT = 3.0  # longer than any stop of the schedule: a stopped rank recovers
WORKERS = 6


@dataclass(slots=True)
class SoakResult:
    finished: int = 0
    errors: int = 0  # requests that ended with "error" (on a killed rank, with output)
    kills: int = 0
    stops: int = 0
    shrink_seconds: list[float] = field(default_factory=list)  # loss seen -> serving
    recovery_seconds: list[float] = field(default_factory=list)  # SIGKILL -> serving
    problems: list[str] = field(default_factory=list)


async def soak(seed: int, *, dp_mode: str, dp_size: int = 3, faults: int = 3) -> SoakResult:
    """One seeded run; the result lists every violated check in `problems`."""
    rng = random.Random(seed)
    result = SoakResult()
    ended: dict[str, int] = {}
    config = null_config(
        dp_size=dp_size,
        dp_mode=dp_mode,
        on_rank_failure="shrink",
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    killed: set[str] = set()
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            client = client_of(engine)
            processes = wiring_of(engine).processes
            stop = anyio.Event()

            async def worker(index: int) -> None:
                draws = random.Random(seed * 1000 + index)
                number = 0
                while not stop.is_set():
                    prompt = f"soak {seed} {index} {number}"
                    count = draws.randint(20, 200)
                    number += 1
                    await one_request(prompt, count)

            async def one_request(prompt: str, count: int) -> None:
                deltas: list[Any] = []
                try:
                    async for delta in engine.generate(prompt, SamplingParams(max_tokens=count)):
                        deltas.append(delta)
                except Exception as error:  # any exception is a violation here
                    result.problems.append(f"{prompt!r} raised {type(error).__name__}: {error}")
                ended[prompt] = ended.get(prompt, 0) + 1
                if not deltas or deltas[-1].finish_reason is None:
                    return
                last = deltas[-1]
                if last.finish_reason == "length":
                    result.finished += 1
                    if tokens_of(deltas) != expected_tokens(prompt, count):
                        result.problems.append(f"{prompt!r} finished with the wrong tokens")
                elif last.finish_reason == "error":
                    result.errors += 1
                    if not any(f"{name} lost" in (last.error or "") for name in killed):
                        result.problems.append(f"{prompt!r} error names no killed rank")
                else:
                    result.problems.append(f"{prompt!r} finished {last.finish_reason!r}")

            async def inject() -> None:
                for _ in range(faults):
                    await anyio.sleep(rng.uniform(0.05, 0.4))
                    ranks = sorted(
                        (name, process)
                        for name, process in processes.items()
                        if name.startswith("rank ") and "retired" not in name
                    )
                    name, process = rng.choice(ranks)
                    if len(ranks) > 1 and rng.random() < 0.5:
                        shrunk = client.shrunk
                        killed.add(name)
                        started = anyio.current_time()
                        os.kill(process.pid, signal.SIGKILL)
                        result.kills += 1
                        await shrunk.wait()  # serving again, one rank fewer
                        result.recovery_seconds.append(anyio.current_time() - started)
                    else:
                        os.kill(process.pid, signal.SIGSTOP)
                        await anyio.sleep(rng.uniform(0.05, 0.5))
                        os.kill(process.pid, signal.SIGCONT)
                        result.stops += 1
                await anyio.sleep(0.2)
                stop.set()

            async with anyio.create_task_group() as tg:
                for index in range(WORKERS):
                    tg.start_soon(worker, index)
                tg.start_soon(inject)
            result.shrink_seconds = list(client.shrink_seconds)
        for name, process in processes.items():
            if process.pid is not None and process.exitcode is None:
                result.problems.append(f"{name} (pid {process.pid}) outlived the engine")
    result.problems += [f"{p!r} ended {n} times" for p, n in ended.items() if n != 1]
    return result
