"""End-to-end generation throughput: wavecore's async engine against transformers.

Side by side in one run, same model (the default SmolLM2-135M GGUF; wavecore on the
path `--weights`/`--dtype` name, by default "auto", the kernels it prints), same
prompts (token ids of mixed lengths), same number of output tokens, greedy:
- wavecore through `open_engine`/`generate` with up to C requests in flight;
- transformers `generate` with left padding, C prompts per batch.
For C in the concurrency sweep both run, each measurement in a fresh process; the
headline compares wavecore at C=64 against transformers at its best batch size.
Where llama-cpp-python is installed (`make bench-llamacpp`), llama.cpp runs the C=1
row's requests one at a time on the same GGUF (`bench/llamacpp_peer.py`), in a fresh
process too: one more line and the JSON's "llamacpp"; and the top concurrency's
requests all together in one cache (llama.cpp's batched decoding, prompts evaluated
one by one, then every sequence one token per call): the JSON's "llamacpp_batched".
Prints a table, writes bench/results/generate.json and plots throughput against
concurrency as a PNG; both name the CPU and the projection kernels wavecore chose
(`engine/model/kernel_choice.py`; `WAVECORE_KERNELS` forces them).

`--quick` shrinks everything for a smoke test; `--executor null --skip-peer` times the
engine alone without a model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import anyio
import llamacpp_peer  # bench/llamacpp_peer.py, beside this script
from machine import describe  # bench/machine.py, beside this script

from wavecore.engine.api import open_engine
from wavecore.engine.cli.latency import RequestTimer, RunSummary
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
KV_CACHE_MEMORY = 2 * 2**30
SYSTEMS = ("wavecore", "transformers")


def make_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of lengths spread over [low, high], deterministic by seed."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = low + (high - low) * i // max(1, count - 1)
        prompts.append([rng.randrange(100, vocab) for _ in range(length)])
    rng.shuffle(prompts)
    return prompts


async def run_wavecore(
    config: EngineConfig, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[RunSummary, dict[str, str]]:
    """The run's figures and the rank's kernel report (CPU, kernel per shape class)."""
    params = SamplingParams(
        max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True
    )
    limiter = anyio.CapacityLimiter(concurrency)
    timers: list[RequestTimer] = []
    outputs = 0

    async def one(prompt: list[int]) -> None:
        nonlocal outputs
        async with limiter:
            timer = RequestTimer()
            timers.append(timer)
            async for delta in engine.generate(prompt, params):
                timer.tokens_arrived(len(delta.token_ids))
                outputs += len(delta.token_ids)

    async with open_engine(config) as engine:
        # Warm up once so the first timed request does not pay for lazy set-up.
        async for _ in engine.generate(prompts[0][:8], SamplingParams(max_tokens=2)):
            pass
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(one, prompt)
        seconds = time.perf_counter() - start
        kernels = (await engine.stats()).ranks[0].kernels
    summary = RunSummary.of(
        timers, prompt_tokens=sum(map(len, prompts)), output_tokens=outputs, seconds=seconds
    )
    return summary, kernels


def _step_clock(timers: list[RequestTimer]):  # type: ignore[no-untyped-def]
    """A logits processor called once per generated position: each sequence got a token."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):  # type: ignore[no-untyped-def]
            for timer in timers:
                timer.tokens_arrived(1)
            return scores

    return StepClock()


