"""`ModelWeights`: checked, fused and laid out for the forward pass.

Three layout choices, each to cut work per step:
- q, k and v are one `[hidden, q + 2*kv]` matrix and gate and up one
  `[hidden, 2*intermediate]` matrix, so each layer runs three matmuls, not seven;
- every matrix is stored transposed, `[in, out]`, so `x @ w` reads it row-major, which
  on this CPU's BLAS is the faster orientation for the small-batch decode products;
- a tied LM head is stored once, as `[hidden, vocab]`; the embedding is its
  transposed view, gathered by row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import ModelLoadError


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelWeights:
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [hidden, vocab]
    embed: torch.Tensor  # [vocab, hidden]; a view of lm_head when tied
    rope_freqs: torch.Tensor | None  # per-frequency divisors (Llama 3 GGUF files)

    @property
    def num_bytes(self) -> int:
        tensors = [self.final_norm, self.lm_head, *([] if self.tied else [self.embed])]
        for layer in self.layers:
            tensors += [
                layer.attn_norm,
                layer.qkv,
                layer.o,
                layer.ffn_norm,
                layer.gate_up,
                layer.down,
            ]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def tied(self) -> bool:
        return self.embed.data_ptr() == self.lm_head.data_ptr()

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        origin: Path,
        device: torch.device,
        dtype: torch.dtype,
    ) -> ModelWeights:
        """Check every tensor's shape against `config`, then fuse and move to `device`."""
        hidden, vocab = config.hidden_size, config.vocab_size

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            tensor = tensors.get(name)
            if tensor is None:
                raise ModelLoadError(f"{origin}: missing tensor {name}")
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    f"{origin}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}"
                )
            return tensor

        def place(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            q = take(p + "q", (config.q_size, hidden))
            k = take(p + "k", (config.kv_size, hidden))
            v = take(p + "v", (config.kv_size, hidden))
            bias = None
            if config.qkv_bias:
                bias = place(
                    torch.cat(
                        [
                            take(p + "q_bias", (config.q_size,)),
                            take(p + "k_bias", (config.kv_size,)),
                            take(p + "v_bias", (config.kv_size,)),
                        ]
                    )
                )
            inter = config.intermediate_size
            layers.append(
                LayerWeights(
                    attn_norm=place(take(p + "attn_norm", (hidden,))),
                    # Concatenating transposed views writes `[in, out]` in one copy.
                    qkv=place(torch.cat([q.t(), k.t(), v.t()], dim=1)),
                    qkv_bias=bias,
                    o=place(take(p + "o", (hidden, config.q_size)).t()),
                    ffn_norm=place(take(p + "ffn_norm", (hidden,))),
                    gate_up=place(
                        torch.cat(
                            [
                                take(p + "gate", (inter, hidden)).t(),
                                take(p + "up", (inter, hidden)).t(),
                            ],
                            dim=1,
                        )
                    ),
                    down=place(take(p + "down", (hidden, inter)).t()),
                )
            )
        embed = take("embed", (vocab, hidden))
        if config.tie_word_embeddings:
            lm_head = place(embed.t())
            embed_view = lm_head.t()
        else:
            lm_head = place(take("lm_head", (vocab, hidden)).t())
            embed_view = place(embed)
        rope_freqs = tensors.get("rope_freqs")
        if rope_freqs is not None and tuple(rope_freqs.shape) != (config.head_dim // 2,):
            raise ModelLoadError(
                f"{origin}: tensor rope_freqs has shape {tuple(rope_freqs.shape)}, "
                f"expected {(config.head_dim // 2,)}"
            )
        return cls(
            layers=tuple(layers),
            final_norm=place(take("final_norm", (hidden,))),
            lm_head=lm_head,
            embed=embed_view,
            rope_freqs=rope_freqs.to(torch.float32) if rope_freqs is not None else None,
        )

    def to(self, device: torch.device) -> ModelWeights:
        """A copy on `device` (tying preserved); used to offload to and restore from CPU."""
        layers = tuple(
            LayerWeights(
                attn_norm=layer.attn_norm.to(device),
                qkv=layer.qkv.to(device),
                qkv_bias=layer.qkv_bias.to(device) if layer.qkv_bias is not None else None,
                o=layer.o.to(device),
                ffn_norm=layer.ffn_norm.to(device),
                gate_up=layer.gate_up.to(device),
                down=layer.down.to(device),
            )
            for layer in self.layers
        )
        lm_head = self.lm_head.to(device)
        return ModelWeights(
            layers=layers,
            final_norm=self.final_norm.to(device),
            lm_head=lm_head,
            embed=lm_head.t() if self.tied else self.embed.to(device),
            rope_freqs=self.rope_freqs,
        )
