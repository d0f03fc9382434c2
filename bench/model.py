"""Model forward throughput: wavecore's executor against transformers, same model, same run.

For each decode batch size B, both sides prefill the same B prompts (token ids,
`--context` tokens each; not timed), then run greedy decode steps of B tokens:
- wavecore: `ModelExecutor.execute` (paged KV cache, sampler included);
- transformers: the model's forward with its own KV cache (`past_key_values`);
and at batch 1 also transformers `generate` and, where llama-cpp-python is installed
(`make bench-llamacpp`), llama.cpp's decode on the same GGUF, prompt and step count
(`bench/llamacpp_peer.py`), in rounds alternating with wavecore's float32 (and int8)
executors: one line and the JSON's "llamacpp". Where it is installed, llama.cpp also
decodes each batch size's prompts together in one cache (its batched decoding), right
before wavecore's columns of that size: the "llama.cpp" column. The reference column is wavecore in
float32 (`weights="float32"`, `dtype="float32"`); with `--weights float32 int8 auto`
(the default) wavecore runs again with `weights="int8"` (int8 projections and LM head,
`engine/model/int8_linear.py`) and with the default path (`weights="auto"`: per shape
class the fastest kernel within the accuracy budget, `engine/model/kernel_choice.py`),
same prompts, same run, each as its own column; the auto plan is printed.
Two roofs are measured in the same run:
- compute: this machine's float32 matmul rate (a 2048^3 product); a decode step
  costs 2 x parameters x tokens FLOPs, so "roof" is that over the step time, as a
  fraction of the measured GFLOP/s;
- memory: the rate at which a vector-matrix product streams a 256 MiB float32
  matrix. A batch-1 step must read every weight once, so this rate over the
  weights' bytes bounds batch-1 decode, whatever the engine (int8: over its bytes).
Decode rates use the median step time, so a load spike from another process on a
shared machine moves them little; the load average is recorded with the results.

Kernels: wavecore picks a projection kernel per shape class on the machine at hand
(`engine/model/kernel_choice.py`). Batch-1 decode runs with the chosen kernels and
with each kernel forced (`WAVECORE_KERNELS`), executors side by side, in alternating
rounds (the median round counts), each as tokens/s and as a share of the bandwidth
roof. The CPU model and the chosen kernels are printed and written with the results.

Prints a table, writes bench/results/model.json. `--quick` shrinks everything for a
smoke test; `--model` takes any model spec (a GGUF file or a Hugging Face directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import llamacpp_peer  # bench/llamacpp_peer.py, beside this script
import torch
from machine import cpu_name  # bench/machine.py, beside this script

from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.model import ModelExecutor, load_executor
from wavecore.engine.model.kernel_plan import FORCE_ENV
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4096)


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """Mean wall time of `call()` over `repeats` calls, after one untimed warm-up."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def matmul_gflops(size: int, repeats: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / seconds_per_call(lambda: a @ b, repeats) / 1e9


