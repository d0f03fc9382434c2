"""New weights for a loaded model, built beside the ones it serves with.

`weight_shapes` lists the canonical tensors a model holds (`model.source` names them);
`stage_weights` builds a complete `ModelWeights` from the current one and an already
checked update (`executors.weight_specs.check_update`), without touching the current
one, so that a failure anywhere (on any rank) leaves the old weights serving and the
commit is a single assignment.

Only what changed is rebuilt: a layer whose tensors are not in the update is shared
with the current weights. A partial update may name part of a fused projection (q
without k and v, gate without up): the untouched rows are read back from the current
projection by multiplying it with an identity matrix, which is exact in floating point
(each output is one weight times 1 plus zeros), packed or plain. An updated int8
projection is quantized with the calibration of the one it replaces
(`weight_format.build_projection`); its untouched rows are read back dequantized
(a one-hot input quantizes exactly) and quantized again, which moves them by at
most a rounding step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.weight_format import AnyProjection, build_projection
from wavecore.engine.model.weights import LayerWeights, ModelWeights

_QKV = ("q", "k", "v")
_QKV_BIAS = ("q_bias", "k_bias", "v_bias")
_GATE_UP = ("gate", "up")


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of a model of this configuration, with its shape.

    `rope_freqs` is left out: it follows from the configuration and is not trained."""
    hidden, q_size, kv_size = config.hidden_size, config.q_size, config.kv_size
    inter = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (config.vocab_size, hidden),
        "final_norm": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm": (hidden,),
            p + "q": (q_size, hidden),
            p + "k": (kv_size, hidden),
            p + "v": (kv_size, hidden),
            p + "o": (hidden, q_size),
            p + "ffn_norm": (hidden,),
            p + "gate": (inter, hidden),
            p + "up": (inter, hidden),
            p + "down": (hidden, inter),
        }
        if config.qkv_bias:
            shapes |= {p + "q_bias": (q_size,), p + "k_bias": (kv_size,), p + "v_bias": (kv_size,)}
    return shapes


def stage_weights(
    current: ModelWeights,
    config: ModelConfig,
    update: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> ModelWeights:
    """`current` with `update` applied, as a new `ModelWeights` (see the module docstring).
    Run under `torch.inference_mode` on the model thread."""
    builder = _Builder(update, device=device, dtype=dtype)
    sizes = (config.q_size, config.kv_size, config.kv_size)
    inter = config.intermediate_size
    layers = []
    for i, layer in enumerate(current.layers):
        p = f"layers.{i}."
        if not any(name.startswith(p) for name in update):
            layers.append(layer)
            continue
        bias = layer.qkv_bias
        if bias is not None:
            bias = builder.vector_group(bias, [p + n for n in _QKV_BIAS], sizes)
        layers.append(
            LayerWeights(
                attn_norm=builder.vector(layer.attn_norm, p + "attn_norm"),
                qkv=builder.projection_group(layer.qkv, [p + n for n in _QKV], sizes),
                qkv_bias=bias,
                o=builder.projection_group(layer.o, [p + "o"], (config.hidden_size,)),
                ffn_norm=builder.vector(layer.ffn_norm, p + "ffn_norm"),
                gate_up=builder.projection_group(
                    layer.gate_up, [p + n for n in _GATE_UP], (inter, inter)
                ),
                down=builder.projection_group(layer.down, [p + "down"], (config.hidden_size,)),
            )
        )
    lm_head, embed = current.lm_head, current.embed
    if config.tie_word_embeddings and "embed" in update:
        lm_head = builder.projection(update["embed"], current.lm_head)
        # As `ModelWeights.build`: a plain head is the embedding's memory, a packed
        # one cannot be gathered by row and needs a plain copy beside it.
        embed = lm_head.weight.t() if not lm_head.packed else builder.place(update["embed"])
    elif not config.tie_word_embeddings:
        if "lm_head" in update:
            lm_head = builder.projection(update["lm_head"], current.lm_head)
        if "embed" in update:
            embed = builder.place(update["embed"])
    return ModelWeights(
        layers=tuple(layers),
        final_norm=builder.vector(current.final_norm, "final_norm"),
        lm_head=lm_head,
        embed=embed,
        rope_freqs=current.rope_freqs,
    )


class _Builder:
    """Places updated tensors on the model's device and dtype, reusing what is unchanged."""

    def __init__(
        self,
        update: Mapping[str, torch.Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self._update = update
        self._device = device
        self._dtype = dtype

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        # Always a copy: the caller's tensors (an in-process update) may change later.
        return tensor.to(device=self._device, dtype=self._dtype, copy=True).contiguous()

    def projection(self, matrix: torch.Tensor, like: AnyProjection) -> AnyProjection:
        """`matrix` as a projection of the same kind as `like`, the one it replaces."""
        return build_projection(matrix, device=self._device, dtype=self._dtype, like=like)

    def vector(self, old: torch.Tensor, name: str) -> torch.Tensor:
        new = self._update.get(name)
        return old if new is None else self.place(new)

    def vector_group(
        self, old: torch.Tensor, names: Sequence[str], sizes: Sequence[int]
    ) -> torch.Tensor:
        if not any(name in self._update for name in names):
            return old
        parts = old.split(list(sizes))
        return self.place(torch.cat(self._merged(names, parts)))

    def projection_group(
        self, old: AnyProjection, names: Sequence[str], sizes: Sequence[int]
    ) -> AnyProjection:
        """A fused projection whose row blocks `names` (of `sizes` rows) may be updated."""
        if not any(name in self._update for name in names):
            return old
        if all(name in self._update for name in names):
            return self.projection(torch.cat([self._update[name] for name in names]), old)
        eye = torch.eye(old.in_features, device=self._device, dtype=self._dtype)
        rows = old(eye).t()  # [out, in], exactly the current matrix
        return self.projection(torch.cat(self._merged(names, rows.split(list(sizes)))), old)

    def _merged(self, names: Sequence[str], current: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [
            self._update[name].to(device=self._device, dtype=self._dtype)
            if name in self._update
            else part
            for name, part in zip(names, current, strict=True)
        ]
