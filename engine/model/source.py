"""`ModelSource`: a model file (or directory) that has been opened and understood.

Resolving a model spec reads only metadata: the architecture, the tokenizer facts the
engine needs (EOS and BOS ids, chat template, context length), and for GGUF files the
whole key/value table and the tensor table, each parsed once. The tokenizer is built
from this metadata (`Tokenizer.from_source`); tensor data is read later, by
`load_tensors()`, from the recorded offsets, without parsing the header again.

The format readers (`gguf_file`, `hf_directory`) build `ModelSource`s and hand each one
its own tensor loader, so this module never imports them: dependencies point one way.

Tensors come back under canonical names, independent of the file format, each laid
out `[out_features, in_features]` like both GGUF and Hugging Face store them:
`embed`, `final_norm`, `lm_head` (absent when tied), `rope_freqs` (optional) and
`layers.{i}.{attn_norm,q,k,v,q_bias,k_bias,v_bias,o,ffn_norm,gate,up,down}`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.gguf_format import GGUFTensorInfo

SourceFormat = Literal["gguf", "safetensors"]
# Reads every weight of a source: the reader of its format supplies it.
TensorLoader = Callable[["ModelSource"], dict[str, torch.Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """A resolved model. `path` is the GGUF file, or the Hugging Face directory.

    `gguf_metadata` maps every GGUF key (e.g. `tokenizer.ggml.tokens`) to its value as
    plain Python (str, int, float, bool, or lists of those); it is empty for
    safetensors directories, whose tokenizer lives in `tokenizer_json`.
    """

    format: SourceFormat
    path: Path
    config: ModelConfig
    gguf_metadata: Mapping[str, Any]
    tokenizer_json: Path | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    tensor_loader: TensorLoader = field(repr=False, compare=False)
    # Where each tensor of a GGUF file lies, so the header is parsed only once.
    gguf_tensors: tuple[GGUFTensorInfo, ...] = field(default=(), repr=False, compare=False)

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence token (the first when a model declares several)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def context_length(self) -> int:
        return self.config.context_length

    def load_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight, dequantized to float32 on the CPU, under canonical names."""
        return self.tensor_loader(self)
