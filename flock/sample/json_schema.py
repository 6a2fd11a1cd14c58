"""JSON Schemas as xgrammar can enforce them.

xgrammar compiles some keywords without enforcing them, found by compiling schemas and feeding the matcher
instances that break them. Where a rewrite keeps a schema's meaning, `enforceable` makes it (a string's length
as a pattern, which also keeps raw control characters out of the JSON; an enum filtered by its type); where none
does, it refuses the schema naming the keyword and where it is, as vLLM refuses some, rather than letting output
through that does not validate.
"""

from __future__ import annotations

import copy
import json
import re

# keys that do not constrain an instance
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$defs", "definitions", "discriminator", "nullable"}
# standard formats xgrammar has no grammar for (it lets any string through); other names are annotations
UNENFORCED_FORMATS = {"regex", "idn-email", "idn-hostname", "iri", "iri-reference"}
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
            "else", "unevaluatedProperties", "unevaluatedItems")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
# One character of a JSON string as written: printable ASCII but the quote and backslash, a short escape, or a
# code point's valid UTF-8 spelled as ranges that xgrammar's patterns match bytewise (its `.` and a negated class
# let overlong and surrogate byte sequences through, which decode to no character)
JSON_CHAR = (r'(?:[ !#-\[\]-~]|\\["\\/bfnrt]|[\u0080-\u07FF]|[\u0800-\uD7FF]|[\uE000-\uFFFF]|['
             + chr(0x10000) + "-" + chr(0x10FFFF) + "])")
# keywords that constrain only instances of one type: a schema naming no type, and no enum, const or subschemas,
# takes the type they imply (xgrammar would let any value through them)
_TYPED_KEYWORDS = {
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "additionalItems", "unevaluatedItems"},
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "unevaluatedProperties"}}
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
               "array": (list,), "object": (dict,)}


