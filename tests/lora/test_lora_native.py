"""The C kernel of LoRA deltas (`lora/native.py`, `delta_kernel.c`): each row gets its
own adapter's delta (the torch path's, to float32 rounding) for runs and interleaved
rows, adapters of different ranks and targets, shapes that are not multiples of the
kernel's vectors, and weights in bfloat16 (also in pairs, through AVX-512 BF16's dot
products, where the rows round to bfloat16 too); a row's delta does not depend on the rows
around it; a call that does not fit the step is refused before the kernel runs; the
build is cached and optional, and an executor says which path runs its deltas and
gives the same tokens on either."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lora_helpers import TINY_CONFIG, greedy_alone, write_adapter, write_tiny_model

from wavecore.engine import native_build
from wavecore.engine.lora.adapters import PRODUCTS, Adapter, build_adapter
from wavecore.engine.lora.compute import LoRARows, add_lora
from wavecore.engine.lora.native import (
    DELTA_KERNEL,
    NativeKernel,
    delta_kernel,
    has_pairs,
    kernel_function,
    product_shapes,
    step_owner,
)
from wavecore.engine.lora.peft_files import TARGETS, projection_shape, read_peft_adapter
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.executor import ModelExecutor
from wavecore.engine.model.resolve import resolve_model_source

ADAPTERS = {
    "every": {"rank": 4},
    "q-and-v": {"rank": 2, "targets": ("q_proj", "v_proj"), "rslora": True},
    "gate-and-down": {"rank": 7, "targets": ("gate_proj", "down_proj")},
    # q, k and v at rank 24: 72 columns of `x @ a`, the kernel's 64-wide pass and a rest.
    "wide": {"rank": 24, "targets": ("q_proj", "k_proj", "v_proj")},
}
# Widths that are not multiples of 16 (the kernel's vector) or of 64 (its widest step),
# and an odd input width (the pairs layout pads it).
ODD_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=300,
    hidden_size=41,
    intermediate_size=72,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=10,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    context_length=64,
    tie_word_embeddings=True,
    qkv_bias=False,
)


@pytest.fixture(autouse=True)
def fresh_build() -> Iterator[None]:
    """Each test builds (or loads) the kernel under its own environment."""
    native_build.build.cache_clear()
    yield
    native_build.build.cache_clear()


def built_library() -> ctypes.CDLL:
    """The kernel's library; a machine with a C compiler must build it, one without
    skips (its engine runs torch's products)."""
    build = delta_kernel()
    if build.library is None:
        if shutil.which("cc") is not None:
            pytest.fail(f"the LoRA kernel did not build: {build.reason}")
        pytest.skip(build.reason)
    return build.library


def kernel(
    config: ModelConfig, weight_dtype: torch.dtype = torch.float32, pairs: bool = False
) -> NativeKernel:
    library = built_library()
    if pairs and not has_pairs(library):
        pytest.skip("this CPU has no AVX-512 BF16")
    function = kernel_function(library, weight_dtype, pairs)
    return NativeKernel(function, weight_dtype, config, pairs)


def adapters_for(root: Path, config: ModelConfig) -> list[Adapter]:
    made = []
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        directory = write_adapter(
            root / name,
            seed=seed,
            shapes={target: projection_shape(config, target) for target in TARGETS},
            layers=config.num_layers,
            **settings,  # type: ignore[arg-type]
        )
        peft = read_peft_adapter(str(directory), config, max_rank=32)
        made.append(build_adapter(LoRARequest(name, str(directory)), peft, config))
    return made


def torch_reference(
    x: torch.Tensor, width: int, owner: list[int], adapters: list[Adapter], layer: int, product: str
) -> torch.Tensor:
    """Each row's delta on torch's path, one row at a time."""
    expected = torch.zeros(x.shape[0], width)
    for row, number in enumerate(owner):
        if number >= 0:
            add_lora(expected, x, LoRARows(((adapters[number], row, row + 1),)), layer, product)
    return expected


def rounded(adapter: Adapter) -> Adapter:
    """`adapter` with its matrices rounded to bfloat16 (and back to float32)."""
    return adapter.to(torch.device("cpu"), torch.bfloat16).to(torch.device("cpu"), torch.float32)


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def rounded_rows_reference(
    x: torch.Tensor, width: int, owner: list[int], adapters: list[Adapter], layer: int, product: str
) -> torch.Tensor:
    """Each row's delta as the AVX-512 BF16 path takes it: the row rounded to bfloat16,
    and each target's columns of `x @ a` rounded again before its `b`."""
    expected = torch.zeros(x.shape[0], width)
    for row, number in enumerate(owner):
        delta = getattr(adapters[number].layers[layer], product) if number >= 0 else None
        if delta is not None:
            h = to_bf16(x[row : row + 1]) @ delta.a
            for span, b in delta.blocks:
                part = to_bf16(h[:, span.start : span.stop]) @ b
                expected[row : row + 1, span.out_start : span.out_stop] += part
    return expected


WEIGHTS = {
    "f32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),
    "bf16-pairs": (torch.bfloat16, True),
}


@pytest.mark.parametrize("config", [TINY_CONFIG, ODD_CONFIG], ids=["tiny", "odd-widths"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_each_row_gets_its_own_adapters_delta(
    tmp_path: Path, config: ModelConfig, weights: str
) -> None:
    weight_dtype, pairs = WEIGHTS[weights]
    adapters = adapters_for(tmp_path, config)
    native = kernel(config, weight_dtype, pairs)
    forms = [native.adapter(adapter) for adapter in adapters]
    # Interleaved rows, base rows among them, and a run: groups of 4 and remainders.
    owner = [2, -1, 0, 1, 0, 2, -1, 1, 1, 0, 0, 0, 0, 0, 2, -1, 1, 3, 3, 0, 3, 3, 3, 3]
    rows = native.rows(forms, torch.tensor(owner))
    if weight_dtype == torch.bfloat16:
        adapters = [rounded(adapter) for adapter in adapters]
    reference = rounded_rows_reference if pairs else torch_reference
    gen = torch.Generator().manual_seed(0)
    shapes = product_shapes(config)
    for layer in range(config.num_layers):
        for product in PRODUCTS:
            fan_in, width = shapes[product]
            x = torch.randn(len(owner), fan_in, generator=gen)
            start = torch.randn(len(owner), width, generator=gen)
            got = start.clone()
            rows.add(got, x, layer, product)
            delta = reference(x, width, owner, adapters, layer, product)
            assert delta.abs().sum() > 0  # some adapter targets every product
            # Rounded rows: a sum that lands next to a rounding boundary may round the
            # other way (one bfloat16 step, 2**-8, of one of h's values).
            tolerance = 1e-5 if not pairs else 1e-2 * delta.abs().max().item()
            torch.testing.assert_close(got, start + delta, rtol=1e-5, atol=tolerance)


def test_a_rows_delta_does_not_depend_on_the_rows_around_it(tmp_path: Path) -> None:
    adapters = adapters_for(tmp_path, TINY_CONFIG)
    native = kernel(TINY_CONFIG)
    forms = [native.adapter(adapter) for adapter in adapters]
    gen = torch.Generator().manual_seed(1)
    x_row = torch.randn(1, TINY_CONFIG.hidden_size, generator=gen)
    alone = torch.zeros(1, 128)
    native.rows(forms, torch.tensor([0])).add(alone, x_row, 1, "qkv")
    for position, owner in [(0, [0, 0, 0, 0, 0]), (3, [1, 2, 0, 0, 0]), (6, [-1] * 6 + [0])]:
        x = torch.randn(len(owner), TINY_CONFIG.hidden_size, generator=gen)
        x[position] = x_row[0]
        out = torch.zeros(len(owner), 128)
        native.rows(forms, torch.tensor(owner)).add(out, x, 1, "qkv")
        assert torch.equal(out[position], alone[0])  # bit for bit


def test_a_call_that_does_not_fit_the_step_is_refused(tmp_path: Path) -> None:
    native = kernel(TINY_CONFIG)
    rows = native.rows(
        [native.adapter(adapters_for(tmp_path, TINY_CONFIG)[0])], torch.tensor([0, 0])
    )
    out = torch.zeros(2, 128)
    cases = [
        (torch.zeros(3, 64), out, "do not fit"),  # more rows than the step
        (torch.zeros(2, 32), out, "do not fit"),  # the wrong input width
        (torch.zeros(2, 64), torch.zeros(2, 100), "do not fit"),  # the wrong output width
        (torch.zeros(2, 64, dtype=torch.bfloat16), out, "float32"),
        (torch.zeros(64, 2).t(), out, "contiguous"),
        (torch.zeros(2, 64), torch.zeros(128, 2).t(), "contiguous"),
        (torch.zeros(2, 128)[:, ::2], out, "contiguous"),
    ]
    for x, target, message in cases:
        before = target.clone()
        with pytest.raises(ValueError, match=message):
            rows.add(target, x, 0, "qkv")
        assert torch.equal(target, before)


def test_step_owner_maps_runs_and_mixed_decodes_to_the_steps_adapters() -> None:
    owner = step_owner(
        7,
        ("b", "a", "c"),
        runs=[("c", 4, 6)],
        mixed=("a", "b"),
        mixed_owner=torch.tensor([1, -1, 0, 0]),
    )
    assert owner.tolist() == [0, -1, 1, 1, 2, 2, -1]
    assert owner.dtype == torch.int32


def test_the_build_is_cached_and_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built_library()
    built = list(native_build.cache_dir().glob("lora_delta-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    # A second process (here: the cache cleared) loads the same file, compiling nothing.
    native_build.build.cache_clear()
    monkeypatch.setattr(native_build, "_compile", lambda *_: pytest.fail("compiled again"))
    assert delta_kernel().library is not None
    assert built[0].stat().st_mtime_ns == stamp
    for env, value, reason in [
        ("CC", "/nonexistent/cc", "no C compiler"),
        ("CC", "false", "--version failed"),
        (DELTA_KERNEL.env, "torch", "WAVECORE_LORA_KERNEL=torch"),
    ]:
        native_build.build.cache_clear()
        with monkeypatch.context() as patch:
            patch.setenv(env, value)
            build = delta_kernel()
        assert build.library is None
        assert reason in build.reason
    native_build.build.cache_clear()
    with monkeypatch.context() as patch:
        patch.setenv(DELTA_KERNEL.env, "fast")
        with pytest.raises(ValueError, match="must be 'native', 'torch' or unset"):
            delta_kernel()


def test_a_compiler_that_fails_leaves_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'error: no' >&2; exit 1\n")  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    build = delta_kernel()
    assert build.library is None
    assert "failed to build delta_kernel.c: error: no" in build.reason
    assert not list(native_build.cache_dir().glob("lora_delta-*"))  # nothing half written


def test_an_executor_says_which_path_runs_and_both_give_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_tiny_model(tmp_path / "model")
    directories = {
        name: write_adapter(tmp_path / name, seed=seed, **settings)  # type: ignore[arg-type]
        for seed, (name, settings) in enumerate(ADAPTERS.items())
    }

    def tokens(path_expected: str) -> dict[tuple[str, str | None], list[int]]:
        executor = ModelExecutor(
            resolve_model_source(model),
            device="cpu",
            dtype="float32",
            weights="float32",
            kv_cache_memory=2**20,
            enable_lora=True,
        )
        try:
            assert executor.path_report()["lora"].startswith(path_expected)
            for name, directory in directories.items():
                executor.add_lora(LoRARequest(name, str(directory)))
            return {
                (prompt, lora): greedy_alone(executor, list(prompt.encode()), 6, lora)
                for prompt in ("Hello", "a b c d e f")
                for lora in (None, *ADAPTERS)
            }
        finally:
            executor.close()

    built_library()
    native = tokens("native kernel, float32 adapter weights")
    native_build.build.cache_clear()
    monkeypatch.setenv(DELTA_KERNEL.env, "torch")
    assert tokens("torch products (WAVECORE_LORA_KERNEL=torch)") == native


def test_the_lora_modules_import_before_the_model_package() -> None:
    """`store` (through `native`, `adapters`, `peft_files`) imported first, in a fresh
    interpreter: the model package imports them through its executor, so they may
    import it only for type checking."""
    code = "import wavecore.engine.lora.store"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
