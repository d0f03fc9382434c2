"""`compile_decode=True`: one-decode steps through a torch.compile'd graph
(`engine/model/compiled_decode.py`), on a tiny model: the same greedy tokens as eager,
one graph for every context length and across a sleep that drops the weights and the
cache, other steps eager, and a machine that cannot compile refused at load."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_test_helpers import ArgmaxSampler, GreedyRunner, greedy_alone

from wavecore.engine.config import EngineConfig
from wavecore.engine.model import ModelExecutor, load_executor, vnni_linear
from wavecore.engine.model import compiled_decode as compiled_module
from wavecore.engine.model.errors import CompileDecodeError
from wavecore.engine.model.kernel_plan import FORCE_ENV

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend needs a C++ compiler",
)
PROMPT = [3, 17, 5, 9, 11, 2, 8]


def load(path: Path, compile_decode: bool) -> ModelExecutor:
    return load_executor(
        str(path),
        device="cpu",
        weights="float32",
        dtype="float32",
        kv_cache_memory=64 * 2**10,
        block_size=4,  # contexts cross many blocks, and start inside the first one
        sampler=ArgmaxSampler(),
        compile_decode=compile_decode,
    )


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def compiled(tiny_gguf: Path) -> Iterator[ModelExecutor]:
    executor = load(tiny_gguf, compile_decode=True)  # compiles here
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def eager(tiny_gguf: Path) -> Iterator[ModelExecutor]:
    executor = load(tiny_gguf, compile_decode=False)
    yield executor
    executor.close()


def test_decodes_give_eager_tokens_on_one_graph_for_every_context(
    compiled: ModelExecutor, eager: ModelExecutor
) -> None:
    before = graphs()
    calls: list[int] = []
    real = compiled_module.CompiledDecode.__call__

    def counting(self, model, plan, cache):  # type: ignore[no-untyped-def]
        calls.append(plan.attention.decodes[0].context_len)
        return real(self, model, plan, cache)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_module.CompiledDecode, "__call__", counting)
        tokens = greedy_alone(compiled, [1, 4], 24)  # context 2: a one-block table
    assert tokens == greedy_alone(eager, [1, 4], 24)
    assert calls == list(range(3, 3 + 23))  # every decode compiled; the prefill eager
    assert graphs() == before  # the load's compile served every context


def test_batches_of_several_sequences_run_eager_and_agree(
    compiled: ModelExecutor, eager: ModelExecutor
) -> None:
    outputs = []
    for executor in (compiled, eager):
        runner = GreedyRunner(executor)
        requests = [runner.add(PROMPT, 8), runner.add(PROMPT[:3], 8)]
        runner.run(requests, chunk_size=3)
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]


def test_weights_and_cache_renewed_by_a_deep_sleep_reuse_the_graph(
    compiled: ModelExecutor, eager: ModelExecutor
) -> None:
    compiled.sleep(2)
    compiled.wake_up(frozenset({"weights", "kv_cache"}))
    before = graphs()
    assert greedy_alone(compiled, PROMPT, 10) == greedy_alone(eager, PROMPT, 10)
    assert graphs() == before


def test_the_weights_and_every_cache_pool_are_compiled_in_as_static(
    compiled: ModelExecutor,
) -> None:
    """Rule 3. A pool left dynamic once (its marking skipped when a freed temporary's id
    was reused) made every view of it seconds of symbolic shape work: a compile of
    SmolLM2 took 139 s instead of 22."""
    model, cache = compiled._ready()
    tensors = [*cache.keys, *cache.values, model.rotary.cos, model.weights.final_norm]
    tensors += [layer.attn_norm for layer in model.weights.layers]
    for tensor in tensors:
        assert getattr(tensor, "_dynamo_static_indices", None) == set(range(tensor.dim()))


def test_the_executor_says_it_compiles(compiled: ModelExecutor, eager: ModelExecutor) -> None:
    assert compiled.compiles_decode and not eager.compiles_decode


def test_a_machine_that_cannot_compile_is_refused_at_load(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(self, model, plan, cache):  # type: ignore[no-untyped-def]
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled_module.CompiledDecode, "__call__", fails)
    with pytest.raises(CompileDecodeError, match=r"No working C.*needs a working C\+\+ compiler"):
        load(tiny_gguf, compile_decode=True)


def test_the_setting_is_a_bool() -> None:
    with pytest.raises(ValueError, match="compile_decode must be a bool, got 'yes'"):
        EngineConfig(compile_decode="yes")  # type: ignore[arg-type]


def test_int8_products_are_never_compiled(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 1: they cannot be traced, so the graph would break at each of them."""
    with pytest.raises(ValueError, match="compile_decode cannot go with weights='int8'"):
        EngineConfig(compile_decode=True, weights="int8")
    with pytest.raises(ValueError, match="fbgemm's int8 products cannot be traced"):
        load_executor(str(tiny_gguf), weights="int8", compile_decode=True)
    # An "auto" plan that runs int8 for batch 1 keeps that step eager, and says so.
    monkeypatch.setenv(FORCE_ENV, "decode=fbgemm")
    executor = load_executor(str(tiny_gguf), kv_cache_memory=2**20, compile_decode=True)
    try:
        assert not executor.compiles_decode
        decode = executor.path_report()["decode"]
        assert decode == "fbgemm (not compiled: int8 products break the graph)"
    finally:
        executor.close()


