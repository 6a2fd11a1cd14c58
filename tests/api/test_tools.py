import json

import pytest

from flock.api.protocol import APIError, make_choice, parse_request, response_body
from flock.api.tools import ToolCalling, ToolCallStream
from flock.model import resolve_model
from flock.tokenizer import assistant_tool_calls, load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def hermes(choice="auto") -> ToolCalling:
    return ToolCalling("hermes", [WEATHER, NOW], choice)


def llama(choice="auto") -> ToolCalling:
    return ToolCalling("llama3_json", [WEATHER, NOW], choice)


def calls(extracted) -> tuple:
    content, found = extracted
    assert all(c["type"] == "function" and (c["id"].startswith("chatcmpl-tool-") or len(c["id"]) == 9)
               for c in found)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


def test_hermes_calls_as_vllm_parses_them():
    """Text before the first <tool_call> is the content; a closed or unterminated call's JSON is one call; if any
    call does not parse there are none and the whole text is the content."""
    one = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}\n</tool_call>'
    # the whitespace before the call stays, as vLLM's hermes parser keeps it
    assert calls(hermes().extract(one)) == ("Let me look.\n", [("get_weather", {"city": "Paris", "celsius": True})])
    two = '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "now", "arguments": {"é": 1}}'
    assert calls(hermes().extract(two)) == (None, [("now", {}), ("now", {"é": 1})])
    assert hermes().extract(two)[1][1]["function"]["arguments"] == '{"é": 1}'  # json.dumps, non-ASCII kept
    for text in ("It is sunny.", '<tool_call>{"name": "now"}</tool_call>', '<tool_call>{"name": "now", "argu',
                 '<tool_call>{"name": 5, "arguments": {}}</tool_call>'):  # a name that is no string: no call
        assert hermes().extract(text) == (text, [])


def test_llama3_json_calls_as_vllm_parses_them():
    """Every JSON object is a call with "parameters" (or "arguments"); the content is the text before them."""
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "celsius": false}}; ' \
           '{"name": "now", "arguments": {}}'
    assert calls(llama().extract(text)) == (None, [("get_weather", {"city": "Rome", "celsius": False}), ("now", {})])
    for text in ("No tools needed.", 'Use {braces} {"name": "now", "parameters": {}}', '{"name": "now"}',
                 '{"name": {"x": 1}, "parameters": {}}'):
        assert llama().extract(text) == (text, [])


@pytest.mark.parametrize("make, text, streamed_before_end", [
    (hermes, 'Sure thing. <tool_call>{"name": "now", "arguments": {}}</tool_call>', "Sure thing."),
    (hermes, "Plain <tool answer, no call.", "Plain <tool answer, no call."),
    (llama, '  {"name": "now", "parameters": {}}', ""),
    (llama, "  Plain {answer}.", "  Plain {answer}."),  # no key opens it: code's braces stream
    (llama, 'Use f() { return 1; } or {\n "name": "now", "parameters": {}}', "Use f() { return 1; } or"),
    (llama, 'Sure: <|python_tag|>{"name": "now", "parameters": {}}', "Sure:"),
])
def test_a_stream_sends_content_until_a_call_may_start(make, text, streamed_before_end):
    """Streamed in 1-3 character deltas: content goes out while it cannot start a call (a partial "<tool_call>" is
    held back); at the end the rest, or the calls, and together they are the whole answer's."""
    stream, sent = ToolCallStream(make()), ""
    for at in range(0, len(text), 2):
        sent += stream.content(text[at : at + 2])
        assert text.startswith(sent)
    assert sent == streamed_before_end
    rest, found = stream.finish()
    content, whole = make().extract(text)
    assert sent + rest == (content or "") and [c["function"] for c in found] == [c["function"] for c in whole]


