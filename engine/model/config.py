"""`ModelConfig`: the shape of a Llama-family decoder, whatever file it came from.

GGUF metadata and Hugging Face `config.json` files spell the same facts differently;
both loaders translate into this one record, and the rest of the runtime reads only
it. Qwen2 (biases on q/k/v) and Mistral are Llama with different settings, so one
forward implementation serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeScaling = Literal["none", "linear", "llama3"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: RopeScaling = "none"
    # "linear": positions are divided by this. "llama3": see `rope.py`.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context_length: int = 8192

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights touched per token (the LM head counted once even when tied)."""
        attention = (
            self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        embedding = self.vocab_size * self.hidden_size
        return self.num_layers * (attention + mlp) + embedding

    def check(self, origin: str) -> None:
        """Raise `ModelLoadError` naming `origin` if the numbers cannot describe a model."""
        from wavecore.engine.model.errors import ModelLoadError

        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "context_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"{origin}: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{origin}: {self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{origin}: head_dim {self.head_dim} must be even for rotary")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ModelLoadError(f"{origin}: rope_theta and rms_norm_eps must be positive")
