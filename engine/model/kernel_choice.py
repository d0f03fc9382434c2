"""`choose_kernels`: the kernel plan of a model's projections on the machine at hand.

Kernels tuned on one CPU can be slow on another (oneDNN's packed products made batch-64
decode 1.5x faster than BLAS on an AMD EPYC, and batch-1 decode 1.5x slower on an
Intel Xeon), so the plan (`kernel_plan.KernelPlan`: one kernel per shape class) is
measured on the machine itself, at load, and kept on disk (`kernel_cache.py`).

Theory of operation: float32 on a CPU with oneDNN has a choice of two kernels
("blas" or "onednn"); `weights="auto"` adds the rounding kernels this CPU runs fast,
"onednn-bf16" where it has native bfloat16, "fbgemm" (int8), "woq" (weight-only: a GGUF's
4-bit blocks as they are, 8 bits elsewhere; where every product packs) and "woq-vnni" (the
same weights times int8 activations, where the CPU has AVX-512 VNNI), each admitted only if
the model's predictions with it stay within `quality.MIN_AGREEMENT` and
`MAX_PERPLEXITY_CHANGE` of float32's (judged by the caller's `quality`, on the loaded
weights; only for kernels the clock would choose, since judging runs the model in
that form: a kernel that fails is dropped and the plan made again from the same
timings). For each shape class, the
kernels run a "mini model": whole units of one layer's projections plus a
1/num_layers slice of the LM head's rows, so each kernel's time is weighted as in a
real step. Decode and small-batch passes stream through enough units to exceed
`_STREAM_BYTES` (more than these machines' last-level caches): a step of up to 8 rows
reads every weight from memory, and in-cache timings rank kernels otherwise (SmolLM2
on the Xeon of the README: one unit in cache at 8 rows put oneDNN's bfloat16 16% ahead
of the weight-only kernel, which ran a 6-token verification of the real model in
26.8 ms against bfloat16's 32.8, and 6 decodes in 34.4 against 37.9); the
compute-bound classes run one unit. The kernels alternate within each round, so a
burst of load from another process hits all of them, and each is judged by its fastest round: outside
load only ever adds time, and on a shared 2-core machine a busy neighbour slowed every
parallel op of a round several-fold (medians then ranked kernels by their number of
ops, not their speed).

Rules:
1. CUDA or reduced precision, or no oneDNN: "blas" for every class, nothing measured.
   int8 weights: "fbgemm" for every class (their only kernel), nothing measured.
2. Classes forced by `WAVECORE_KERNELS` take the forced kernel; a kernel this device
   cannot run there is a ValueError. With anything forced the cache is neither read
   nor written, and only the other classes are measured.
3. Otherwise the plan cached under this machine's key is used (for "auto", the key
   names the model too: the accuracy budget is judged on its weights); failing that,
   every class is measured and the plan cached.
4. Kernels are ranked in the order blas, onednn, onednn-bf16, fbgemm, woq, woq-vnni
   (simpler, more exact, fewer extra forms first): a later kernel replaces the one
   chosen so far only if its time is `MARGIN` below it, so a tie keeps the simpler
   kernel, which also needs no second form of the weights.
5. A plan holds another form of the weights only where it pays: a kernel whose
   classes would all run within `MARGIN` on a kernel the plan holds anyway is dropped
   for it (`plan_of`).
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.int8_linear import Int8Projection
from wavecore.engine.model.kernel_cache import KernelCache
from wavecore.engine.model.kernel_plan import (
    FORCE_ENV,
    SHAPE_CLASSES,
    Kernel,
    KernelPlan,
    forced_kernels,
)
from wavecore.engine.model.linear import Projection, can_pack, can_pack_bf16
from wavecore.engine.model.quality import QualityReport
from wavecore.engine.model.vnni_linear import can_pack_vnni
from wavecore.engine.model.woq_linear import can_pack_woq

MARGIN = 0.1
_STREAM_BYTES = 64 * 2**20
# Rows each class is measured at, and how many timed rounds (after one warm-up).
_MEASURED_AT = {"decode": (1, 7), "small": (8, 7), "large": (64, 5), "prefill": (256, 5)}
# The classes whose steps stream the weights from memory (see above).
_STREAMED = frozenset({"decode", "small"})
_FLOAT_KERNELS: tuple[Kernel, ...] = ("blas", "onednn")
# The kernels that round the weights, admitted only within the accuracy budget.
ROUNDING_KERNELS: tuple[Kernel, ...] = ("onednn-bf16", "fbgemm", "woq", "woq-vnni")

Timer = Callable[[], float]
# Seconds of each kernel's runs, by shape class.
Times = Mapping[str, Mapping[Kernel, Sequence[float]]]
# What `choose_kernels` calls to measure: (shapes, classes, kernels) -> times.
Measure = Callable[["ProjectionShapes", Sequence[str], Sequence[Kernel]], Times]
# What it calls to judge rounding kernels: kernels -> {kernel: report against float32}.
Quality = Callable[[Sequence[Kernel]], Mapping[Kernel, QualityReport]]


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it, or the architecture if unknown."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True, kw_only=True)
class ProjectionShapes:
    """The `[out, in]` shapes of one layer's projections and of the LM head."""

    layer: tuple[tuple[int, int], ...]
    head: tuple[int, int]
    num_layers: int

    @classmethod
    def of(cls, config: ModelConfig) -> ProjectionShapes:
        hidden = config.hidden_size
        return cls(
            layer=(
                (config.q_size + 2 * config.kv_size, hidden),
                (hidden, config.q_size),
                (2 * config.intermediate_size, hidden),
                (hidden, config.intermediate_size),
            ),
            head=(config.vocab_size, hidden),
            num_layers=config.num_layers,
        )

    def unit(self) -> tuple[tuple[int, int], ...]:
        """One layer's shapes and the LM head's share of a step, as a slice of its rows
        (in 16s, as the 4-bit packing takes them)."""
        rows = -(-self.head[0] // (16 * self.num_layers)) * 16
        return (*self.layer, (rows, self.head[1]))


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelChoice:
    plan: KernelPlan
    origin: str  # "measured", "cached", "forced", or "fixed" (no choice on this device)
    cpu: str
    measure_seconds: float = 0.0
    # When measured for weights="auto": each rounding kernel's quality against float32.
    quality: Mapping[Kernel, QualityReport] = dataclasses.field(default_factory=dict)

    def report(self) -> dict[str, str]:
        """The CPU, each class's kernel, and where the plan came from, for stats."""
        return {"cpu": self.cpu, **self.plan.as_dict(), "origin": self.origin}


def choose_kernels(
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    weights: str,
    cache: KernelCache | None = None,
    measure: Measure | None = None,
    quality: Quality | None = None,
    model_key: str = "",
    kv_cache_dtype: torch.dtype | None = None,
) -> KernelChoice:
    """The plan for `config`'s projections in format `weights` on `device` (rules
    above). For "auto", `quality` judges the rounding kernels (none admitted without
    it), and `model_key` and the `kv_cache_dtype` they are judged beside are in the
    cache key."""
    cpu = cpu_name() if device.type == "cpu" else str(device)
    if weights == "int8":
        return KernelChoice(plan=KernelPlan.uniform("fbgemm"), origin="fixed", cpu=cpu)
    forced = forced_kernels()
    if not can_pack(device, dtype):
        if any(kernel != "blas" for kernel in forced.values()):
            raise ValueError(f"{FORCE_ENV}: only 'blas' runs {dtype} on {device}")
        origin = "forced" if forced else "fixed"
        return KernelChoice(plan=KernelPlan.uniform("blas"), origin=origin, cpu=cpu)
    shapes = ProjectionShapes.of(config)
    candidates = candidate_kernels(device, dtype, weights, shapes)
    for name, kernel in forced.items():
        if kernel not in candidates:
            raise ValueError(f"{FORCE_ENV}: {name}={kernel} cannot run {weights} weights here")
    if len(forced) == len(SHAPE_CLASSES):
        return KernelChoice(plan=KernelPlan(**forced), origin="forced", cpu=cpu)
    # The candidates are in the key: a kernel added to wavecore is measured, not
    # ignored for a plan cached before it existed.
    key = f"{cache_key(cpu, dtype, weights, shapes)} | {' '.join(candidates)}"
    if weights == "auto":
        key += f" | model {model_key} | kv cache {kv_cache_dtype or dtype}"
    cache = cache if cache is not None else KernelCache()
    if not forced:
        cached = cache.load(key)
        if cached is not None:
            return KernelChoice(plan=cached, origin="cached", cpu=cpu)
    start = time.perf_counter()
    classes = [c for c in SHAPE_CLASSES if c not in forced]
    times = (measure or measure_times)(shapes, classes, candidates)
    # Judge only the rounding kernels the clock would choose (judging loads and runs
    # the model in that form), again after each one that fails.
    reports: dict[Kernel, QualityReport] = {}
    admitted = [k for k in candidates if k not in ROUNDING_KERNELS or quality is not None]
    while True:
        measured = plan_of({name: _only(times[name], admitted) for name in classes})
        unjudged = [
            k
            for k in dict.fromkeys(measured.values())
            if k in ROUNDING_KERNELS and k not in reports
        ]
        if not unjudged or quality is None:
            break
        reports.update(quality(unjudged))
        admitted = [k for k in admitted if k not in reports or reports[k].within_budget]
    plan = KernelPlan(**{**measured, **forced})
    if not forced:
        cache.store(key, plan)
    return KernelChoice(
        plan=plan,
        origin="forced" if forced else "measured",
        cpu=cpu,
        measure_seconds=time.perf_counter() - start,
        quality=reports,
    )


def candidate_kernels(
    device: torch.device, dtype: torch.dtype, weights: str, shapes: ProjectionShapes | None = None
) -> list[Kernel]:
    """The kernels `weights` may run on `device` in `dtype`, in rule 4's order (with
    `shapes`, "woq" and "woq-vnni" where every product can be packed for them)."""
    kernels: list[Kernel] = ["blas"]
    if can_pack(device, dtype):
        kernels.append("onednn")
    if weights == "auto" and can_pack_bf16(device, dtype):
        kernels.append("onednn-bf16")
    if weights == "auto" and device.type == "cpu" and dtype == torch.float32 and has_fbgemm():
        kernels.append("fbgemm")
    weight_only: dict[Kernel, Callable[..., bool]] = {
        "woq": can_pack_woq,
        "woq-vnni": can_pack_vnni,
    }
    for kernel, packs in weight_only.items():
        if (
            weights == "auto"
            and shapes is not None
            and all(packs(device, dtype, i, o) for o, i in (*shapes.layer, shapes.head))
        ):
            kernels.append(kernel)
    return kernels


def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _only(
    times: Mapping[Kernel, Sequence[float]], kernels: Sequence[Kernel]
) -> dict[Kernel, Sequence[float]]:
    return {kernel: times[kernel] for kernel in kernels}


def cache_key(cpu: str, dtype: torch.dtype, weights: str, shapes: ProjectionShapes) -> str:
    layer = " ".join(f"{o}x{i}" for o, i in shapes.layer)
    return (
        f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype} | "
        f"{weights} | {shapes.num_layers} x [{layer}] + head {shapes.head[0]}x{shapes.head[1]}"
    )


