"""Each compute path side by side in one run: the default ("auto") and every explicit one.

Paths (`EngineConfig.weights` / `dtype`): auto / auto (the default: per shape class the
fastest kernel within the accuracy budget, `engine/model/kernel_choice.py`), float32 /
float32, int8 / auto, float32 / bfloat16 (the whole model in bfloat16). transformers
`generate` (float32) runs in the same run. Two workloads, as in `../shared/anchors.md`:
- the 32 chat prompts (the demo prompts, chat template applied), up to `--new-tokens`
  greedy tokens each (EOS ends a request), all submitted at once: output tokens/s
  excluding the load; transformers at batch 16 and 32 (left-padded);
- batch-1 decode: one chat prompt, `--new-tokens` tokens with EOS ignored; tokens/s
  from the median inter-token latency; transformers `generate` at batch 1.
Every measurement runs in a fresh process; `--rounds` rounds alternate the systems,
and the median round counts (the machine is shared: bursts of other load hit every
system alike). Roofs measured in the same run: float32 and bfloat16 matmul rates
(2048^3 products) and the bandwidth a vector-matrix product streams a 256 MiB float32
matrix at; a batch-1 step reads every weight once (in the form its plan runs one row
on: `streamed_weight_bytes`), so that rate over those bytes bounds its batch-1 decode.

`--emulate-cpu-without-bf16` runs everything as on the CPUs of these machines that have
AVX-512 VNNI but no AMX or AVX-512 BF16 (Xeons before Cooper Lake, and EPYCs that do
not report avx512_bf16; the Zen 4 EPYC of the README does), on one that has them:
oneDNN capped at that instruction set (`ONEDNN_MAX_CPU_ISA`),
wavecore told the CPU has no native bfloat16 (`WAVECORE_CPU_BF16=off`), and the kernel
plans measured afresh in a cache of the run's own; clocks and memory stay this
machine's, so read the ratios.

Prints a table naming the CPU and each path's kernels, memory and load time; writes
bench/results/paths.json. llama.cpp is not run here (see `bench/llamacpp_peer.py`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from machine import describe  # bench/machine.py, beside this script

from wavecore.engine.api import open_engine
from wavecore.engine.cli.demo_prompts import DEMO_PROMPTS
from wavecore.engine.cli.latency import RequestTimer, RunSummary
from wavecore.engine.config import EngineConfig
from wavecore.engine.model import default_model_path, load_executor, resolve_model_source
from wavecore.engine.model.linear import CPU_BF16_ENV
from wavecore.engine.sampling.tokenizer import Tokenizer
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
# label: (weights, dtype)
PATHS = {
    "auto": ("auto", "auto"),
    "float32": ("float32", "float32"),
    "int8": ("int8", "auto"),
    "bfloat16": ("float32", "bfloat16"),
}
# What --emulate-cpu-without-bf16 sets (besides a fresh plan cache).
EMULATED_CPU_WITHOUT_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", CPU_BF16_ENV: "off"}


def chat_prompts(count: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_source(resolve_model_source(None))
    texts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(count)]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        for text in texts
    ]


async def wavecore_run(path: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    weights, dtype = PATHS[path]
    config = EngineConfig(
        weights=weights,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        kv_cache_memory=512 * 2**20,
    )
    chat = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    fixed = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
    )
    outputs = 0

    async def one(engine: Any, prompt: list[int], params: SamplingParams, timer: RequestTimer):
        nonlocal outputs
        async for delta in engine.generate(prompt, params):
            timer.tokens_arrived(len(delta.token_ids))
            outputs += len(delta.token_ids)

    start = time.perf_counter()
    async with open_engine(config) as engine:
        load = time.perf_counter() - start
        async for _ in engine.generate(prompts[0][:8], SamplingParams(max_tokens=2)):
            pass  # lazy set-up, untimed
        timers = [RequestTimer() for _ in prompts]
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt, timer in zip(prompts, timers, strict=True):
                tg.start_soon(one, engine, prompt, chat, timer)
        seconds = time.perf_counter() - start
        batched = RunSummary.of(
            timers, prompt_tokens=sum(map(len, prompts)), output_tokens=outputs, seconds=seconds
        )
        single = RequestTimer()
        outputs = 0
        await one(engine, prompts[1], fixed, single)
        batch1 = RunSummary.of([single], prompt_tokens=0, output_tokens=outputs, seconds=1.0)
        stats = (await engine.stats()).ranks[0]
    # The batch-1 roof counts what one decode step reads: the decode class's form of
    # each weight only (a mixed plan holds two forms; stats count both).
    executor = load_executor(None, weights=weights, dtype=dtype, kv_cache_memory=16 * 2**20)  # type: ignore[arg-type]
    streamed = executor.streamed_weight_bytes
    executor.close()
    return {
        "system": f"wavecore {path}",
        "tokens": batched.output_tokens,
        "tokens_per_s": batched.output_tokens / seconds,
        "batch1_tokens_per_s": 1 / batch1.itl_p50,
        "load_s": load,
        "weights_bytes": stats.core.weights_bytes,
        "streamed_weight_bytes": streamed,
        "kernels": dict(stats.kernels),
    }


def transformers_run(prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    pad = resolve_model_source(None).eos_token_id or 0

    def generate(group: list[list[int]], fixed: bool) -> int:
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        extra = {"min_new_tokens": new_tokens} if fixed else {}
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **extra,
        )
        new = out[:, width:]
        # Tokens up to and including each row's first EOS (what it generated).
        return sum(
            int((row == pad).nonzero()[0]) + 1
            if bool((row == pad).any()) and not fixed
            else len(row)
            for row in new
        )

    result: dict[str, Any] = {"system": "transformers"}
    with torch.inference_mode():
        generate(prompts[:1], True)  # warm-up
        for batch in (16, 32):
            start = time.perf_counter()
            tokens = sum(
                generate(prompts[i : i + batch], False) for i in range(0, len(prompts), batch)
            )
            result[f"tokens_per_s_batch{batch}"] = tokens / (time.perf_counter() - start)
            result["tokens"] = tokens
        start = time.perf_counter()
        generate(prompts[1:2], True)
        result["batch1_tokens_per_s"] = new_tokens / (time.perf_counter() - start)
    return result


def measure(system: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    if system == "transformers":
        return transformers_run(prompts, new_tokens)
    return anyio.run(wavecore_run, system, prompts, new_tokens)


def measure_alone(system: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, system, prompts, new_tokens).result()


def seconds_per_call(call: Any, repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def roofs() -> dict[str, float]:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    size = 2048
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        rates[f"{name}_matmul_gflops"] = (
            2 * size**3 / seconds_per_call(lambda a=a, b=b: a @ b, 5) / 1e9
        )
    matrix = torch.randn(256 * 2**20 // 4 // 1024, 1024)
    vector = torch.randn(1, matrix.shape[0])
    stream = seconds_per_call(lambda: vector @ matrix, 20)
    rates["stream_gbps"] = matrix.numel() * 4 / stream / 1e9
    return rates


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per system, each figure's median over the rounds (the rest from the first)."""
    rows = []
    for runs in zip(*rounds, strict=True):
        row = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, float):
                row[key] = statistics.median(run[key] for run in runs)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    parser.add_argument("--output", type=Path, default=RESULTS / "paths.json")
    parser.add_argument(
        "--emulate-cpu-without-bf16",
        action="store_true",
        help="run as on a CPU with AVX-512 VNNI and no AMX or bf16 (see above)",
    )
    args = parser.parse_args()
    if not args.emulate_cpu_without_bf16:
        run(args)
        return
    with tempfile.TemporaryDirectory(prefix="wavecore-plans-") as plans:
        # Set before this process's first oneDNN call; each measurement inherits them.
        os.environ.update(EMULATED_CPU_WITHOUT_BF16, XDG_CACHE_HOME=plans)
        run(args)


