"""Anthropic's Messages API without a server: bodies as chat requests, answers as content blocks, a stream's events
adding up to the whole Message (checked against the anthropic client's own types)."""

import json
from types import SimpleNamespace

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from flock.api.answer_stream import AnswerStream
from flock.api.messages import MessageEvents, chat_messages, error_body, parse_messages
from flock.api.protocol import APIError, Choice, make_choice, parse_request
from flock.api.logprobs import TokenText
from flock.engine.async_engine import StreamOutput
from flock.model import resolve_model
from flock.tokenizer import load_tokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def test_a_body_is_the_chat_request_vllm_makes_of_it(tok):
    m = parse_messages({"model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
                        "messages": [{"role": "user", "content": "Hi there"}], "temperature": 0.5, "top_p": 0.9,
                        "top_k": 4, "stop_sequences": ["x"], "metadata": {"user_id": "u"}, "seed": 3}, tok)
    chat = parse_request("chat", {"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi there"}]}, tok)
    assert m.gen.prompts == chat.prompts and m.gen.kind == "chat" and m.gen.n == 1 and m.id.startswith("msg_")
    p = m.gen.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.seed) == (7, 0.5, 0.9, 4, ["x"], 3)
    prefill = parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": "Count"},
                                                            {"role": "assistant", "content": "1, 2,"}]}, tok)
    continued = parse_request("chat", {"messages": [{"role": "user", "content": "Count"},
                                                    {"role": "assistant", "content": "1, 2,"}],
                                       "add_generation_prompt": False, "continue_final_message": True}, tok)
    assert prefill.gen.prompts == continued.prompts


def test_blocks_become_the_messages_of_earlier_turns():
    image = {"type": "base64", "media_type": "image/png", "data": "iVBO"}
    body = {"system": "Use tools.", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Weather", "cache_control": {"type": "ephemeral"}},
            {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain",
                                                              "data": "Paris is in France."}},
            {"type": "search_result", "source": "https://a.example", "title": "Atlas",
             "content": [{"type": "text", "text": "Rome is in Italy."}]},
            {"type": "image", "source": image}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me look."},
            {"type": "thinking", "thinking": " Both.", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "Rain"}, {"type": "image", "source": {"type": "url",
                                                                                        "url": "https://x/y.png"}}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "system", "content": "Be brief."}]}
    calls = [{"id": t, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for t, city in (("t1", "Paris"), ("t2", "Rome"))]
    assert chat_messages(body) == [
        {"role": "system", "content": "Use tools.Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Weather"}, {"type": "text", "text": "Notes\n\nParis is in France."},
            {"type": "text", "text": "Atlas\nhttps://a.example\nRome is in Italy."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Call it. Both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Rain"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                     {"type": "text", "text": "And tomorrow?"}]}]


def test_tools_formats_and_thinking_as_chat_fields(tok, thinker):
    kw = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    named = parse_messages(kw | {"tool_choice": {"type": "tool", "name": "get_weather",
                                                 "disable_parallel_tool_use": True}}, tok, tool_parser="hermes")
    assert named.gen.tools.choice == "get_weather" and named.gen.tools.named and not named.gen.tools.parallel
    assert named.gen.tools.tools[0]["function"] == {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                   "description": WEATHER["description"]}
    assert named.gen.params.structured_outputs.structural_tag and named.gen.structured_param == "tools"
    assert parse_messages(kw | {"tool_choice": {"type": "any"}}, tok, tool_parser="hermes").gen.tools.choice == \
        "required"
    assert parse_messages(kw | {"tool_choice": {"type": "none"}}, tok, tool_parser="hermes").gen.tools is None
    assert parse_messages(kw, tok, tool_parser="hermes").gen.tools.choice == "auto"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    for fmt in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                {"output_format": {"type": "json_schema", "schema": schema}}):
        assert parse_messages(kw | fmt, tok, tool_parser="hermes").gen.params.structured_outputs.json == schema
    thinking_tok = load_tokenizer(thinker)
    for tokenizer, budget in ((thinking_tok, 2048), (tok, None)):  # a budget where the model thinks in <think>
        m = parse_messages(kw | {"thinking": {"type": "enabled", "budget_tokens": 2048}}, tokenizer, "hermes")
        assert m.gen.params.thinking_token_budget == budget
    off = parse_messages(kw | {"thinking": {"type": "disabled"}}, tok, "hermes")
    assert off.gen.prompts == parse_request("chat", {"messages": kw["messages"], "tools": kw["tools"] and [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                          "description": WEATHER["description"]}}],
        "chat_template_kwargs": {"enable_thinking": False}}, tok, None, "hermes").prompts


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "a"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "a"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "a"}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBER"}}]}]}, "messages[0].content[0].source"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "f"}}]}]}, "messages[0].content[0].source"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": "x"}]}]},
     "messages[0].content[0].input"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 1},
     "max_completion_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "mcp_servers": [{}]}, "mcp_servers"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "thinking": {"type": "enabled"}},
     "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "thinking": {"type": "on"}}, "thinking.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}],
      "output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "output_config": {"effort": "huge"}},
     "output_config.effort"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature"),
])
def test_bad_bodies_name_the_messages_field(tok, body, param):
    with pytest.raises(APIError) as e:
        parse_messages(body, tok, tool_parser="hermes")
    assert e.value.param == param and e.value.status == 400
    assert error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": e.value.message}}


def test_count_tokens_needs_no_max_tokens_nor_a_tool_parser(tok):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    counted = parse_messages(body, tok, count_only=True)
    assert counted.gen.prompts == parse_messages(body | {"max_tokens": 5}, tok, "hermes").gen.prompts