def measure_plan(
    shapes: ProjectionShapes,
    classes: Sequence[str],
    kernels: Sequence[Kernel] = _FLOAT_KERNELS,
    *,
    timer: Timer = time.perf_counter,
) -> dict[str, Kernel]:
    """Each of `classes` with the one of `kernels` its measurement picks (rules 4, 5)."""
    return plan_of(measure_times(shapes, classes, kernels, timer=timer))


def measure_times(
    shapes: ProjectionShapes,
    classes: Sequence[str],
    kernels: Sequence[Kernel] = _FLOAT_KERNELS,
    *,
    timer: Timer = time.perf_counter,
) -> dict[str, dict[Kernel, list[float]]]:
    """Seconds of each of `kernels` on each of `classes`' mini model (see above)."""
    unit = shapes.unit()
    unit_bytes = 4 * sum(o * i for o, i in unit)
    units = min(shapes.num_layers, max(1, math.ceil(_STREAM_BYTES / unit_bytes)))
    if not _STREAMED.intersection(classes):
        units = 1
    # Fixed weights: a product's time depends on their form, not their values.
    projections = {
        kernel: [_projection(o, i, kernel) for _ in range(units) for o, i in unit]
        for kernel in kernels
    }
    seconds: dict[str, dict[Kernel, list[float]]] = {}
    with torch.inference_mode():
        for name in classes:
            rows, samples = _MEASURED_AT[name]
            inputs = {i: torch.randn(rows, i) for _, i in unit}
            runs = {
                kernel: _run(each if name in _STREAMED else each[: len(unit)], inputs)
                for kernel, each in projections.items()
            }
            seconds[name] = time_runs(runs, samples, timer)
    return seconds


