"""`StructuredOutputs`: one kind, checked shapes, canonical schemas; `check_spec`: a spec
that does not compile names its field and the compiler's reason."""

from __future__ import annotations

import json

import pytest

from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.structured.grammars import GrammarError, GrammarVocabulary, check_spec
from wavecore.engine.structured_outputs import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_schema_given_as_dict_or_text_is_one_spec() -> None:
    as_dict = StructuredOutputs(json=SCHEMA)
    as_text = StructuredOutputs(json=json.dumps(SCHEMA, indent=2))
    assert as_dict == as_text and as_dict.key == as_text.key
    assert json.loads(as_dict.json or "") == SCHEMA
    assert as_dict.kind == "json"


def test_properties_are_generated_in_the_schema_s_order() -> None:
    # Not sorted: "zeta" is declared first, so the grammar forces it first.
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    spec = StructuredOutputs(json=schema)
    assert list(json.loads(spec.json or "")["properties"]) == ["zeta", "alpha"]
    reordered = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    assert StructuredOutputs(json=reordered).key != spec.key
    tokenizer = ByteTokenizer()
    matcher = GrammarVocabulary.for_tokenizer(tokenizer, tokenizer.vocab_size).matcher(spec)
    assert bytes(matcher.compute_ff_bytes()).startswith(b'{"zeta"')


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        (StructuredOutputs(json_object=True), "json_object"),
        (StructuredOutputs(regex="[0-9]+"), "regex"),
        (StructuredOutputs(choice=["yes", "no"]), "choice"),
        (StructuredOutputs(grammar='start: "a"+'), "grammar"),
    ],
)
def test_each_kind_is_named_and_compiles(spec: StructuredOutputs, kind: str) -> None:
    assert spec.kind == kind
    check_spec(spec)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of .*got none"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of .*got regex, choice"),
        ({"json": SCHEMA, "json_object": True}, "exactly one of .*got json, json_object"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must hold non-empty strings"),
        ({"choice": ["a", 3]}, "choice must hold non-empty strings"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": 5}, "regex must be a non-empty string"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "json must be a JSON schema"),
        ({"json": 3}, "json must be a JSON schema"),
        ({"json_object": "yes"}, "json_object must be a bool"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json={"type": "frobnicate"}), r"structured_outputs\.json: .*frobnicate"),
        (StructuredOutputs(regex="[a-"), r"structured_outputs\.regex: .*unclosed character class"),
        (StructuredOutputs(grammar="start: undefined_rule"), r"structured_outputs\.grammar: .*"),
        (StructuredOutputs(grammar="root ::= undefined"), r"structured_outputs\.grammar: .*"),
    ],
)
def test_a_spec_that_does_not_compile_names_its_field(
    spec: StructuredOutputs, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        check_spec(spec)


def test_gbnf_is_read_as_well_as_lark() -> None:
    check_spec(StructuredOutputs(grammar='root ::= "yes" | "no"'))
