"""Per-client fairness of `wavecore serve`: a light client's latency with a heavy caller
running, against its latency on an idle server (issue 28: within 2x).

The light client (connecting from 127.0.0.2) sends `--light-requests` completions one
after another, each of `--light-tokens` tokens, and times each. The heavy caller (from
127.0.0.1) keeps `--heavy-calls` calls in flight at all times, each of
`--heavy-prompts` prompts and `--heavy-tokens` tokens: far more engine requests than
the engine runs at once. Each server runs the null executor with a fixed step time
(`--null-step-ms`, a device whose step hardly depends on the batch), so the figure is
the admission order, not the CPU's batch cost; the heavy caller's HTTP work still
shares the machine with the server.

Two servers, side by side in one run: fair admission at its defaults, and the old
first-come-first-served order (fair admission set out of the way:
`--max-inflight` and `--max-inflight-per-client` past anything the heavy caller sends).
For each: the light client's p50 and p90 latency idle and under load, their ratio, and
the heavy caller's output tokens/s meanwhile (what the per-client cap costs it).

Prints a table and writes bench/results/fairness.json. `--quick` shrinks it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from machine import describe  # bench/machine.py, beside this script
from serve import print_table, running_server  # bench/serve.py, beside this script

RESULTS = Path(__file__).resolve().parent / "results"
MAX_NUM_SEQS = 16
UNBOUNDED = str(10**6)


def body(prompts: int, tokens: int) -> dict[str, Any]:
    prompt: Any = ["count to ten"] * prompts if prompts > 1 else "count to ten"
    return {"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True}


async def light_latencies(url: str, requests: int, tokens: int) -> list[float]:
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    seconds = []
    async with httpx.AsyncClient(base_url=url, timeout=None, transport=transport) as light:
        for _ in range(requests):
            start = time.perf_counter()
            response = await light.post("/v1/completions", json=body(1, tokens))
            response.raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds


async def under_load(url: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """The light client's latencies while the heavy caller keeps its calls in flight;
    also the heavy caller's output tokens per second meanwhile (its calls that ended)."""
    done = 0
    stop = anyio.Event()

    async def heavy_loop(heavy: httpx.AsyncClient) -> None:
        nonlocal done
        while not stop.is_set():
            response = await heavy.post(
                "/v1/completions", json=body(args.heavy_prompts, args.heavy_tokens)
            )
            response.raise_for_status()
            done += 1

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as heavy,
        anyio.create_task_group() as tg,
    ):
        for _ in range(args.heavy_calls):
            tg.start_soon(heavy_loop, heavy)
        # Let the heavy backlog build before the light client starts.
        await anyio.sleep(args.warmup)
        start, done_before = time.perf_counter(), done
        seconds = await light_latencies(url, args.light_requests, args.light_tokens)
        heavy_tokens = (done - done_before) * args.heavy_prompts * args.heavy_tokens
        heavy_rate = heavy_tokens / (time.perf_counter() - start)
        stop.set()
        tg.cancel_scope.cancel()
    return seconds, heavy_rate


def figures(mode: str, idle: list[float], loaded: list[float], heavy_rate: float) -> dict:
    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=10)[q // 10 - 1] if len(values) > 1 else values[0]

    ms = 1000.0
    return {
        "admission": mode,
        "idle_p50_ms": round(statistics.median(idle) * ms, 1),
        "idle_p90_ms": round(p(idle, 90) * ms, 1),
        "loaded_p50_ms": round(statistics.median(loaded) * ms, 1),
        "loaded_p90_ms": round(p(loaded, 90) * ms, 1),
        "ratio_p50": round(statistics.median(loaded) / statistics.median(idle), 2),
        "ratio_p90": round(p(loaded, 90) / p(idle, 90), 2),
        "heavy_tokens_per_s": round(heavy_rate, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS / "fairness.json")
    parser.add_argument("--null-step-ms", type=float, default=20.0)
    parser.add_argument("--light-requests", type=int, default=20)
    parser.add_argument("--light-tokens", type=int, default=16)
    parser.add_argument("--heavy-calls", type=int, default=8)
    parser.add_argument("--heavy-prompts", type=int, default=16)
    parser.add_argument("--heavy-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of heavy load first")
    args = parser.parse_args()
    if args.quick:
        args.light_requests, args.heavy_calls, args.heavy_tokens, args.warmup = 4, 2, 16, 0.5

    engine = [
        "--executor",
        "null",
        "--null-step-ms",
        str(args.null_step_ms),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-requests-per-call",
        str(args.heavy_prompts),
    ]
    modes = {
        "fair (defaults)": [],
        "first come, first served": [
            "--max-inflight",
            UNBOUNDED,
            "--max-inflight-per-client",
            UNBOUNDED,
            "--max-queued-per-client",
            UNBOUNDED,
        ],
    }
    rows = []
    for mode, flags in modes.items():
        with running_server([*engine, *flags]) as server:
            idle = anyio.run(light_latencies, server.url, args.light_requests, args.light_tokens)
            loaded, heavy_rate = anyio.run(under_load, server.url, args)
        rows.append(figures(mode, idle, loaded, heavy_rate))
        print_table(rows[-1:])
    print()
    print_table(rows)
    result = {
        "machine": describe(),
        "workload": {
            "null_step_ms": args.null_step_ms,
            "max_num_seqs": MAX_NUM_SEQS,
            "light": {"requests": args.light_requests, "tokens": args.light_tokens},
            "heavy": {
                "calls_in_flight": args.heavy_calls,
                "prompts_per_call": args.heavy_prompts,
                "tokens": args.heavy_tokens,
            },
        },
        "rows": rows,
    }
    print(json.dumps(result["machine"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
