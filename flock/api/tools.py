"""Tool calls in chat completions, as vLLM's server makes them with `--tool-call-parser`.

A request's `tools` go to the chat template. With a parser, `tool_choice` "auto" lets the model call them,
"required" and a named function constrain the answer to calls in the model's format and nothing else (an
xgrammar structural tag: one call, or with parallel_tool_calls one or more; each call's arguments following its
tool's `parameters` schema, as far as the grammar engine enforces it), and the calls are parsed out of the
answer into OpenAI's `tool_calls`. Without one, only "none" is accepted, as vLLM without a parser.

Formats: "hermes" (Qwen2.5, Hermes 2 Pro: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after
optional text), "llama3_json" (Llama 3.1 / 3.2: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`), "mistral" (Mistral 7B v0.3 and its kin: `[TOOL_CALLS] [{"name": ..., "arguments": {...}},
...]`; the v11 tokenizers' models, Mistral Small 3.2, Magistral, Devstral: `[TOOL_CALLS]NAME[ARGS]{...}` for each
call; ids of 9 letters and digits as Mistral's template wants them), "pythonic" (Llama 3.2 with its pythonic
template, Llama 4, ToolACE: the whole answer a Python list of calls with literal keyword arguments,
`[get_weather(city="Paris"), now()]`, in Llama 4's `<|python_start|>...<|python_end|>` or not), "qwen3_coder"
(Qwen3-Coder, Qwen3.5: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n
</tool_call>`, each value raw text read as its parameter's schema type; forced calls constrained by xgrammar's own
structural tag of the format), "granite" (Granite 3.x: a JSON list of calls after `<|tool_call|>` or
`<tool_call>`) and "phi4_mini_json" (Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`). The content
is the text before the first call, without the whitespace that ends it (a pythonic answer is calls or content,
whole). A JSON list's call without arguments has none ({}), and arguments written as a string are taken as the
JSON text they are (as vLLM's parsers take them); a call whose name is no string is not a call.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from flock.api.reasoning import REASONING_PARSERS, held_back
from flock.sample.grammar import rejection
from flock.sample.json_schema import enforceable, python_literal_rules
from flock.sampling_params import StructuredOutputsParams

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite", "phi4_mini_json")
TOOL_PARSER_ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}  # vLLM's other names of them
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_HERMES_START = "<tool_call>"
_LLAMA_TAG = "<|python_tag|>"
_MISTRAL_START = "[TOOL_CALLS]"
_GRANITE_STARTS = ("<|tool_call|>", "<tool_call>")
# formats whose calls are a JSON list after a marker: the markers, and what a forced answer writes before the list
_JSON_LISTS = {"mistral": ((_MISTRAL_START,), _MISTRAL_START + " "),
               "granite": (_GRANITE_STARTS, _GRANITE_STARTS[0]), "phi4_mini_json": (("functools",), "functools")}
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's
_MISTRAL_ARGS = "[ARGS]"  # v11 tokenizers': between a call's name and its arguments
_XML_FUNCTION = "<function="  # a Qwen XML call's start, also without its <tool_call> (as vLLM reads it)
# where a call may start after content (a pythonic answer is calls or content, whole)
_STARTS = {"hermes": [_HERMES_START], "mistral": [_MISTRAL_START], "qwen3_coder": [_HERMES_START, _XML_FUNCTION],
           "granite": list(_GRANITE_STARTS), "phi4_mini_json": ["functools"]}
# what may begin a Llama 3 call: its tag, or an object whose first key is coming (code's braces are content)
_LLAMA_CALL, _LLAMA_OPENING = re.compile(r'<\|python_tag\|>|\{\s*"'), re.compile(r"\{\s*$")
_XML_CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>|$)|$)",
                       re.DOTALL)
# a parameter's value ends at its closing tag or the next parameter; one cut off by max_tokens is dropped (as vLLM)
_XML_PARAMETER = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
                            re.DOTALL)
# JSON Schema type names as vLLM reads a Qwen XML value's type, their aliases, and the order it tries them
_XML_TYPE_ALIASES = {**dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
                     **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short",
                                      "unsigned"), "integer"),
                     **dict.fromkeys(("float", "float32", "float64", "double"), "number"), "bool": "boolean",
                     "dict": "object", **dict.fromkeys(("arr", "list", "sequence"), "array")}
_XML_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_NOT_JSON = object()
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_ANY_OBJECT = {"type": "object", "additionalProperties": True}
# what starts a call in free text, for formats whose calls may follow text (strict tools with tool_choice auto)
_STRICT_TRIGGERS = {"hermes": [_HERMES_START], "llama3_json": ['{"name": '], "qwen3_coder": [_HERMES_START],
                    **{parser: [begin.rstrip()] for parser, (_, begin) in _JSON_LISTS.items()}}
# a format's call as (begin, end) around the arguments, in the forms a model writes it; the separator of calls
_CALL_FORMS = {"hermes": ([('<tool_call>\n{{"name": {}, "arguments": ', "}\n</tool_call>"),
                           ('<tool_call>{{"name": {}, "arguments": ', "}</tool_call>")], ""),
               "llama3_json": ([('{{"name": {}, "parameters": ', "}")], "; ")}


class ToolError(ValueError):
    """A bad tools / tool_choice field: the message, and the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCalling:
    """How one chat request may call tools: the parser of its model's format, its tools, and its choice ("auto",
    "required", or the name of the function it must call)."""

    parser: str
    tools: list[dict]
    choice: str
    named: bool = False
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of a forced answer (required or named): calls and nothing else; for auto, none, but with a
        strict tool the calls' (`_auto_constraint`). ToolError for a tool whose parameters schema the grammar engine
        would not enforce."""
        if self.choice == "auto" and not (self.parser in _STRICT_TRIGGERS and self._any_strict()):
            return None
        try:
            return self._auto_constraint() if self.choice == "auto" else self._constraint()
        except (ValueError, RuntimeError) as e:
            raise ToolError(f"tools: a function's parameters were rejected: {rejection(e)}", "tools") from None

    def _any_strict(self) -> bool:
        return any(t["function"].get("strict") is True for t in self.tools)

    def _auto_constraint(self) -> StructuredOutputsParams:
        """Free text in which a call, once it starts, follows the format (OpenAI's `strict` tools, as vLLM: their
        arguments follow their schema, the other tools' arguments are any object)."""
        functions = [f if f.get("strict") is True else f | {"parameters": _ANY_OBJECT} for f in self._functions()]
        if self.parser == "qwen3_coder":
            return self._xgrammar_constraint("qwen_3_coder", functions)
        if self.parser in _JSON_LISTS:
            tags = [{"type": "tag", "begin": _JSON_LISTS[self.parser][1], "end": "",
                     "content": {"type": "json_schema", "json_schema": self._call_array(functions)}}]
        else:
            tags = self._call_tags(functions)
        calls = {"type": "triggered_tags", "triggers": _STRICT_TRIGGERS[self.parser], "tags": tags,
                 "at_least_one": False, "stop_after_first": not self.parallel}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": calls}))

    def _functions(self) -> list[dict]:
        """The functions the answer may call (a named one: it alone), their parameters as the grammar engine
        enforces them (as a response_format's schema; no parameters: no arguments, as vLLM); a schema it rejects
        fails here."""
        import xgrammar

        functions = [f | {"parameters": enforceable(f.get("parameters") or _EMPTY_PARAMETERS)}
                     for f in (t["function"] for t in self.tools) if not self.named or f["name"] == self.choice]
        for f in functions:
            xgrammar.Grammar.from_json_schema(json.dumps(f["parameters"]))
        return functions

    def _constraint(self) -> StructuredOutputsParams:
        if self.parser in _JSON_LISTS:
            return self._json_list_constraint()
        if self.parser == "pythonic":
            return self._pythonic_constraint()
        if self.parser == "qwen3_coder":
            return self._xgrammar_constraint("qwen_3_coder", self._functions())
        calls = {"type": "tags_with_separator", "tags": self._call_tags(self._functions()),
                 "separator": _CALL_FORMS[self.parser][1], "at_least_one": True,
                 "stop_after_first": self.named or not self.parallel}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": calls}))

    def _call_tags(self, functions: list[dict]) -> list[dict]:
        """Each function's call in each form the format writes it, its arguments following its parameters."""
        return [{"type": "tag", "begin": begin.format(json.dumps(f["name"], ensure_ascii=False)), "end": end,
                 "content": {"type": "json_schema", "json_schema": f["parameters"], "max_whitespace_cnt": 1}}
                for f in functions for begin, end in _CALL_FORMS[self.parser][0]]

    def _call_array(self, functions: list[dict]) -> dict:
        """The schema of a JSON array of calls ({"name", "arguments"}), one when not parallel or named."""
        calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                  "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in functions]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.named or not self.parallel:
            array["maxItems"] = 1
        return array

    def _json_list_constraint(self) -> StructuredOutputsParams:
        """The format's marker and a JSON array of calls, and nothing else."""
        answer = {"type": "sequence", "elements": [{"type": "const_string", "value": _JSON_LISTS[self.parser][1]},
                                                   {"type": "json_schema", "json_schema": self._call_array(
                                                       self._functions()), "max_whitespace_cnt": 1}]}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": answer}))

    def _pythonic_constraint(self) -> StructuredOutputsParams:
        """A list of calls, one when not parallel or named: each a tool's name and its parameters as keyword
        arguments in the schema's order (the required ones always), each value a Python literal of an instance of
        the parameter's schema."""
        functions = self._functions()
        calls = " | ".join(f"call{i}" for i in range(len(functions)))
        rules = [f"root ::= \"[\" ({calls})" + ("" if self.named or not self.parallel else
                                                f" (\", \" ({calls}))*") + " \"]\""]
        for i, f in enumerate(functions):
            rules += _pythonic_call(f"call{i}", f["name"], f["parameters"])
        return StructuredOutputsParams(grammar="\n".join(rules))

    def _xgrammar_constraint(self, model: str, functions: list[dict]) -> StructuredOutputsParams:
        """The functions' calls as xgrammar's structural tag of the model family writes them (the thinking before
        them is Flock's to allow): free text around them for auto, else calls and nothing else, one when not
        parallel or named."""
        import xgrammar

        tools = [{"type": "function", "function": f} for f in functions]
        choice = "auto" if self.choice == "auto" else "required"
        tag = xgrammar.get_model_structural_tag(model, tools=tools, tool_choice=choice, reasoning="disabled",
                                                max_whitespace_cnt=1, parallel_tool_calls=self.parallel)
        if choice == "auto":
            return StructuredOutputsParams(structural_tag=json.dumps(tag.model_dump()))
        calls = {"type": "tags_with_separator", "tags": [t.model_dump() for t in tag.format.tags], "separator": "\n",
                 "at_least_one": True, "stop_after_first": self.named or not self.parallel}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": calls}))

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of an answer, as vLLM's parser of the format extracts them: when any call does
        not parse, there are none and the whole text is the content. Without parallel calls only the first
        counts."""
        parse = {"hermes": _hermes, "llama3_json": _llama3_json, "pythonic": _pythonic,
                 "qwen3_coder": lambda text: _qwen3_coder(text, self.tools)}
        content, calls = _json_list(text, self.parser) if self.parser in _JSON_LISTS else parse[self.parser](text)
        if not calls:
            return text, []
        calls = calls if self.parallel else calls[:1]
        # vLLM's hermes parser keeps the whitespace before a call the model chose to make
        content = content if self.parser == "hermes" and self.choice == "auto" else content.rstrip()
        return content or None, [{"id": self._call_id(), "type": "function",
                                  "function": {"name": name, "arguments": arguments}} for name, arguments in calls]

    def _call_id(self) -> str:
        if self.parser == "mistral":  # Mistral's template refuses other tool_call_ids
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"

    def streamable(self, text: str) -> int:
        """How much of a partial answer is content for sure (never part of a call), to stream before the end."""
        if self.choice != "auto":
            return 0
        if self.parser == "pythonic":  # calls are the whole answer: it streams unless it starts as one
            head = text.lstrip()
            return 0 if not head or head[0] == "[" or _PYTHON_START.startswith(head[: len(_PYTHON_START)]) \
                else len(text)
        if self.parser == "llama3_json":
            found = _LLAMA_CALL.search(text) or _LLAMA_OPENING.search(text)
            end = found.start() if found else len(text) - held_back(text, _LLAMA_TAG)
        else:
            starts = _STARTS[self.parser]
            found = [at for at in (text.find(s) for s in starts) if at >= 0]
            end = min(found) if found else len(text) - max(held_back(text, s) for s in starts)
        return len(text[:end].rstrip())  # the content before a call ends without its whitespace

    def finish_reason(self, calls: list[dict], engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the answer called tools, but "stop" for a named function."""
        return "tool_calls" if calls and not self.named and engine_reason == "stop" else engine_reason


def _hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    if _HERMES_START not in text:
        return text, []
    try:
        calls = [json.loads(closed or open_) for closed, open_ in _HERMES_CALL.findall(text)]
        calls = [(_name(c), json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[: text.index(_HERMES_START)], calls


def _name(call: dict) -> str:
    """A call's function name; TypeError when it is none (a number, null, an object)."""
    name = call["name"]
    if not isinstance(name, str):
        raise TypeError(f"a call's name is {name!r}")
    return name


def _llama3_json(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Every JSON object from the first `{` on is a call ({"name", "parameters" or "arguments"}); text between
    them is dropped, as vLLM's parser drops it."""
    decoder, calls, at = json.JSONDecoder(), [], text.find("{")
    try:
        while at >= 0:
            obj, end = decoder.raw_decode(text, at)
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append((_name(obj), json.dumps(args, ensure_ascii=False)))
            at = text.find("{", end)
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[: text.find("{")].replace(_LLAMA_TAG, ""), calls


def _json_list(text: str, parser: str) -> tuple[str, list[tuple[str, str]]]:
    """The JSON after the format's first marker: a list of calls (or one call) with "name" and "arguments" (or
    Phi-4-mini's "parameters"); Mistral's v11 calls, `NAME[ARGS]{...}` after each marker."""
    markers = _JSON_LISTS[parser][0]
    at = min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)
    if at < 0:
        return text, []
    marker = next(m for m in markers if text.startswith(m, at))
    content, rest = text[:at], text[at + len(marker) :]
    try:
        if parser == "mistral" and not rest.lstrip().startswith(("[", "{")):
            return content, [_mistral_v11_call(part) for part in rest.split(_MISTRAL_START)]
        calls, _ = json.JSONDecoder().raw_decode(rest.strip())
        calls = [(_name(c), _list_arguments(c)) for c in (calls if isinstance(calls, list) else [calls])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    return content, calls


def _list_arguments(call: dict) -> str:
    """A JSON list call's arguments as JSON text: none are {}, a string is taken as the JSON text it is."""
    args = call["arguments"] if "arguments" in call else call.get("parameters")
    return "{}" if args is None else args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _mistral_v11_call(part: str) -> tuple[str, str]:
    """One `NAME[ARGS]{...}` (or `NAME{...}`) call of Mistral's v11 tokenizers; ValueError if it is none."""
    name, sep, args = part.partition(_MISTRAL_ARGS)
    if not sep:
        name, brace, args = part.partition("{")
        args = brace + args
    name = name.strip()
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"no function name in {part!r}")
    obj, _ = json.JSONDecoder().raw_decode(args.strip())
    if not isinstance(obj, dict):
        raise ValueError(f"the arguments of {name} are no object")
    return name, json.dumps(obj, ensure_ascii=False)


def _pythonic(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole answer as a Python list of calls with literal keyword arguments (vLLM's pythonic parser)."""
    code = text.strip()
    if code.startswith(_PYTHON_START):
        code = code[len(_PYTHON_START):].replace(_PYTHON_END, "").strip()
    if not code.startswith("["):
        return text, []
    try:
        tree = ast.parse(code, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return text, []
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append((call.func.id, json.dumps(args, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError):
        return text, []
    return "", calls


def _qwen3_coder(text: str, tools: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Qwen's XML calls: each `<function=NAME>`'s `<parameter=KEY>` values, read by their schema types (vLLM's
    qwen3_coder parser); a call left open at the end (max_tokens) counts with the parameters it closed."""
    found = [at for at in (text.find(_HERMES_START), text.find(_XML_FUNCTION)) if at >= 0]
    if not found:
        return text, []
    schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
               for t in tools}
    calls = []
    for name, body in _XML_CALL.findall(text):
        name, properties = name.strip(), schemas.get(name.strip(), {})
        args = {key.strip(): _xml_value(value, properties.get(key.strip()))
                for key, value in _XML_PARAMETER.findall(body)}
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    return text[: min(found)], calls


def _xml_value(raw: str, schema: dict | None):
    """A parameter's value as vLLM reads it: its text without the newline on either side, as the first of its
    schema's types it reads as (null, integer, number, boolean, object, array, string; a parameter the schema does
    not name, or names without a type, is a string); JSON's non-finite numbers stay text. An enum's value with
    space around it is the value."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if not isinstance(schema, dict):
        return value
    enum = schema.get("enum") if isinstance(schema.get("enum"), list) else []
    if value not in enum and value.strip() in enum:  # the whitespace a forced call's grammar allows around it
        return value.strip()
    types = {_XML_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in _schema_types(schema)}
    for kind in (t for t in _XML_TYPE_ORDER if t in types):
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind in ("integer", "number"):
            try:
                number = int(value) if kind == "integer" else float(value)
            except ValueError:
                continue
            if kind == "integer" or math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and value.strip().lower() in ("true", "1", "false", "0"):
            return value.strip().lower() in ("true", "1")
        if kind in ("object", "array") and (parsed := _finite_json(value)) is not _NOT_JSON:
            return parsed
    parsed = _finite_json(value)
    return value if parsed is _NOT_JSON else parsed


def _schema_types(schema: dict) -> list[str]:
    """The type names a parameter's schema allows: its `type`, its enum values' types, its anyOf / oneOf /
    allOf branches'; "string" when it names none."""
    types = schema.get("type")
    found = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)] \
        if isinstance(types, list) else []
    kinds = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
             (list, "array"), (dict, "object"))
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        found += [name for kind, name in kinds if isinstance(value, kind)][:1]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            found += [t for branch in schema[key] if isinstance(branch, dict) for t in _schema_types(branch)]
    return found or ["string"]


def _finite_json(value: str):
    """`value` read as JSON; _NOT_JSON when it is not, or holds a non-finite number (NaN, Infinity, 1e999: no JSON
    text can carry them)."""
    try:
        parsed = json.loads(value, parse_constant=_reject)
        json.dumps(parsed, allow_nan=False)
    except (ValueError, RecursionError):
        return _NOT_JSON
    return parsed


def _reject(constant: str):
    raise ValueError(f"{constant} is no JSON number")


def _pythonic_call(rule: str, name: str, schema: dict) -> list[str]:
    """The EBNF rules of one call `name(...)` whose keyword arguments are an instance of the object `schema` (see
    _pythonic_constraint): `rule_fJ` writes the arguments from the J-th property on when none came before it,
    `rule_tJ` those after one came; properties the schema does not name only where additionalProperties allows."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what the parameters' $refs point into
    rules = [f"{rule} ::= {json.dumps(name + '(')} {rule}_f0 \")\""]
    for j, (key, sub) in enumerate(properties.items()):
        rules += python_literal_rules((sub if isinstance(sub, dict) else {}) | defs, f"{rule}_v{j}")
        arg, first, tail = f"{json.dumps(key + '=')} {rule}_v{j}", f"{rule}_f{j + 1}", f"{rule}_t{j + 1}"
        optional = key not in required
        rules += [f"{rule}_f{j} ::= {arg} {tail}" + (f" | {first}" if optional else ""),
                  f'{rule}_t{j} ::= ", " {arg} {tail}' + (f" | {tail}" if optional else "")]
    n, extra = len(properties), schema.get("additionalProperties")
    if extra in (None, False):
        return rules + [f'{rule}_f{n} ::= ""', f'{rule}_t{n} ::= ""']
    rules += python_literal_rules((extra if isinstance(extra, dict) else {}) | defs, f"{rule}_x")
    keyword = f'[a-zA-Z_] [a-zA-Z0-9_]* "=" {rule}_x'
    return rules + [f'{rule}_f{n} ::= "" | {keyword} {rule}_t{n}', f'{rule}_t{n} ::= "" | ", " {keyword} {rule}_t{n}']


def parse_tools(body: dict, parser: str | None) -> tuple[list[dict] | None, ToolCalling | None]:
    """The tools to show the chat template, and how the answer may call them (None: it is text), from a chat
    body's `tools`, `tool_choice` and `parallel_tool_calls`, checked as vLLM checks them."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None, None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function" or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("parameters") or {}, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, 'parameters': "
                            f"object, ...}}}}", f"tools[{i}]")
    tools = [template_tool(t) for t in tools]
    choice = "auto" if choice is None else choice
    if choice == "none":
        return tools, None
    named = isinstance(choice, dict)
    if named:
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolError("a named tool_choice is {'type': 'function', 'function': {'name': NAME}}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        choice = name
    elif choice not in ("auto", "required"):
        raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                        "tool_choice")
    if parser is None:
        raise ToolError(f"tool_choice {body.get('tool_choice', 'auto')!r} needs a tool-call parser (flock serve / "
                        f"flock run --tool-call-parser {' | '.join(TOOL_PARSERS)}); without one it must be 'none'",
                        "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be a bool, got {parallel!r}", "parallel_tool_calls")
    return tools, ToolCalling(parser, tools, choice, named, parallel is not False)


def template_tool(tool: dict) -> dict:
    """A tool as chat templates get it from vLLM (its request model dumped): the function's name, description
    and parameters (null when absent), strict and defer_loading where set; other keys dropped."""
    f = tool["function"]
    function = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    function |= {k: f[k] for k in ("strict", "defer_loading") if f.get(k) is not None}
    if tool.get("defer_loading") is not None and "defer_loading" not in function:
        function["defer_loading"] = tool["defer_loading"]
    out = {"type": "function", "function": function}
    return out | ({"defer_loading": tool["defer_loading"]} if tool.get("defer_loading") is not None else {})


class ToolCallStream:
    """A streamed chat choice that may call tools: its text is sent as content as far as it cannot start a call;
    at the end the whole text is parsed, and its calls are sent whole."""

    def __init__(self, calling: ToolCalling):
        self.calling, self.text, self.sent = calling, "", 0

    def content(self, delta: str) -> str:
        """The content to send now, after the answer grew by `delta`."""
        self.text += delta
        end = max(self.sent, self.calling.streamable(self.text))
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet, and the answer's tool calls."""
        content, calls = self.calling.extract(self.text)
        if not calls:
            return self.text[self.sent :], []
        sent = self.text[: self.sent]
        return (content[len(sent) :] if content and content.startswith(sent) else ""), calls


def add_parser_arguments(p) -> None:
    """`flock serve` / `flock run` flags of the chat answers' parsers, vLLM's names."""
    p.add_argument("--tool-call-parser", choices=[*TOOL_PARSERS, *TOOL_PARSER_ALIASES],
                   help="parse chat answers' tool calls in this model format (hermes: Qwen2.5, Hermes 2 Pro; "
                        "llama3_json: Llama 3.1 / 3.2; mistral: Mistral 7B v0.3; pythonic: Llama 3.2's pythonic "
                        "template, Llama 4; qwen3_coder: Qwen3-Coder, Qwen3.5; granite: Granite 3.x; "
                        "phi4_mini_json: Phi-4-mini; vLLM's llama4_json and llama4_pythonic are llama3_json and "
                        "pythonic): tool_choice auto, required and named functions work")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto, accepted: with --tool-call-parser auto is on anyway")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                   help="split a reasoning model's thinking from its answer into message.reasoning "
                        "(deepseek_r1: <think>...</think>, DeepSeek-R1 distills, QwQ; qwen3: Qwen3, whose "
                        "<tool_call> also ends the thinking and enable_thinking=false turns it off)")


def tool_parser(args) -> str | None:
    """The parser the flags ask for; ValueError for --enable-auto-tool-choice alone (as vLLM)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return TOOL_PARSER_ALIASES.get(args.tool_call_parser, args.tool_call_parser)
