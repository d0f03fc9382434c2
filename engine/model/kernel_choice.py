"""`choose_kernels`: the kernel plan of a model's projections on the machine at hand.

Kernels tuned on one CPU can be slow on another (oneDNN's packed products made batch-64
decode 1.5x faster than BLAS on an AMD EPYC, and batch-1 decode 1.5x slower on an
Intel Xeon), so the plan (`kernel_plan.KernelPlan`: one kernel per shape class) is
measured on the machine itself, at load, and kept on disk (`kernel_cache.py`).

Theory of operation: only float32 on a CPU with oneDNN has a choice ("blas" or
"onednn"). For each shape class, both kernels run a "mini model": whole units of one
layer's projections plus a 1/num_layers slice of the LM head's rows, so each kernel's
time is weighted as in a real step. A decode pass streams through enough units to
exceed `_STREAM_BYTES` (more than these machines' last-level caches; a batch-1 step
reads every weight from memory, and in-cache timings would rank kernels otherwise);
the compute-bound classes run one unit. The two kernels alternate within each round,
so a burst of load from another process hits both, and each is judged by its median.

Rules:
1. CUDA or reduced precision, or no oneDNN: "blas" for every class, nothing measured.
   int8 weights: "fbgemm" for every class (their only kernel), nothing measured.
2. Classes forced by `WAVECORE_KERNELS` take the forced kernel; a kernel this device
   cannot run there is a ValueError. With anything forced the cache is neither read
   nor written, and only the other classes are measured.
3. Otherwise the plan cached under this machine's key is used; failing that, every
   class is measured and the plan cached.
4. "onednn" is chosen for a class only if its median is `MARGIN` below BLAS's: a tie
   keeps the simpler kernel, which also needs no second copy of the weights.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.kernel_cache import KernelCache
from wavecore.engine.model.kernel_plan import (
    FORCE_ENV,
    SHAPE_CLASSES,
    Kernel,
    KernelPlan,
    forced_kernels,
)
from wavecore.engine.model.linear import can_pack, pack, packed_product

MARGIN = 0.1
_STREAM_BYTES = 64 * 2**20
# Rows each class is measured at, and how many timed rounds (after one warm-up).
_MEASURED_AT = {"decode": (1, 7), "small": (8, 5), "large": (64, 3), "prefill": (256, 3)}
_FLOAT_KERNELS: tuple[Kernel, ...] = ("blas", "onednn")

Timer = Callable[[], float]
# What `choose_kernels` calls to measure: (shapes, classes) -> {class: kernel}.
Measure = Callable[["ProjectionShapes", Sequence[str]], dict[str, Kernel]]


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
        """One layer's shapes and the LM head's share of a step, as a slice of its rows."""
        return (*self.layer, (-(-self.head[0] // self.num_layers), self.head[1]))


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelChoice:
    plan: KernelPlan
    origin: str  # "measured", "cached", "forced", or "fixed" (no choice on this device)
    cpu: str
    measure_seconds: float = 0.0

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
) -> KernelChoice:
    """The plan for `config`'s projections in format `weights` on `device` (rules above)."""
    cpu = cpu_name() if device.type == "cpu" else str(device)
    if weights == "int8":
        return KernelChoice(plan=KernelPlan.uniform("fbgemm"), origin="fixed", cpu=cpu)
    forced = forced_kernels()
    if not can_pack(device, dtype):
        if any(kernel != "blas" for kernel in forced.values()):
            raise ValueError(f"{FORCE_ENV}: only 'blas' runs {dtype} on {device}")
        origin = "forced" if forced else "fixed"
        return KernelChoice(plan=KernelPlan.uniform("blas"), origin=origin, cpu=cpu)
    for name, kernel in forced.items():
        if kernel not in _FLOAT_KERNELS:
            raise ValueError(f"{FORCE_ENV}: {name}={kernel} cannot run {weights} weights")
    shapes = ProjectionShapes.of(config)
    if len(forced) == len(SHAPE_CLASSES):
        return KernelChoice(plan=KernelPlan(**forced), origin="forced", cpu=cpu)
    key = cache_key(cpu, dtype, weights, shapes)
    cache = cache if cache is not None else KernelCache()
    if not forced:
        cached = cache.load(key)
        if cached is not None:
            return KernelChoice(plan=cached, origin="cached", cpu=cpu)
    start = time.perf_counter()
    measured = (measure or measure_plan)(shapes, [c for c in SHAPE_CLASSES if c not in forced])
    plan = KernelPlan(**{**measured, **forced})
    if not forced:
        cache.store(key, plan)
    return KernelChoice(
        plan=plan,
        origin="forced" if forced else "measured",
        cpu=cpu,
        measure_seconds=time.perf_counter() - start,
    )


def cache_key(cpu: str, dtype: torch.dtype, weights: str, shapes: ProjectionShapes) -> str:
    layer = " ".join(f"{o}x{i}" for o, i in shapes.layer)
    return (
        f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype} | "
        f"{weights} | {shapes.num_layers} x [{layer}] + head {shapes.head[0]}x{shapes.head[1]}"
    )


def measure_plan(
    shapes: ProjectionShapes, classes: Sequence[str], *, timer: Timer = time.perf_counter
) -> dict[str, Kernel]:
    """Each of `classes` with the kernel its measurement picks (rule 4)."""
    unit = shapes.unit()
    unit_bytes = 4 * sum(o * i for o, i in unit)
    units = min(shapes.num_layers, max(1, math.ceil(_STREAM_BYTES / unit_bytes)))
    if "decode" not in classes:
        units = 1
    # Constant weights: a float product's time does not depend on the values.
    matrices = [
        (i, dense.t().contiguous(), pack(dense))
        for _ in range(units)
        for o, i in unit
        for dense in (torch.full((o, i), 0.01),)
    ]
    chosen: dict[str, Kernel] = {}
    with torch.inference_mode():
        for name in classes:
            rows, samples = _MEASURED_AT[name]
            pass_of = matrices if name == "decode" else matrices[: len(unit)]
            runs = _runs(pass_of, rows)
            chosen[name] = pick(time_runs(runs, samples, timer))
    return chosen


def _runs(
    matrices: Sequence[tuple[int, torch.Tensor, torch.Tensor]], rows: int
) -> dict[Kernel, Callable[[], None]]:
    inputs = {i: torch.randn(rows, i) for i, _, _ in matrices}

    def blas() -> None:
        for i, plain, _ in matrices:
            inputs[i] @ plain

    def onednn() -> None:
        for i, _, blocked in matrices:
            packed_product(inputs[i], blocked)

    return {"blas": blas, "onednn": onednn}


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
    """ "onednn" if its median time is `margin` below BLAS's, else "blas" (rule 4)."""
    blas = statistics.median(seconds["blas"])
    onednn = statistics.median(seconds["onednn"])
    return "onednn" if onednn < (1 - margin) * blas else "blas"