def test_forced_calls_stream_nothing_before_the_end():
    stream = ToolCallStream(hermes("required"))
    assert stream.content('<tool_call>{"name": "now", "arguments": {}}</tool_call>') == ""
    assert calls(stream.finish()) == ("", [("now", {})])


def test_tool_fields_checked_as_vllm_checks_them(tok):
    def param(body, parser="hermes"):
        with pytest.raises(APIError) as e:
            parse_request("chat", {"messages": USER} | body, tok, None, parser)
        return e.value.param

    assert param({"tools": [WEATHER]}, parser=None) == "tool_choice"  # auto by default: needs a parser
    assert param({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}) == \
        "tool_choice"
    assert param({"tools": [WEATHER], "tool_choice": "always"}) == "tool_choice"
    assert param({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ""}}}) == \
        "tool_choice"
    history = USER + [{"role": "assistant", "content": "", "tool_calls": ["get_weather"]}]
    assert param({"messages": history}) == "messages[1].tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert param({"tools": [WEATHER], "tool_choice": named, "structured_outputs": {"json_object": True}}) == \
        "tool_choice"
    forced = parse_request("chat", {"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                                    "response_format": {"type": "json_object"}}, tok, None, "hermes")
    assert forced.params.structured_outputs.structural_tag  # the forced call's grammar wins, as vLLM's
    assert param({"tools": [WEATHER], "parallel_tool_calls": "yes"}) == "parallel_tool_calls"
    shown = parse_request("chat", {"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, tok, None, None)
    assert shown.tools is None and shown.params.structured_outputs is None


def test_forced_calls_are_constrained_and_auto_is_not(tok):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parser in [("required", "hermes"), (named, "hermes"), (named, "llama3_json")]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice}, tok, None,
                            parser)
        assert gen.params.structured_outputs.kind == "structural_tag" and gen.structured_param == "tools"
        assert gen.params.skip_special_tokens == (parser != "hermes")  # hermes' tags may be special tokens
    auto = parse_request("chat", {"messages": USER, "tools": [WEATHER], "parallel_tool_calls": False}, tok, None,
                         "hermes")
    assert auto.tools.choice == "auto" and not auto.tools.parallel and auto.params.structured_outputs is None


def test_a_choice_with_calls(tok):
    """content "" for a forced call (null for auto), tool_calls beside it, finish_reason tool_calls (a named
    function's: stop, as OpenAI's)."""
    answer = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}</tool_call>'
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, content, reason in [("auto", None, "tool_calls"), ("required", "", "tool_calls"), (named, "", "stop")]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER], "tool_choice": choice}, tok, None, "hermes")
        c = make_choice(gen, 0, answer, "stop", [1], None, None, None)
        message = response_body("chat", "id", "m", [c], {})["choices"][0]["message"]
        assert (message["content"], c.finish_reason, message["tool_calls"][0]["function"]["name"]) == \
            (content, reason, "get_weather")
    text = make_choice(gen, 0, "Cannot say.", "stop", [1], None, None, None)
    assert (text.text, text.tool_calls, text.finish_reason) == ("Cannot say.", None, "stop")