class TransformersPeer:
    """transformers `generate`, left-padded batches, timing the first token by hook."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from wavecore.engine.model import default_model_path

        path = default_model_path()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        self.model.eval()

    def run(self, prompts: list[list[int]], new_tokens: int, batch: int) -> RunSummary:
        from transformers import LogitsProcessorList

        torch = self.torch
        timers: list[RequestTimer] = []
        outputs = 0
        pad = 0
        start = time.perf_counter()
        for first in range(0, len(prompts), batch):
            group = prompts[first : first + batch]
            longest = max(map(len, group))
            ids = torch.tensor([[pad] * (longest - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group])
            group_timers = [RequestTimer() for _ in group]

            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    logits_processor=LogitsProcessorList([_step_clock(group_timers)]),
                )
            outputs += (out.shape[1] - longest) * len(group)
            timers += group_timers
        seconds = time.perf_counter() - start
        return RunSummary.of(
            timers, prompt_tokens=sum(map(len, prompts)), output_tokens=outputs, seconds=seconds
        )


def measure(
    system: str, config: EngineConfig, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict[str, Any] | None:
    """One row of the table, measured in the calling process (None: llama.cpp is absent)."""
    if system == "wavecore":
        summary, kernels = anyio.run(run_wavecore, config, prompts, new_tokens, concurrency)
        return {**row(system, concurrency, summary), "kernels": kernels}
    if system == "llama.cpp":
        return measure_llamacpp(prompts, new_tokens)
    if system == "llama.cpp batched":
        return measure_llamacpp_batched(prompts, new_tokens, concurrency)
    summary = TransformersPeer().run(prompts, new_tokens, concurrency)
    return row(system, concurrency, summary)


def measure_llamacpp(prompts: list[list[int]], new_tokens: int) -> dict[str, Any] | None:
    """llama.cpp, one request at a time, with as many threads as the engine uses."""
    from wavecore.engine.model import default_model_path

    threads = len(os.sched_getaffinity(0))  # as `ModelExecutor` sets torch's
    n_ctx = max(map(len, prompts)) + new_tokens + 8
    llama = llamacpp_peer.open_peer(default_model_path(), threads, n_ctx)
    if llama is None:
        return None
    summary = llamacpp_peer.one_at_a_time(llama, prompts, new_tokens)
    llama.close()
    return {**row("llama.cpp", 1, summary), "version": llamacpp_peer.version()}


def measure_llamacpp_batched(
    prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict[str, Any] | None:
    """llama.cpp decoding all `prompts` together in one cache (its batched decoding)."""
    from wavecore.engine.model import default_model_path

    path = default_model_path()
    if not llamacpp_peer.importable(path):
        return None
    threads = len(os.sched_getaffinity(0))
    n_ctx = len(prompts) * (max(map(len, prompts)) + new_tokens + 8)
    with llamacpp_peer.batched_context(path, threads, len(prompts), n_ctx) as context:
        summary = llamacpp_peer.batched_generate(context, prompts, new_tokens)
    return {**row("llama.cpp batched", concurrency, summary), "version": llamacpp_peer.version()}


def measure_alone(
    system: str, config: EngineConfig, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> dict[str, Any] | None:
    """`measure` in a fresh process, so that no other system's threads share it.

    Sharing a process is not neutral: wavecore at C=64 ran 117 tokens/s alone and 98
    in a process that had loaded and run transformers first. transformers (and
    llama.cpp, through the same libgomp) leave an OpenMP team on the thread that ran
    them, which makes the engine's model thread pay a wake-up per parallel op
    (`machine.on_a_thread_of_its_own` says how).
    """
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, system, config, prompts, new_tokens, concurrency).result()


def requests_at(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The requests run at `concurrency`: low concurrency runs a few only; the figure is
    a rate."""
    return prompts[: max(4, min(len(prompts), 2 * concurrency))]


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """wavecore at its highest concurrency against transformers at its best batch size."""
    ours = {r["concurrency"]: r for r in rows if r["system"] == "wavecore"}
    top = ours[max(ours)]
    result: dict[str, Any] = {"wavecore_tokens_per_s": top["tokens_per_s"]}
    theirs = {r["concurrency"]: r for r in rows if r["system"] == "transformers"}
    if theirs:
        best = max(theirs.values(), key=lambda r: r["tokens_per_s"])
        result["transformers_best_tokens_per_s"] = best["tokens_per_s"]
        result["transformers_best_batch"] = best["concurrency"]
        result["throughput_ratio"] = round(top["tokens_per_s"] / best["tokens_per_s"], 2)
    if 1 in ours and 1 in theirs:
        result["batch1_itl_ratio"] = round(theirs[1]["itl_p50_ms"] / ours[1]["itl_p50_ms"], 2)
    return result