def enforceable(schema: dict | str) -> dict | str:
    """`schema` (a dict or JSON text) as xgrammar enforces it, a copy; ValueError naming the first keyword it
    would not enforce, and where."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return schema  # xgrammar reports it
    schema = copy.deepcopy(schema)
    _walk(schema, "#")
    return schema


def _walk(schema, path: str) -> None:
    if not isinstance(schema, dict):
        return
    _type_from_keywords(schema, path)
    _declare_required(schema, path)
    _refuse_unenforced(schema, path)
    _lengths_as_pattern(schema)
    _filter_enum(schema, path)
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _walk(sub, f"{path}/{key}/{name}")
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk(sub, f"{path}/{key}/{i}")
    for key in _SCHEMAS:
        _walk(schema.get(key), f"{path}/{key}")


def _type_from_keywords(schema: dict, path: str) -> None:
    """A schema without a type whose keywords constrain one type's instances only ({"minimum": 18}) gets that
    type: xgrammar lets any value through them, the typed schema keeps its output valid. Keywords of two types
    are refused."""
    if "type" in schema or {"enum", "const", "anyOf", "oneOf", "allOf", "$ref"} & schema.keys():
        return
    implied = sorted(t for t, keywords in _TYPED_KEYWORDS.items() if keywords & schema.keys())
    if len(implied) > 1:
        raise ValueError(f"keywords of several types ({', '.join(implied)}) without a type at {path} are not "
                         "supported")
    if implied:
        schema["type"] = implied[0]


def _declare_required(schema: dict, path: str) -> None:
    """Required names that only patternProperties or additionalProperties give, declared as properties with
    their schema: xgrammar leaves undeclared required names out."""
    required, properties = schema.get("required"), schema.get("properties") or {}
    if not isinstance(required, list):
        return
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    extra = schema.get("additionalProperties")
    for name in (n for n in required if isinstance(n, str) and n not in properties):
        try:
            matched = [sub for pattern, sub in patterns.items() if re.search(pattern, name)]
        except re.error as e:
            raise ValueError(f"patternProperties at {path}: {e}") from None
        if len(matched) > 1:
            raise ValueError(f"required {name!r} at {path} matches several patternProperties; not supported")
        if matched or extra is True or isinstance(extra, dict):
            schema.setdefault("properties", {})[name] = matched[0] if matched else {} if extra is True else extra
            properties = schema["properties"]


def _refuse_unenforced(schema: dict, path: str) -> None:
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    constraints = set(schema) - ANNOTATIONS
    unenforced = [k for k in ("not", "if", "dependentRequired", "dependentSchemas", "dependencies", "contains",
                              "minContains", "maxContains", "$dynamicRef", "$recursiveRef") if k in schema]
    if schema.get("uniqueItems") is True:
        unenforced.append("uniqueItems")
    if "multipleOf" in schema and "integer" not in types:
        unenforced.append("multipleOf (on numbers)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        unenforced.append("allOf (with more than one schema)")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        unenforced.append("minLength / maxLength (with a pattern or format)")
    if "pattern" in schema and "format" in schema:
        unenforced.append("pattern (with a format)")
    if schema.get("format") in UNENFORCED_FORMATS:
        unenforced.append(f"format {schema['format']!r}")
    for key in ("pattern", "patternProperties", "propertyNames"):
        if _LOOKAROUND.search(json.dumps(schema.get(key, ""))):
            unenforced.append(f"a lookaround in {key}")
    for key in ("anyOf", "oneOf", "allOf", "$ref"):
        if key in schema and constraints - {key}:
            unenforced.append(f"{sorted(constraints - {key})[0]} (beside {key})")
    if "propertyNames" in schema and "properties" in schema:  # xgrammar lets the declared names through (as vLLM)
        unenforced.append("propertyNames (beside properties)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        unenforced.append(f"$ref {ref!r} (only '#/...' pointers)")
    unenforced += [f"required {name!r} (not in properties)" for name in _undeclared_required(schema)]
    if unenforced:
        raise ValueError(f"{unenforced[0]} at {path} is not supported")


def _undeclared_required(schema: dict) -> list[str]:
    """Required names that no property can give (_declare_required declared those the others give): xgrammar's
    strict mode leaves them out."""
    required, properties = schema.get("required"), schema.get("properties") or {}
    if not isinstance(required, list):
        return []
    return [name for name in required if isinstance(name, str) and name not in properties]


def _lengths_as_pattern(schema: dict) -> None:
    """minLength / maxLength alone let xgrammar write raw control characters into the string; the same bounds
    as a pattern of JSON_CHAR do not."""
    if "pattern" in schema or "format" in schema or not ({"minLength", "maxLength"} & schema.keys()):
        return
    low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
    schema["pattern"] = f"^{JSON_CHAR}{{{low},{high}}}$"


def _filter_enum(schema: dict, path: str) -> None:
    """An enum (or const) wins over its siblings in xgrammar: keep the values of the declared type; other
    constraints beside it are refused."""
    key = "enum" if "enum" in schema else "const" if "const" in schema else None
    if key is None:
        return
    others = set(schema) - ANNOTATIONS - {key, "type"}
    if others:
        raise ValueError(f"{sorted(others)[0]} (beside {key}) at {path} is not supported")
    types = schema.get("type")
    if types is None:
        return
    allowed = tuple(t for name in ([types] if isinstance(types, str) else types) for t in _JSON_TYPES.get(name, ()))
    fits = [v for v in (schema[key] if key == "enum" else [schema[key]])
            if isinstance(v, allowed) and (bool in allowed or not isinstance(v, bool))]
    if not fits:
        raise ValueError(f"no value of {key} at {path} has its type {types!r}")
    if key == "enum":
        schema["enum"] = fits


_PYTHON_NAMES = {"true": "True", "false": "False", "null": "None"}
# an EBNF token: a string literal, a character class, or a name (a rule's, or a keyword such as Regex)
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')


def python_literal_rules(schema: dict, rule: str) -> list[str]:
    """EBNF rules whose `rule` matches the Python literals of a JSON schema's instances: xgrammar's grammar of the
    schema's compact JSON (so its every keyword as xgrammar enforces it), with True / False / None for JSON's
    names and each of its rules renamed `rule_...` to sit beside other such grammars. ValueError (or xgrammar's
    RuntimeError) for a schema it rejects."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(enforceable(schema)), any_whitespace=False,
                                                 strict_mode=True))
    ebnf = re.sub(r'(?<!\\)"(true|false|null)"', lambda m: f'"{_PYTHON_NAMES[m[1]]}"', ebnf)
    names = set(re.findall(r"^(\w+) ::=", ebnf, re.M))
    renamed = {name: rule if name == "root" else f"{rule}_{name}" for name in names}
    return [_EBNF_TOKEN.sub(lambda m: renamed.get(m[0], m[0]), line) for line in ebnf.splitlines() if line.strip()]
