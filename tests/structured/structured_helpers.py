"""What the structured-output tests share: specs of each kind with their validators, and
a synchronous run of a null-executor core."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs

TOKENIZER = ByteTokenizer()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ("red", "green", "blue")
LARK = 'start: "(" item (" " item)* ")"\nitem: /[0-9]{1,2}/\n'


def _is_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


def _is_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


# Each spec with a check that its output text matches it.
SPECS: Mapping[str, tuple[StructuredOutputs, Callable[[str], bool]]] = {
    "json": (StructuredOutputs(json=PERSON), _is_person),
    "json_object": (StructuredOutputs(json_object=True), _is_object),
    "regex": (StructuredOutputs(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) is not None),
    "choice": (StructuredOutputs(choice=list(CHOICES)), lambda text: text in CHOICES),
    "grammar": (
        StructuredOutputs(grammar=LARK),
        lambda text: re.fullmatch(r"\([0-9]{1,2}( [0-9]{1,2})*\)", text) is not None,
    ),
}


# The null executor takes the first allowed token after its own: an open-ended object
# (`json_object`) may never close, so its runs leave that kind to the real model.
NULL_SPECS = {kind: value for kind, value in SPECS.items() if kind != "json_object"}


def null_core(**config: Any) -> EngineCore:
    return EngineCore.from_config(EngineConfig(executor="null", **config))


def request(request_id: str, prompt: str, **params: Any) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(TOKENIZER.encode(prompt)),
        params=SamplingParams(**params),
    )


def run_to_end(core: EngineCore) -> dict[str, tuple[list[int], str, str | None]]:
    """Step until every request ended: each request's tokens, finish reason and error."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple[str, str | None]] = {}
    for _ in range(100_000):
        if not core.has_unfinished():
            break
        for update in core.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                ends[update.request_id] = (str(update.finish_reason), update.error)
    else:
        raise AssertionError("the core never finished its requests")
    return {rid: (tokens.get(rid, []), *ends[rid]) for rid in ends}


def text(token_ids: list[int]) -> str:
    return TOKENIZER.decode(token_ids)
