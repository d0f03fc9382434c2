"""weights="int8": the config knob, the int8 projection's arithmetic, a tiny model end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_test_helpers import ArgmaxSampler, GreedyRunner, greedy_alone, prefill_logits

from wavecore.engine.config import EngineConfig
from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.model import load_executor
from wavecore.engine.model.int8_linear import Int8Projection, quantize_rows
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.weight_format import build_projection, check_weight_format
from wavecore.engine.sampling_params import SamplingParams


def test_engine_config_takes_auto_float32_and_int8_only() -> None:
    assert EngineConfig().weights == "auto"
    assert EngineConfig(weights="int8").weights == "int8"
    assert EngineConfig(weights="float32").weights == "float32"
    with pytest.raises(
        ValueError, match=r"EngineConfig.weights must be .auto., .float32. or .int8."
    ):
        EngineConfig(weights="int4")  # type: ignore[arg-type]


def test_weight_format_is_checked_against_the_device() -> None:
    assert check_weight_format("int8", torch.device("cpu")) == "int8"
    with pytest.raises(ValueError, match="weights must be 'auto', 'float32' or 'int8', got 'q4'"):
        check_weight_format("q4", torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on the CPU only"):
        check_weight_format("int8", torch.device("cuda"))


def test_auto_weights_choose_only_where_the_dtype_is_auto_on_the_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert check_weight_format("auto", cpu) == "auto"
    assert check_weight_format("auto", cpu, "float32") == "float32"
    assert check_weight_format("auto", cpu, "bfloat16") == "float32"
    assert check_weight_format("auto", cuda) == "float32"


def test_executor_refuses_an_unknown_format(tiny_gguf: Path) -> None:
    with pytest.raises(ValueError, match="got 'bfloat16'"):
        load_executor(str(tiny_gguf), device="cpu", kv_cache_memory=2**20, weights="bfloat16")  # type: ignore[arg-type]


def test_quantize_rows_rounds_each_row_to_its_own_scale() -> None:
    matrix = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [100.0, 1.0, -50.0]])
    values, scales = quantize_rows(matrix)
    assert values.dtype == torch.int8
    assert torch.equal(
        values[:, 0:2], torch.tensor([[64, -127], [0, 0], [127, 1]], dtype=torch.int8)
    )
    assert scales[1] == 1.0  # a zero row: any scale is exact
    assert (values.float() * scales[:, None] - matrix).abs().max() <= scales.max() / 2
    with pytest.raises(ValueError, match="holds NaN or infinity"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))


def _projection_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight, activations with two outlier channels, and their calibrated range."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    x = torch.randn(8, 64, generator=gen)
    x[:, 3] *= 300.0
    x[:, 40] *= -80.0
    return weight, x, x.abs().amax(dim=0)


def test_int8_product_is_close_to_float_despite_outlier_channels() -> None:
    weight, x, input_range = _projection_case()
    projection = Int8Projection.build(weight, input_range)
    exact = x @ weight.t()
    error = (projection(x) - exact).abs().max() / exact.abs().max()
    assert error < 0.01, error
    residual = torch.ones(8, 96)
    assert torch.allclose(projection.add_to(residual, x), 1 + projection(x))
    assert projection.num_bytes < 96 * 64 * 4  # float32 bytes


def test_a_token_gets_the_same_product_alone_or_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 256, generator=gen) * 0.1
    x = torch.randn(9, 256, generator=gen)
    x[0, 7] *= 50.0  # an outlier token...
    x[:, 100] *= 30.0  # ...and an outlier channel, as in a prefill
    projection = Int8Projection.build(weight, x.abs().amax(dim=0))
    exact = x @ weight.t()
    scale = exact.abs().max()
    together = projection(x)
    beside_a_giant = projection(torch.cat([x[3:4], 1000.0 * x[4:5]]))
    for row in range(9):
        alone = projection(x[row : row + 1])[0]
        # The int8 part is exact integer arithmetic on a pinned range: only the float32
        # outlier product may round differently with the batch's size, as float32 does.
        assert torch.allclose(together[row], alone, rtol=0, atol=1e-6 * scale), row
        assert (alone - exact[row]).abs().max() < 0.01 * scale.item(), row
    assert torch.allclose(beside_a_giant[0], together[3], rtol=0, atol=1e-6 * scale)


def test_int8_projection_refuses_bad_input() -> None:
    weight, _, input_range = _projection_case()
    with pytest.raises(ValueError, match=r"input_range has shape \(63,\), expected \(64,\)"):
        Int8Projection.build(weight, input_range[:63])
    with pytest.raises(ValueError, match="needs a 2-D matrix"):
        Int8Projection.build(weight[0], input_range)
    projection = Int8Projection.build(weight, input_range)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        projection.to(torch.device("cuda"))


def test_an_update_keeps_the_format_of_what_it_replaces() -> None:
    weight, x, input_range = _projection_case()
    old = Int8Projection.build(weight, input_range)
    cpu = torch.device("cpu")
    new = build_projection(2 * weight, device=cpu, dtype=torch.float32, like=old)
    assert isinstance(new, Int8Projection)
    assert torch.equal(new.input_range, old.input_range)
    assert torch.allclose(new(x), 2 * old(x), rtol=0.02, atol=0.02 * old(x).abs().max().item())
    float_old = Projection.build(weight, device=cpu, dtype=torch.float32)
    assert isinstance(
        build_projection(weight, device=cpu, dtype=torch.float32, like=float_old), Projection
    )


@pytest.fixture
def tiny_int8(tiny_gguf: Path):
    executor = load_executor(
        str(tiny_gguf),
        device="cpu",
        kv_cache_memory=64 * 2**10,
        sampler=ArgmaxSampler(),
        weights="int8",
    )
    yield executor
    executor.close()


def test_tiny_model_in_int8_predicts_like_float32(tiny_gguf: Path, tiny_int8) -> None:
    prompt = [5, 17, 200, 3, 99, 42, 7, 130]
    exact = prefill_logits(tiny_gguf, prompt)
    chunk = SequenceChunk(
        request_id="r",
        token_ids=prompt,
        start_pos=0,
        block_table=[0],
        sample=True,
        sampling=SamplingParams(temperature=0),
        all_token_ids=prompt,
        prompt_len=len(prompt),
    )
    logits = tiny_int8.compute_logits(ModelBatch(chunks=(chunk,)))[0]
    assert tiny_int8.weights == "int8"
    assert isinstance(tiny_int8._model.weights.layers[0].gate_up, Int8Projection)
    assert (logits - exact).abs().max() < 0.05 * exact.abs().max()
    assert logits.argmax() == exact.argmax()
    assert len(greedy_alone(tiny_int8, prompt, 6)) == 6


def test_tiny_model_in_int8_decodes_the_same_tokens_alone_or_batched(tiny_gguf: Path) -> None:
    executor = load_executor(
        str(tiny_gguf),
        device="cpu",
        kv_cache_memory=2**22,
        sampler=ArgmaxSampler(),
        weights="int8",
    )
    try:
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 256, (5 + 3 * i,), generator=gen).tolist() for i in range(12)]
        alone = [greedy_alone(executor, prompt, 8) for prompt in prompts[:3]]
        runner = GreedyRunner(executor, seed=1)
        together = [runner.add(prompt, 8) for prompt in prompts]
        runner.run(together)
        assert [request.output for request in together[:3]] == alone
    finally:
        executor.close()


def test_tiny_model_in_int8_takes_a_partial_weight_update(tiny_int8) -> None:
    before = tiny_int8.score([1, 2, 3, 4])
    gate = tiny_int8.weight_shapes()["layers.0.gate"]
    staged = tiny_int8.stage_weights(
        {"layers.0.gate": torch.zeros(gate)}, partial=True, origin="test"
    )
    assert isinstance(staged.layers[0].gate_up, Int8Projection)
    tiny_int8.commit_weights(staged)
    after = tiny_int8.score([1, 2, 3, 4])
    assert after.shape == before.shape and not torch.allclose(after, before)


def test_quality_bench_runs_on_a_tiny_model(tiny_hf_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "int8_quality.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "int8_quality.py"
    completed = subprocess.run(
        [sys.executable, str(bench), "--model", str(tiny_hf_dir), "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["positions"] > 100
    assert 0 < results["agreement"] <= 1
    assert results["float32_perplexity"] > 1 and results["int8_perplexity"] > 1
    # int8 and woq (torch's CPU build has both kernels), bf16 where the CPU has it.
    assert {"int8", "woq"} <= set(results["candidates"])
    for row in results["candidates"].values():
        assert 0 < row["agreement"] <= 1 and isinstance(row["within_budget"], bool)
    assert results["candidates"]["int8"]["agreement"] == results["agreement"]
