"""The Responses API's parts without a server: bodies as chat requests, answers as output items, a stream's
events adding up to the whole answer's Response, the store's conversations."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from flock.api.answer_stream import AnswerStream
from flock.api.logprobs import TokenText, chat_logprobs
from flock.api.protocol import APIError, Choice, make_choice, parse_request
from flock.api.responses import ResponseEvents, ResponseStore, parse_responses
from flock.engine.async_engine import StreamOutput
from flock.model import resolve_model
from flock.sample.logprobs import TokenLogprobs
from flock.tokenizer import load_tokenizer

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def test_a_body_is_the_chat_request_vllm_makes_of_it(tok):
    r = parse_responses({"model": "m", "input": "Hi there", "instructions": "Be brief.", "max_output_tokens": 7,
                         "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 4, "stop": ["x"]}, tok)
    chat = parse_request("chat", {"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi there"}]}, tok)
    assert r.gen.prompts == chat.prompts and r.gen.kind == "chat" and r.gen.n == 1
    p = r.gen.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k, p.stop) == (7, 0.5, 0.9, 3, 4, ["x"])
    assert r.messages == [{"role": "user", "content": "Hi there"}]  # instructions do not carry over
    assert parse_responses({"input": "a"}, tok).gen.params.max_tokens is None
    effort = parse_responses({"input": "a", "reasoning": {"effort": "low"}}, tok)
    assert effort.gen.prompts == parse_request("chat", {"messages": [{"role": "user", "content": "a"}],
                                                        "reasoning_effort": "low"}, tok).prompts
    auto = parse_responses({"input": "a", "truncation": "auto"}, tok)
    assert auto.gen.params.truncate_prompt_tokens == -1


def test_input_items_become_the_messages_of_earlier_turns(tok):
    items = [{"type": "message", "role": "developer", "content": "Use tools."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Call it."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
             {"type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Sunny in Paris.", "annotations": []}]}]
    r = parse_responses({"input": items}, tok)
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for c, city in (("c1", "Paris"), ("c2", "Rome"))]
    assert r.messages == [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"},
        {"role": "assistant", "content": "Sunny in Paris."}]
    partial = parse_responses({"input": [{"role": "user", "content": "Count"},
                                         {"role": "assistant", "content": "1, 2,", "status": "incomplete"}]}, tok)
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "Count"},
                                               {"role": "assistant", "content": "1, 2,"}],
                                  "add_generation_prompt": False, "continue_final_message": True}, tok)
    assert partial.gen.prompts == chat.prompts
    # instructions and a developer message: one first system message, as the chat path (and vLLM) merges them
    merged = parse_responses({"instructions": "I", "input": [{"role": "developer", "content": "D"},
                                                              {"role": "user", "content": "u"}]}, tok)
    chat = parse_request("chat", {"messages": [{"role": "system", "content": "I\n\nD"},
                                               {"role": "user", "content": "u"}]}, tok)
    assert merged.gen.prompts == chat.prompts


def test_an_incomplete_answer_after_its_reasoning_is_continued(tok):
    """vLLM resumes an assistant message in progress or incomplete, also after its reasoning item."""
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}
    cut = {"type": "message", "role": "assistant", "status": "incomplete",
           "content": [{"type": "output_text", "text": "1, 2,"}]}
    for items in ([cut], [thought, cut]):
        ids = parse_responses({"input": [{"role": "user", "content": "Count"}, *items]}, tok).gen.prompts[0]
        assert tok.decode(ids).endswith("1, 2,"), items


def test_tools_formats_and_logprobs_as_chat_fields(tok):
    r = parse_responses({"input": "Weather in Paris?", "tools": [WEATHER],
                         "tool_choice": {"type": "function", "name": "get_weather"},
                         "include": ["message.output_text.logprobs"]}, tok, tool_parser="hermes")
    assert r.gen.tools.choice == "get_weather" and r.gen.tools.named and r.gen.params.logprobs == 0
    assert r.gen.tools.tools[0]["function"]["parameters"] == WEATHER["parameters"]
    assert r.gen.params.structured_outputs.structural_tag and r.gen.structured_param == "tools"
    fmt = {"type": "json_schema", "name": "c", "schema": {"type": "object"}, "strict": True}
    r = parse_responses({"input": "a", "text": {"format": fmt}, "top_logprobs": 3}, tok)
    assert r.gen.params.structured_outputs.json == {"type": "object"} and r.gen.params.logprobs == 3
    assert parse_responses({"input": "a", "text": {"format": {"type": "json_object"}}},
                           tok).gen.params.structured_outputs.json_object


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "messages": []}, "messages"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),  # text-only
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "a", "max_output_tokens": "7"}, "max_output_tokens"),
    ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "a", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "a", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "a", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "a", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "a", "background": True}, "background"),
    ({"input": "a", "include": ["file_search_call.results"]}, "include"),
    ({"input": "a", "truncation": "sometimes"}, "truncation"),
    ({"input": "a", "top_logprobs": -2}, "top_logprobs"),
])
def test_bad_bodies_name_the_responses_field(tok, body, param):
    with pytest.raises(APIError) as e:
        parse_responses(body, tok, tool_parser="hermes")
    assert e.value.param == param and e.value.status == 400


def test_previous_response_id_needs_a_stored_response(tok):
    with pytest.raises(APIError) as e:
        parse_responses({"input": "a", "previous_response_id": "resp_gone"}, tok)
    assert (e.value.param, e.value.status) == ("previous_response_id", 404)


def test_the_store_continues_a_conversation_and_forgets_the_oldest(tok):
    store = ResponseStore(capacity=2)
    first = parse_responses({"input": "Hi", "instructions": "Be brief."}, tok)
    answer = Choice("Hello!", "stop", reasoning="Greet.", tool_calls=None)
    store.put(first, first.response("m", answer, _Final(5, 3)))
    history = store.history(first.id)
    assert history == [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
    second = parse_responses({"input": "Bye", "previous_response_id": first.id}, tok, history=history)
    assert second.messages == history + [{"role": "user", "content": "Bye"}] and first.messages[-1]["content"] == "Hi"
    unstored = parse_responses({"input": "x", "store": False}, tok)
    store.put(unstored, unstored.response("m", answer, _Final(1, 1)))
    assert store.get(unstored.id) is None
    for r in (second, parse_responses({"input": "z"}, tok)):
        store.put(r, r.response("m", answer, _Final(1, 1)))
    assert store.get(first.id) is None and store.history(first.id) is None and store.get(second.id)
    assert store.delete(second.id) and not store.delete(second.id)
    many = parse_responses({"input": [{"role": "user", "content": f"q{i}"} for i in range(4)]
                            + [{"role": "assistant", "content": "a4"}]}, tok)
    store.put(many, many.response("m", answer, _Final(1, 1)))
    page = store.input_items(many.id, "asc", limit=2)
    text = lambda items: [i["content"][0]["text"] for i in items]  # noqa: E731 (string contents listed as parts)
    assert text(page["data"]) == ["q0", "q1"] and page["has_more"]
    assert page["data"][0]["content"] == [{"type": "input_text", "text": "q0"}]
    rest = store.input_items(many.id, "asc", limit=10, after=page["last_id"])
    assert text(rest["data"]) == ["q2", "q3", "a4"] and not rest["has_more"]
    assert rest["data"][-1]["content"] == [{"type": "output_text", "text": "a4", "annotations": []}]
    assert text(store.input_items(many.id)["data"])[0] == "a4"  # newest first by default


class _Final:
    def __init__(self, prompt: int, output: int, cached: int = 0):
        self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens = prompt, output, cached


ANSWERS = [  # (answer text, reasoning parser, tool parser, finish reason)
    ("Paris is sunny today.", None, None, "stop"),
    ("Paris is sunny", None, None, "length"),
    ("<think>The user wants weather.</think>Let me check.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "deepseek_r1", "hermes", "stop"),
    ("Still thinking about it", "deepseek_r1", None, "length"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', None, "hermes", "stop"),
    ("", None, None, "stop"),
]


@pytest.mark.parametrize("answer, reasoning, tools, finish", ANSWERS)
@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_stream_adds_up_to_the_whole_response(tok, answer, reasoning, tools, finish, step, logprobs):
    """The events are OpenAI's types; the last one's Response equals the one a whole answer gets, item ids and
    logprobs included; each item's deltas add up to its text."""
    body = {"input": "Weather in Paris?", "tools": [WEATHER] if tools else None, "top_logprobs": 2 if logprobs else 0}
    req = parse_responses({k: v for k, v in body.items() if v is not None}, tok, tools, reasoning)
    ids = tok.encode(answer, add_special_tokens=False)
    entries = [TokenLogprobs(t, -0.5, 1, [(t, -0.5), (t + 1, -2.0)]) for t in ids] if logprobs else None
    text = TokenText(tok)
    choice = make_choice(req.gen, 0, tok.decode(ids), finish, ids, entries, None, text)
    whole = req.whole("m", choice, _Final(9, len(ids)), ids, tok)
    Response.model_validate(whole)

    events, split = ResponseEvents(req, "m"), AnswerStream(req.gen, tok)
    sent = events.start()
    for at in range(0, max(len(ids), 1), step):
        last = at + step >= len(ids)
        chunk = ids[at : at + step]
        out = StreamOutput(tok.decode(ids[: at + step]).removeprefix(tok.decode(ids[:at])), 9, at + len(chunk),
                           finish_reason=finish if last else None, token_ids=chunk,
                           logprobs=entries[at : at + step] if logprobs else None)
        r, c, calls, reason = split.split(out)
        shaped = chat_logprobs(text, out.logprobs)["content"] if out.logprobs else None
        sent += events.add(r, c, shaped, split.answer_start)
        if last:
            streamed = Choice(events.content, reason, tool_calls=calls or None, reasoning=events.reasoning,
                              reasoning_tokens=split.reasoning_tokens)
            sent += events.finish(streamed, out, split.answer_start, logprobs)
    for e in sent:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert sent[0]["type"] == "response.created" and sent[-1]["type"] == "response.completed"
    assert _without_call_ids(sent[-1]["response"]) == _without_call_ids(whole)  # call ids are drawn per parse
    assert whole["status"] == ("incomplete" if finish == "length" else "completed")
    deltas = {}
    for e in sent:
        if e["type"].endswith("_text.delta") or e["type"].endswith("arguments.delta"):
            deltas[e["item_id"]] = deltas.get(e["item_id"], "") + e["delta"]
    for item in whole["output"]:
        full = item["arguments"] if item["type"] == "function_call" else \
            "".join(part["text"] for part in item["content"])
        assert deltas.get(item["id"], "") == full
    if logprobs and any(item["type"] == "message" for item in whole["output"]):
        message = next(item for item in whole["output"] if item["type"] == "message")
        streamed = [lp for e in sent if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
        assert streamed == message["content"][0]["logprobs"][: len(streamed)]


def _without_call_ids(response: dict) -> dict:
    return response | {"output": [item | {"call_id": None} for item in response["output"]]}


def test_output_items_of_a_thinking_tool_calling_answer(tok):
    req = parse_responses({"input": "Weather in Paris?", "tools": [WEATHER], "top_logprobs": 1}, tok, "hermes",
                          "deepseek_r1")
    answer = ANSWERS[2][0]
    ids = tok.encode(answer, add_special_tokens=False)
    entries = [TokenLogprobs(t, -0.5, 1, [(t, -0.5)]) for t in ids]
    choice = make_choice(req.gen, 0, answer, "stop", ids, entries, None, TokenText(tok))
    out = req.whole("m", choice, _Final(9, len(ids), 4), ids, tok)
    kinds = [item["type"] for item in out["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    thinking, message, call = out["output"]
    assert thinking["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert message["content"][0]["text"] == "Let me check.\n"  # vLLM's hermes keeps the whitespace
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Paris"},
                                                                             "completed")
    start = len(tok.encode("<think>The user wants weather.</think>", add_special_tokens=False))
    assert tok.decode([t for t in ids[start:]]).startswith("Let me")
    assert len(message["content"][0]["logprobs"]) == len(ids) - start  # the answer's tokens, not the thinking's
    usage = out["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == choice.reasoning_tokens > 0
    assert (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]) == (9, 4)
    capped = parse_responses({"input": "a", "tools": [WEATHER], "max_tool_calls": 0}, tok, "hermes")
    assert [i["type"] for i in capped.items(None, None, choice.tool_calls, None)] == ["message"]
