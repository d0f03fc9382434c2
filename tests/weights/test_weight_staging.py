"""Staging new weights beside the old (model/weight_update.py), the checks before it
(executors/weight_specs.py), reading update files (model/update_source.py) and the
plain-data codec of collective_rpc, on a tiny random model: no model file needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.executors.rpc_values import decode_values, encode_values
from wavecore.engine.executors.weight_specs import check_update
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.update_source import canonical_tensors, read_update_file
from wavecore.engine.model.weight_update import stage_weights, weight_shapes
from wavecore.engine.model.weights import ModelWeights

CPU = torch.device("cpu")


def tiny_config(*, tied: bool, bias: bool) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        context_length=64,
        tie_word_embeddings=tied,
        qkv_bias=bias,
    )


def random_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator)
        for name, shape in weight_shapes(config).items()
    }


def build(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    return ModelWeights.build(config, tensors, origin=Path("test"), device=CPU, dtype=torch.float32)


def same_weights(a: ModelWeights, b: ModelWeights, config: ModelConfig) -> bool:
    """Equal products of every projection and equal vectors: what the forward reads."""

    def matrix(projection: object) -> torch.Tensor:
        return projection(torch.eye(projection.in_features))  # type: ignore[operator]

    pairs = [(a.final_norm, b.final_norm), (a.embed, b.embed)]
    pairs.append((matrix(a.lm_head), matrix(b.lm_head)))
    for x, y in zip(a.layers, b.layers, strict=True):
        pairs += [(x.attn_norm, y.attn_norm), (x.ffn_norm, y.ffn_norm)]
        pairs += [(matrix(p), matrix(q)) for p, q in ((x.qkv, y.qkv), (x.o, y.o),
                  (x.gate_up, y.gate_up), (x.down, y.down))]  # fmt: skip
        if config.qkv_bias:
            pairs.append((x.qkv_bias, y.qkv_bias))
    return all(torch.equal(p, q) for p, q in pairs)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_partial_update_equals_a_fresh_build(tied: bool, bias: bool) -> None:
    config = tiny_config(tied=tied, bias=bias)
    old = random_tensors(config, seed=1)
    new = random_tensors(config, seed=2)
    # Parts of fused projections (q alone, up alone, k_bias alone), a norm, the head.
    names = ["layers.1.q", "layers.0.up", "layers.1.ffn_norm", "final_norm", "embed"]
    names += ["layers.0.k_bias"] if bias else []
    names += [] if tied else ["lm_head"]
    update = {name: new[name] for name in names}
    current = build(config, old)
    with torch.inference_mode():
        staged = stage_weights(current, config, update, device=CPU, dtype=torch.float32)
        assert same_weights(staged, build(config, old | update), config)
        # The current weights are untouched; an unchanged layer is shared, not copied.
        assert same_weights(current, build(config, old), config)
    assert staged.layers[0] is not current.layers[0]
    assert staged.layers[1] is not current.layers[1]
    only_layer_0 = stage_weights(
        current, config, {"layers.0.o": new["layers.0.o"]}, device=CPU, dtype=torch.float32
    )
    assert only_layer_0.layers[1] is current.layers[1]


def test_staged_weights_do_not_alias_the_callers_tensors() -> None:
    config = tiny_config(tied=True, bias=False)
    norm = torch.ones(16)
    with torch.inference_mode():
        staged = stage_weights(
            build(config, random_tensors(config, 1)),
            config,
            {"final_norm": norm},
            device=CPU,
            dtype=torch.float32,
        )
    norm += 1  # the caller trains on
    assert torch.equal(staged.final_norm, torch.ones(16))


def test_bfloat16_is_converted() -> None:
    config = tiny_config(tied=True, bias=False)
    update = {"layers.0.down": torch.randn(16, 24).to(torch.bfloat16)}
    with torch.inference_mode():
        staged = stage_weights(
            build(config, random_tensors(config, 1)),
            config,
            update,
            device=CPU,
            dtype=torch.float32,
        )
    assert torch.equal(
        staged.layers[0].down(torch.eye(24)).t(), update["layers.0.down"].to(torch.float32)
    )


@pytest.mark.parametrize(
    ("update", "partial", "message"),
    [
        ({}, True, "holds no tensors"),
        ({"a": torch.zeros(2), "zzz": torch.zeros(1)}, True, "'zzz' is not a weight"),
        ({"a": torch.zeros(2)}, False, "'b' is missing"),
        ({"a": torch.zeros(3)}, True, r"'a' has shape \(3,\), the model's is \(2,\)"),
        ({"a": torch.zeros(2, dtype=torch.int32)}, True, "'a' has dtype torch.int32"),
    ],
)
def test_check_update_names_the_tensor(
    update: dict[str, torch.Tensor], partial: bool, message: str
) -> None:
    with pytest.raises(WeightUpdateError, match=message):
        check_update(update, {"a": (2,), "b": (1,)}, partial=partial, origin="src")


def test_read_update_file_maps_hf_names(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file(
        {"model.layers.3.self_attn.q_proj.weight": torch.ones(2, 2), "other": torch.zeros(1)},
        str(file),
    )
    tensors = read_update_file(file)
    assert sorted(tensors) == ["layers.3.q", "other"]
    with pytest.raises(WeightUpdateError, match="given twice"):
        canonical_tensors({"layers.0.q": torch.ones(1), "model.layers.0.self_attn.q_proj.weight": torch.ones(1)}, "m")  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightUpdateError, match=r"empty: no \*\.safetensors files"):
        read_update_file(empty)


def test_plain_values_round_trip_and_refusals() -> None:
    value = [1, -2.5, "x", b"y", None, True, {"k": [1, {"n": None}]}]
    assert decode_values(encode_values(value, "v"), "v") == value
    with pytest.raises(ValueError, match=r"v\[0\]: a set is not plain data"):
        encode_values([{1}], "v")
    with pytest.raises(ValueError, match="dict keys must be str"):
        encode_values({1: 2}, "v")
    with pytest.raises(ValueError, match="not plain"):
        decode_values(b"\xc1\x00", "v")  # CBOR tag 1, a datetime