def test_past_calls_reach_the_template_with_object_arguments(tok):
    """An assistant message's tool_calls carry their arguments as JSON text (OpenAI's); templates index them as
    objects (as vLLM passes them), and a tool's answer follows."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert assistant_tool_calls(messages[1])["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}[{{ c.function.arguments.city }}]"
                "{% endfor %}{{ m.content or '' }}|{% endfor %}")
    tok.chat_template, original = template, tok.chat_template
    try:
        ids = parse_request("chat", {"messages": messages}, tok).prompts[0]
    finally:
        tok.chat_template = original
    assert tok.decode(ids) == "Weather in Paris?|[Rome]|sunny|"


def mistral(choice="auto") -> ToolCalling:
    return ToolCalling("mistral", [WEATHER, NOW], choice)


def test_mistral_calls_as_vllm_parses_them():
    """[TOOL_CALLS] then a JSON list of calls (a call without arguments has none, arguments written as a string
    are the JSON text they are), or the v11 tokenizers' NAME[ARGS]{...} after each marker; ids of 9 letters and
    digits, as Mistral's template wants them."""
    import re

    text = 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "celsius": true}}, ' \
           '{"name": "now"}]'
    assert calls(mistral().extract(text)) == ("Checking.", [("get_weather", {"city": "Rome", "celsius": True}),
                                                            ("now", {})])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in mistral().extract(text)[1])
    quoted = '[TOOL_CALLS] [{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]'
    assert mistral().extract(quoted)[1][0]["function"]["arguments"] == '{"city": "Paris"}'
    v11 = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "celsius": true}[TOOL_CALLS]now[ARGS]{}'
    assert calls(mistral().extract(v11)) == ("Checking.", [("get_weather", {"city": "Paris", "celsius": True}),
                                                           ("now", {})])
    assert calls(mistral().extract('[TOOL_CALLS]now{}')) == (None, [("now", {})])
    for text in ("No call.", "[TOOL_CALLS] not json", '[TOOL_CALLS] [{"name": null, "arguments": {}}]',
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "[TOOL_CALLS][ARGS]{}"):
        assert mistral().extract(text) == (text, [])
    stream = ToolCallStream(mistral())
    assert stream.content("Sure. [TOOL") == "Sure." and stream.content('_CALLS] [{"name": "now", ') == ""


def test_forced_mistral_calls_follow_the_format(tok):
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, answer in [("required", '[TOOL_CALLS] [{"name": "now", "arguments": {}}]'),
                           (named, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                                   '"celsius": false}}]')]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice}, tok, None,
                            "mistral")
        assert not gen.params.skip_special_tokens  # [TOOL_CALLS] is a control token of Mistral's vocabulary
        assert grammars.matcher(gen.params.structured_outputs).accept_string(answer)
        assert not grammars.matcher(gen.params.structured_outputs).accept_string("Sure.")


def pythonic(choice="auto") -> ToolCalling:
    return ToolCalling("pythonic", [WEATHER, NOW], choice)


def test_pythonic_calls_as_vllm_parses_them():
    """The whole answer a list of calls with literal keyword arguments (Llama 3.2's pythonic template, Llama 4's
    within <|python_start|>); anything else is content, whole."""
    text = '[get_weather(city="Rome", celsius=True), now()]'
    assert calls(pythonic().extract(text)) == (None, [("get_weather", {"city": "Rome", "celsius": True}), ("now", {})])
    assert calls(pythonic().extract("<|python_start|>[now()]<|python_end|>")) == (None, [("now", {})])
    for text in ("It is [sunny] today.", "[]", "[now(1)]", "[get_weather(city=place)]", "[now()", "Say [now()]"):
        assert pythonic().extract(text) == (text, [])
    stream = ToolCallStream(pythonic())
    assert stream.content("The weather [is") == "The weather [is" and stream.content(" fine].") == " fine]."
    assert stream.finish() == ("", [])
    held = ToolCallStream(pythonic())
    assert held.content(" [get_weather(") == "" and held.content('city="Paris")]') == ""
    rest, found = held.finish()
    assert rest == "" and found[0]["function"]["name"] == "get_weather"


def test_forced_pythonic_calls_follow_the_format(tok):
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel, answer in [
            ("required", True, '[now(), get_weather(city="Paris", celsius=False)]'),
            (named, True, '[get_weather(city="Rome", celsius=True)]')]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice,
                                     "parallel_tool_calls": parallel}, tok, None, "pythonic")
        spec = gen.params.structured_outputs
        assert grammars.matcher(spec).accept_string(answer) and calls(gen.tools.extract(answer))
        for wrong in ("Sure.", "[other()]", '[get_weather(town="Paris")]', '[get_weather(city="Oslo", celsius=True)]',
                      '[get_weather(celsius=True, city="Rome")]', '[get_weather(city="Rome", celsius=1)]'):
            assert not grammars.matcher(spec).accept_string(wrong)
    single = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": "required",
                                    "parallel_tool_calls": False}, tok, None, "pythonic")
    assert not grammars.matcher(single.params.structured_outputs).accept_string("[now(), now()]")


