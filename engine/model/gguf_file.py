"""Reading Llama-family GGUF files: metadata into a `ModelSource`, tensors into float32.

The header (metadata and tensor table) is parsed once, by `wavecore.engine.model.gguf_format`,
when the model is resolved; the `ModelSource` keeps both, so the tokenizer is built from
the same metadata and the weights are read by mapping the file and slicing each tensor
at its recorded offset.
Quantized tensors are dequantized by `gguf.quants`, the reference implementation
that llama.cpp's converters ship; whatever type it cannot dequantize is reported as
unsupported. GGUF converters for the `llama` architecture permute the rows of the q
and k projections so llama.cpp's interleaved rotary matches Hugging Face's
half-split rotary; `_unpermute_rows` undoes that, so the runtime sees Hugging Face
layout whatever the source. Qwen2 files are written unpermuted.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.gguf_format import GGUFFormatError, GGUFTensorInfo, read_gguf_header
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
    try:
        header = read_gguf_header(path)
    except GGUFFormatError as error:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from error
    metadata = header.metadata

    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {architecture!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    _, qkv_bias = SUPPORTED_ARCHITECTURES[architecture]
    tensors = {tensor.name: tensor for tensor in header.tensors}
    config = _config_from_metadata(path, architecture, metadata, tensors, qkv_bias)

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
        tensor_loader=load_gguf_tensors,
        gguf_tensors=header.tensors,
    )


def _config_from_metadata(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, GGUFTensorInfo],
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
        embedding = tensors.get("token_embd.weight")
        if embedding is None or len(embedding.dims) != 2:
            raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
        vocab = embedding.dims[-1]
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
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=qkv_bias and "blk.0.attn_q.bias" in tensors,
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
    config = source.config
    permuted, _ = SUPPORTED_ARCHITECTURES[config.architecture]
    tensors: dict[str, torch.Tensor] = {}
    with source.path.open("rb") as file:
        try:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"{source.path}: cannot be mapped ({error})") from error
    # A plain ndarray over the map, not np.memmap: the dequantizer slices it thousands of
    # times and memmap's per-view bookkeeping would cost seconds. The map is unmapped when
    # the last view is dropped; none outlives this call, since every tensor is copied.
    file_bytes = np.frombuffer(mapped, dtype=np.uint8)
    for info in source.gguf_tensors:
        name = _canonical_name(info.name)
        if name is None:
            continue
        values = _dequantized(source.path, file_bytes, info)
        if permuted and name.endswith((".q", ".k")) and values.ndim == 2:
            heads = config.num_heads if name.endswith(".q") else config.num_kv_heads
            if values.shape[0] % (2 * heads):
                raise ModelLoadError(
                    f"{source.path}: tensor {info.name} has {values.shape[0]} rows, "
                    f"not divisible into {heads} rotary heads"
                )
            values = _unpermute_rows(values, heads)
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
    return tensors


def _dequantized(path: Path, file_bytes: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's values as float32, shaped `[..., dims[0]]` (row-major, GGUF reversed)."""
    try:
        kind = gguf.GGMLQuantizationType(info.type_code)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError) as error:
        raise ModelLoadError(
            f"{path}: tensor {info.name} has unknown tensor type {info.type_code}"
        ) from error
    shape = tuple(reversed(info.dims))
    row_length = info.dims[0] if info.dims else 1
    if row_length % block:
        raise ModelLoadError(
            f"{path}: tensor {info.name} rows of {row_length} values do not fill "
            f"{kind.name} blocks of {block}"
        )
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = row_length // block * block_bytes
    end = info.offset + rows * row_bytes
    if end > file_bytes.size:
        raise ModelLoadError(
            f"{path}: tensor {info.name} runs past the end of the file "
            f"(needs bytes up to {end}, the file has {file_bytes.size})"
        )
    raw = file_bytes[info.offset : end].reshape(rows, row_bytes)
    try:
        values = gguf.quants.dequantize(raw, kind)
    except NotImplementedError as error:
        raise ModelLoadError(
            f"{path}: tensor {info.name} has unsupported quantization type {kind.name}"
        ) from error
    return values.reshape(shape)


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None