def run(args: argparse.Namespace) -> None:
    prompts = chat_prompts(args.prompts)
    systems = [*args.paths, *([] if args.skip_peer else ["transformers"])]
    rounds = []
    for number in range(args.rounds):
        runs = []
        for system in systems:
            runs.append(measure_alone(system, prompts, args.new_tokens))
            print(f"round {number + 1}: {json.dumps(runs[-1])}", flush=True)
        rounds.append(runs)
    rows = median_rows(rounds)
    limits = roofs()
    machine = describe()
    cpu = f"{machine['cpu']}, {machine['cpus']} CPUs"
    if args.emulate_cpu_without_bf16:
        machine["emulated"] = json.dumps(EMULATED_CPU_WITHOUT_BF16)
        cpu += f", emulating a CPU without AMX or bf16 ({machine['emulated']})"

    print()
    print(
        f"{cpu}; median of {args.rounds} rounds; {args.prompts} chat prompts x up to "
        f"{args.new_tokens} tokens; batch 1: {args.new_tokens} tokens"
    )
    print(
        f"roofs: float32 matmul {limits['float32_matmul_gflops']:.0f} GFLOP/s, bfloat16 "
        f"matmul {limits['bfloat16_matmul_gflops']:.0f} GFLOP/s, streaming "
        f"{limits['stream_gbps']:.1f} GB/s"
    )
    header = (
        f"{'system':<22}{'tokens':>7}{'tok/s':>8}{'batch 1':>9}{'b1 roof':>9}"
        f"{'load s':>8}{'weights MB':>11}  kernels decode/small/large/prefill"
    )
    print(header)
    for row in rows:
        if row["system"] == "transformers":
            for batch in (16, 32):
                rate = row[f"tokens_per_s_batch{batch}"]
                b1 = f"{row['batch1_tokens_per_s']:>9.1f}" if batch == 16 else f"{'':>9}"
                print(f"{'transformers bs' + str(batch):<22}{row['tokens']:>7}{rate:>8.1f}{b1}")
            continue
        row["batch1_roof_tokens_per_s"] = limits["stream_gbps"] * 1e9 / row["streamed_weight_bytes"]
        kernels = "/".join(
            row["kernels"].get(c, "?") for c in ("decode", "small", "large", "prefill")
        )
        print(
            f"{row['system']:<22}{row['tokens']:>7}{row['tokens_per_s']:>8.1f}"
            f"{row['batch1_tokens_per_s']:>9.1f}{row['batch1_roof_tokens_per_s']:>9.1f}"
            f"{row['load_s']:>8.1f}{row['weights_bytes'] / 1e6:>11.0f}  {kernels}"
        )

    result = {
        "machine": {**machine, "platform": platform.platform()},
        "workload": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "greedy": True,
        },
        "roofs": limits,
        "rows": rows,
        "rounds": rounds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