FILE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}, "options": {"type": "object"}},
    "required": ["path", "content"]}}}


def qwen3_coder(choice="auto") -> ToolCalling:
    return ToolCalling("qwen3_coder", [WEATHER, NOW, FILE], choice)


def xml_call(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_qwen3_coder_calls_as_vllm_parses_them():
    """Qwen's XML calls after optional text, each value read as its parameter's schema type (a string raw, markup
    and newlines in it kept); no function in a call: no calls."""
    text = "I'll check.\n" + xml_call("get_weather", city="Rome", celsius="true") + "\n" + xml_call("now")
    assert calls(qwen3_coder().extract(text)) == ("I'll check.", [("get_weather", {"city": "Rome", "celsius": True}),
                                                                  ("now", {})])
    html = xml_call("write_file", path="index.html", content="<div>\n  42\n</div>", mode="420",
                    options='{"overwrite": true}')
    assert calls(qwen3_coder().extract(html)) == (None, [("write_file", {
        "path": "index.html", "content": "<div>\n  42\n</div>", "mode": 420, "options": {"overwrite": True}})])
    cut = "<tool_call>\n<function=get_weather>\n<parameter=celsius>\ntrue\n</parameter>\n<parameter=city>\nPar"
    assert calls(qwen3_coder().extract(cut)) == (None, [("get_weather", {"celsius": True})])  # max_tokens ran out
    bare = "Sure.\n<function=now>\n</function>"  # no <tool_call> around it: still a call, as vLLM reads it
    assert calls(qwen3_coder().extract(bare)) == ("Sure.", [("now", {})])
    for text in ("No call.", "<tool_call>\n</tool_call>"):
        assert qwen3_coder().extract(text) == (text, [])
    stream = ToolCallStream(qwen3_coder())
    assert stream.content("Sure. <tool") == "Sure." and stream.content("_call>\n<function=now>") == ""


def test_qwen3_coder_values_as_vllm_reads_them():
    """A value is the first of its schema's types it reads as (null, integer, number, boolean, object, array,
    string), a parameter the schema does not name or types a string; non-finite numbers stay text; an enum's
    value with space around it the value."""
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "flag": {"type": "bool"},
        "pick": {"enum": [" y ", "z"]}, "also": {"enum": ["z"]}, "obj": {"type": "object"},
        "any": {"description": "untyped"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    calling = ToolCalling("qwen3_coder", [tool], "auto")
    values = {"n": "12", "x": "NaN", "flag": "1", "pick": " y ", "also": " z ", "obj": "{'a': 1}", "any": "5",
              "either": "7",
              "extra": "[1, 2]"}
    args = calls(calling.extract(xml_call("f", **values)))[1][0][1]
    assert args == {"n": 12, "x": "NaN", "flag": True, "pick": " y ", "also": "z", "obj": "{'a': 1}", "any": "5",
                    "either": 7,
                    "extra": "[1, 2]"}
    assert calls(calling.extract(xml_call("f", x="null", n="-Infinity")))[1][0][1] == {"x": None, "n": "-Infinity"}


def test_forced_qwen3_coder_calls_follow_the_format(tok):
    from flock import LLM
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    named = {"type": "function", "function": {"name": "get_weather"}}
    weather = xml_call("get_weather", city="Paris", celsius="false")
    llm = LLM("flock/tiny", max_model_len=512)
    rome = xml_call("get_weather", city="Rome", celsius="true")
    for choice, answer in [("required", rome + "\n" + weather), (named, weather)]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice,
                                     "max_tokens": 120, "temperature": 0}, tok, None, "qwen3_coder")
        spec = gen.params.structured_outputs
        assert grammars.matcher(spec).accept_string(answer) and calls(gen.tools.extract(answer))[1]
        for wrong in ("Sure.", xml_call("other"), xml_call("get_weather", city="Oslo", celsius="true"),
                      xml_call("get_weather", city="Rome", celsius="maybe")):
            assert not grammars.matcher(spec).accept_string(wrong)
        text = llm.generate([{"prompt_token_ids": gen.prompts[0]}], gen.params, use_tqdm=False)[0].outputs[0].text
        found = calls(gen.tools.extract(text))[1]  # the random model's answer, held to the format
        assert found and all(name in ("get_weather", "now") for name, _ in found)
        assert all(args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool)
                   for name, args in found if name == "get_weather")
    single = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": "required",
                                    "parallel_tool_calls": False}, tok, None, "qwen3_coder")
    assert not grammars.matcher(single.params.structured_outputs).accept_string(rome + "\n" + weather)