def stream_gbps(mib: int, repeats: int) -> float:
    """GB/s at which a vector-matrix product reads a `mib` MiB float32 matrix."""
    matrix = torch.randn(mib * 2**20 // 4 // 1024, 1024)
    vector = torch.randn(1, matrix.shape[0])
    return matrix.numel() * 4 / seconds_per_call(lambda: vector @ matrix, repeats) / 1e9


FORCED_KERNELS = ("blas", "onednn")


def load_forced(kernel: str | None, **kwargs: Any) -> ModelExecutor:
    """An executor with `kernel` forced for every shape class (None: chosen as usual)."""
    previous = os.environ.pop(FORCE_ENV, None)
    if kernel is not None:
        os.environ[FORCE_ENV] = kernel
    try:
        return load_executor(**kwargs)
    finally:
        os.environ.pop(FORCE_ENV, None)
        if previous is not None:
            os.environ[FORCE_ENV] = previous


def kernels_batch1(
    executors: dict[str, ModelExecutor], prompt: list[int], steps: int, rounds: int
) -> dict[str, float]:
    """Batch-1 decode tokens/s of each executor: the median of `rounds` alternating runs."""
    rates: dict[str, list[float]] = {name: [] for name in executors}
    for _ in range(rounds):
        for name, executor in executors.items():
            rates[name].append(wavecore_decode(executor, [prompt], steps))
            executor.reset_kv_cache()
    return {name: statistics.median(values) for name, values in rates.items()}


def against_llamacpp(
    llama: Any, executors: dict[str, ModelExecutor], prompt: list[int], steps: int, rounds: int
) -> dict[str, float]:
    """Batch-1 decode tokens/s of llama.cpp and of each executor, the median of `rounds`
    alternating runs, so that load from other processes falls on all of them alike."""
    rates: dict[str, list[float]] = {"llama.cpp": [], **{name: [] for name in executors}}
    for _ in range(rounds):
        rates["llama.cpp"].append(llamacpp_peer.decode_tok_s(llama, prompt, steps))
        for name, rate in kernels_batch1(executors, prompt, steps, 1).items():
            rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab // 4, vocab) for _ in range(length)] for _ in range(count)]


def wavecore_decode(executor: ModelExecutor, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens per second over `steps` steps, after an untimed prefill and warm-up."""
    size = executor.block_size
    tokens = [list(p) for p in prompts]
    blocks_each = -(-(len(prompts[0]) + steps + 2) // size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    if blocks_each * len(prompts) > executor.num_kv_blocks:
        raise SystemExit("KV cache too small for this benchmark; raise --kv-cache-mib")
    computed = [0] * len(prompts)

    def step() -> None:
        chunks = tuple(
            SequenceChunk(
                request_id=f"r{i}",
                token_ids=seq[computed[i] :],
                start_pos=computed[i],
                block_table=tables[i],
                sample=True,
                sampling=GREEDY,
                all_token_ids=seq,
                prompt_len=len(prompts[i]),
            )
            for i, seq in enumerate(tokens)
        )
        output = executor.execute(ModelBatch(chunks=chunks))
        for i, sampled in enumerate(output.sampled):
            computed[i] = len(tokens[i])
            tokens[i].append(sampled.token_id)

    step()  # prefill
    step()  # warm-up decode
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return len(prompts) / statistics.median(times)


def load_transformers(model: str | None, executor: ModelExecutor) -> Any:
    from transformers import AutoModelForCausalLM

    path = executor.source.path
    if executor.source.format == "gguf":
        loaded = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return loaded.eval()


def transformers_decode(model: Any, prompts: list[list[int]], steps: int) -> float:
    with torch.inference_mode():
        out = model(torch.tensor(prompts), use_cache=True)
        cache = out.past_key_values
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(next_ids, past_key_values=cache, use_cache=True)  # warm-up
        cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(next_ids, past_key_values=cache, use_cache=True)
            cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
        return len(prompts) / statistics.median(times)


def transformers_generate(model: Any, prompt: list[int], steps: int) -> float:
    ids = torch.tensor([prompt])
    kwargs = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False}
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per sequence")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument(
        "--skip-peer", action="store_true", help="wavecore alone (no transformers, no llama.cpp)"
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=("float32", "int8", "auto"),
        default=["float32", "int8", "auto"],
        help="wavecore's weight formats to run (float32 is the reference column)",
    )
    parser.add_argument(
        "--skip-kernels", action="store_true", help="no batch-1 run per forced kernel"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "model.json")
    args = parser.parse_args()

    batches = (1, 4) if args.quick else (1, 16, 64)
    steps = 3 if args.quick else 16
    context = args.context or (16 if args.quick else 128)
    roof = matmul_gflops(512 if args.quick else 2048, 2 if args.quick else 10)
    bandwidth = stream_gbps(16 if args.quick else 256, 2 if args.quick else 10)

    load = {"model": args.model, "device": "cpu", "kv_cache_memory": args.kv_cache_mib * 2**20}
    executor = load_executor(**load, seed=0, weights="float32", dtype="float32")
    config = executor.config
    flops_per_token = 2 * config.num_parameters
    # What one batch-1 step must read: every weight but an untied embedding, of which
    # it reads one row.
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weight_bytes = 4 * (config.num_parameters - embedding)
    bandwidth_roof = bandwidth * 1e9 / weight_bytes
    peer = None if args.skip_peer else load_transformers(args.model, executor)
    int8 = None
    if "int8" in args.weights:
        int8 = load_executor(
            args.model,
            device="cpu",
            kv_cache_memory=args.kv_cache_mib * 2**20,
            seed=0,
            weights="int8",
        )
    auto = load_executor(**load, seed=0) if "auto" in args.weights else None
    int8_bytes = int8.streamed_weight_bytes if int8 is not None else None
    int8_roof = bandwidth * 1e9 / int8_bytes if int8_bytes else None

    # llama.cpp (where installed) decoding the same batches in one cache, in the same loop.
    batched_peer = ExitStack()
    llama_batched = None
    if not args.skip_peer and llamacpp_peer.importable(executor.source.path):
        llama_batched = batched_peer.enter_context(
            llamacpp_peer.batched_context(
                executor.source.path,
                torch.get_num_threads(),
                max(batches),
                max(batches) * (context + steps + 8),
            )
        )
    rows = []
    for batch in batches:
        prompts = make_prompts(batch, context, config.vocab_size)
        theirs_cpp = (
            llamacpp_peer.batched_decode_tok_s(llama_batched, prompts, steps)
            if llama_batched is not None
            else None
        )
        ours = wavecore_decode(executor, prompts, steps)
        executor.reset_kv_cache()
        quantized = wavecore_decode(int8, prompts, steps) if int8 is not None else None
        if int8 is not None:
            int8.reset_kv_cache()
        default = wavecore_decode(auto, prompts, steps) if auto is not None else None
        if auto is not None:
            auto.reset_kv_cache()
        theirs = transformers_decode(peer, prompts, steps) if peer is not None else None
        rows.append(
            {
                "batch": batch,
                "wavecore_tok_s": ours,
                "int8_tok_s": quantized,
                "int8_vs_float32": quantized / ours if quantized else None,
                "auto_tok_s": default,
                "auto_vs_float32": default / ours if default else None,
                "llamacpp_tok_s": theirs_cpp,
                "auto_vs_llamacpp": default / theirs_cpp if default and theirs_cpp else None,
                "transformers_forward_tok_s": theirs,
                "speedup": ours / theirs if theirs else None,
                "wavecore_roof_fraction": ours * flops_per_token / 1e9 / roof,
                "transformers_roof_fraction": theirs * flops_per_token / 1e9 / roof
                if theirs
                else None,
            }
        )
    batched_peer.close()
    forced: dict[str, ModelExecutor] = {}
    kernel_rows = []
    if not args.skip_kernels and executor.kernels.origin != "fixed":
        forced = {
            f"forced {k}": load_forced(k, **load, seed=0, weights="float32", dtype="float32")
            for k in FORCED_KERNELS
        }
        prompt = make_prompts(1, context, config.vocab_size)[0]
        rates = kernels_batch1(
            {"chosen": executor, **forced}, prompt, steps, 1 if args.quick else 3
        )
        for name, rate in rates.items():
            chosen = executor if name == "chosen" else forced[name]
            kernel_rows.append(
                {
                    "kernels": name,
                    "plan": chosen.kernels.plan.as_dict(),
                    "batch1_tok_s": rate,
                    "batch1_bandwidth_fraction": rate / bandwidth_roof,
                    "weights_bytes": chosen.memory().weights,
                }
            )
    # llama.cpp (where installed) on the same GGUF, prompt and step count as batch 1.
    llamacpp = None
    llama = None
    if not args.skip_peer:
        llama = llamacpp_peer.open_peer(
            executor.source.path, torch.get_num_threads(), context + steps + 8
        )
    if llama is not None:
        ours = {
            "float32": executor,
            **({"int8": int8} if int8 is not None else {}),
            **({"auto": auto} if auto is not None else {}),
        }
        prompt = make_prompts(1, context, config.vocab_size)[0]
        rounds = 1 if args.quick else 3
        rates = against_llamacpp(llama, ours, prompt, steps, rounds)
        llama.close()
        llamacpp = {
            "version": llamacpp_peer.version(),
            "rounds": rounds,
            "batch1_tok_s": rates["llama.cpp"],
            "wavecore_float32_batch1_tok_s": rates["float32"],
            "wavecore_int8_batch1_tok_s": rates.get("int8"),
            "float32_vs_llamacpp": rates["float32"] / rates["llama.cpp"],
            "int8_vs_llamacpp": rates["int8"] / rates["llama.cpp"] if "int8" in rates else None,
            "wavecore_auto_batch1_tok_s": rates.get("auto"),
            "auto_vs_llamacpp": rates["auto"] / rates["llama.cpp"] if "auto" in rates else None,
        }
    generate = None
    if peer is not None:
        generate = transformers_generate(
            peer, make_prompts(1, context, config.vocab_size)[0], steps
        )

    def show(value: float | None, pattern: str) -> str:
        return "n/a" if value is None else pattern.format(value)

    print(
        f"{cpu_name()}; model {executor.source.path.name}: "
        f"{config.num_parameters / 1e6:.1f} M parameters, "
        f"context {context}, {torch.get_num_threads()} threads; roofs: fp32 matmul "
        f"{roof:.1f} GFLOP/s, weight streaming {bandwidth:.1f} GB/s"
    )
    print(
        f"{'batch':>5} {'wavecore tok/s':>15} {'int8 tok/s':>11} {'int8/f32':>9} "
        f"{'auto tok/s':>11} {'auto/f32':>9} {'llama.cpp':>10} {'auto/l.cpp':>10} "
        f"{'HF forward tok/s':>17} {'ratio':>6} {'wavecore roof':>14} {'HF roof':>8}"
    )
    for row in rows:
        print(
            f"{row['batch']:>5} {row['wavecore_tok_s']:>15.1f} "
            f"{show(row['int8_tok_s'], '{:.1f}'):>11} "
            f"{show(row['int8_vs_float32'], '{:.2f}x'):>9} "
            f"{show(row['auto_tok_s'], '{:.1f}'):>11} "
            f"{show(row['auto_vs_float32'], '{:.2f}x'):>9} "
            f"{show(row['llamacpp_tok_s'], '{:.1f}'):>10} "
            f"{show(row['auto_vs_llamacpp'], '{:.2f}x'):>10} "
            f"{show(row['transformers_forward_tok_s'], '{:.1f}'):>17} "
            f"{show(row['speedup'], '{:.2f}x'):>6} "
            f"{row['wavecore_roof_fraction']:>14.0%} "
            f"{show(row['transformers_roof_fraction'], '{:.0%}'):>8}"
        )
    batch_one = rows[0]["wavecore_tok_s"]
    print(
        f"transformers generate, batch 1: {show(generate, '{:.1f}')} tok/s; "
        f"wavecore batch 1 is {show(batch_one / generate if generate else None, '{:.2f}x')} that"
    )
    print(
        f"batch-1 bandwidth roof: {bandwidth_roof:.1f} tok/s ({weight_bytes / 1e6:.0f} MB of "
        f"weights per token at {bandwidth:.1f} GB/s); wavecore batch 1 reaches "
        f"{batch_one / bandwidth_roof:.0%} of it"
    )
    report = executor.path_report()
    print(
        f"kernels chosen ({report['origin']}): "
        + ", ".join(f"{c} {report[c]}" for c in ("decode", "small", "large", "prefill"))
    )
    if auto is not None:
        chosen = auto.path_report()
        auto_roof = bandwidth * 1e9 / auto.streamed_weight_bytes
        print(
            f"default path (weights=auto) kernels ({chosen['origin']}): "
            + ", ".join(f"{c} {chosen[c]}" for c in ("decode", "small", "large", "prefill"))
            + f"; {auto.memory().weights / 1e6:.0f} MB of weights; batch-1 bandwidth roof "
            f"{auto_roof:.1f} tok/s, reached {rows[0]['auto_tok_s'] / auto_roof:.0%}"
        )
    if kernel_rows:
        print(
            f"{'batch-1 kernels':<16} {'decode/small/large/prefill':<30} {'tok/s':>7} {'% roof':>7} {'weights MB':>11}"
        )
        for k in kernel_rows:
            plan = "/".join(k["plan"].values())
            print(
                f"{k['kernels']:<16} {plan:<30} {k['batch1_tok_s']:>7.1f} "
                f"{k['batch1_bandwidth_fraction']:>7.0%} {k['weights_bytes'] / 1e6:>11.0f}"
            )
    if llamacpp is not None:
        print(
            f"llama.cpp {llamacpp['version']} batch 1 (GGUF weights as stored; median of "
            f"{llamacpp['rounds']} rounds alternating with wavecore): "
            f"{llamacpp['batch1_tok_s']:.1f} tok/s; wavecore float32 "
            f"{llamacpp['wavecore_float32_batch1_tok_s']:.1f} "
            f"({llamacpp['float32_vs_llamacpp']:.2f}x), int8 "
            f"{show(llamacpp['wavecore_int8_batch1_tok_s'], '{:.1f}')} "
            f"({show(llamacpp['int8_vs_llamacpp'], '{:.2f}x')}), default path "
            f"{show(llamacpp['wavecore_auto_batch1_tok_s'], '{:.1f}')} "
            f"({show(llamacpp['auto_vs_llamacpp'], '{:.2f}x')})"
        )
    int8_one = rows[0]["int8_tok_s"]
    if int8_one is not None and int8_bytes and int8_roof:
        print(
            f"int8 batch-1 bandwidth roof: {int8_roof:.1f} tok/s ({int8_bytes / 1e6:.0f} MB "
            f"per token); int8 batch 1 reaches {int8_one / int8_roof:.0%} of it"
        )

    results = {
        "benchmark": "model",
        "quick": args.quick,
        "model": str(executor.source.path),
        "parameters": config.num_parameters,
        "context": context,
        "decode_steps": steps,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "load_average_at_end": os.getloadavg(),
        "cpu_model": cpu_name(),
        "kernels": report,
        "kernel_measure_s": executor.kernels.measure_seconds,
        "int8_kernels": int8.path_report() if int8 is not None else None,
        "auto_kernels": auto.path_report() if auto is not None else None,
        "auto_weights_bytes": auto.memory().weights if auto is not None else None,
        "kernels_batch1": kernel_rows,
        "matmul_gflops": roof,
        "stream_gbps": bandwidth,
        "weight_bytes_per_token": weight_bytes,
        "batch1_bandwidth_roof_tok_s": bandwidth_roof,
        "wavecore_batch1_bandwidth_fraction": batch_one / bandwidth_roof,
        "int8_weight_bytes_per_token": int8_bytes,
        "int8_batch1_bandwidth_roof_tok_s": int8_roof,
        "int8_batch1_bandwidth_fraction": int8_one / int8_roof if int8_one and int8_roof else None,
        "decode": rows,
        "transformers_generate_batch1_tok_s": generate,
        "wavecore_batch1_vs_generate": batch_one / generate if generate else None,
        "llamacpp": llamacpp,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")
    for opened in (executor, *forced.values()):
        opened.close()
    for other in (int8, auto):
        if other is not None:
            other.close()


if __name__ == "__main__":
    main()