def row(system: str, concurrency: int, summary: RunSummary) -> dict[str, Any]:
    return {
        "system": system,
        "concurrency": concurrency,
        "requests": summary.requests,
        "output_tokens": summary.output_tokens,
        "seconds": round(summary.seconds, 3),
        "tokens_per_s": round(summary.output_tokens_per_s, 1),
        "requests_per_s": round(summary.requests_per_s, 3),
        "ttft_p50_ms": round(summary.ttft_p50 * 1000, 1),
        "ttft_p99_ms": round(summary.ttft_p99 * 1000, 1),
        "itl_p50_ms": round(summary.itl_p50 * 1000, 2),
        "itl_p99_ms": round(summary.itl_p99 * 1000, 2),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'system':<18}{'conc':>5}{'reqs':>6}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}"
    print(header)
    for r in rows:
        print(
            f"{r['system']:<18}{r['concurrency']:>5}{r['requests']:>6}{r['tokens_per_s']:>9.1f}"
            f"{r['requests_per_s']:>8.2f}{r['ttft_p50_ms']:>9.0f}ms{r['ttft_p99_ms']:>7.0f}ms"
            f"{r['itl_p50_ms']:>7.1f}ms{r['itl_p99_ms']:>6.1f}ms"
        )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for system in sorted({r["system"] for r in rows}):
        points = sorted(
            (r["concurrency"], r["tokens_per_s"]) for r in rows if r["system"] == system
        )
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("requests in flight (wavecore) / batch size (transformers)")
    axes.set_ylabel("output tokens/s")
    axes.set_title("generation throughput, SmolLM2-135M fp32, 2 CPU cores")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--executor", choices=["model", "null"], default="model")
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    parser.add_argument(
        "--weights",
        choices=("auto", "float32", "int8"),
        default="auto",
        help="wavecore's weight format (EngineConfig.weights; auto: the default path)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="wavecore's compute dtype (EngineConfig.dtype)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="wavecore's KV cache dtype (EngineConfig.kv_cache_dtype)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="the concurrencies to run (default 1 4 16 64; llama.cpp runs when 1 is one)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "generate.json")
    args = parser.parse_args()

    if args.quick:
        count, low, high, new_tokens, sweep = 8, 16, 64, 8, (1, 4)
    else:
        count, low, high, new_tokens, sweep = 64, 16, 512, 128, (1, 4, 16, 64)
    if args.concurrency:
        sweep = tuple(args.concurrency)
    # transformers' cache grows as it needs; the engine's is sized for the workload (64
    # sequences of up to 640 tokens need 1.8 GiB of float32 KV, half that in bfloat16),
    # as a server would be.
    config = EngineConfig(
        executor=args.executor,
        weights=args.weights,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_memory=2**28 if args.quick else KV_CACHE_MEMORY,
    )
    vocab = 250 if args.executor == "null" else 49152
    prompts = make_prompts(count, low, high, vocab)
    systems = ["wavecore"] if args.skip_peer or args.executor == "null" else SYSTEMS

    rows = []
    for concurrency in sweep:
        subset = requests_at(prompts, concurrency)
        for system in systems:
            rows.append(measure_alone(system, config, subset, new_tokens, concurrency))
        print_table(rows[-len(systems) :])

    llamacpp = None
    if args.executor == "model" and 1 in sweep:
        # The C=1 row's requests, so the two compare one to one.
        llamacpp = measure_alone("llama.cpp", config, requests_at(prompts, 1), new_tokens, 1)
    batched = None
    if args.executor == "model":
        # The top row's requests, all in one llama.cpp cache, as the engine holds them.
        top = max(sweep)
        batched = measure_alone(
            "llama.cpp batched", config, requests_at(prompts, top), new_tokens, top
        )
    summary = headline(rows)
    kernels = next((r["kernels"] for r in rows if "kernels" in r), {})
    print()
    print(f"{describe()['cpu']}; wavecore kernels: {kernels or 'n/a'}")
    print_table(rows)
    if llamacpp is not None:
        ours = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["system"] == "wavecore"}
        llamacpp["wavecore_c1_vs_llamacpp"] = round(ours[1] / llamacpp["tokens_per_s"], 2)
        llamacpp["wavecore_top_vs_llamacpp"] = round(ours[max(ours)] / llamacpp["tokens_per_s"], 2)
        print_table([llamacpp])
        print(
            f"llama.cpp {llamacpp['version']}, one request at a time (GGUF weights as "
            f"stored): wavecore ({args.weights}) at C=1 is "
            f"{llamacpp['wavecore_c1_vs_llamacpp']:.2f}x, at C={max(ours)} "
            f"{llamacpp['wavecore_top_vs_llamacpp']:.2f}x that"
        )
    if batched is not None:
        ours = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["system"] == "wavecore"}
        batched["wavecore_vs_llamacpp"] = round(
            ours[batched["concurrency"]] / batched["tokens_per_s"], 2
        )
        print_table([batched])
        print(
            f"llama.cpp {batched['version']}, the C={batched['concurrency']} requests decoding "
            f"together in one cache: wavecore ({args.weights}) at C={batched['concurrency']} is "
            f"{batched['wavecore_vs_llamacpp']:.2f}x that"
        )
    print(json.dumps(summary, indent=2))

    result = {
        "machine": {**describe(), "platform": platform.platform()},
        "kernels": kernels,
        "workload": {
            "prompts": count,
            "prompt_tokens": [low, high],
            "new_tokens": new_tokens,
            "greedy": True,
            "weights": args.weights,
            "dtype": args.dtype,
        },
        "rows": rows,
        "headline": summary,
        "llamacpp": llamacpp,
        "llamacpp_batched": batched,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
