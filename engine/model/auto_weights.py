"""`AutoWeights`: the weights of `weights="auto"`, in the forms their plan runs.

The model is first built in float32, plain (`ModelWeights.build` with BLAS): the
reference. From it:
- `quality(kernels)` judges each rounding kernel the plan may choose
  (`kernel_choice.ROUNDING_KERNELS`): the float32 model and a copy whose every
  projection runs that kernel score the fixed texts of `quality.py`, teacher-forced;
  only a kernel within `quality.MIN_AGREEMENT` / `MAX_PERPLEXITY_CHANGE` is admitted.
  The copy runs with the engine's KV cache dtype (bfloat16 beside these kernels on a
  CPU with native bfloat16, `dtypes.pick_kv_cache_dtype`), so the budget covers the
  cache's rounding too; the reference keeps float32 throughout. Called only when the
  plan is measured, not when it comes from the cache;
- `build(plan)` makes the final weights: every projection with the forms `plan`
  runs and no other (`linear.Projection.build`), the int8 form quantized with the
  calibration of `int8_weights.py`. The float32 reference is then dropped, unless the
  plan runs it ("blas" shares its memory).

Memory: a plan of int8 for batch 1 and bfloat16 for batches holds each projection
twice, at 1 + 2 bytes a weight, less than float32's 4; a tied embedding that no
longer shares the head's float32 matrix gets its own float32 copy (SmolLM2-135M:
113 MB). `ModelWeights.num_bytes` counts every form held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.int8_weights import quantize_weights
from wavecore.engine.model.kernel_plan import Kernel, KernelPlan
from wavecore.engine.model.linear import Projection
from wavecore.engine.model.quality import (
    AGREEMENT_TEXTS,
    PERPLEXITY_TEXT,
    QualityReport,
    compare,
)
from wavecore.engine.model.scoring import score_sequences
from wavecore.engine.model.weight_format import AnyProjection
from wavecore.engine.model.weights import ModelWeights

_CPU = torch.device("cpu")


class AutoWeights:
    def __init__(
        self,
        reference: ModelWeights,
        config: ModelConfig,
        encode: Callable[[str], list[int]],
        calibration_encode: Callable[[str], list[int]] | None,
        *,
        kv_cache_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`reference`: float32, plain; `encode` tokenizes the quality texts and
        `calibration_encode` the int8 calibration text (None: its bytes);
        `kv_cache_dtype`: the cache the judged kernels will run beside."""
        self._reference = reference
        self._kv_cache_dtype = kv_cache_dtype
        self._config = config
        self._encode = encode
        self._calibration_encode = calibration_encode
        self._int8: ModelWeights | None = None

    def quality(self, kernels: Sequence[Kernel]) -> Mapping[Kernel, QualityReport]:
        """Each of `kernels` against float32, on the model itself."""
        texts = [*AGREEMENT_TEXTS, PERPLEXITY_TEXT]
        sequences = [self._encode(text)[: self._config.context_length] for text in texts]

        def scorer(
            weights: ModelWeights, kv_cache_dtype: torch.dtype
        ) -> Callable[[Sequence[int]], torch.Tensor]:
            # Every text in one pass; `compare` then asks for them one by one.
            logits = score_sequences(weights, self._config, sequences, kv_cache_dtype)
            by_tokens = {tuple(s): each for s, each in zip(sequences, logits, strict=True)}
            return lambda tokens: by_tokens[tuple(tokens)]

        encode = {text: tokens for text, tokens in zip(texts, sequences, strict=True)}.__getitem__

        reference = scorer(self._reference, torch.float32)
        return {
            kernel: compare(reference, scorer(self._uniform(kernel), self._kv_cache_dtype), encode)
            for kernel in kernels
        }

    def build(self, plan: KernelPlan) -> ModelWeights:
        """The weights that hold exactly the forms `plan` runs."""
        int8 = self._int8_weights() if plan.uses("fbgemm") else None
        int8_of = _projections_by_name(int8) if int8 is not None else {}

        def build(name: str, projection: AnyProjection) -> AnyProjection:
            return Projection.build(
                projection.matrix(),
                device=_CPU,
                dtype=torch.float32,
                kernels=plan,
                int8=int8_of.get(name),  # type: ignore[arg-type]
            )

        return self._reference.map_projections(build)

    def _uniform(self, kernel: Kernel) -> ModelWeights:
        if kernel == "fbgemm":
            return self._int8_weights()
        plan = KernelPlan.uniform(kernel)
        return self._reference.map_projections(
            lambda _, p: Projection.build(
                p.matrix(), device=_CPU, dtype=torch.float32, kernels=plan
            )
        )

    def _int8_weights(self) -> ModelWeights:
        if self._int8 is None:
            with torch.inference_mode():
                self._int8 = quantize_weights(
                    self._reference, self._config, self._calibration_encode
                )
        return self._int8


def _projections_by_name(weights: ModelWeights) -> dict[str, AnyProjection]:
    found: dict[str, AnyProjection] = {}

    def record(name: str, projection: AnyProjection) -> AnyProjection:
        found[name] = projection
        return projection

    weights.map_projections(record)
    return found
