"""LoRA adapters: how the deltas are computed, and what adapters cost the engine.

Part 1, the delta kernel (on the CPU with one thread): one fused product's LoRA delta
(SmolLM2-135M's qkv, 576 -> 960, every target at rank 16, so R = 48) for a step of T
tokens spread over K adapters interleaved token by token (as decodes of several
adapters are), three ways: wavecore's (one adapter: a slice; several: every row
against the adapters stacked, its own columns kept by a mask, then one product per
target, `compute.MixedDecodes`; each target's own `b` block, and for one adapter also
the block-diagonal `b` wavecore used before: one product, zeros between the targets),
grouped by a gather in adapter order (one
`index_select`, two products per adapter, one `index_add_`), and a gather-based
batched product (each token's own `a` and `b` gathered from the stacked adapters, then
one `bmm` per side for all tokens, as punica's BGMV does on GPUs), and wavecore's C
kernel (`lora/native.py`: one call for every row, each against its own adapter only,
with the adapter's weights in float32, in bfloat16, and in bfloat16 pairs through
AVX-512 BF16's dot products where the CPU has them); beside the base product itself
(float32 BLAS), and, for one adapter on a CPU with native bfloat16, the delta in
bfloat16 through the base's oneDNN kernel. On a CUDA device too when one is present
(bfloat16).

Parts 2 and 3 take random adapters of two kinds (`ADAPTER_KINDS`): rank 16 on every
projection (q, k, v, o, gate, up, down: the costliest layout an adapter has here), and
PEFT's default for Llama models (`LoraConfig()`: rank 8 on q_proj and v_proj).

Part 2, one decode step of the executor (the real model as `open_engine` loads it by
default): 32 decodes at context 100 of the base model, and for each kind all on one
adapter and spread over 4 adapters interleaved row by row, on each path of the deltas
(two executors: the C kernel, the default where it builds, and torch's products,
`WAVECORE_LORA_KERNEL=torch`), every step interleaved; median milliseconds and ratio
to the same path's base step.

Part 3, end to end (one rank in this process, the same model, greedy, `ignore_eos`):
32 concurrent requests of the same prompts, in the same engine: the base model only,
and for each kind every request on one adapter and spread over 4 adapters
(`max_loras=8`, so that both kinds' adapters stay resident), the runs interleaved (each
repeat starting one run later); throughput in generated tokens per second, its ratio to
the base model's, and the load average (1 minute) after each run.

Prints a table per part and writes them as JSON (`--output`, by default
bench/results/lora.json; name a file per CPU kind to keep each machine's figures).

Usage: python bench/lora.py [--quick] [--skip-engine] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from machine import describe, on_a_thread_of_its_own
from safetensors.torch import save_file

from wavecore.engine import native_build
from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.lora.adapters import (
    Adapter,
    AdapterLayer,
    FusedDelta,
    StackedAdapters,
    TargetSpan,
)
from wavecore.engine.lora.compute import LoRARows, MixedDecodes, add_lora
from wavecore.engine.lora.native import (
    DELTA_KERNEL,
    NativeKernel,
    delta_kernel,
    has_pairs,
    kernel_function,
)
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model import load_executor
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.linear import can_pack_bf16, pack_bf16, packed_product
from wavecore.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "lora.json"
HIDDEN, QKV_OUT, RANK = 576, 960, 16
R = 3 * RANK  # q, k and v side by side
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List ten uses of copper and say why each works.",
    "Describe the water cycle to a child.",
]


def _timed(run: Any, repeats: int, device: torch.device) -> float:
    """Median milliseconds of `run()` (after a warm-up), synchronized on CUDA."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def delta_kernels(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(device, dtype)

    weight = rand(HIDDEN, QKV_OUT)
    repeats = 5 if quick else 50
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # One thread: on a shared 2-vCPU machine every op of two threads waits for both
        # cores (1.5 ms floors under load); one thread compares the methods' own work.
        torch.set_num_threads(1)
    try:
        return _delta_cases(rand, weight, repeats, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _delta_cases(
    rand: Any, weight: torch.Tensor, repeats: int, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    with torch.inference_mode():
        _timed(lambda: rand(512, HIDDEN) @ weight, 10, device)  # thread pools up
        _delta_case(rand, weight, 1, 1, repeats, device, dtype)  # the first case, discarded
        return [
            _delta_case(rand, weight, tokens, count, repeats, device, dtype)
            for tokens in (1, 8, 32, 128, 512)
            for count in (1, 4)
            if count <= tokens
        ]


def _qkv_delta(rand: Any) -> FusedDelta:
    """A random qkv delta as `adapters.build_adapter` lays one out: q, k and v at rank
    `RANK` side by side in `a`, each target's own `b` block."""
    a = rand(HIDDEN, R)
    blocks = []
    for index, (out_start, out_stop) in enumerate(((0, 576), (576, 768), (768, QKV_OUT))):
        span = TargetSpan(index * RANK, (index + 1) * RANK, out_start, out_stop)
        blocks.append((span, rand(RANK, out_stop - out_start)))
    return FusedDelta(a, tuple(blocks))


def _block_diagonal(delta: FusedDelta) -> torch.Tensor:
    """`delta`'s `b` blocks as one `[R, out]` matrix, zeros between them (the layout
    wavecore had before: one `b` product per fused product)."""
    a = delta.a
    b = torch.zeros(a.shape[1], QKV_OUT, device=a.device, dtype=a.dtype)
    for span, block in delta.blocks:
        b[span.start : span.stop, span.out_start : span.out_stop] = block
    return b


def _delta_case(
    rand: Any,
    weight: torch.Tensor,
    tokens: int,
    count: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    x = rand(tokens, HIDDEN)
    deltas = [_qkv_delta(rand) for _ in range(count)]
    adapters = [
        Adapter(LoRARequest(f"a{i}", "/x"), RANK, (AdapterLayer(d, None, None, None),))
        for i, d in enumerate(deltas)
    ]
    # Decode-like: adapters interleaved token by token (scattered rows).
    owner = torch.arange(tokens) % count
    if count == 1:
        rows = LoRARows(((adapters[0], 0, tokens),))
    else:
        rows = LoRARows((), MixedDecodes(StackedAdapters(adapters), owner.to(device)))
    order = torch.cat([(owner == i).nonzero().flatten() for i in range(count)]).to(device)
    bounds = torch.bincount(owner, minlength=count).cumsum(0).tolist()
    runs = list(zip(deltas, [0, *bounds[:-1]], bounds, strict=True))
    dense_b = [_block_diagonal(d) for d in deltas]
    stacked_a = torch.stack([d.a for d in deltas])  # [K, in, R]
    stacked_b = torch.stack(dense_b)  # [K, R, out]
    index = owner.to(device)
    out = torch.zeros(tokens, QKV_OUT, device=device, dtype=dtype)
    native = {
        name: _native_delta(adapters, owner, x, out, weights, pairs)
        for name, weights, pairs in NATIVE_FORMS
        if device.type == "cpu"
    }

    def wavecore() -> None:
        add_lora(out, x, rows, 0, "qkv")

    def block_diagonal() -> None:
        out.addmm_(x @ deltas[0].a, dense_b[0])

    def sorted_gather() -> None:
        taken = x.index_select(0, order)
        deltas_out = torch.zeros(tokens, QKV_OUT, device=device, dtype=dtype)
        for delta, start, end in runs:
            h = taken[start:end] @ delta.a
            for span, b in delta.blocks:
                deltas_out[start:end, span.out_start : span.out_stop].addmm_(
                    h[:, span.start : span.stop], b
                )
        out.index_add_(0, order, deltas_out)

    def gathered() -> None:
        a = stacked_a.index_select(0, index)  # [T, in, R]
        b = stacked_b.index_select(0, index)  # [T, R, out]
        out.add_(torch.bmm(torch.bmm(x.unsqueeze(1), a), b).squeeze(1))

    return {
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "adapters": count,
        "base_ms": _timed(lambda: x @ weight, repeats, device),
        "wavecore_ms": _timed(wavecore, repeats, device),
        "block_diagonal_ms": _timed(block_diagonal, repeats, device) if count == 1 else None,
        "sorted_gather_ms": _timed(sorted_gather, repeats, device),
        "gather_bmm_ms": _timed(gathered, repeats, device),
        "bf16_onednn_ms": (
            _bf16_delta_ms(x, deltas[0].a, dense_b[0], out, repeats) if count == 1 else None
        ),
        **{
            f"native_{name}_ms": _timed(run, repeats, device) if run is not None else None
            for name, run in ((name, native.get(name)) for name, _, _ in NATIVE_FORMS)
        },
    }


# SmolLM2-135M's shapes, for the kernel's checks (one layer: part 1's adapters have one).
SMOLLM_ONE_LAYER = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=HIDDEN,
    intermediate_size=1536,
    num_layers=1,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    context_length=8192,
    tie_word_embeddings=True,
    qkv_bias=False,
)


# The kernel's forms of the adapter weights: float32, bfloat16 widened to float32, and
# bfloat16 in pairs through AVX-512 BF16's dot products (where the CPU has them).
NATIVE_FORMS = (
    ("f32", torch.float32, False),
    ("bf16", torch.bfloat16, False),
    ("bf16_pairs", torch.bfloat16, True),
)


def _native_delta(
    adapters: list[Adapter],
    owner: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    weights: torch.dtype,
    pairs: bool,
) -> Any:
    """wavecore's C kernel on the same rows (`lora/native.py`), adapter weights in
    `weights` (in pairs for AVX-512 BF16); None where it did not build."""
    built = delta_kernel()
    if built.library is None or (pairs and not has_pairs(built.library)):
        return None
    function = kernel_function(built.library, weights, pairs)
    kernel = NativeKernel(function, weights, SMOLLM_ONE_LAYER, pairs)
    rows = kernel.rows([kernel.adapter(adapter) for adapter in adapters], owner)
    return lambda: rows.add(out, x, 0, "qkv")


def _bf16_delta_ms(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, repeats: int
) -> float | None:
    """One adapter's delta the way the base's "onednn-bf16" kernel takes a product:
    `a` and `b` rounded to bfloat16 and packed once, the rows rounded per product, the
    products by oneDNN (AMX), the delta added in float32. None where that kernel does
    not run (a GPU, or a CPU without native bfloat16)."""
    if not can_pack_bf16(x.device, x.dtype):
        return None
    a, b = pack_bf16(a.t()), pack_bf16(b.t())

    def bf16() -> None:
        out.add_(packed_product(packed_product(x.to(torch.bfloat16), a), b))

    return _timed(bf16, repeats, x.device)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterKind:
    label: str  # in the tables
    prefix: str  # of its adapters' names
    rank: int
    targets: tuple[str, ...]


ADAPTER_KINDS = (
    AdapterKind("every projection, rank 16", "all16", RANK, PROJECTIONS),
    AdapterKind("q and v, rank 8 (PEFT's default)", "qv8", 8, ("q_proj", "v_proj")),
)


def write_adapter(
    directory: Path,
    seed: int,
    config: dict[str, int],
    rank: int = RANK,
    targets: tuple[str, ...] = PROJECTIONS,
) -> Path:
    """A random adapter of `rank` on `targets`, in PEFT's format."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, q, kv = config["hidden"], config["inter"], config["q"], config["kv"]
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    tensors = {}
    for layer in range(config["layers"]):
        for target in targets:
            fan_in, fan_out = shapes[target]
            block = "self_attn" if target[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    directory.mkdir(parents=True)
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


DELTA_PATHS = ("native", "torch")  # `WAVECORE_LORA_KERNEL`'s two values
SMOLLM = {"hidden": 576, "inter": 1536, "q": 576, "kv": 192, "layers": 30}
STEP_DECODES, STEP_CONTEXT = 32, 100


def _decode_batch(loras: list[str | None], block_size: int) -> ModelBatch:
    """One decode per entry of `loras` at context `STEP_CONTEXT`, each in its own blocks."""
    blocks = -(-(STEP_CONTEXT + 1) // block_size)
    params = SamplingParams(max_tokens=64, temperature=0)
    chunks = []
    for row, lora in enumerate(loras):
        tokens = [(row * 7 + i) % 1000 + 5 for i in range(STEP_CONTEXT + 1)]
        chunks.append(
            SequenceChunk(
                request_id=f"r{row}",
                token_ids=tokens[-1:],
                start_pos=STEP_CONTEXT,
                block_table=list(range(row * blocks, (row + 1) * blocks)),
                sample=True,
                sampling=params,
                all_token_ids=tokens,
                prompt_len=STEP_CONTEXT,
                lora=lora,
            )
        )
    return ModelBatch(chunks=tuple(chunks))


def _runs(kinds: dict[str, list[str]], count: int) -> dict[str, list[str | None]]:
    """The adapter of each of `count` requests (or decodes) per run: the base model, then
    for each kind all on its first adapter and spread over its adapters."""
    runs: dict[str, list[str | None]] = {"base": [None] * count}
    for kind, names in kinds.items():
        runs[f"{kind}: 1 adapter"] = [names[0]] * count
        runs[f"{kind}: {len(names)} adapters"] = [names[i % len(names)] for i in range(count)]
    return runs


def _rotated(names: list[str], repeat: int) -> list[str]:
    """Each repeat starts one run later: over as many repeats as runs, every run holds
    every place once, so a load that rises or falls through the bench (a shared
    machine) hits every run alike."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def _executor(kernel: str, max_loras: int) -> Any:
    """An executor whose deltas run on `kernel`: "native" (the C kernel) or "torch"
    (torch's products), as `WAVECORE_LORA_KERNEL` says at its load."""
    saved = os.environ.get(DELTA_KERNEL.env)
    os.environ[DELTA_KERNEL.env] = kernel
    native_build.build.cache_clear()
    try:
        return load_executor(None, enable_lora=True, max_loras=max_loras)
    finally:
        if saved is None:
            del os.environ[DELTA_KERNEL.env]
        else:
            os.environ[DELTA_KERNEL.env] = saved
        native_build.build.cache_clear()


def executor_step(kinds: dict[str, list[LoRARequest]], quick: bool) -> list[dict[str, Any]]:
    """Part 2: median ms of one decode step of `STEP_DECODES`, on each delta path (two
    executors of the same model), every run and path interleaved."""
    adapters = [adapter for each in kinds.values() for adapter in each]
    executors = {path: _executor(path, len(adapters)) for path in DELTA_PATHS}
    try:
        names = {kind: [adapter.name for adapter in each] for kind, each in kinds.items()}
        runs = _runs(names, STEP_DECODES)
        batches = {}
        for path, executor in executors.items():
            for adapter in adapters:
                executor.add_lora(adapter)
            for name, loras in runs.items():
                batches[path, name] = _decode_batch(loras, executor.block_size)
                for _ in range(3):  # warm-up: kernels, the stacked adapters
                    executor.execute(batches[path, name])
        times: dict[tuple[str, str], list[float]] = {key: [] for key in batches}
        for repeat in range(2 * len(runs) if quick else 6 * len(runs)):
            for name in _rotated(list(runs), repeat):
                for path in _rotated(list(DELTA_PATHS), repeat):
                    start = time.perf_counter()
                    executors[path].execute(batches[path, name])
                    times[path, name].append((time.perf_counter() - start) * 1000)
        kernels = {path: executor.path_report() for path, executor in executors.items()}
    finally:
        for executor in executors.values():
            executor.close()
    return [
        {
            "step": name,
            "path": path,
            "decodes": STEP_DECODES,
            "ms": statistics.median(values),
            "ratio_to_base": statistics.median(times[path, "base"]) / statistics.median(values),
            "load_average": os.getloadavg()[0],
            "kernels": kernels[path],
        }
        for (path, name), values in times.items()
    ]


async def _throughput(engine: Any, loras: list[str | None], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    produced = 0

    async def one(index: int) -> None:
        nonlocal produced
        prompt = PROMPTS[index % len(PROMPTS)] + f" ({index})"
        async for delta in engine.generate(prompt, params, lora=loras[index]):
            produced += len(delta.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for index in range(len(loras)):
            tg.start_soon(one, index)
    return produced / (time.perf_counter() - start)


async def end_to_end(kinds: dict[str, list[LoRARequest]], quick: bool) -> list[dict[str, Any]]:
    """Part 3: tokens per second of each run, the runs interleaved, the median over as
    many repeats as runs (one with `--quick`)."""
    modules = tuple(adapter for each in kinds.values() for adapter in each)
    names = {kind: [adapter.name for adapter in each] for kind, each in kinds.items()}
    requests, max_tokens = (32, 16) if quick else (32, 64)
    runs = _runs(names, requests)
    repeats = 1 if quick else len(runs)
    config = EngineConfig(
        enable_lora=True, max_loras=len(modules), lora_modules=modules, max_num_seqs=64
    )
    async with open_engine(config) as engine:
        await _throughput(engine, [None] * 8, 8)  # warm-up
        figures: dict[str, list[float]] = {name: [] for name in runs}
        loads: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(repeats):
            for name in _rotated(list(runs), repeat):
                await engine.reset_prefix_cache()
                figures[name].append(await _throughput(engine, runs[name], max_tokens))
                loads[name].append(os.getloadavg()[0])
        kernels = (await engine.stats()).ranks[0].kernels
    base = statistics.median(figures["base"])
    return [
        {
            "run": name,
            "requests": requests,
            "max_tokens": max_tokens,
            "tokens_per_s": statistics.median(values),
            "ratio_to_base": statistics.median(values) / base,
            "every_tokens_per_s": values,
            "load_averages": loads[name],
            "kernels": kernels,
        }
        for name, values in figures.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter outputs")
    parser.add_argument("--skip-engine", action="store_true", help="the kernels only")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    machine = describe()
    result: dict[str, Any] = {"machine": machine}
    # Parts 1 and 2 run torch on threads that end with them: the engine of part 3 then
    # runs as it does in a process of its own (`on_a_thread_of_its_own` says why).
    kernels = on_a_thread_of_its_own(delta_kernels, torch.device("cpu"), torch.float32, args.quick)
    if torch.cuda.is_available():
        kernels += delta_kernels(torch.device("cuda"), torch.bfloat16, args.quick)
    result["delta_kernels"] = kernels
    print(
        f"LoRA delta of one qkv product, R={R}, one CPU thread ({machine['cpu']}, "
        f"{machine['cpus']} CPUs)"
    )
    print(f"{'device':<6} {'tokens':>6} {'adapters':>8} {'base ms':>8} {'wavecore ms':>11} "
          f"{'block-diag b ms':>15} {'sorted-gather ms':>16} {'gather-bmm ms':>13} "
          f"{'bf16 oneDNN ms':>14} {'native f32 ms':>13} {'native bf16 ms':>14} "
          f"{'native bf16 pairs ms':>20}")  # fmt: skip
    for row in kernels:
        shown = {
            key: "-" if row[key] is None else f"{row[key]:.3f}"
            for key in (
                "bf16_onednn_ms",
                "block_diagonal_ms",
                "native_f32_ms",
                "native_bf16_ms",
                "native_bf16_pairs_ms",
            )
        }
        print(
            f"{row['device']:<6} {row['tokens']:>6} {row['adapters']:>8} {row['base_ms']:>8.3f} "
            f"{row['wavecore_ms']:>11.3f} {shown['block_diagonal_ms']:>15} "
            f"{row['sorted_gather_ms']:>16.3f} {row['gather_bmm_ms']:>13.3f} "
            f"{shown['bf16_onednn_ms']:>14} {shown['native_f32_ms']:>13} "
            f"{shown['native_bf16_ms']:>14} {shown['native_bf16_pairs_ms']:>20}"
        )
    if not args.skip_engine:
        with tempfile.TemporaryDirectory() as root:
            kinds = {
                kind.label: [
                    LoRARequest(
                        f"{kind.prefix}-{i}",
                        str(
                            write_adapter(
                                Path(root) / f"{kind.prefix}-{i}",
                                i,
                                SMOLLM,
                                kind.rank,
                                kind.targets,
                            )
                        ),
                    )
                    for i in range(4)
                ]
                for kind in ADAPTER_KINDS
            }
            steps = on_a_thread_of_its_own(executor_step, kinds, args.quick)
            result["executor_step"] = steps
            print(f"\nOne executor step of {STEP_DECODES} decodes (interleaved, median)")
            print(f"{'step':<48} {'deltas':<7} {'ms':>8} {'ratio':>6} {'load':>5}")
            for row in steps:
                print(
                    f"{row['step']:<48} {row['path']:<7} {row['ms']:>8.1f} "
                    f"{row['ratio_to_base']:>6.2f} {row['load_average']:>5.2f}"
                )
            for path in DELTA_PATHS:
                report = next(row["kernels"] for row in steps if row["path"] == path)
                print(f"{path}: LoRA deltas by {report.get('lora')}")
            runs = anyio.run(end_to_end, kinds, args.quick)
        result["end_to_end"] = runs
        print("\nEnd to end, one rank, greedy, 32 concurrent requests (same engine)")
        print(f"{'run':<48} {'tok/s':>8} {'ratio':>6}  load after each run")
        for row in runs:
            loads = " ".join(f"{load:.1f}" for load in row["load_averages"])
            print(
                f"{row['run']:<48} {row['tokens_per_s']:>8.1f} {row['ratio_to_base']:>6.2f}  "
                f"{loads}"
            )
        print(f"kernels: {runs[0]['kernels']}")
    args.output.parent.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