def plan_of(seconds: Times) -> dict[str, Kernel]:
    """Each class's kernel from its kernels' times (rule 4), then rule 5: while some
    kernel's classes would all run within `MARGIN` on another kernel the plan holds,
    they move there and its form is not held."""
    best = {
        name: {kernel: min(times) for kernel, times in each.items()}
        for name, each in seconds.items()
    }
    chosen = {name: pick(each) for name, each in seconds.items()}
    while True:
        held = list(dict.fromkeys(chosen.values()))
        # The kernel fewest classes run goes first: its form pays least.
        for kernel in sorted(held, key=lambda k: list(chosen.values()).count(k)):
            others = [k for k in held if k != kernel]
            moves = {
                name: min(others, key=lambda k: best[name][k])
                for name, k in chosen.items()
                if k == kernel and others
            }
            if moves and all(
                best[name][kernel] >= (1 - MARGIN) * best[name][other]
                for name, other in moves.items()
            ):
                chosen.update(moves)
                break
        else:
            return chosen


def _projection(out_features: int, in_features: int, kernel: Kernel) -> Projection:
    # 4-bit groups (every group holds codes 0..15 of one step, which float16 holds): the
    # weight-only kernels time the 4-bit form a GGUF's layers take, not a degenerate one.
    codes = torch.arange(out_features * in_features) % 16
    dense = (codes.reshape(out_features, in_features) / 256).to(torch.float32)
    int8 = Int8Projection.build(dense, torch.ones(in_features)) if kernel == "fbgemm" else None
    return Projection.build(
        dense,
        device=torch.device("cpu"),
        dtype=torch.float32,
        kernels=KernelPlan.uniform(kernel),
        int8=int8,
    )


def _run(
    projections: Sequence[Projection], inputs: Mapping[int, torch.Tensor]
) -> Callable[[], None]:
    def run() -> None:
        for projection in projections:
            projection(inputs[projection.in_features])

    return run


def time_runs(
    runs: Mapping[Kernel, Callable[[], object]], samples: int, timer: Timer = time.perf_counter
) -> dict[Kernel, list[float]]:
    """Seconds of each run over `samples` rounds, after one untimed warm-up each; the
    runs alternate within a round, so a burst of outside load is shared between them."""
    for run in runs.values():
        run()
    seconds: dict[Kernel, list[float]] = {name: [] for name in runs}
    for _ in range(samples):
        for name, run in runs.items():
            start = timer()
            run()
            seconds[name].append(timer() - start)
    return seconds


def pick(seconds: Mapping[Kernel, Sequence[float]], margin: float = MARGIN) -> Kernel:
    """The kernel rule 4 picks from each kernel's times, given in its order."""
    best = {kernel: min(times) for kernel, times in seconds.items()}
    chosen, *others = best
    for kernel in others:
        if best[kernel] < (1 - margin) * best[chosen]:
            chosen = kernel
    return chosen
