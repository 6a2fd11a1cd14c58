import json
import re

import pytest

from flock.api.protocol import APIError, chunk_body, encode_messages, make_choice, parse_request, response_body
from flock.engine.text_stream import TextStream
from flock.model import resolve_model
from flock.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def test_completion_body(tok):
    r = parse_request("completion", {"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0,
                                     "stop": "x", "seed": 3}, tok)
    assert r.prompt == "hello" and r.prompt_token_ids == tok.encode("hello", add_special_tokens=True)
    assert (r.params.max_tokens, r.params.temperature, r.params.stop, r.params.seed) == (5, 0.0, ["x"], 3)
    assert parse_request("completion", {"prompt": [[5, 6, 7]]}, tok).prompt_token_ids == [5, 6, 7]
    assert parse_request("completion", {"prompt": "a"}, tok).params.max_tokens == 16


def test_prompt_lists_and_n(tok):
    r = parse_request("completion", {"prompt": ["hello", "a b"], "n": 2, "seed": 7}, tok)
    assert r.prompts == [tok.encode("hello", add_special_tokens=True), tok.encode("a b", add_special_tokens=True)]
    assert r.texts == ["hello", "a b"] and r.n == 2 and r.prompt is None
    pairs = r.engine_requests()  # choice i * n + j is prompt i's sample j, seeded seed + j
    assert [(ids, p.seed) for ids, p in pairs] == [(r.prompts[0], 7), (r.prompts[0], 8), (r.prompts[1], 7),
                                                   (r.prompts[1], 8)]
    assert r.params.seed == 7 and all(p.stop == r.params.stop for _, p in pairs)
    ids = parse_request("completion", {"prompt": [[5, 6], [7]], "n": 3}, tok)
    assert ids.prompts == [[5, 6], [7]] and ids.texts == [None, None]
    assert [p.seed for _, p in ids.engine_requests()] == [None] * 6
    flat = parse_request("completion", {"prompt": [5, 6, 7]}, tok)  # a flat list of ints is one prompt
    assert flat.prompts == [[5, 6, 7]] and flat.prompt_token_ids == [5, 6, 7]
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "n": 128}, tok)
    assert len(chat.engine_requests()) == 128
    with pytest.raises(APIError) as e:
        r.prompt_token_ids  # callers taking a body as one engine request refuse several choices
    assert e.value.param == "n"


def test_penalties_and_biases_as_vllm_names_them(tok):
    r = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5,
                               "frequency_penalty": -0.25, "repetition_penalty": 1.2, "logit_bias": {"7": 100},
                               "min_tokens": 3}, tok)
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -0.25, 1.2, 3)
    assert p.logit_bias == {7: 100.0}


def test_llama_cpp_samplers_on_the_openai_endpoints(tok):
    body = {"prompt": "x", "dry_multiplier": 0.8, "dry_allowed_length": 3, "dry_sequence_breakers": ["\n"],
            "dynatemp_range": 0.5, "typical_p": 0.9, "xtc_probability": 0.3, "top_n_sigma": 2}
    p = parse_request("completion", body, tok).params
    assert (p.dry_multiplier, p.dry_allowed_length, p.dry_sequence_breakers, p.dynatemp_range) == (0.8, 3, ["\n"], 0.5)
    assert (p.typical_p, p.xtc_probability, p.top_n_sigma, p.dry_base) == (0.9, 0.3, 2.0, 1.75)