@pytest.mark.parametrize("parser, marker", [("granite", "<|tool_call|>"), ("granite", "<tool_call>"),
                                            ("phi4_mini_json", "functools")])
def test_json_list_calls_as_vllm_parses_them(parser, marker):
    """Granite's and Phi-4-mini's calls: their marker and a JSON list, after any text; a call without arguments
    has none, Phi-4-mini's may name them "parameters"."""
    calling = ToolCalling(parser, [WEATHER, NOW], "auto")
    listed = '[{"name": "get_weather", "parameters": {"city": "Rome", "celsius": true}}, {"name": "now"}]'
    assert calls(calling.extract("Checking. " + marker + listed)) == ("Checking.", [
        ("get_weather", {"city": "Rome", "celsius": True}), ("now", {})])
    for text in ("No call.", marker + " not json", marker + '[{"name": 5, "arguments": {}}]', listed):
        assert calling.extract(text) == (text, [])  # a list without the marker is text
    start = marker[:-3]
    stream = ToolCallStream(calling)
    assert stream.content("Sure. " + start) == "Sure." and stream.content(marker[-3:] + '[{"name": "now"') == ""


@pytest.mark.parametrize("parser", ["granite", "phi4_mini_json"])
def test_forced_json_list_calls_follow_the_format(tok, parser):
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    marker = {"granite": "<|tool_call|>", "phi4_mini_json": "functools"}[parser]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, answer in [("required", marker + '[{"name": "now", "arguments": {}}]'),
                           (named, marker + '[{"name": "get_weather", "arguments": {"city": "Paris", '
                                            '"celsius": false}}]')]:
        gen = parse_request("chat", {"messages": USER, "tools": [WEATHER, NOW], "tool_choice": choice}, tok, None,
                            parser)
        assert gen.params.skip_special_tokens == (parser != "granite")  # Granite's marker is a special token
        spec = gen.params.structured_outputs
        assert grammars.matcher(spec).accept_string(answer) and calls(gen.tools.extract(answer))[1]
        assert not grammars.matcher(spec).accept_string("Sure.")


NESTED = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 10, "maximum": 12}, "xs": {"type": "array", "items": {"type": "integer"},
                                                                     "maxItems": 2},
    "o": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": False},
    "s": {"type": "string"}}, "required": ["n", "xs", "o"]}}}
ANY_ARGS = {"type": "function", "function": {"name": "g", "parameters": {"type": "object",
                                                                        "additionalProperties": True}}}


