"""Per-request sampling parameters, validated on construction.

Nothing invalid reaches the model: every field is checked here and a bad one raises
`ValueError` naming the field, before the request is accepted anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wavecore.engine.structured_outputs import StructuredOutputs


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {value}")


def _check_float(
    name: str, value: object, *, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        raise ValueError(f"SamplingParams.{name} must be in {left}{low}, {high}], got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token of one request.

    `temperature == 0` means greedy. `top_k == 0` disables top-k; `top_p == 1` and
    `min_p == 0` disable nucleus and min-p filtering. `seed` makes a request's random
    choices depend only on the seed and the token position, not on its batch.
    `logprobs` asks for the log-probability of each sampled token plus that many of the
    most likely alternatives (0 means the sampled token's alone).
    `structured_outputs` constrains the output to a JSON schema, a regex, a choice or a
    grammar (`engine.structured_outputs`); log-probabilities are then those of the
    constrained distribution.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed "
                f"max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True
        )
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("SamplingParams.stop must be a sequence of non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                "SamplingParams.stop_token_ids must be a sequence of non-negative ints"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("SamplingParams.ignore_eos must be a bool")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError(
                "SamplingParams.structured_outputs must be a StructuredOutputs, got "
                f"{type(self.structured_outputs).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
