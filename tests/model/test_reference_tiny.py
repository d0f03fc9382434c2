"""Tiny synthetic models, loaded from GGUF and from safetensors, against transformers."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from model_test_helpers import (
    TinySpec,
    prefill_logits,
    random_state_dict,
    write_gguf,
    write_hf_directory,
)

from wavecore.engine.model import resolve_model_source

PROMPT = [5, 17, 99, 3, 250, 42, 7, 128, 64, 11, 200, 31, 8, 90, 15, 77, 140, 19, 23]


def transformers_logits(hf_dir: Path, prompt: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


@pytest.mark.usefixtures("projections")
def test_gguf_and_safetensors_match_transformers(tiny_gguf: Path, tiny_hf_dir: Path) -> None:
    reference = transformers_logits(tiny_hf_dir, PROMPT)
    from_gguf = prefill_logits(tiny_gguf, PROMPT)
    from_dir = prefill_logits(tiny_hf_dir, PROMPT)
    assert torch.allclose(from_gguf, reference, atol=1e-4, rtol=0)
    assert torch.allclose(from_dir, reference, atol=1e-4, rtol=0)


@pytest.mark.usefixtures("projections")
def test_untied_qwen2_with_biases_matches_transformers(tmp_path: Path) -> None:
    spec = TinySpec(architecture="qwen2", tie_word_embeddings=False, rope_theta=1e6)
    state = random_state_dict(spec, seed=3)
    hf_dir = write_hf_directory(tmp_path / "qwen2", spec, state)
    gguf_file = write_gguf(tmp_path / "qwen2.gguf", spec, state)
    reference = transformers_logits(hf_dir, PROMPT)
    assert resolve_model_source(str(gguf_file)).config.qkv_bias
    assert torch.allclose(prefill_logits(hf_dir, PROMPT), reference, atol=1e-4, rtol=0)
    assert torch.allclose(prefill_logits(gguf_file, PROMPT), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("quant", "tolerance"),
    [
        (gguf.GGMLQuantizationType.Q8_0, 0.02),
        (gguf.GGMLQuantizationType.Q4_0, 0.15),
        (gguf.GGMLQuantizationType.Q4_1, 0.1),
        (gguf.GGMLQuantizationType.F16, 1e-3),
        (gguf.GGMLQuantizationType.BF16, 5e-3),
    ],
)
def test_quantized_weights_dequantize_near_the_originals(
    tmp_path: Path, tiny_spec: TinySpec, tiny_state, quant, tolerance: float
) -> None:
    path = write_gguf(tmp_path / "q.gguf", tiny_spec, tiny_state, quant=quant)
    tensors = resolve_model_source(str(path)).load_tensors()
    # q is stored permuted in the file: matching the original shows it was un-permuted.
    for ours, theirs in (
        ("layers.1.q", "model.layers.1.self_attn.q_proj.weight"),
        ("layers.0.k", "model.layers.0.self_attn.k_proj.weight"),
        ("layers.0.down", "model.layers.0.mlp.down_proj.weight"),
    ):
        original = tiny_state[theirs]
        error = (tensors[ours] - original).abs().max().item()
        assert error <= tolerance * original.abs().max().item(), (ours, error)


def test_source_exposes_tokenizer_metadata(tiny_gguf: Path, tiny_hf_dir: Path) -> None:
    source = resolve_model_source(str(tiny_gguf))
    assert source.format == "gguf"
    assert source.eos_token_id == 2 and source.bos_token_id == 1
    assert source.chat_template == "{{ messages[0]['content'] }}"
    assert source.context_length == 512
    assert source.gguf_metadata["general.architecture"] == "llama"
    directory = resolve_model_source(str(tiny_hf_dir))
    assert directory.format == "safetensors" and directory.gguf_metadata == {}
    assert directory.eos_token_ids == (2,)
