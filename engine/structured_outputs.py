"""What a request asks its output to match: `StructuredOutputs`, checked on construction.

Exactly one of the constraints is set, under upstream's names: `json` (a JSON schema,
given as a dict or as its JSON text), `json_object` (any JSON object), `regex`,
`choice` (the output is one of these strings) and `grammar` (a Lark grammar, or a
GBNF one as llama.cpp writes it). Construction checks only the shape (one kind, the
right types, a schema that is JSON); whether the schema, regex or grammar compiles is
the grammar engine's question (`engine.structured`), asked on `generate` before the
request reaches a rank.

The spec is what travels on the wire, never a compiled object: a schema given as a
dict is kept as canonical JSON text (sorted keys), so equal schemas are equal specs
and share one compiled grammar (`key`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputs:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _canonical_schema(self.json))
        elif isinstance(self.json, str):
            object.__setattr__(self, "json", _canonical_schema(_parse_schema(self.json)))
        elif self.json is not None:
            raise ValueError(
                "StructuredOutputs.json must be a JSON schema (a dict or its JSON text), "
                f"got {type(self.json).__name__}"
            )
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_kinds = [kind for kind in KINDS if _is_set(self, kind)]
        if len(set_kinds) != 1:
            found = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(
                f"StructuredOutputs takes exactly one of {', '.join(KINDS)}; got {found}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError("StructuredOutputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice:
                raise ValueError("StructuredOutputs.choice must be a non-empty list of strings")
            if not all(isinstance(option, str) and option for option in self.choice):
                raise ValueError("StructuredOutputs.choice must hold non-empty strings only")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(kind for kind in KINDS if _is_set(self, kind))

    @property
    def key(self) -> tuple[str, str]:
        """Equal for specs that compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _is_set(spec: StructuredOutputs, kind: str) -> bool:
    value = getattr(spec, kind)
    return value is not False and value is not None


def _parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"StructuredOutputs.json is not valid JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("StructuredOutputs.json must be a JSON schema: an object or a boolean")
    return schema


def _canonical_schema(schema: Any) -> str:
    # Compact, but in the order given: a schema's key order is the order its object
    # properties are generated in (as OpenAI's structured outputs and the grammar
    # engines do), so two schemas that differ only in key order are different specs.
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"StructuredOutputs.json is not a JSON value: {error}") from None