def counts(prompt: int, cached: int, output: int) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt, num_cached_tokens=cached, num_output_tokens=output)


@pytest.mark.parametrize("finish, stop_reason, expected", [
    ("stop", None, ("end_turn", None)), ("stop", 2, ("end_turn", None)), ("length", None, ("max_tokens", None)),
    ("stop", "\n\n", ("stop_sequence", "\n\n"))])
def test_a_message_says_why_it_stopped_and_counts_as_anthropic(tok, finish, stop_reason, expected):
    m = parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}], "stop_sequences": ["\n\n"]},
                       tok)
    body = m.message("served", Choice("Hello", finish, stop_reason=stop_reason), counts(10, 4, 3))
    Message.model_validate(body)
    assert body["content"] == [{"type": "text", "text": "Hello"}] and body["model"] == "served"
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    assert body["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                             "output_tokens": 3}


def stream_events(m, tokenizer, pieces: list[str], finish_reason: str, stop_reason=None) -> list[dict]:
    """The events of an answer that arrives in `pieces`, as the server sends them."""
    events, answer = MessageEvents(m, "served"), AnswerStream(m.gen, tokenizer)
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        o = StreamOutput(text, 10, i + 1, 4, finish_reason if last else None, stop_reason=stop_reason if last else None)
        reasoning, content, calls, reason = answer.split(o)
        out += events.add(o, reasoning, content)
        if last:
            out += events.finish(Choice("", reason, stop_reason=stop_reason, tool_calls=calls or None), o)
    return out


def accumulate(events: list[dict]) -> dict:
    """The Message a client builds from the events (as the anthropic client's stream helper does)."""
    message = None
    for event in events:
        EVENTS.validate_python(event)
        kind = event["type"]
        if kind == "message_start":
            message = json.loads(json.dumps(event["message"]))
        elif kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            elif delta["type"] == "signature_delta":  # a thinking block's, last
                block["signature"] = delta["signature"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[key] += delta[key]
        elif kind == "message_delta":
            message |= event["delta"]
            message["usage"] |= event["usage"]
    assert events[-1] == {"type": "message_stop"}
    return message


@pytest.mark.parametrize("pieces, parser, reasoning, display", [
    (["Hel", "lo ", "there."], None, None, None),
    (["<think>Two", " and two.</think>", "Four."], None, "deepseek_r1", None),
    (["<think>Two", " and two.</think>", "Four."], None, "deepseek_r1", "omitted"),
    (["Sure. <tool", '_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'], "hermes", None,
     None),
    ([""], None, None, None),
])
def test_a_streams_events_add_up_to_the_whole_message(tok, pieces, parser, reasoning, display):
    body = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    if display:
        body["thinking"] = {"type": "adaptive", "display": display}
    if parser:
        body["tools"] = [WEATHER]
    m = parse_messages(body, tok, tool_parser=parser, reasoning_parser=reasoning)
    text = "".join(pieces)
    whole = m.message("served", make_choice(m.gen, 0, text, "stop", [], None, None, TokenText(tok)),
                      counts(10, 4, len(pieces)))
    Message.model_validate(whole)
    streamed = accumulate(stream_events(m, tok, pieces, "stop"))
    for block in streamed["content"] + whole["content"]:
        block.pop("id", None)  # a tool call's id is drawn fresh each time
        assert len(block.pop("signature", "s" * 32)) == 32  # and a thinking block's signature
    assert streamed == whole
    if parser:
        assert whole["stop_reason"] == "tool_use" and whole["content"][-1]["input"] == {"city": "Paris"}
        assert whole["content"][0] == {"type": "text", "text": "Sure. "}  # vLLM's hermes keeps the space
    if reasoning:
        shown = "" if display == "omitted" else "Two and two."
        assert whole["content"] == [{"type": "thinking", "thinking": shown},
                                    {"type": "text", "text": "Four."}]


def test_count_tokens_render_tools_as_the_request_would(tok):
    """With a parser, count_tokens renders the tools under the request's own tool_choice (so a server that hides
    tools from tool_choice none counts them as the request shows them); max_tokens wins over a tool call as the
    stop reason, as vLLM's."""
    import copy

    from flock.tokenizer import ChatOptions

    hiding = copy.copy(tok)
    hiding.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" \
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    hiding.chat_options = ChatOptions(exclude_tools_when_none=True)
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    counted = parse_messages(body, hiding, "hermes", count_only=True).gen.prompts[0]
    assert counted == parse_messages(body, hiding, "hermes").gen.prompts[0]
    assert hiding.decode(counted).startswith("[get_weather]")
    m = parse_messages(body, tok, "hermes")
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    assert m.stop(Choice("", "length", tool_calls=[call]))["stop_reason"] == "max_tokens"
    assert m.stop(Choice("", "stop", tool_calls=[call]))["stop_reason"] == "tool_use"


def test_system_turns_stay_in_place_unless_the_template_takes_one_only_first():
    """As vLLM: a system turn inside `messages` (Claude Code's reminders) keeps its place where the template takes
    one there, so the turns before it keep their cached prefix; a template that raises on it (Qwen's loop.first
    guard) gets it joined to the leading system prompt."""
    from flock.api.messages import system_first

    loose = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}" \
             "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}"
    assert not system_first(loose) and system_first(strict) and system_first(None)
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "Note."},
                                                {"role": "user", "content": "b"}]}
    assert [m["role"] for m in chat_messages(body, merge_system=False)] == ["system", "user", "system", "user"]
    assert chat_messages(body)[0] == {"role": "system", "content": "Be brief.Note."}
