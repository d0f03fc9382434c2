"""`wavecore serve` under open-loop load: does HTTP keep up with the engine?

An open-loop load generator (Poisson arrivals at a request rate, like the upstream
`bench serve`) sends streamed completions over the 64 prompts of bench/generate.py
(token ids, greedy, a fixed number of output tokens) to a `wavecore serve` process:
- at several request rates: request throughput, output tokens/s, time to first token,
  inter-token latency (per streamed chunk) and end-to-end latency, p50/p99;
- at saturation (every request at once): the server's output tokens/s against the
  in-process engine (`open_engine`) on the same workload; the target is >= 0.9x;
- with the null executor and 16-token responses: the highest request rate the server
  sustains (completes >= 90% of the offered rate with TTFT p99 under a second).
The client runs in this process on the same machine, so it competes with the server
for the CPU: on a small machine the sustained rate is a floor. It stands for many users
but connects from one address, so the servers let one client have as many requests in
flight as the engine runs at once (`--max-inflight-per-client`; bench/fairness.py
measures that limit's purpose).

Prints a table, writes bench/results/serve.json and plots latency against request
rate as a PNG. `--quick` shrinks everything (null executor) for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from generate import make_prompts, run_wavecore  # bench/generate.py, beside this script
from machine import describe  # bench/machine.py, beside this script

from wavecore.engine.cli.latency import RequestTimer, RunSummary, percentile
from wavecore.engine.config import EngineConfig

RESULTS = Path(__file__).resolve().parent / "results"
KV_CACHE_MEMORY = 2 * 2**30
STARTUP_GUARD = 300.0


@dataclass(frozen=True, slots=True)
class Server:
    process: subprocess.Popen[str]
    url: str


@contextmanager
def running_server(flags: Sequence[str]) -> Iterator[Server]:
    """`wavecore serve --port 0 FLAGS` until the block ends (then SIGTERM, exit 0)."""
    command = [sys.executable, "-m", "wavecore.engine.cli.main", "serve", "--port", "0"]
    process = subprocess.Popen([*command, *flags], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = ""
        deadline = time.monotonic() + STARTUP_GUARD
        for line in process.stdout:
            if line.startswith("serving on "):
                url = line.removeprefix("serving on ").strip()
            if line.startswith("ready: "):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready")
        else:
            raise RuntimeError(f"the server exited with status {process.wait()}")
        yield Server(process, url)
    finally:
        process.terminate()
        process.wait(timeout=60)
        if process.stdout is not None:
            process.stdout.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class RateRun:
    summary: RunSummary
    e2e: list[float]
    failures: int
    # Requests over the time they took to arrive: a short Poisson run offers its
    # nominal rate only on average.
    arrival_rate: float


async def run_rate(
    url: str, prompts: Sequence[list[int]], new_tokens: int, rate: float, seed: int = 0
) -> RateRun:
    """Every prompt once, arriving as a Poisson process at `rate` requests/s (all at
    once for an infinite rate), each a streamed completion of `new_tokens` tokens."""
    rng = random.Random(seed)
    timers: list[RequestTimer] = []
    e2e: list[float] = []
    outputs = 0
    failures = 0

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        nonlocal outputs, failures
        body = {
            "prompt": prompt,
            "max_tokens": new_tokens,
            "min_tokens": new_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        timer = RequestTimer()
        last = ""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                failures += 1
                return
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"choices":[]' not in line:
                    timer.tokens_arrived(1)  # one chunk per engine step
                elif line.startswith("data: {"):
                    last = line
        timers.append(timer)
        e2e.append(time.perf_counter() - timer.start)
        outputs += json.loads(last.removeprefix("data: "))["usage"]["completion_tokens"]

    # Connections idle for a second are dropped by the client: a connection reused just
    # as the server closes it (its keep-alive timeout is 5 s) fails without a response,
    # and a loaded client can lag that much.
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0
    )
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for number, prompt in enumerate(prompts):
                if number and math.isfinite(rate):
                    await anyio.sleep(rng.expovariate(rate))
                tg.start_soon(one, client, prompt)
            arrived = time.perf_counter() - start
        seconds = time.perf_counter() - start
    summary = RunSummary.of(
        timers, prompt_tokens=sum(map(len, prompts)), output_tokens=outputs, seconds=seconds
    )
    arrival_rate = (len(prompts) - 1) / arrived if arrived > 0 else math.inf
    return RateRun(summary=summary, e2e=e2e, failures=failures, arrival_rate=arrival_rate)


def row(kind: str, rate: float, run: RateRun) -> dict[str, Any]:
    s = run.summary
    ms = 1000.0
    return {
        "kind": kind,
        "rate": rate if math.isfinite(rate) else "inf",
        "arrival_rate": round(run.arrival_rate, 1) if math.isfinite(run.arrival_rate) else "inf",
        "requests": s.requests,
        "failures": run.failures,
        "requests_per_s": round(s.requests_per_s, 2),
        "output_tokens_per_s": round(s.output_tokens_per_s, 1),
        "ttft_p50_ms": round(s.ttft_p50 * ms, 1),
        "ttft_p99_ms": round(s.ttft_p99 * ms, 1),
        "itl_p50_ms": round(s.itl_p50 * ms, 2),
        "itl_p99_ms": round(s.itl_p99 * ms, 2),
        "e2e_p50_ms": round(percentile(run.e2e, 50) * ms, 1),
        "e2e_p99_ms": round(percentile(run.e2e, 99) * ms, 1),
    }


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(" | ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print(" | ".join(f"{r[c]!s:>{w}}" for c, w in zip(columns, widths, strict=True)))


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, kind in zip(axes, ("model", "null"), strict=True):
        mine = [r for r in rows if r["kind"] == kind and r["rate"] != "inf"]
        if not mine:
            axis.set_visible(False)
            continue
        rates = [r["rate"] for r in mine]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
            axis.plot(rates, [r[key] for r in mine], marker="o", label=key)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("offered request rate (requests/s)")
        axis.set_ylabel("latency (ms)")
        axis.set_title(f"wavecore serve, {kind} executor")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def sustained(rows: Sequence[dict[str, Any]]) -> float | None:
    """The highest arrival rate the server kept up with: every request served, at
    least 90% of the arrival rate completed per second, TTFT p99 under a second (an
    overloaded server's queue, and so its TTFT, grows without bound)."""
    kept = [
        r["arrival_rate"]
        for r in rows
        if r["kind"] == "null"
        and r["rate"] != "inf"
        and r["failures"] == 0
        and r["requests_per_s"] >= 0.9 * r["arrival_rate"]
        and r["ttft_p99_ms"] < 1000
    ]
    return max(kept, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, null executor only")
    parser.add_argument("--output", type=Path, default=RESULTS / "serve.json")
    parser.add_argument("--prompts", type=int, default=64, help="model runs: prompts")
    parser.add_argument("--new-tokens", type=int, default=128, help="model runs: output tokens")
    parser.add_argument(
        "--model-rates",
        default="0.25,0.5,1,inf",
        help="model runs: request rates, comma-separated ('inf': all at once; '' skips)",
    )
    parser.add_argument("--null-rates", default="50,100,200,400,800")
    parser.add_argument("--null-seconds", type=float, default=5.0, help="arrivals per null rate")
    args = parser.parse_args()

    count, new_tokens = args.prompts, args.new_tokens
    model_rates = tuple(float(r) for r in args.model_rates.split(",") if r)
    null_rates = tuple(float(r) for r in args.null_rates.split(",") if r)
    null_seconds = args.null_seconds
    if args.quick:
        count, new_tokens, model_rates, null_rates, null_seconds = 8, 8, (), (20.0, 80.0), 1.0
    rows: list[dict[str, Any]] = []
    comparison: dict[str, Any] = {}

    if model_rates:
        engine = ["--max-num-seqs", "64", "--kv-cache-memory", str(KV_CACHE_MEMORY)]
        prompts = make_prompts(count, 16, 512, 49152)
        flags = [*engine, "--enable-admin-api", "--max-inflight-per-client", "64"]
        with running_server(flags) as server:
            for rate in model_rates:
                # Every rate sends the same prompts: each starts from an empty prefix
                # cache, as the in-process engine below does.
                httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
                rows.append(
                    row("model", rate, anyio.run(run_rate, server.url, prompts, new_tokens, rate))
                )
                print_table(rows[-1:])
        config = EngineConfig(max_num_seqs=64, kv_cache_memory=KV_CACHE_MEMORY)
        alone = anyio.run(run_wavecore, config, prompts, new_tokens, count)
        served = rows[-1]["output_tokens_per_s"]
        comparison = {
            "server_output_tokens_per_s": served,
            "in_process_output_tokens_per_s": round(alone.output_tokens_per_s, 1),
            "ratio": round(served / alone.output_tokens_per_s, 3),
        }
        print(json.dumps(comparison))

    null_prompts = make_prompts(64, 16, 512, 250)
    null = ["--executor", "null", "--max-num-seqs", "256", "--max-inflight-per-client", "256"]
    with running_server(null) as server:
        for rate in null_rates:
            total = max(8, int(rate * null_seconds))
            prompts = [null_prompts[i % len(null_prompts)] for i in range(total)]
            rows.append(row("null", rate, anyio.run(run_rate, server.url, prompts, 16, rate)))
            print_table(rows[-1:])

    print()
    print_table(rows)
    result = {
        "machine": describe(),
        "workload": {"prompts": count, "prompt_tokens": [16, 512], "new_tokens": new_tokens},
        "rows": rows,
        "saturation_vs_in_process": comparison,
        "null_sustained_requests_per_s": sustained(rows),
    }
    print(
        json.dumps(
            {k: result[k] for k in ("saturation_vs_in_process", "null_sustained_requests_per_s")}
        )
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