def test_steps_from_another_thread_take_the_compiled_graph(
    compiled: ModelExecutor, eager: ModelExecutor
) -> None:
    """The engine steps its executor from a worker thread, not the one that compiled."""
    before = graphs()
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(greedy_alone(compiled, PROMPT, 12)))
    worker.start()
    worker.join(120)
    assert results == [greedy_alone(eager, PROMPT, 12)]
    assert graphs() == before


def test_a_model_or_cache_of_another_layout_gets_a_graph_of_its_own(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule 5: without dynamo's guards on the model and the cache, nothing but the
    layout check stands between a graph and a model it was not made for."""
    made: list[object] = []

    def counted() -> object:
        made.append(object())
        return compiled_module._one_decode  # eager: the test is about which graph serves

    monkeypatch.setattr(compiled_module, "_compile", counted)
    decode = compiled_module.CompiledDecode()
    executors = {
        dtype: load_executor(
            str(tiny_gguf), weights="float32", kv_cache_memory=64 * 2**10, kv_cache_dtype=dtype
        )
        for dtype in ("float32", "bfloat16")
    }
    try:

        def run(dtype: str) -> None:
            executor = executors[dtype]
            model, cache = executor._ready()
            decode(model, executor._scratch_plan(decode=True), cache)

        run("float32")
        run("float32")
        assert len(made) == 1
        executors["float32"].sleep(2)  # new weights and cache objects, the same layout
        executors["float32"].wake_up(frozenset({"weights", "kv_cache"}))
        run("float32")
        assert len(made) == 1
        run("bfloat16")  # pools of another dtype
        assert len(made) == 2
        run("float32")
        assert len(made) == 3
    finally:
        for executor in executors.values():
            executor.close()


def test_the_layout_sees_what_a_graph_depends_on_and_not_the_values(
    compiled: ModelExecutor,
) -> None:
    model, cache = compiled._ready()

    def layout(*values: object) -> object:
        return compiled_module._layout(values, {})

    weights = model.weights
    norm = weights.final_norm
    renewed = dataclasses.replace(weights, final_norm=torch.randn_like(norm))
    assert layout(renewed, cache) == layout(weights, cache)  # contents do not count
    for changed in (
        norm.to(torch.float64),  # dtype
        norm.repeat(2)[::2],  # strides
        norm[:-1],  # shape
        weights.layers[0].attn_norm,  # the same tensor twice: an alias
    ):
        other = dataclasses.replace(weights, final_norm=changed)
        assert layout(other, cache) != layout(weights, cache), changed
    assert layout(1e-5) == layout(1e-5) != layout(1e-6)  # constants are compiled in
    assert layout(float("nan")) == layout(float("nan"))


@pytest.mark.soak  # a second compile of the model: outside make test's time budget
def test_the_native_operators_run_inside_the_graph(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight-only products with int8 activations and decode attention over a
    bfloat16 cache, torch operators registered in C++, called by the graph's C++ wrapper:
    the same greedy tokens as eager."""
    if not vnni_linear.can_pack_vnni(torch.device("cpu"), torch.float32, 32, 16):
        pytest.skip(vnni_linear.kernel_report())
    monkeypatch.setenv(FORCE_ENV, "woq-vnni")

    def load_vnni(compile_decode: bool) -> ModelExecutor:
        return load_executor(
            str(tiny_gguf),
            device="cpu",
            kv_cache_memory=64 * 2**10,
            kv_cache_dtype="bfloat16",
            block_size=4,
            sampler=ArgmaxSampler(),
            compile_decode=compile_decode,
        )

    compiled, eager = load_vnni(True), load_vnni(False)
    try:
        assert compiled.path_report()["decode"] == "woq-vnni (compiled)"
        assert compiled.path_report()["attention"].startswith("native kernel")
        before = graphs()
        assert greedy_alone(compiled, PROMPT, 16) == greedy_alone(eager, PROMPT, 16)
        assert graphs() == before
    finally:
        compiled.close()
        eager.close()
