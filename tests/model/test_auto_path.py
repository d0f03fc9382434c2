"""`weights="auto"`: per shape class the fastest kernel within the accuracy budget.

The choice rules on scripted timings and quality reports, the forms a mixed plan
holds (and frees), batched scoring, and the tiny model loaded with a mixed plan."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from model_test_helpers import KERNEL_TEST_CONFIG, ArgmaxSampler

from wavecore.engine.model import kernel_choice, linear, load_executor
from wavecore.engine.model.int8_linear import Int8Projection
from wavecore.engine.model.kernel_cache import KernelCache
from wavecore.engine.model.kernel_choice import choose_kernels, plan_of
from wavecore.engine.model.kernel_plan import FORCE_ENV, KernelPlan
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.quality import QualityReport
from wavecore.engine.model.scoring import score_sequences

CPU = torch.device("cpu")
CONFIG = KERNEL_TEST_CONFIG
MIXED = KernelPlan(decode="fbgemm", small="onednn-bf16", large="onednn-bf16", prefill="blas")


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)


def times(**medians: dict[str, float]) -> dict[str, dict[str, list[float]]]:
    return {name: {k: [t, t, t] for k, t in each.items()} for name, each in medians.items()}


def test_each_class_takes_the_clearly_fastest_kernel() -> None:
    measured = times(
        decode={"blas": 26, "onednn": 33, "onednn-bf16": 20.5, "fbgemm": 15.9},
        small={"blas": 38, "onednn": 36, "onednn-bf16": 20.5, "fbgemm": 21},
        large={"blas": 91, "onednn": 94, "onednn-bf16": 32, "fbgemm": 66},
        prefill={"blas": 272, "onednn": 244, "onednn-bf16": 79, "fbgemm": 185},
    )
    assert plan_of(measured) == {
        "decode": "fbgemm",
        "small": "onednn-bf16",
        "large": "onednn-bf16",
        "prefill": "onednn-bf16",
    }


def test_a_second_form_is_held_only_where_it_pays() -> None:
    # onednn is 10% faster than BLAS for prefill alone, but within the margin of the
    # bf16 kernel the plan holds anyway: no float32 packed copy is kept for it.
    measured = times(
        decode={"blas": 26, "onednn": 33, "onednn-bf16": 20.5},
        small={"blas": 38, "onednn": 36, "onednn-bf16": 20.5},
        large={"blas": 91, "onednn": 94, "onednn-bf16": 32},
        prefill={"blas": 100, "onednn": 80, "onednn-bf16": 84},
    )
    assert set(plan_of(measured).values()) == {"onednn-bf16"}
    # Where the second kernel is clearly faster for its class, it stays.
    measured["prefill"] = {"blas": [100], "onednn": [60], "onednn-bf16": [84]}
    assert plan_of(measured)["prefill"] == "onednn"


class Judge:
    """Stands in for `AutoWeights.quality`: `failing` kernels miss the budget."""

    def __init__(self, *failing: str) -> None:
        self.failing = failing
        self.asked: list[list[str]] = []

    def __call__(self, kernels: Sequence[str]) -> dict[str, QualityReport]:
        self.asked.append(list(kernels))
        return {
            k: QualityReport(
                positions=100,
                agreeing=90 if k in self.failing else 99,
                reference_perplexity=10.0,
                candidate_perplexity=10.1,
            )
            for k in kernels
        }


def clock(**plan: str):
    """A `Measure` under which each class's kernel in `plan` is fastest, then the
    others in the order fbgemm, onednn-bf16, onednn, blas, woq, woq-vnni."""
    speed = {"woq-vnni": 6.0, "woq": 5.0, "fbgemm": 1.0, "onednn-bf16": 2.0, "onednn": 3.0}
    speed["blas"] = 4.0

    def measure(shapes: object, classes: list[str], kernels: list[str]) -> dict:
        return {
            name: {k: [0.1 if k == plan.get(name) else speed[k]] for k in kernels}
            for name in classes
        }

    return measure


def choose(cache: KernelCache, judge: Judge | None, measure, model_key: str = "m"):
    return choose_kernels(
        CONFIG,
        device=CPU,
        dtype=torch.float32,
        weights="auto",
        cache=cache,
        measure=measure,
        quality=judge,
        model_key=model_key,
    )


@pytest.fixture
def every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """All six kernels are candidates (the choice here never runs them)."""
    if not linear.can_pack(CPU, torch.float32) or not kernel_choice.has_fbgemm():
        pytest.skip("this torch build has no oneDNN or fbgemm")
    monkeypatch.setattr(kernel_choice, "can_pack_bf16", lambda device, dtype: True)


@pytest.mark.usefixtures("every_kernel")
def test_a_kernel_outside_the_budget_is_never_chosen(tmp_path: Path) -> None:
    judge = Judge("fbgemm")
    choice = choose(KernelCache(tmp_path / "k.json"), judge, clock())
    # The clock prefers int8 everywhere; it misses the budget, so bf16 runs instead.
    assert choice.plan == KernelPlan.uniform("onednn-bf16")
    assert judge.asked == [["fbgemm"], ["onednn-bf16"]]  # each judged once it would run
    assert not choice.quality["fbgemm"].within_budget
    assert choice.quality["onednn-bf16"].within_budget
    assert choice.origin == "measured"


@pytest.mark.usefixtures("every_kernel")
def test_the_auto_plan_is_cached_per_model(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "k.json")
    first = choose(cache, Judge(), clock(decode="fbgemm", small="onednn-bf16"))
    assert first.plan.decode == "fbgemm"
    again = choose(cache, None, clock(decode="blas"))
    assert (again.plan, again.origin) == (first.plan, "cached")
    other = choose(cache, Judge(), clock(decode="onednn-bf16"), model_key="another model")
    assert other.origin == "measured" and other.plan.decode == "onednn-bf16"


@pytest.mark.usefixtures("every_kernel")
def test_without_a_judge_only_float32_kernels_run(tmp_path: Path) -> None:
    choice = choose(KernelCache(tmp_path / "k.json"), None, clock())
    assert set(choice.plan.as_dict().values()) <= {"blas", "onednn"}


def test_no_bf16_candidate_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "can_pack_bf16", lambda device, dtype: False)
    assert "onednn-bf16" not in kernel_choice.candidate_kernels(CPU, torch.float32, "auto")
    # Explicit float32 weights never round.
    float32 = kernel_choice.candidate_kernels(CPU, torch.float32, "float32")
    assert set(float32) <= {"blas", "onednn"}


def test_cpu_bf16_off_takes_bf16_out_of_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`WAVECORE_CPU_BF16=off`: no native bfloat16 whatever the CPU's flags, so no
    bfloat16 kernel and (the executor's `rounds_to_bf16`) no bfloat16 KV cache by
    default; any other value is refused by name."""
    try:
        monkeypatch.setenv(linear.CPU_BF16_ENV, "off")
        linear.native_bf16.cache_clear()
        assert not linear.native_bf16()
        assert not linear.can_pack_bf16(CPU, torch.float32)
        assert "onednn-bf16" not in kernel_choice.candidate_kernels(CPU, torch.float32, "auto")
        monkeypatch.setenv(linear.CPU_BF16_ENV, "on")
        linear.native_bf16.cache_clear()
        with pytest.raises(ValueError, match="WAVECORE_CPU_BF16 must be 'off' or unset, got 'on'"):
            linear.native_bf16()
    finally:
        monkeypatch.delenv(linear.CPU_BF16_ENV, raising=False)
        linear.native_bf16.cache_clear()


