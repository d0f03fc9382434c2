"""The kernel plan: the choice rule on scripted timings, the disk cache, the override,
what stats report, and (real model) token-exact greedy output with every kernel."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import anyio
import pytest
import torch
from model_test_helpers import KERNEL_TEST_CONFIG, GreedyRunner

from wavecore.engine.api import open_engine_core
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.model import ModelExecutor, linear, load_executor
from wavecore.engine.model.kernel_cache import KernelCache, KernelCacheWarning
from wavecore.engine.model.kernel_choice import (
    KernelChoice,
    Measure,
    ProjectionShapes,
    choose_kernels,
    cpu_name,
    measure_plan,
    pick,
    time_runs,
)
from wavecore.engine.model.kernel_plan import FORCE_ENV, KernelPlan, forced_kernels, shape_class
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.weights import LayerWeights, ModelWeights
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

CPU = torch.device("cpu")
CONFIG = KERNEL_TEST_CONFIG
ONEDNN = KernelPlan.uniform("onednn")


class ScriptedClock:
    """A timer under which each timed run lasts the next of `durations` (cycled): runs
    alternate blas, onednn within a round, so `(1.0, 0.5)` makes oneDNN twice as fast."""

    def __init__(self, durations: Iterable[float]) -> None:
        self.durations = itertools.cycle(durations)
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the reading that ends a run
            self.now += next(self.durations)
        return self.now


class FakeMeasure:
    """Stands in for `measure_times`: times `kernel` twice as fast as every other
    kernel asked for, on every class asked for."""

    def __init__(self, kernel: str = "onednn") -> None:
        self.kernel = kernel
        self.asked: list[list[str]] = []
        self.kernels: list[list[str]] = []

    def __call__(
        self, shapes: object, classes: list[str], kernels: list[str]
    ) -> dict[str, dict[str, list[float]]]:
        self.asked.append(list(classes))
        self.kernels.append(list(kernels))
        times = {kernel: [0.5 if kernel == self.kernel else 1.0] for kernel in kernels}
        return dict.fromkeys(classes, times)


def no_measure(shapes: object, classes: list[str], kernels: list[str]) -> dict:
    raise AssertionError("measured, but the plan should have come without measuring")


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)


@pytest.fixture
def needs_onednn() -> None:
    if not linear.can_pack(CPU, torch.float32):
        pytest.skip("this torch build has no oneDNN")


def choose(
    cache: KernelCache, measure: Measure = no_measure, weights: str = "float32"
) -> KernelChoice:
    return choose_kernels(
        CONFIG, device=CPU, dtype=torch.float32, weights=weights, cache=cache, measure=measure
    )


def test_pick_keeps_blas_unless_onednn_is_clearly_faster() -> None:
    assert pick({"blas": [1.0, 1.0, 1.0], "onednn": [0.95, 0.95, 0.95]}) == "blas"
    assert pick({"blas": [1.0, 1.0, 1.0], "onednn": [0.85, 0.85, 0.85]}) == "onednn"
    # The fastest round counts: a slow one (another process's burst) decides nothing.
    assert pick({"blas": [1.0, 9.0, 1.0], "onednn": [0.95, 0.95, 0.95]}) == "blas"
    assert pick({"blas": [1.0, 1.0, 1.0], "onednn": [0.5, 9.0, 0.5]}) == "onednn"


def test_time_runs_alternates_the_kernels() -> None:
    calls: list[str] = []
    runs = {"blas": lambda: calls.append("b"), "onednn": lambda: calls.append("o")}
    seconds = time_runs(runs, 3, ScriptedClock([2.0, 1.0, 4.0, 3.0]))  # type: ignore[arg-type]
    assert calls == ["b", "o"] + ["b", "o"] * 3  # a warm-up each, then rounds
    assert seconds == {"blas": [2.0, 4.0, 2.0], "onednn": [1.0, 3.0, 1.0]}


@pytest.mark.usefixtures("needs_onednn")
def test_measuring_runs_both_kernels_and_picks_by_the_clock() -> None:
    shapes = ProjectionShapes.of(CONFIG)
    assert shapes.unit()[-1] == (128, 64)  # half the head's rows: one of two layers
    chosen = measure_plan(shapes, ["decode"], timer=ScriptedClock([1.0, 0.5]))
    assert chosen == {"decode": "onednn"}
    assert measure_plan(shapes, ["small"], timer=ScriptedClock([1.0, 0.95])) == {"small": "blas"}


def test_rows_fall_into_classes() -> None:
    assert [shape_class(r) for r in (1, 2, 8, 9, 128, 129, 4096)] == [
        "decode",
        "small",
        "small",
        "large",
        "large",
        "prefill",
        "prefill",
    ]


@pytest.mark.usefixtures("needs_onednn")
def test_the_measured_plan_is_cached_and_reused(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "kernels.json")
    first = choose(cache, FakeMeasure())
    assert (first.plan, first.origin) == (ONEDNN, "measured")
    stored = json.loads(cache.path.read_text())["plans"]
    assert list(stored.values()) == [ONEDNN.as_dict()]
    assert "torch" in next(iter(stored)) and "64x64" in next(iter(stored))

    again = choose(cache)  # no_clock: measuring again would fail
    assert (again.plan, again.origin) == (ONEDNN, "cached")
    # Another format is another key: measured (here BLAS wins every class).
    other = choose_kernels(
        dataclasses.replace(CONFIG, intermediate_size=96),
        device=CPU,
        dtype=torch.float32,
        weights="float32",
        cache=cache,
        measure=FakeMeasure("blas"),
    )
    assert (other.plan, other.origin) == (KernelPlan.uniform("blas"), "measured")
    assert len(json.loads(cache.path.read_text())["plans"]) == 2


@pytest.mark.usefixtures("needs_onednn")
@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 0, "plans": {}}),
        json.dumps({"version": 1, "plans": [1, 2]}),
    ],
)
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path, content: str) -> None:
    cache = KernelCache(tmp_path / "kernels.json")
    cache.path.write_text(content)
    with pytest.warns(KernelCacheWarning, match="ignoring the kernel cache"):
        choice = choose(cache, FakeMeasure())
    assert choice.origin == "measured"
    assert choose(cache).origin == "cached"


@pytest.mark.usefixtures("needs_onednn")
def test_a_stale_entry_is_ignored(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "kernels.json")
    choose(cache, FakeMeasure())
    data = json.loads(cache.path.read_text())
    for entry in data["plans"].values():
        entry["decode"] = "a-kernel-of-the-future"
    cache.path.write_text(json.dumps(data))
    with pytest.warns(KernelCacheWarning, match="stale entry"):
        assert choose(cache, FakeMeasure()).origin == "measured"


@pytest.mark.usefixtures("needs_onednn")
def test_forced_kernels_skip_measuring_and_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(tmp_path / "kernels.json")
    monkeypatch.setenv(FORCE_ENV, "blas")
    assert choose(cache).plan == KernelPlan.uniform("blas")
    monkeypatch.setenv(FORCE_ENV, "decode=blas")
    measure = FakeMeasure()
    partial = choose(cache, measure)  # the other classes: measured
    assert measure.asked == [["small", "large", "prefill"]]
    assert partial.plan == KernelPlan(
        decode="blas", small="onednn", large="onednn", prefill="onednn"
    )
    assert partial.origin == "forced" and not cache.path.exists()
    for wrong in ("mkl", "decode=blas,huge=onednn", "fbgemm"):
        monkeypatch.setenv(FORCE_ENV, wrong)
        with pytest.raises(ValueError, match=FORCE_ENV):
            choose(cache)


def test_forced_kernels_parse() -> None:
    assert forced_kernels("") == {}
    assert forced_kernels(" onednn ") == dict.fromkeys(
        ("decode", "small", "large", "prefill"), "onednn"
    )
    assert forced_kernels("decode = blas, prefill=onednn") == {
        "decode": "blas",
        "prefill": "onednn",
    }


def test_no_choice_without_onednn_nor_for_int8(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "kernels.json")
    reduced = choose_kernels(
        CONFIG, device=CPU, dtype=torch.bfloat16, weights="float32", cache=cache, measure=no_measure
    )
    assert (reduced.plan, reduced.origin) == (KernelPlan.uniform("blas"), "fixed")
    int8 = choose(cache, weights="int8")
    assert int8.plan == KernelPlan.uniform("fbgemm")
    assert int8.report()["decode"] == "fbgemm" and int8.report()["cpu"]
    assert not cache.path.exists()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_stats_name_the_cpu_and_the_kernels(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_ENV, "decode=blas,small=onednn,large=blas,prefill=onednn")
    if not linear.can_pack(CPU, torch.float32):
        monkeypatch.setenv(FORCE_ENV, "blas")
    config = EngineConfig(device="cpu", kv_cache_memory=2**20)

    def build_core() -> EngineCore:
        executor = load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=2**20)
        return EngineCore(
            executor=executor, tokenizer=ByteTokenizer(), config=config, eos_token_id=0
        )

    with anyio.fail_after(120):  # a hang guard only
        async with open_engine_core(build_core) as engine:
            kernels = (await engine.stats()).ranks[0].kernels
    expected = KernelPlan(**forced_kernels()).as_dict()
    # Nothing in this plan rounds, so neither does the cache.
    assert kernels == {"cpu": cpu_name(), **expected, "origin": "forced", "kv_cache": "float32"}


# -- the real model -----------------------------------------------------------------


def only(weights: ModelWeights, kernel: str) -> ModelWeights:
    """`weights`, which hold `kernel`'s layout, with every projection on it alone."""
    plan = KernelPlan.uniform(kernel)  # type: ignore[arg-type]

    def keep(p: Projection) -> Projection:
        if kernel == "blas":
            return Projection(p.plain, None, plan, p.in_features, p.out_features)
        return Projection(None, p.blocked, plan, p.in_features, p.out_features)

    layers = tuple(
        dataclasses.replace(
            layer, **{n: keep(getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down")}
        )
        for layer in weights.layers
    )
    assert all(isinstance(layer, LayerWeights) for layer in layers)
    return dataclasses.replace(weights, layers=layers, lm_head=keep(weights.lm_head))


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.usefixtures("needs_onednn")
def test_every_kernel_stays_token_exact(smollm_executor: ModelExecutor, hf_reference) -> None:
    from wavecore.engine.sampling.tokenizer import Tokenizer

    executor = smollm_executor
    original = executor._model.weights  # type: ignore[union-attr]

    def with_layout(kernel: str) -> ModelWeights:
        """The session's weights when they hold `kernel`'s layout (a mixed plan holds
        both), else the model built again for that kernel alone."""
        if getattr(original.lm_head, "plain" if kernel == "blas" else "blocked") is not None:
            return original
        return ModelWeights.build(
            executor.config,
            executor.source.load_tensors(),
            origin=executor.source.path,
            device=CPU,
            dtype=torch.float32,
            kernels=KernelPlan.uniform(kernel),  # type: ignore[arg-type]
        )

    encode = Tokenizer.from_source(executor.source).encode
    prompt = encode("Q: What is the capital of France, and which river runs through it?\nA:")
    try:
        for kernel in ("blas", "onednn"):
            executor.commit_weights(only(with_layout(kernel), kernel))
            # One kernel for every class: a prefill and two decodes exercise it.
            runner = GreedyRunner(executor)
            request = runner.add(prompt, 3)
            runner.run([request])
            ids = torch.tensor([prompt + request.output[:-1]], device=hf_reference.device)
            with torch.inference_mode():
                logits = hf_reference(ids).logits[0, len(prompt) - 1 :]
            assert logits.argmax(-1).tolist() == request.output, kernel
    finally:
        executor.commit_weights(original)
