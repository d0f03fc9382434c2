"""Scheduler overhead per running request per decode step, with the NullExecutor.

Workload: `--requests` requests (256 by default) are prefilled, then timed over
`--steps` pure decode steps; each step is `schedule()` + `NullExecutor.execute()` +
`update()`, so the figure is the engine-side Python cost a real model step pays on top
of its forward pass. Reported in microseconds per running request per step.

Peers. The upstream figure (about 12.7 us per running request, vLLM's scheduler plus
output processing) cannot be measured here (no vLLM on these machines), so it is
quoted, not measured. Measured in the same run: "contract floor", the cost of only
constructing one `SequenceChunk`, one `SampledToken` and one `RequestUpdate` per
request through their dataclass constructors, which any scheduler that speaks these
contracts naively pays before doing any scheduling at all.

Usage: python bench/scheduler.py [--quick] [--requests N] [--steps N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import time
from pathlib import Path

from wavecore.engine.executors.batch import SampledToken, SequenceChunk
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig

UPSTREAM_US_PER_REQUEST = 12.7
TARGET_US_PER_REQUEST = 5.0
RESULTS = Path(__file__).resolve().parent / "results" / "scheduler.json"


def _setup(num_requests: int, prompt_len: int, max_tokens: int) -> tuple[Scheduler, NullExecutor]:
    block_size = 16
    max_len = prompt_len + max_tokens + 1
    blocks_per_request = -(-max_len // block_size)
    executor = NullExecutor(
        num_kv_blocks=num_requests * blocks_per_request,
        block_size=block_size,
        max_model_len=max_len,
        vocab_size=32000,
        eos_token_id=2,
    )
    scheduler = Scheduler(
        SchedulerConfig.for_executor(
            executor,
            max_num_seqs=num_requests,
            max_num_batched_tokens=max(8192, num_requests * prompt_len),
            eos_token_id=2,
        )
    )
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for index in range(num_requests):
        # Distinct prompts, so prefix caching shares nothing and every step is pure decode.
        prompt = [(index * 7919 + offset) % 32000 for offset in range(prompt_len)]
        scheduler.add(f"req-{index}", prompt, sampling)
    # Prefill step: every request gets its first token.
    output = scheduler.schedule()
    scheduler.update(output, executor.execute(output.batch))
    if scheduler.num_running != num_requests:
        raise RuntimeError(f"expected {num_requests} running, got {scheduler.num_running}")
    return scheduler, executor


def _time_decode(num_requests: int, steps: int, repeats: int) -> dict[str, float]:
    """Best over repeats of per-phase microseconds per request per step.

    The best run is the one least disturbed by other work on a shared machine.
    """
    phases: dict[str, list[float]] = {"schedule": [], "execute": [], "update": [], "total": []}
    for _ in range(repeats):
        scheduler, executor = _setup(num_requests, prompt_len=32, max_tokens=steps + 2)
        spent = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
        clock = time.perf_counter
        # The collector stays on: a real engine pays its gen-0 passes too.
        gc.collect()
        for _ in range(steps):
            start = clock()
            output = scheduler.schedule()
            scheduled = clock()
            model_output = executor.execute(output.batch)
            executed = clock()
            updates = scheduler.update(output, model_output)
            done = clock()
            spent["schedule"] += scheduled - start
            spent["execute"] += executed - scheduled
            spent["update"] += done - executed
            if len(updates) != num_requests:
                raise RuntimeError(f"a decode step updated {len(updates)} requests")
        scale = 1e6 / (steps * num_requests)
        for name, seconds in spent.items():
            phases[name].append(seconds * scale)
        phases["total"].append(sum(spent.values()) * scale)
    return {name: min(values) for name, values in phases.items()}


def _time_contract_floor(num_requests: int, steps: int, repeats: int) -> float:
    sampling = SamplingParams(max_tokens=16)
    tokens = list(range(40))
    table = [0, 1, 2]
    ids = [f"req-{index}" for index in range(num_requests)]
    results = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        for _ in range(steps):
            for request_id in ids:
                SequenceChunk(
                    request_id=request_id,
                    token_ids=(tokens[-1],),
                    start_pos=39,
                    block_table=table,
                    sample=True,
                    sampling=sampling,
                    all_token_ids=tokens,
                    prompt_len=32,
                )
                sample = SampledToken(request_id=request_id, token_id=7)
                RequestUpdate(
                    request_id=request_id, new_token_ids=(7,), sampled=(sample,), finish_reason=None
                )
        results.append((time.perf_counter() - start) * 1e6 / (steps * num_requests))
    return min(results)


def _profile(num_requests: int, steps: int) -> None:
    scheduler, executor = _setup(num_requests, prompt_len=32, max_tokens=steps + 2)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        output = scheduler.schedule()
        scheduler.update(output, executor.execute(output.batch))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the loop")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.steps, args.repeats = 32, 10, 1

    if args.profile:
        _profile(args.requests, args.steps)
        return
    ours = _time_decode(args.requests, args.steps, args.repeats)
    floor = _time_contract_floor(args.requests, args.steps, args.repeats)

    rows = [
        ("wavecore schedule()", ours["schedule"], "measured"),
        ("wavecore NullExecutor.execute()", ours["execute"], "measured"),
        ("wavecore update()", ours["update"], "measured"),
        ("wavecore step total", ours["total"], "measured"),
        ("contract floor (3 dataclass inits)", floor, "measured"),
        ("upstream scheduler + output processing", UPSTREAM_US_PER_REQUEST, "quoted"),
        ("target", TARGET_US_PER_REQUEST, "assignment"),
    ]
    print(
        f"decode step overhead, {args.requests} running requests, {args.steps} steps, "
        f"best of {args.repeats}"
    )
    print(f"{'what':<42} {'us/request/step':>16} {'total vs this':>14}  source")
    for name, value, source in rows:
        print(f"{name:<42} {value:>16.2f} {ours['total'] / value:>13.2f}x  {source}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "benchmark": "scheduler",
                "quick": args.quick,
                "requests": args.requests,
                "steps": args.steps,
                "repeats": args.repeats,
                "python": platform.python_version(),
                "us_per_request_step": ours,
                "contract_floor_us": floor,
                "upstream_us_quoted": UPSTREAM_US_PER_REQUEST,
                "target_us": TARGET_US_PER_REQUEST,
                "ratio_total_to_upstream": ours["total"] / UPSTREAM_US_PER_REQUEST,
                "ratio_total_to_contract_floor": ours["total"] / floor,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
