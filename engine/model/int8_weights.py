"""`quantize_weights`: a float32 `ModelWeights` turned into its int8 form.

Each projection's int8 form needs the range of every input channel
(`Int8Projection.build`), so the float32 model first runs one calibration pass
over `CALIBRATION_TEXT` with recorders in place of its projections; then every
projection is read back as a matrix and quantized. The calibration text is not
one that `quality.py` measures with. Loading takes about a second longer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.int8_linear import Int8Projection
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.quality import byte_ids
from wavecore.engine.model.scoring import score_sequences
from wavecore.engine.model.weight_format import AnyProjection
from wavecore.engine.model.weights import LayerWeights, ModelWeights

CALIBRATION_TEXT = (
    "User: Can you help me plan a trip to the mountains next weekend?\n"
    "Assistant: Of course! Start by checking the weather forecast, then pack warm "
    "layers, water, snacks and a map. Tell someone where you are going.\n"
    "User: What is 23 + 19? And write a Python function that adds two numbers.\n"
    "Assistant: 23 + 19 = 42.\n\ndef add(a, b):\n    return a + b\n\n"
    "The history of the printing press begins in the fifteenth century, when movable "
    "type made books cheaper and spread learning across Europe. Today, 3D printers, "
    "laser cutters and robots build everything from houses to rockets."
)
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(slots=True)
class _Recorder:
    """Stands in for a projection during calibration: records max |x| per input channel."""

    inner: AnyProjection
    peak: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.peak, x.abs().amax(dim=0), out=self.peak)
        return self.inner(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.peak, x.abs().amax(dim=0), out=self.peak)
        return self.inner.add_to(residual, x)


def _recorder(projection: AnyProjection) -> _Recorder:
    return _Recorder(projection, torch.zeros(projection.in_features))


def quantize_weights(
    weights: ModelWeights, config: ModelConfig, encode: Callable[[str], list[int]] | None = None
) -> ModelWeights:
    """`weights` (float32, on the CPU) with every projection and the LM head in int8.

    `encode` turns the calibration text into token ids; without it, the ids are the
    text's bytes folded into the vocabulary (`quality.byte_ids`; a tokenizer gives
    more natural activations)."""
    if encode is not None:
        tokens = encode(CALIBRATION_TEXT)
    else:
        tokens = byte_ids(CALIBRATION_TEXT, config.vocab_size)
    recorded_layers = tuple(
        dataclasses.replace(
            layer, **{name: _recorder(getattr(layer, name)) for name in _PROJECTIONS}
        )
        for layer in weights.layers
    )
    recorded = dataclasses.replace(
        weights, layers=recorded_layers, lm_head=_recorder(weights.lm_head)
    )
    _run(recorded, config, tokens)

    def convert(recorder: _Recorder) -> Int8Projection:
        if not isinstance(recorder.inner, Projection):
            raise TypeError(f"quantize_weights takes float weights, got {recorder.inner!r}")
        return Int8Projection.build(recorder.inner.matrix(), recorder.peak)

    layers = tuple(
        LayerWeights(
            attn_norm=layer.attn_norm,
            qkv=convert(layer.qkv),
            qkv_bias=layer.qkv_bias,
            o=convert(layer.o),
            ffn_norm=layer.ffn_norm,
            gate_up=convert(layer.gate_up),
            down=convert(layer.down),
        )
        for layer in recorded_layers
    )
    lm_head = convert(recorded.lm_head)
    # A plain float head shared its memory with the embedding; the int8 head does not.
    embed = weights.embed.contiguous() if weights.shares_embedding else weights.embed
    return dataclasses.replace(weights, layers=layers, lm_head=lm_head, embed=embed)


def _run(weights: ModelWeights, config: ModelConfig, tokens: list[int]) -> None:
    """One float32 prefill of `tokens` through `weights` (the recorders record)."""
    score_sequences(weights, config, [tokens])