@pytest.mark.usefixtures("needs_bf16_kernel")
def test_a_mixed_projection_runs_each_class_on_its_form() -> None:
    torch.manual_seed(0)
    matrix = torch.randn(24, 32)
    int8 = Int8Projection.build(matrix, torch.ones(32))
    projection = Projection.build(matrix, device=CPU, dtype=torch.float32, kernels=MIXED, int8=int8)
    assert projection.blocked is None  # no class runs float32 oneDNN
    for rows in (1, 8, 64, 200):
        x = torch.randn(rows, 32)
        exact = x @ matrix.t()
        kernel = MIXED.for_rows(rows)
        got = projection(x)
        if kernel == "blas":
            torch.testing.assert_close(got, exact)
        else:  # rounded: close, not equal
            assert not torch.equal(got, exact)
            torch.testing.assert_close(got, exact, atol=0.3, rtol=0.05)
        torch.testing.assert_close(projection.add_to(torch.ones(rows, 24), x), got + 1)
    elements = 24 * 32
    assert projection.num_bytes == elements * (4 + 2) + int8.num_bytes
    trimmed = projection.run_by(KernelPlan.uniform("onednn-bf16")).trimmed()
    assert (trimmed.plain, trimmed.int8) == (None, None)
    assert trimmed.num_bytes == elements * 2
    with pytest.raises(ValueError, match="no form for kernel 'blas'"):
        trimmed.run_by(KernelPlan.uniform("blas"))


