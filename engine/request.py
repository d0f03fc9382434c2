"""What a request is once the front end accepted it, and what it needs to get there.

Shared by the front end (which builds `EngineRequest`s) and the core (which schedules
them), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from wavecore.engine.sampling_params import SamplingParams

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


class PromptTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # The LoRA adapter it runs under (None: the base model).
    lora: str | None = None
