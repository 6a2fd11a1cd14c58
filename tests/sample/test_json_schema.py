"""JSON Schemas as xgrammar enforces them: rewrites that keep a schema's meaning, refusals where it would let
invalid output through (each refusal was found by feeding xgrammar's matcher an instance that breaks it)."""

import json

import jsonschema
import pytest

from flock import LLM, SamplingParams, StructuredOutputsParams
from flock.sample.json_schema import JSON_CHAR, enforceable


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
    ({"allOf": [{"type": "integer"}], "minimum": 5}, "minimum (beside allOf)"),
    ({"type": "object", "properties": {"userId": {"type": "integer"}}, "propertyNames": {"pattern": "^[a-z]+$"}},
     "propertyNames (beside properties)"),
    ({"properties": {"v": {"$dynamicRef": "#n"}}}, "$dynamicRef"),
    ({"minimum": 1, "maxLength": 3}, "several types (number, string)"),
    ({"type": "object", "patternProperties": {"^x": {}, "y$": {}}, "required": ["xy"]}, "several patternProperties"),
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
    assert out["properties"]["name"] == {"type": "string", "title": "Name", "pattern": f"^{JSON_CHAR}{{2,5}}$"}
    assert out["properties"]["tag"]["enum"] == ["a", "b"]
    assert out["properties"]["note"]["anyOf"][0] == {"type": "string", "pattern": f"^{JSON_CHAR}{{0,3}}$"}


def test_untyped_keywords_and_required_names_given_by_patterns_are_enforced():
    """{"minimum": 18} constrains numbers only: the schema becomes a number's (xgrammar let any value through);
    a required name that only patternProperties or additionalProperties give becomes a property of that schema
    (xgrammar left it out)."""
    grammars = LLM("flock/tiny", load_format="dummy", dtype="float32").engine.grammars
    cases = [
        ({"type": "object", "properties": {"age": {"description": "years", "minimum": 18, "maximum": 30}},
          "required": ["age"]}, '{"age": 20}', ['{"age": 53}', '{"age": "x"}']),
        ({"type": "object", "properties": {"code": {"maxLength": 2}}, "required": ["code"]}, '{"code": "en"}',
         ['{"code": "en-US"}']),
        ({"type": "object", "required": ["id"], "additionalProperties": True}, '{"id": 1}', ['{"x": 1}']),
        ({"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "string"}}, "required": ["x-id"]},
         '{"x-id": "a"}', ["{}", '{"x-id": 1}']),
    ]
    for schema, valid, invalid in cases:
        spec = StructuredOutputsParams(json=schema)
        assert grammars.matcher(spec).accept_string(valid), schema
        for text in invalid:
            matcher = grammars.matcher(spec)
            assert not (matcher.accept_string(text) and matcher.is_terminated()), (schema, text)
        jsonschema.validate(json.loads(valid), schema)


def test_json_layouts():
    """By default no free whitespace but after commas and colons (as json.dumps writes); vLLM's
    disable_any_whitespace none at all; disable_any_whitespace=False any."""
    grammars = LLM("flock/tiny", load_format="dummy", dtype="float32").engine.grammars
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    for flag, text in ((None, '{"a": 1, "b": 2}'), (True, '{"a":1,"b":2}'), (False, '{ "a" :1 ,\n"b": 2 }')):
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=flag)
        assert grammars.matcher(spec).accept_string(text), flag
    assert not grammars.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True)).accept_string(
        '{"a": 1')


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


@pytest.mark.parametrize("text, fits", [
    (b'"ab\xe0\x85\x81"', False),  # an overlong spelling of a character: no UTF-8 (xgrammar's `.` took it)
    (b'"ab\xed\xa0\x80"', False),  # a surrogate's bytes
    (b'"ab\x0b"', False),  # a raw control character
    (b'"a\\"\xf0\x9f\x98\x80"', True),  # an escaped quote and a 4-byte character: 3 characters
    (b'"\\n\\t\\\\\xc3\xa9\xe4\xb8\xad\xef\xbf\xbf"', True),
    (b'"abc\\"', False),  # the closing quote escaped
    (b'"ab"', False), (b'"abcdefg"', False), (b'"abcdef"', True),
])
def test_bounded_strings_take_characters_as_json_spells_them(text, fits):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 6}},
              "required": ["s"]}
    llm = LLM("flock/tiny", load_format="dummy", dtype="float32")
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(json=schema))
    whole = b'{"s": ' + text + b"}"
    ends = matcher.accept_string(whole) and matcher.accept_token(llm.engine.grammars.stop_token_ids[0])
    assert ends is fits
    if fits:
        assert 3 <= len(json.loads(whole)["s"]) <= 6
