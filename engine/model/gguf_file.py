"""Reading Llama-family GGUF files: metadata into a `ModelSource`, tensors into float32.

Quantized tensors are dequantized by `gguf.quants`, the reference implementation
that llama.cpp's converters ship; whatever type it cannot dequantize is reported as
unsupported. GGUF converters for the `llama` architecture permute the rows of the q
and k projections so llama.cpp's interleaved rotary matches Hugging Face's
half-split rotary; `_unpermute_rows` undoes that, so the runtime sees Hugging Face
layout whatever the source. Qwen2 files are written unpermuted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.source import ModelSource

# GGUF architecture name -> whether its converter permutes q/k rows, whether q/k/v have biases.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (True, False),
    "qwen2": (False, True),
}

_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_MODEL_TENSORS = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
    "rope_freqs.weight": "rope_freqs",
}


def read_gguf(path: Path) -> ModelSource:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the parser raises many types for a damaged file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from error
    try:
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as error:
        raise ModelLoadError(f"{path}: damaged GGUF metadata ({error})") from error

    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {architecture!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    _, qkv_bias = SUPPORTED_ARCHITECTURES[architecture]
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = _config_from_metadata(path, architecture, metadata, reader, tensor_names, qkv_bias)

    eos = metadata.get("tokenizer.ggml.eos_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    template = metadata.get("tokenizer.chat_template")
    return ModelSource(
        format="gguf",
        path=path,
        config=config,
        gguf_metadata=metadata,
        tokenizer_json=None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
        chat_template=template if isinstance(template, str) else None,
        reader=reader,
    )


def _config_from_metadata(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    reader: Any,
    tensor_names: set[str],
    qkv_bias: bool,
) -> ModelConfig:
    def required(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // max(num_heads, 1)))
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
        vocab = int(embedding.shape[-1])
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    scaling_factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if scaling_type == "linear" and scaling_factor != 1.0:
        rope_scaling = "linear"
    elif scaling_type in ("none", "linear") or scaling_factor == 1.0:
        # Llama 3 GGUF files carry their frequency scaling as the rope_freqs tensor.
        rope_scaling = "none"
    else:
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling_type!r}")
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(required("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=qkv_bias and "blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        rope_scaling_factor=scaling_factor,
    )
    config.check(str(path))
    return config


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert the converter's per-head (pairs -> halves) row permutation."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def load_gguf_tensors(source: ModelSource) -> dict[str, torch.Tensor]:
    import gguf

    reader = source.reader if source.reader is not None else gguf.GGUFReader(source.path)
    config = source.config
    permuted, _ = SUPPORTED_ARCHITECTURES[config.architecture]
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name)
        if name is None:
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ModelLoadError(
                f"{source.path}: tensor {tensor.name} has unsupported quantization type "
                f"{tensor.tensor_type.name}"
            ) from error
        except Exception as error:
            raise ModelLoadError(
                f"{source.path}: tensor {tensor.name} could not be read ({error})"
            ) from error
        expected_shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if values.size != int(np.prod(expected_shape)):
            raise ModelLoadError(
                f"{source.path}: tensor {tensor.name} holds {values.size} values, "
                f"its header says shape {expected_shape}"
            )
        values = values.reshape(expected_shape)
        if permuted and name.endswith((".q", ".k")) and values.ndim == 2:
            heads = config.num_heads if name.endswith(".q") else config.num_kv_heads
            if values.shape[0] % (2 * heads):
                raise ModelLoadError(
                    f"{source.path}: tensor {tensor.name} has {values.shape[0]} rows, "
                    f"not divisible into {heads} rotary heads"
                )
            values = _unpermute_rows(values, heads)
        if not values.flags.writeable:  # float32 tensors come back as views of the mmap
            values = values.copy()
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return tensors


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None