@pytest.mark.parametrize("answer, fits", [
    ('[f(n=11, xs=[1, 2], o={"k": True})]', True), ('[f(n=11, xs=[], o={"k": False}, s="hi")]', True),
    ('[f(n=13, xs=[], o={"k": True})]', False), ('[f(n=11, xs=[1, 2, 3], o={"k": True})]', False),
    ('[f(n=11, xs=[[1]], o={})]', False), ('[f(n=11, xs=[1], o={"k": true})]', False),
    ('[f(xs=[1], n=11, o={"k": True})]', False), ('[f(n=11, xs=[1], o={"k": True}, n=12)]', False),
    ("[now()]", True), ("[now(a=1)]", False),  # no parameters: no arguments, as vLLM's empty object
    ("[g()]", True), ('[g(a=1, b="x", c=None)]', True)])
def test_forced_pythonic_arguments_follow_their_schemas(tok, answer, fits):
    """Each keyword argument's value is a Python literal of an instance of its parameter's schema, every keyword
    xgrammar enforces in JSON enforced (bounds, item counts, nested objects' required keys)."""
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    gen = parse_request("chat", {"messages": USER, "tools": [NESTED, NOW, ANY_ARGS], "tool_choice": "required"}, tok,
                        None, "pythonic")
    matcher = grammars.matcher(gen.params.structured_outputs)
    assert bool(matcher.accept_string(answer) and matcher.accept_token(tok.eos_token_id)) is fits
    if fits:
        assert gen.tools.extract(answer)[1]


@pytest.mark.parametrize("parser", ["pythonic", "hermes", "mistral", "qwen3_coder"])
@pytest.mark.parametrize("parameters, reason", [({"type": "foo"}, "type"),
                                                 ({"type": "object", "properties": {"xs": {"type": "array",
                                                                                           "uniqueItems": True}}},
                                                  "uniqueItems")])
def test_forced_calls_refuse_parameters_the_grammar_engine_would_not_enforce(tok, parser, parameters, reason):
    """As a response_format's schema is refused (flock.sample.json_schema), not let through unenforced."""
    bad = {"type": "function", "function": {"name": "b", "parameters": parameters}}
    with pytest.raises(APIError) as e:
        parse_request("chat", {"messages": USER, "tools": [bad], "tool_choice": "required"}, tok, None, parser)
    assert e.value.param == "tools" and reason in e.value.message


STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                           "parameters": WEATHER["function"]["parameters"]}}
LOOSE = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}


@pytest.mark.parametrize("parser, good, bad, loose", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "celsius": true}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>',
     '<tool_call>\n{"name": "count", "arguments": {"n": "x", "m": 1}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "celsius": false}}',
     '{"name": "get_weather", "parameters": {"city": "Paris"}}', '{"name": "count", "parameters": {"z": []}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": 1, "celsius": true}}]',
     '[TOOL_CALLS] [{"name": "count", "arguments": {"q": 2}}]'),
    ("qwen3_coder", xml_call("get_weather", city="Paris", celsius="true"), xml_call("get_weather", city="Oslo"),
     xml_call("count", n="7"))])
def test_strict_tools_constrain_auto_calls_once_they_start(tok, parser, good, bad, loose):
    """OpenAI's `strict` with tool_choice auto (as vLLM): text stays free, and a call, once begun, follows the
    format, a strict tool's arguments its schema (the others' any object); no strict tool, no grammar."""
    from flock.sample.grammar import GrammarCompiler

    grammars = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    gen = parse_request("chat", {"messages": USER, "tools": [STRICT, LOOSE]}, tok, None, parser)
    for answer, fits in [("It is sunny.", True), ("Let me check. " + good, True), (bad, False), (loose, True)]:
        matcher = grammars.matcher(gen.params.structured_outputs)
        assert bool(matcher.accept_string(answer) and matcher.accept_token(tok.eos_token_id)) is fits, answer
    assert parse_request("chat", {"messages": USER, "tools": [WEATHER, LOOSE]}, tok, None,
                         parser).params.structured_outputs is None
    with_format = parse_request("chat", {"messages": USER, "tools": [STRICT], "response_format": {
        "type": "json_object"}}, tok, None, parser)
    assert with_format.structured_param == "response_format"
