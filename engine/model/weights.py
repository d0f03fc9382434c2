"""`ModelWeights`: checked, fused and laid out for the forward pass.

Layout choices, each to cut work per step:
- q, k and v are one projection to `q + 2*kv` outputs and gate and up one to
  `2*intermediate`, so each layer runs four matrix products, not seven;
- every matrix is a `Projection` (`linear.py`), stored the way its device multiplies
  fastest: oneDNN-packed on the CPU, a plain `[in, out]` matrix elsewhere; with
  `weights="int8"` the built weights are then quantized (`int8_weights.py`), and
  each becomes an `Int8Projection`;
- a tied LM head shares the embedding's memory when it is plain (the embedding is
  its transposed view); a packed head cannot be gathered by row, so the embedding
  then keeps its own plain copy (on SmolLM2-135M, 113 MB more for a faster head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.errors import ModelLoadError
from wavecore.engine.model.kernel_plan import KernelPlan
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.weight_format import AnyProjection


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: AnyProjection
    qkv_bias: torch.Tensor | None
    o: AnyProjection
    ffn_norm: torch.Tensor
    gate_up: AnyProjection
    down: AnyProjection


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelWeights:
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: AnyProjection  # hidden -> vocab
    embed: torch.Tensor  # [vocab, hidden]; a view of a plain lm_head's matrix when shared
    rope_freqs: torch.Tensor | None  # per-frequency divisors (Llama 3 GGUF files)

    @property
    def num_bytes(self) -> int:
        tensors = [self.final_norm, *([] if self.shares_embedding else [self.embed])]
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.ffn_norm]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.numel() * t.element_size() for t in tensors) + sum(
            p.num_bytes for p in self.projections()
        )

    @property
    def streamed_bytes(self) -> int:
        """What a batch-1 step reads: every weight but the embedding, of which it reads
        one row (a tied embedding that shares the head's memory is read as the head),
        each projection in the one form its plan runs one row on."""
        own_embed = 0 if self.shares_embedding else self.embed.numel() * self.embed.element_size()
        unread = sum(p.num_bytes - p.bytes_read(rows=1) for p in self.projections())
        return self.num_bytes - own_embed - unread

    def projections(self) -> list[AnyProjection]:
        """Every projection: the LM head, then each layer's qkv, o, gate-up and down."""
        projections = [self.lm_head]
        for layer in self.layers:
            projections += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return projections

    @property
    def shares_embedding(self) -> bool:
        """Whether the embedding is a view of the LM head's memory (tied, plain head)."""
        return not self.lm_head.packed and self.embed.data_ptr() == self.lm_head.weight.data_ptr()

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        origin: Path,
        device: torch.device,
        dtype: torch.dtype,
        kernels: KernelPlan | None = None,
    ) -> ModelWeights:
        """Check every tensor's shape against `config`, then fuse and move to `device`,
        each projection laid out for `kernels` (`linear.Projection.build`)."""
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

        def project(matrix: torch.Tensor) -> Projection:
            return Projection.build(matrix, device=device, dtype=dtype, kernels=kernels)

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
                    qkv=project(torch.cat([q, k, v])),
                    qkv_bias=bias,
                    o=project(take(p + "o", (hidden, config.q_size))),
                    ffn_norm=place(take(p + "ffn_norm", (hidden,))),
                    gate_up=project(
                        torch.cat(
                            [take(p + "gate", (inter, hidden)), take(p + "up", (inter, hidden))]
                        )
                    ),
                    down=project(take(p + "down", (hidden, inter))),
                )
            )
        embed = take("embed", (vocab, hidden))
        head_matrix = embed if config.tie_word_embeddings else take("lm_head", (vocab, hidden))
        lm_head = project(head_matrix)
        if config.tie_word_embeddings and not lm_head.packed:
            embed_view = lm_head.weight.t()
        else:
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

    def map_projections(self, build: Callable[[str, AnyProjection], AnyProjection]) -> ModelWeights:
        """These weights with each projection replaced by `build(name, projection)`
        (name: "layers.{i}.{qkv,o,gate_up,down}" or "lm_head"). A tied embedding stays
        a view of the new head when it can (plain), else gets its own copy."""
        layers = tuple(
            dataclasses.replace(
                layer,
                **{
                    name: build(f"layers.{i}.{name}", getattr(layer, name))
                    for name in ("qkv", "o", "gate_up", "down")
                },
            )
            for i, layer in enumerate(self.layers)
        )
        lm_head = build("lm_head", self.lm_head)
        embed = self.embed
        if self.shares_embedding:
            embed = lm_head.weight.t() if not lm_head.packed else self.embed.contiguous()
        return dataclasses.replace(self, layers=layers, lm_head=lm_head, embed=embed)

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
            embed=lm_head.weight.t() if self.shares_embedding else self.embed.to(device),
            rope_freqs=self.rope_freqs,
        )