def test_an_int8_plan_needs_its_int8_form() -> None:
    with pytest.raises(ValueError, match="needs the int8 form"):
        Projection.build(
            torch.randn(4, 4), device=CPU, dtype=torch.float32, kernels=KernelPlan.uniform("fbgemm")
        )


def test_scoring_together_equals_scoring_alone(tiny_gguf: Path) -> None:
    executor = load_executor(str(tiny_gguf), device="cpu", weights="float32", kv_cache_memory=2**20)
    try:
        weights = executor._model.weights  # type: ignore[union-attr]
        first, second = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]
        together = score_sequences(weights, executor.config, [first, second])
        for tokens, logits in zip((first, second), together, strict=True):
            # The same float32 arithmetic, but BLAS blocks 14 rows differently from 8 or
            # 6 on some CPUs (an AMD EPYC differed by 1.1e-5 on one logit): rounding, not a
            # row seeing another's tokens, which would move logits by orders more.
            torch.testing.assert_close(logits, executor.score(tokens), atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="at least two tokens"):
            score_sequences(weights, executor.config, [[1]])
    finally:
        executor.close()


@pytest.mark.usefixtures("needs_bf16_kernel")
def test_the_tiny_model_runs_a_forced_mixed_plan(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel_choice.has_fbgemm():
        pytest.skip("this torch build has no fbgemm")
    reference = load_executor(
        str(tiny_gguf),
        device="cpu",
        weights="float32",
        kv_cache_memory=2**20,
        sampler=ArgmaxSampler(),
    )
    monkeypatch.setenv(FORCE_ENV, ",".join(f"{k}={v}" for k, v in MIXED.as_dict().items()))
    # The cache in float32 (it takes bfloat16 beside these kernels by default), so that
    # each class's kernel alone decides how its logits round.
    mixed = load_executor(
        str(tiny_gguf),
        device="cpu",
        kv_cache_memory=2**20,
        kv_cache_dtype="float32",
        sampler=ArgmaxSampler(),
    )
    try:
        assert mixed.weights == "auto" and mixed.kernels.plan == MIXED
        assert mixed.kernels.report()["decode"] == "fbgemm"
        # A prefill of over 128 tokens runs float32 BLAS: float32's logits.
        tokens = [(7 * i) % 256 for i in range(150)]
        torch.testing.assert_close(mixed.score(tokens), reference.score(tokens))
        # A shorter one runs bf16: close to float32, not equal.
        rounded, exact = mixed.score(tokens[:40]), reference.score(tokens[:40])
        assert not torch.equal(rounded, exact)
        assert float((rounded - exact).norm() / exact.norm()) < 0.05
        layer = mixed._model.weights.layers[0]  # type: ignore[union-attr]
        assert layer.qkv.int8 is not None and layer.qkv.bf16 is not None
        assert layer.qkv.blocked is None
        # A weight update keeps the plan's forms, requantizing the int8 one.
        staged = mixed.stage_weights(
            {"layers.0.q": torch.zeros(mixed.config.q_size, mixed.config.hidden_size)},
            partial=True,
            origin="test",
        )
        updated = staged.layers[0].qkv
        assert updated.kernels == MIXED and updated.int8 is not None
        assert updated.int8 is not layer.qkv.int8
    finally:
        mixed.close()
        reference.close()


def test_the_tiny_model_loads_with_a_measured_auto_plan(tiny_gguf: Path) -> None:
    executor = load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=2**20)
    try:
        choice = executor.kernels
        assert executor.weights == "auto" and choice.origin in ("measured", "cached")
        for kernel, report in choice.quality.items():
            assert kernel in kernel_choice.ROUNDING_KERNELS and report.positions > 0
        # Every rounding kernel the plan runs was judged within the budget.
        for kernel in set(choice.plan.as_dict().values()) & set(kernel_choice.ROUNDING_KERNELS):
            assert choice.origin == "cached" or choice.quality[kernel].within_budget
    finally:
        executor.close()
