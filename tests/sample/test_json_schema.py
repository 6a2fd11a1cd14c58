"""JSON Schemas as xgrammar enforces them: rewrites that keep a schema's meaning, refusals where it would let
invalid output through (each refusal was found by feeding xgrammar's matcher an instance that breaks it)."""

import json

import jsonschema
import pytest

from flock import LLM, SamplingParams, StructuredOutputsParams
from flock.sample.json_schema import enforceable


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "beside anyOf"),
    ({"$defs": {"N": {"type": "string"}}, "properties": {"n": {"$ref": "#/$defs/N", "minLength": 3}}},
     "beside $ref"),
    ({"type": "string", "format": "date", "pattern": "^2024-"}, "pattern (with a format)"),
    ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
    ({"type": "string", "pattern": "^(?=.*[A-Z]).{8,}$"}, "lookaround in pattern"),
    ({"$ref": "https://example.com/schema.json"}, "only '#/...' pointers"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}, "'b' (not in properties)"),
    ({"type": "object", "dependentSchemas": {"card": {"required": ["billing"]}}}, "dependentSchemas"),
    ({"type": "string", "enum": [1, 2]}, "has its type"),
    ({"enum": ["a", "b"], "pattern": "^a"}, "pattern (beside enum)"),
])
def test_keywords_xgrammar_ignores_are_refused_by_name(schema, where):
    with pytest.raises(ValueError, match="not supported|has its type") as e:
        enforceable(schema)
    assert where in str(e.value)


def test_rewrites_keep_the_meaning_and_leave_the_request_alone():
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 5, "title": "Name"},
        "tag": {"type": "string", "enum": ["a", 1, None, "b"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}], "default": None, "title": "Note"},
        "kind": {"type": "string", "format": "binary"}}}  # an unknown format is an annotation
    before = json.dumps(schema)
    out = enforceable(schema)
    assert json.dumps(schema) == before
    assert out["properties"]["name"] == {"type": "string", "title": "Name", "pattern": "^.{2,5}$"}
    assert out["properties"]["tag"]["enum"] == ["a", "b"]
    assert out["properties"]["note"]["anyOf"][0] == {"type": "string", "pattern": "^.{0,3}$"}


def test_bounded_strings_are_json_strings():
    """xgrammar let raw control characters into a string with minLength / maxLength (output that is not
    JSON); as a pattern it does not, and the bounds still hold."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 12}},
              "required": ["s"], "additionalProperties": False}
    llm = LLM("flock/tiny", load_format="dummy", dtype="float32")
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(json=schema))
    assert matcher.accept_string('{"s": "ab') and not matcher.accept_string("\x0b")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=schema)) for seed in range(12)]
    for out in llm.generate(["Give JSON."] * 12, params, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