def test_vllms_guided_fields_of_before_structured_outputs(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for name, kind, value in (("guided_json", "json", schema), ("guided_regex", "regex", "[0-9]+"),
                              ("guided_choice", "choice", ["yes", "no"]), ("guided_grammar", "grammar", 'root ::= "x"')):
        r = parse_request("completion", {"prompt": "x", name: value, "guided_decoding_backend": "outlines"}, tok)
        assert getattr(r.params.structured_outputs, kind) == value
    assert parse_request("completion", {"prompt": "x", "guided_json": '{"type": "string"}'},
                         tok).params.structured_outputs.json == {"type": "string"}
    for body, param in (({"guided_json": schema, "guided_regex": "a"}, "guided_json"),
                        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
                        ({"guided_choice": []}, "guided_choice"), ({"guided_whitespace_pattern": " "},
                                                                   "guided_whitespace_pattern")):
        with pytest.raises(APIError) as e:
            parse_request("completion", {"prompt": "x", **body}, tok)
        assert e.value.param == param


def test_chat_body_uses_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = parse_request("chat", {"messages": msgs, "max_completion_tokens": 4, "stream": True,
                               "stream_options": {"include_usage": True}}, tok, default_max_tokens=None)
    assert r.prompt_token_ids == encode_messages(tok, [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hi"}])
    assert r.params.max_tokens == 4 and r.stream and r.include_usage


def test_vllm_fields(tok):
    """Fields vLLM's server takes: sampling extras, chat template options, tools shown but not called, echo, and
    OpenAI's fields that change nothing generated."""
    user = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    r = parse_request("chat", {"messages": user, "min_p": 0.1, "include_stop_str_in_output": True, "user": "u",
                               "metadata": {"k": "v"}, "store": False, "tool_choice": "none"}, tok)
    assert r.params.min_p == 0.1 and r.params.include_stop_str_in_output
    assert r.prompt_token_ids == encode_messages(tok, [{"role": "user", "content": "a\nb"}])  # parts as vLLM joins
    partial = user + [{"role": "assistant", "content": "The answer is", "name": "bot"}]
    r = parse_request("chat", {"messages": partial, "add_generation_prompt": False, "continue_final_message": True,
                               "echo": True}, tok)
    assert tok.decode(r.prompt_token_ids).endswith("The answer is") and r.texts == ["The answer is"] and r.echo
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_request("chat", {"messages": user, "tools": tools, "tool_choice": "none"}, tok).prompts
    echo = parse_request("chat", {"messages": user, "echo": True}, tok)
    assert echo.texts == [""]  # the answer starts a new message: nothing to echo
    only = parse_request("completion", {"prompt": "a b", "max_tokens": 0, "echo": True, "logprobs": 1}, tok)
    assert only.echo_only and only.params.max_tokens == 1 and only.params.prompt_logprobs == 1
    assert make_choice(only, 0, "c", "length", [7], None, None, None).text == "a b"  # the prompt alone
    asked = parse_request("completion", {"prompt": "a b", "prompt_logprobs": 1}, tok)
    assert make_choice(asked, 0, "", "abort", [], None, None, None).prompt_logprobs is None  # aborted before any


def test_fallback_template_when_tokenizer_has_none(tok):
    saved = tok.chat_template
    tok.chat_template = None
    try:
        ids = encode_messages(tok, [{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = saved
    assert "<|im_start|>assistant" in tok.decode(ids)


@pytest.mark.parametrize("kind,body,param", [
    ("completion", {}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": []}, "prompt"),
    ("completion", {"prompt": ["a", [5, 6]]}, "prompt"),
    ("completion", {"prompt": [[5, 6], []]}, "prompt"),
    ("completion", {"prompt": ["a", ""]}, "prompt"),
    ("completion", {"prompt": [[5, "6"]]}, "prompt"),
    ("completion", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("completion", {"prompt": "a", "temperature": -1}, "temperature"),
    ("completion", {"prompt": "a", "temperature": 2.5}, "temperature"),  # OpenAI's and vLLM's [0, 2]
    ("completion", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt": "a", "n": 0}, "n"),
    ("completion", {"prompt": "a", "n": "2"}, "n"),
    ("completion", {"prompt": "a", "n": 1.5}, "n"),
    ("completion", {"prompt": ["a", "b"], "n": 65}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
    ("completion", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ("completion", {"prompt": "a", "logprobs": -2}, "logprobs"),  # more than max_logprobs: the engine's to refuse
    ("completion", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("completion", {"prompt": "a", "prompt_logprobs": -3}, "prompt_logprobs"),
    ("completion", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ("completion", {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completion", {"prompt": "a", "structured_outputs": {"xml": "a"}}, "structured_outputs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ("completion", {"prompt": "a", "structured_outputs": {"regex": "a", "whitespace_pattern": " ?"}},
     "structured_outputs"),
    ("completion", {"prompt": "a", "structured_outputs": {"regex": "a", "disable_additional_properties": 1}},
     "structured_outputs"),
    ("completion", {"prompt": "a", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("completion", {"prompt": "a", "structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("completion", {"prompt": "a", "top_logprobs": 1}, "top_logprobs"),  # a chat field
    ("chat", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ("completion", {"prompt": "a", "seed": 2**64}, "seed"),
    ("completion", {"prompt": "a", "seed": 2**63 - 1, "n": 2}, "seed"),
    ("completion", {"prompt": "a", "min_p": 1.5}, "min_p"),
    ("completion", {"prompt": "a \ud800"}, None),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f"}}]}, "tool_choice"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f"}}],
              "tool_choice": "required"}, "tool_choice"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": ["f"], "tool_choice": "none"}, "tools[0]"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none"}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
              "continue_final_message": True}, "messages"),
    ("completion", {"prompt": "a", "stop": [1]}, "stop"),
    ("completion", {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ("completion", {"prompt": "a", "frequency_penalty": "x"}, "frequency_penalty"),
    ("completion", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": [1]}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "up"}}, "logit_bias"),
    ("completion", {"prompt": "a", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ("completion", {"prompt": "a", "dry_allowed_length": 1.5}, "dry_allowed_length"),
    ("completion", {"prompt": "a", "dry_base": 0.5}, "dry_base"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_bodies_name_the_parameter(tok, kind, body, param):
    with pytest.raises(APIError) as e:
        parse_request(kind, body, tok)
    assert e.value.param == param and e.value.status == 400
    assert e.value.body()["error"]["message"]


def test_null_fields_count_as_absent(tok):
    """OpenAI's SDKs and proxies send fields Flock does not take as null: ignored, as vLLM ignores them; best_of 1
    on chat too. A field with a value it does not take is still a named error."""
    user = [{"role": "user", "content": "x"}]
    nulls = {"functions": None, "function_call": None, "audio": None, "web_search_options": None, "best_of": None}
    plain = parse_request("chat", {"messages": user}, tok)
    for extra in (nulls, {"best_of": 1}):
        got = parse_request("chat", {"messages": user} | extra, tok)
        assert got.prompts == plain.prompts and got.params == plain.params
    with pytest.raises(APIError) as e:
        parse_request("chat", {"messages": user, "functions": []}, tok)
    assert e.value.param == "functions"


def test_unknown_fields_are_ignored_as_vllm_ignores_them(tok, caplog):
    """A field no API defines (a proxy's, another provider's) is ignored and logged, as vLLM and SGLang ignore
    them; a vLLM or OpenAI field Flock does not run, or a generation field where it does not apply, is refused."""
    from flock.api.embeddings import parse_embeddings

    user = [{"role": "user", "content": "x"}]
    plain = parse_request("chat", {"messages": user}, tok)
    with caplog.at_level("WARNING", logger="flock.api.protocol"):
        got = parse_request("chat", {"messages": user, "provider": {"order": ["a"]}, "enable_thinking": False}, tok)
    assert got.prompts == plain.prompts and got.params == plain.params
    assert "enable_thinking, provider" in caplog.text
    assert parse_embeddings({"input": "x", "encoding_formats": "float"}, tok).prompts
    for kind, body, param in (("completion", {"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds"),
                              ("chat", {"messages": user, "kv_transfer_params": {"do_remote_prefill": True}},
                               "kv_transfer_params"),
                              ("chat", {"messages": user, "watermarking": True}, "watermarking")):
        with pytest.raises(APIError) as e:
            parse_request(kind, body, tok)
        assert e.value.param == param
    with pytest.raises(APIError, match="stream is not supported here") as e:
        parse_embeddings({"input": "x", "stream": True}, tok)


def test_logprobs_a_grammar_rules_out_are_finite_in_json():
    """A token masked to -inf (a grammar, a logit bias) among the top alternatives: -9999.0 in every API shape, as
    vLLM gives it, so that the body stays JSON (no -Infinity)."""
    from flock.api.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
    from flock.api.sglang import NativeRequest, _logprobs
    from flock.sample.logprobs import TokenLogprobs

    text = TokenText(type("Tok", (), {"decode": staticmethod(lambda ids: f"<{ids[0]}>")})())
    entries = [TokenLogprobs(7, -0.5, 1, [(7, -0.5), (3, float("-inf"))]), TokenLogprobs(3, float("-inf"), 2, [])]
    bodies = [completion_logprobs(text, [7, 3], entries), chat_logprobs(text, entries),
              prompt_logprobs(text, [1, 7, 3], [None, *entries]),
              _logprobs(NativeRequest(True, [], [], top_logprobs_num=2), [1, 7, 3], entries, [None, *entries], text)]
    for body in bodies:
        dumped = json.dumps(body, allow_nan=False)
        assert "-9999.0" in dumped


def test_response_shapes():
    u = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert response_body("completion", "id", "m", [("ab", "stop")], u)["choices"][0]["text"] == "ab"
    assert response_body("chat", "id", "m", [("ab", "length")], u)["choices"][0]["message"]["content"] == "ab"
    two = response_body("chat", "id", "m", [("a", "stop"), ("b", "length")], u)["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in two] == [(0, "a", "stop"),
                                                                                      (1, "b", "length")]
    assert chunk_body("chat", "id", "m", "a", None, 0, first=True)["choices"][0]["delta"]["role"] == "assistant"
    assert chunk_body("completion", "id", "m", "a", None, 0, index=3)["choices"][0]["index"] == 3
    assert chunk_body("chat", "id", "m", "", None, 0, usage_=u)["choices"] == []


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    s = TextStream(stop=["END"])
    assert s.delta("abcE", False) == "ab"
    assert s.delta("abcEN\ufffd", False) == "cE"
    assert s.delta("abcENDx", True) == "NDx"
    plain = TextStream(stop=[])
    assert plain.delta("a\ufffd", False) == "a" and plain.delta("a\u00e9", True) == "\u00e9"


def test_add_special_tokens_reaches_the_tokenizer():
    class Recording:
        def encode(self, text, add_special_tokens):
            return [1, 5] if add_special_tokens else [5]

    assert parse_request("completion", {"prompt": "a"}, Recording()).prompts == [[1, 5]]
    assert parse_request("completion", {"prompt": "a", "add_special_tokens": False}, Recording()).prompts == [[5]]


def test_chat_add_special_tokens_adds_them_to_the_template(tmp_path):
    from tests.model.gguf_files import write_spm_gguf

    spm = load_tokenizer(write_spm_gguf(tmp_path / "spm.gguf"))  # adds a BOS; the fallback template does not
    chat = {"messages": [{"role": "user", "content": "the cat"}]}
    plain = parse_request("chat", chat, spm).prompts[0]
    assert parse_request("chat", chat | {"add_special_tokens": True}, spm).prompts[0] == [spm.bos_token_id] + plain


def test_vllm_fields_at_their_neutral_values_documents_and_reasoning_effort(tok):
    """vLLM's request_id, use_beam_search (n beams, length_penalty), priority, modalities at the value Flock runs
    (others refused by name), spaces_between_special_tokens (fast tokenizers ignore it); `documents` and
    `reasoning_effort` reach the chat template as vLLM hands them (reasoning_effort "none" sets enable_thinking
    false unless it is given)."""
    import copy

    neutral = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "spaces_between_special_tokens": False,
               "request_id": "abc", "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "u",
               "prediction": {"type": "content", "content": "b"}, "verbosity": "low"}
    assert parse_request("completion", {"prompt": "a"} | neutral, tok).request_id == "abc"
    beams = parse_request("completion", {"prompt": "a", "use_beam_search": True, "n": 3, "length_penalty": 0.5}, tok)
    assert (beams.beam.beam_width, beams.beam.length_penalty, beams.beam.max_tokens) == (3, 0.5, 16)
    assert parse_request("chat", {"messages": [{"role": "user", "content": "q"}], "use_beam_search": True},
                         tok, None).beam.max_tokens == 0  # up to the context, as a chat without max_tokens
    assert parse_request("completion", {"prompt": "a", "priority": -3}, tok).params.priority == -3
    for name, value in (("modalities", ["text", "audio"]),):
        with pytest.raises(APIError, match=re.escape(f"{name}={value!r} is not supported")) as e:
            parse_request("completion", {"prompt": "a", name: value}, tok)
        assert e.value.param == name
    shown = copy.copy(tok)
    shown.chat_template = ("{% for d in documents %}<{{ d['title'] }}>{% endfor %}{{ enable_thinking }} "
                           "{{ reasoning_effort }}|{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = {"messages": [{"role": "user", "content": "q"}], "documents": [{"title": "A"}, {"title": "B"}],
            "reasoning_effort": "none"}
    assert tok.decode(parse_request("chat", chat, shown).prompts[0]) == "<A><B>False none|q"
    kept = chat | {"chat_template_kwargs": {"enable_thinking": True}}
    assert tok.decode(parse_request("chat", kept, shown).prompts[0]) == "<A><B>True none|q"
    with pytest.raises(APIError) as e:
        parse_request("chat", chat | {"reasoning_effort": "extreme"}, shown)
    assert e.value.param == "reasoning_effort"
    off = parse_request("chat", {"messages": chat["messages"], "reasoning_effort": "none"}, tok, None, None, "qwen3")
    assert off.reasoning is None  # as chat_template_kwargs.enable_thinking false


def test_return_tokens_as_token_ids(tok):
    """vLLM's return_tokens_as_token_ids: every logprobs token (chosen, alternatives, prompt's) as "token_id:N"."""
    from flock.api.logprobs import TokenText
    from flock.sample.logprobs import TokenLogprobs

    gen = parse_request("completion", {"prompt": [5, 6], "logprobs": 1, "return_tokens_as_token_ids": True}, tok)
    entry = TokenLogprobs(token_id=9, logprob=-0.5, rank=1, top=[(9, -0.5), (4, -1.5)])
    choice = make_choice(gen, 0, tok.decode([9]), "length", [9], [entry], None, TokenText(tok))
    assert choice.logprobs["tokens"] == ["token_id:9"]
    assert choice.logprobs["top_logprobs"] == [{"token_id:9": -0.5, "token_id:4": -1.5}]
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1,
                                  "return_tokens_as_token_ids": True}, tok)
    shaped = make_choice(chat, 0, "y", "stop", [9], [entry], None, TokenText(tok)).logprobs["content"][0]
    assert shaped["token"] == "token_id:9" and shaped["top_logprobs"][1]["token"] == "token_id:4"


def test_logprob_token_ids_need_logprobs(tok):
    """vLLM's: chat needs logprobs true, completions a logprobs count; not with beams or an echo of max_tokens 0."""
    chat = {"messages": [{"role": "user", "content": "x"}], "logprob_token_ids": [5, 9]}
    assert parse_request("chat", chat | {"logprobs": True}, tok).params.logprob_token_ids == [5, 9]
    assert parse_request("completion", {"prompt": "a", "logprobs": 0, "logprob_token_ids": [3]},
                         tok).params.logprob_token_ids == [3]
    for kind, body in [("chat", chat), ("completion", {"prompt": "a", "logprob_token_ids": [3]}),
                       ("completion", {"prompt": "a", "use_beam_search": True, "logprob_token_ids": [3]}),
                       ("completion", {"prompt": "a", "logprobs": 1, "echo": True, "max_tokens": 0,
                                       "logprob_token_ids": [3]}),
                       ("chat", chat | {"logprobs": True, "logprob_token_ids": [1, "2"]})]:
        with pytest.raises(APIError) as e:
            parse_request(kind, body, tok)
        assert e.value.param == "logprob_token_ids", body


def test_stream_interval(tok):
    assert parse_request("completion", {"prompt": "a", "stream_interval": 4}, tok).params.stream_interval == 4
    for bad in (0, "2", 1.5):
        with pytest.raises(APIError) as e:
            parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "stream_interval": bad}, tok)
        assert e.value.param == "stream_interval"


def test_developer_messages_become_one_first_system_message_where_the_template_has_no_developer_role(tok):
    """As vLLM: a template that never names "developer" gets the developer text as its system message (merged with
    any system messages, first), not a role it does not know beside its default system prompt."""
    user = {"role": "user", "content": "hi"}
    dev = parse_request("chat", {"messages": [{"role": "developer", "content": "Answer in French."}, user]}, tok)
    assert dev.prompts[0] == encode_messages(tok, [{"role": "system", "content": "Answer in French."}, user])
    mixed = [{"role": "system", "content": "A."}, user,
             {"role": "developer", "content": [{"type": "text", "text": "B."}]}]
    assert parse_request("chat", {"messages": mixed}, tok).prompts[0] == encode_messages(
        tok, [{"role": "system", "content": "A.\n\nB."}, user])
    import copy

    knows = copy.copy(tok)
    knows.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}{# 'developer' #}"
    assert tok.decode(parse_request("chat", {"messages": mixed}, knows).prompts[0]) == "system:A.;user:hi;developer:B.;"


def test_text_like_content_parts_read_as_text(tok):
    """vLLM's text parts: input_text and output_text (the Responses API's), refusal and thinking, each its text."""
    parts = [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"},
             {"type": "refusal", "refusal": "c"}, {"type": "thinking", "thinking": "d"}]
    got = parse_request("chat", {"messages": [{"role": "user", "content": parts}]}, tok)
    assert got.prompts[0] == encode_messages(tok, [{"role": "user", "content": "a\nb\nc\nd"}])
    with pytest.raises(APIError) as e:
        parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "refusal", "text": "c"}]}]}, tok)
    assert e.value.param == "messages[0].content"


def test_vllm_request_fields_at_their_defaults_and_stream_limits(tok):
    """What a client serializing vLLM's request models sends (its fields at their defaults) is accepted; other
    values are refused by name; prompt_logprobs (but 0) with stream, and max_tokens beyond max_model_len, are 400s
    as in vLLM."""
    user = [{"role": "user", "content": "x"}]
    defaults = {"vllm_xargs": {}, "session_id": "s", "return_token_offsets": False, "mm_payload": "tensors",
                "return_mm_kwargs": False, "routed_experts_prompt_start": 0}
    plain = parse_request("chat", {"messages": user}, tok)
    chat = parse_request("chat", {"messages": user, "return_prompt_text": False, "mm_processor_kwargs": {},
                                  "media_io_kwargs": {}} | defaults, tok)
    assert chat.prompts == plain.prompts and chat.params == plain.params
    assert parse_request("completion", {"prompt": "a"} | defaults, tok).prompts
    for kind, body, param in (("completion", {"prompt": "a", "vllm_xargs": {"k": 1}}, "vllm_xargs"),
                              ("chat", {"messages": user, "mm_processor_kwargs": {"max_pixels": 9}},
                               "mm_processor_kwargs"),
                              ("completion", {"prompt": "a", "return_prompt_text": False}, "return_prompt_text"),
                              ("completion", {"prompt": "a", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
                              ("chat", {"messages": user, "stream": True, "prompt_logprobs": -1}, "prompt_logprobs")):
        with pytest.raises(APIError) as e:
            parse_request(kind, body, tok)
        assert e.value.param == param
    assert parse_request("completion", {"prompt": "a", "stream": True, "prompt_logprobs": 0}, tok).stream
    for body, param in (({"messages": user, "max_tokens": 65}, "max_tokens"),
                        ({"messages": user, "max_tokens": 1, "max_completion_tokens": 65}, "max_completion_tokens")):
        gen = parse_request("chat", body, tok)
        with pytest.raises(APIError, match="cannot be greater than max_model_len=64") as e:
            gen.fit(64)
        assert e.value.param == param
    parse_request("chat", {"messages": user, "max_tokens": 64}, tok).fit(64)
    for field in ("max_tokens", "max_completion_tokens"):  # the error names the field the client sent
        with pytest.raises(APIError, match=f"^{field} must be a positive integer") as e:
            parse_request("chat", {"messages": user, field: 0}, tok)
        assert e.value.param == field
    parse_request("completion", {"prompt": "a"}, tok, default_max_tokens=16).fit(8)  # a default is not refused


def test_null_content_reaches_the_template_as_empty_text(tok):
    """As vLLM: an assistant turn of tool calls with content null renders in templates that test `content is none`
    and otherwise concatenate it (the message reaches them with "" rather than without a content)."""
    import copy

    strict = copy.copy(tok)
    strict.chat_template = ("{% for m in messages %}{% if m['content'] is none %}N{% else %}{{ 'X' + m['content'] }}"
                            "{% endif %};{% endfor %}")
    calls = [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    ids = encode_messages(strict, messages, add_generation_prompt=False)
    assert strict.decode(ids) == "Xq;X;Xx;"


def test_structured_outputs_take_vllm_s_whole_dataclass(tok):
    """A client that sends every field of vLLM's StructuredOutputsParams (nulls and defaults) gets the one it set."""
    body = {"prompt": "a", "structured_outputs": {
        "json": None, "regex": "ab?", "choice": None, "grammar": None, "json_object": None, "structural_tag": None,
        "disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}}
    spec = parse_request("completion", body, tok).params.structured_outputs
    assert spec.kind == "regex" and spec.regex == "ab?" and spec.disable_any_whitespace is False


@pytest.mark.parametrize("keep_eos", [False, True])
def test_beam_choices_leave_the_eos_out_and_fit_the_context(tok, keep_eos):
    """As vLLM's server: a beam's EOS is never in its text, in its ids only with include_stop_str_in_output; ids
    come back with return_token_ids; max_tokens is cut to what max_model_len leaves after the prompt."""
    from flock.api.logprobs import TokenText
    from flock.sample.logprobs import TokenLogprobs

    eos = tok.eos_token_id
    gen = parse_request("completion", {"prompt": [5] * 60, "n": 2, "max_tokens": 100, "use_beam_search": True,
                                       "return_token_ids": True, "include_stop_str_in_output": keep_eos,
                                       "skip_special_tokens": False}, tok)
    search, = gen.beam_searches(64, [eos])
    assert search.params.max_tokens == 4  # the beams end with "length" at the context, not with an error
    search.advance([TokenLogprobs(eos, -0.1, 1, [(eos, -0.1), (7, -0.5), (8, -1.0), (9, -3.0)])])
    choices, usage_ = gen.beam_choices([search], TokenText(tok))
    assert [c.finish_reason for c in choices] == ["stop", "length"] and choices[0].text == ""
    assert choices[0].token_ids == ([eos] if keep_eos else []) and choices[1].token_ids == [7]
    assert choices[0].prompt_token_ids == [5] * 60 and choices[0].stop_reason == eos
    assert usage_["completion_tokens"] == 1 + keep_eos
