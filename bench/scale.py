"""Elastic scaling under steady load, with the null executor.

Workload: `--workers` tasks each submit requests of `--max-tokens` tokens one after the
other, for the whole run, on a lockstep DP engine of `--start` ranks. After `--steady`
seconds the engine scales up by one rank; `--steady` seconds later it scales back down;
the run ends `--steady` seconds after that.

Figures: the time of each `scale` call, from the call to its return; the streamed
tokens per second in 1-second bins; and the dip of each scale, the lowest 1-second
throughput from the call to one bin after its return, as a fraction of the peer: the
mean 1-second throughput of the steady phase before that scale (same run).

Output: a table, bench/results/scale.json, and a plot of throughput over time with the
scale events marked (bench/results/scale.png).

Usage: python bench/scale.py [--quick] [--start N] [--workers N] [--max-tokens N]
       [--steady SECONDS] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
BIN_S = 1.0


class Load:
    """Steady request stream; records (time, tokens) of every delta."""

    def __init__(self, engine: Engine, workers: int, max_tokens: int) -> None:
        self.engine = engine
        self.workers = workers
        self.max_tokens = max_tokens
        self.arrivals: list[tuple[float, int]] = []
        self.lost = 0
        self.stop = anyio.Event()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for worker in range(self.workers):
                tg.start_soon(self._worker, worker)

    async def _worker(self, worker: int) -> None:
        number = 0
        while not self.stop.is_set():
            number += 1
            params = SamplingParams(max_tokens=self.max_tokens)
            received = 0
            async for delta in self.engine.generate(f"bench {worker} {number}", params):
                self.arrivals.append((time.perf_counter(), len(delta.token_ids)))
                received += len(delta.token_ids)
            if received != self.max_tokens:
                self.lost += 1


def throughput_bins(arrivals: list[tuple[float, int]], start: float, end: float) -> list[float]:
    count = max(1, int((end - start) / BIN_S))
    bins = [0.0] * count
    for when, tokens in arrivals:
        index = int((when - start) / BIN_S)
        if 0 <= index < count:
            bins[index] += tokens / BIN_S
    return bins


def dip(bins: list[float], steady: tuple[float, float], event: tuple[float, float]) -> float:
    peer = statistics.fmean(bins[int(steady[0]) : max(int(steady[0]) + 1, int(steady[1]))])
    low = min(bins[int(event[0]) : int(event[1]) + 2] or [0.0])
    return low / peer if peer else 0.0


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        executor="null",
        dp_size=args.start,
        max_num_seqs=max(8, args.workers),
        startup_timeout=120.0,
    )
    events: list[dict[str, Any]] = []
    async with open_dp_engine(config) as engine:
        load = Load(engine, args.workers, args.max_tokens)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run)
            for size in (args.start + 1, args.start):
                phase_start = time.perf_counter() - start
                await anyio.sleep(args.steady)  # the steady phase itself, not a race guard
                called = time.perf_counter() - start
                await engine.scale(size)
                returned = time.perf_counter() - start
                events.append(
                    {
                        "to_dp_size": size,
                        "steady_from_s": phase_start,
                        "called_s": called,
                        "returned_s": returned,
                        "seconds": returned - called,
                    }
                )
            await anyio.sleep(args.steady)
            load.stop.set()
        end = time.perf_counter()
    bins = throughput_bins(load.arrivals, start, end)
    for event in events:
        event["dip"] = dip(
            bins,
            (event["steady_from_s"], event["called_s"]),
            (event["called_s"], event["returned_s"]),
        )
    return {"events": events, "bins": bins, "lost_requests": load.lost}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    bins = result["bins"]
    axis.plot([BIN_S * (i + 0.5) for i in range(len(bins))], bins, marker="o")
    for event in result["events"]:
        axis.axvspan(event["called_s"], event["returned_s"], color="orange", alpha=0.3)
        axis.annotate(
            f"-> {event['to_dp_size']}", (event["called_s"], max(bins or [1])), fontsize=8
        )
    axis.set_xlabel("time (s)")
    axis.set_ylabel("streamed tokens / s (1 s bins)")
    axis.set_title("throughput while scaling (shaded: scale call to return)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--start", type=int, default=2)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steady", type=float, default=5.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.start, args.workers, args.max_tokens, args.steady = 1, 4, 8, 1.0
    result = anyio.run(measure, args)
    print(f"{'event':<14}{'seconds':>10}{'dip vs steady before':>24}")
    for event in result["events"]:
        name = f"scale to {event['to_dp_size']}"
        print(f"{name:<14}{event['seconds']:>10.2f}{event['dip']:>23.2f}x")
    print(f"lost requests: {result['lost_requests']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "quick": args.quick,
        "machine": platform.platform(),
        "start_dp_size": args.start,
        "workers": args.workers,
        "max_tokens": args.max_tokens,
        **result,
    }
    args.output.write_text(json.dumps(payload, indent=2))
    plot(result, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
