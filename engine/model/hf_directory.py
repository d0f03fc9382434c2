"""Reading a Hugging Face model directory: `config.json`, `*.safetensors`, `tokenizer.json`.

Only local files are read; nothing here reaches the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.source import ModelSource

# model_type -> whether q/k/v carry biases by default.
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_MODEL_TENSORS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}


def read_hf_directory(directory: Path) -> ModelSource:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: not a model directory (no config.json)")
    if not sorted(directory.glob("*.safetensors")):
        raise ModelLoadError(f"{directory}: no *.safetensors weight files")
    raw = _read_json(config_path)
    config = _config_from_json(config_path, raw)

    tokenizer_json = directory / "tokenizer.json"
    tokenizer_config_path = directory / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_config_path) if tokenizer_config_path.is_file() else {}
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}

    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = (
        tuple(int(t) for t in eos)
        if isinstance(eos, list)
        else ((int(eos),) if eos is not None else ())
    )
    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    template_file = directory / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else tokenizer_config.get("chat_template")
    )
    return ModelSource(
        format="safetensors",
        path=directory,
        config=config,
        gguf_metadata={},
        tokenizer_json=tokenizer_json if tokenizer_json.is_file() else None,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=eos_ids,
        chat_template=template if isinstance(template, str) else None,
        tensor_loader=load_safetensors_tensors,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: unreadable JSON ({error})") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def _config_from_json(path: Path, raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: unsupported model_type {model_type!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )

    def required(key: str) -> Any:
        if key not in raw:
            raise ModelLoadError(f"{path}: missing {key}")
        return raw[key]

    hidden = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // max(num_heads, 1)
    # transformers 5 nests rope settings under rope_parameters; older files use rope_theta
    # and rope_scaling at the top level.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling: dict[str, Any] = {}
    if rope_type == "llama3":
        scaling = {
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_context_length": int(rope["original_max_position_embeddings"]),
        }
    elif rope_type == "linear":
        scaling = {"rope_scaling": "linear", "rope_scaling_factor": float(rope["factor"])}
    elif rope_type != "default":
        raise ModelLoadError(f"{path}: unsupported rope scaling {rope_type!r}")

    context = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", model_type == "mistral"):
        # Without sliding-window attention, the model is exact only within one window.
        context = min(context, int(window))
    config = ModelConfig(
        architecture=model_type,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required("intermediate_size")),
        num_layers=int(required("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=float(theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=context,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", SUPPORTED_MODEL_TYPES[model_type])),
        **scaling,
    )
    config.check(str(path))
    return config


def load_safetensors_tensors(source: ModelSource) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = canonical_tensor_name(key)
                    if name is not None:
                        tensors[name] = handle.get_tensor(key).to(torch.float32)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({error})") from error
    return tensors


def canonical_tensor_name(hf_name: str) -> str | None:
    """The canonical name (`model.source`) of a Hugging Face tensor name, None if unknown."""
    if hf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[hf_name]
    prefix = "model.layers."
    if hf_name.startswith(prefix):
        index, _, rest = hf_name[len(prefix) :].partition(".")
        if index.isdigit() and rest in _LAYER_TENSORS:
            return f"layers.{int(index)}.{_LAYER_TENSORS[rest]}"
    return None


_HF_MODEL_NAMES = {canonical: hf for hf, canonical in _MODEL_TENSORS.items()}
_HF_LAYER_NAMES = {canonical: hf for hf, canonical in _LAYER_TENSORS.items()}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a canonical tensor name (`canonical_tensor_name`'s
    inverse); `KeyError` for a name no Hugging Face checkpoint holds."""
    if name in _HF_MODEL_NAMES:
        return _HF_MODEL_NAMES[name]
    _, index, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
    if not index.isdigit() or rest not in _HF_LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for tensor {name!r}")
    return f"model.layers.{index}.{_HF_LAYER_NAMES[rest]}"
