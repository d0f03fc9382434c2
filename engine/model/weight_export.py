"""Writing the weights a model serves as a Hugging Face directory (`save_weights`):
upstream's `save_sharded_state`, in the layout `hf_directory` reads.

The tensors are read back from the served `ModelWeights` (after any `update_weights`):
fused projections are multiplied by an identity matrix and split, which returns each
weight exactly (a packed or plain float projection; an int8 one gives its dequantized
weights, what it computes with), in the dtype the model computes in. They are written
under Hugging Face names as safetensors shards of at most `max_shard_size` bytes
(a tensor larger than that gets a shard of its own) with `model.safetensors.index.json`,
beside the model's `config.json`, generation config and tokenizer: copied from a
Hugging Face source directory, or made from a GGUF file's metadata and tokenizer. The
weight version goes in `wavecore_weights.json`. The result loads as
`EngineConfig(model=directory)` and as `update_weights(directory)`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.hf_directory import hf_tensor_name
from wavecore.engine.model.source import ModelSource
from wavecore.engine.model.weight_format import AnyProjection
from wavecore.engine.model.weights import ModelWeights

INDEX_FILE = "model.safetensors.index.json"
VERSION_FILE = "wavecore_weights.json"
# What a Hugging Face source directory holds beside its weights, copied as it is.
_SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def served_tensors(
    weights: ModelWeights, config: ModelConfig, *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every canonical tensor (`weight_update.weight_shapes`) of `weights`, which live
    on `device` in `dtype`, copied to the CPU. Run under `torch.inference_mode` on the
    model thread."""

    def matrix(projection: AnyProjection) -> torch.Tensor:
        """The projection's [out, in] weight, read back exactly (module docstring)."""
        return projection(torch.eye(projection.in_features, device=device, dtype=dtype)).t()

    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(weights.layers):
        p = f"layers.{i}."
        parts = dict(zip(("q", "k", "v"), matrix(layer.qkv).split([q, kv, kv]), strict=True))
        parts |= dict(zip(("gate", "up"), matrix(layer.gate_up).split([inter, inter]), strict=True))
        parts |= {"o": matrix(layer.o), "down": matrix(layer.down)}
        parts |= {"attn_norm": layer.attn_norm, "ffn_norm": layer.ffn_norm}
        if layer.qkv_bias is not None:
            biases = layer.qkv_bias.split([q, kv, kv])
            parts |= dict(zip(("q_bias", "k_bias", "v_bias"), biases, strict=True))
        tensors |= {p + name: tensor for name, tensor in parts.items()}
    tensors["final_norm"] = weights.final_norm
    tensors["embed"] = weights.embed
    if not config.tie_word_embeddings:
        tensors["lm_head"] = matrix(weights.lm_head)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}


def write_model_directory(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    source: ModelSource,
    *,
    max_shard_size: int,
    weight_version: str | None,
) -> None:
    """Write `tensors` (canonical names) and what loads them into `directory`, which
    must not exist or hold no safetensors of its own."""
    _check_target(directory, source)
    directory.mkdir(parents=True, exist_ok=True)
    _write_shards(directory, tensors, max_shard_size)
    if source.format == "safetensors":
        for name in _SOURCE_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, directory / name)
    else:
        _write_gguf_metadata(directory, source)
    (directory / VERSION_FILE).write_text(
        json.dumps({"weight_version": weight_version}, indent=2) + "\n", encoding="utf-8"
    )


def _check_target(directory: Path, source: ModelSource) -> None:
    if directory.exists() and not directory.is_dir():
        raise WeightUpdateError(f"save_weights: {directory} exists and is not a directory")
    if directory.is_dir() and any(directory.glob("*.safetensors")):
        raise WeightUpdateError(
            f"save_weights: {directory} already holds safetensors files; "
            "give an empty or new directory"
        )
    if directory.resolve() == source.path.resolve():
        raise WeightUpdateError(f"save_weights: {directory} is the model's own directory")


def _write_shards(directory: Path, tensors: Mapping[str, torch.Tensor], limit: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][hf_tensor_name(name)] = tensor
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _write_gguf_metadata(directory: Path, source: ModelSource) -> None:
    """`config.json`, `generation_config.json` and the tokenizer from a GGUF file."""
    from wavecore.engine.sampling.gguf_tokenizer import build_gguf_tokenizer

    config = source.config
    raw: dict[str, Any] = {
        "architectures": [f"{config.architecture.capitalize()}ForCausalLM"],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.context_length,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.qkv_bias,
        "bos_token_id": source.bos_token_id,
        "eos_token_id": source.eos_token_id,
    }
    if config.rope_scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_scaling_factor}
    elif config.rope_scaling == "llama3":
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": config.rope_scaling_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_context_length,
        }
    _write_json(directory / "config.json", raw)
    generation = {"bos_token_id": source.bos_token_id, "eos_token_id": list(source.eos_token_ids)}
    _write_json(directory / "generation_config.json", generation)
    tokenizer = build_gguf_tokenizer(source.gguf_metadata, source.path)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = dict(tokenizer.special_tokens)
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    _write_json(directory / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
