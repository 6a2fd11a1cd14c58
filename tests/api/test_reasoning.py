import pytest

from flock.api.reasoning import REASONING_PARSERS, ReasoningStream

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("Two and two.</think>\n\nFour.", "Two and two.", "\n\nFour."),  # the template opened the thinking
    ("Still thinking <thi", "Still thinking <thi", None),  # never closed: all reasoning
    ("<think>Done.</think>", "Done.", None),
    ("", "", None),
])
def test_thinking_splits_as_vllms_deepseek_r1_parser(text, reasoning, content):
    assert R1.split(text) == (reasoning, content)
    assert QWEN3.split(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("Call it.<tool_call>{}</tool_call>", "Call it.", "<tool_call>{}</tool_call>"),  # the call ends the thinking
    ("a</think>b<tool_call>{}</tool_call>", "a", "b<tool_call>{}</tool_call>"),
    ("<think>a<tool_call>x</think>", "a", "<tool_call>x</think>"),
])
def test_qwen3_thinking_ends_at_a_tool_call_too(text, reasoning, content):
    assert QWEN3.split(text) == (reasoning, content)


@pytest.mark.parametrize("text", ["<think>Two and two.</think>Four.", "Two and two.</think>\n\nFour.",
                                  "Still thinking <thi", "<thi", "a</thinkx</think>b<think>c", "</think>",
                                  "a<tool_cal <tool_call>{}</tool_call>", "x<tool_call"])
@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_a_stream_splits_as_the_whole_answer(text, step, fmt):
    """Deltas of any size add up to the whole answer's reasoning and content; nothing that could be a tag goes
    out before it is known."""
    stream, reasoning, content = ReasoningStream(fmt), "", ""
    for at in range(0, len(text), step):
        r, c = stream.delta(text[at : at + step], finished=at + step >= len(text))
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content or None) == fmt.split(text)


def test_reasoning_tokens_are_those_of_the_thinking():
    from flock.api.reasoning import reasoning_token_count
    from flock.model import resolve_model
    from flock.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("flock/tiny").folder)
    for text, thinking in [("<think>ab cd</think>Yes", "ab cd"), ("ab cd</think>", "ab cd"), ("never closed", None),
                           ("</think>x", "")]:
        ids = tok.encode(text, add_special_tokens=False)
        expected = len(ids) if thinking is None else len(tok.encode(thinking, add_special_tokens=False))
        assert reasoning_token_count(tok, ids, R1) == expected
    ids = tok.encode("ab cd<tool_call>x", add_special_tokens=False)
    assert reasoning_token_count(tok, ids, QWEN3) == len(tok.encode("ab cd", add_special_tokens=False))


def test_thinking_then_tool_calls_in_a_choice():
    from flock.api.logprobs import TokenText
    from flock.api.protocol import make_choice, parse_request
    from flock.api.tools import ToolCalling
    from flock.model import resolve_model
    from flock.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("flock/tiny").folder)
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": [now], "tool_choice": "required"}
    gen = parse_request("chat", body, tok, None, "hermes", "deepseek_r1")
    assert gen.reasoning and gen.params.structured_outputs.after == "</think>"  # thinking first, then the calls
    answer = 'ab</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    c = make_choice(gen, 0, answer, "stop", tok.encode(answer, add_special_tokens=False), None, None, TokenText(tok))
    assert (c.reasoning, c.text, c.finish_reason) == ("ab", "", "tool_calls") and c.tool_calls[0]["function"][
        "name"] == "now"
    assert c.reasoning_tokens == len(tok.encode("ab", add_special_tokens=False))
    assert isinstance(gen.tools, ToolCalling)
    closed = parse_request("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content":
                           "<think>ab</think>"}], "continue_final_message": True, "add_generation_prompt": False},
                           tok, None, None, "deepseek_r1")
    assert not closed.reasoning  # the prompt closed the thinking: the answer is content
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_request("chat", chat, tok, None, None, "qwen3").reasoning is QWEN3
    off = chat | {"chat_template_kwargs": {"enable_thinking": False}}
    assert parse_request("chat", off, tok, None, None, "qwen3").reasoning is None  # as vLLM's qwen3 parser
    from flock.api.protocol import reasoning_usage

    assert reasoning_usage(parse_request("chat", off, tok, None, None, "qwen3"), []) == 0  # still reported
    assert reasoning_usage(parse_request("chat", chat, tok, None, None, None), []) is None
    assert not parse_request("chat", chat, tok, None, None, "qwen3").params.skip_special_tokens  # </think> kept
    assert parse_request("chat", off, tok, None, None, "deepseek_r1").reasoning is R1


def test_only_the_answers_own_turn_says_whether_it_thinks():
    """An earlier turn's closed thinking (a tool-calling turn before a tool result) says nothing of the answer's:
    only the text after the prompt's last special token (a turn's header) counts, however long the turns are."""
    from flock import LLM
    from flock.api.reasoning import thinking_open

    tok = LLM("flock/tiny", load_format="dummy").get_tokenizer()
    turn = [tok.eos_token_id]  # a special token, as a turn's header is
    earlier = tok.encode("<think>I should call.</think> call", add_special_tokens=False)
    for result in ("12:00", "a long tool result " * 20):
        assert thinking_open(tok, earlier + turn + tok.encode(result, add_special_tokens=False) + turn)
    assert not thinking_open(tok, earlier + turn + tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert thinking_open(tok, turn + tok.encode("<think>\n", add_special_tokens=False))


def test_reasoning_over_the_api():
    """With --reasoning-parser the thinking comes back as message.reasoning (streamed as delta.reasoning); a
    grammar applies only after it (the random model never ends its thinking, so its answer stays reasoning);
    include_reasoning false hides the thinking, its logprobs too; --enable-force-include-usage ends every stream
    with its usage."""
    import openai

    from bench.harness.server_process import ServerProcess

    with ServerProcess("--model", "flock/tiny", "--reasoning-parser", "deepseek_r1", "--enable-force-include-usage",
                       env={"OMP_NUM_THREADS": "1"}) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="flock/tiny", messages=[{"role": "user", "content": "Yes?"}], max_tokens=12, temperature=0,
                  extra_body={"structured_outputs": {"regex": r"Yes\."}, "ignore_eos": True})
        whole = client.chat.completions.create(**kw)
        message = whole.choices[0].message.model_dump()
        assert message["reasoning"] and message["reasoning"] != "Yes." and message["content"] is None
        assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens == 12
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
        chunks = list(client.chat.completions.create(stream=True, **kw))  # no stream_options: usage all the same
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
        deltas = [c.choices[0].delta.model_dump() for c in chunks[:-1]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
        assert not any(d.get("content") for d in deltas)
        hidden = kw | {"extra_body": kw["extra_body"] | {"include_reasoning": False}, "logprobs": True}
        choice = client.chat.completions.create(**hidden).choices[0]
        assert choice.message.content is None and choice.logprobs is None
        assert choice.message.model_dump().get("reasoning") is None


def test_offline_structured_outputs_wait_for_the_thinking():
    """vLLM's LLM(reasoning_parser=...) (or in structured_outputs_config): the grammar applies after the thinking a
    prompt leaves open, from the first token with enable_in_reasoning, or where the prompt closed the thinking."""
    from dataclasses import replace

    from flock import LLM, SamplingParams, StructuredOutputsParams

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="Yes"))
    plain = LLM("flock/tiny", load_format="dummy")
    assert plain._after_thinking(params, [1, 2]) is params
    for llm in (LLM("flock/tiny", load_format="dummy", reasoning_parser="deepseek_r1"),
                LLM("flock/tiny", load_format="dummy", structured_outputs_config={"reasoning_parser": "qwen3"})):
        tok = llm.get_tokenizer()
        assert llm._after_thinking(params, tok.encode("Q?")).structured_outputs.after == "</think>"
        assert llm._after_thinking(params, tok.encode("<think>a</think>")) is params
        out = llm.generate("Q?", replace(params, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert out.text != "Yes"  # the random model never ends its thinking: the grammar never starts
    eager = LLM("flock/tiny", load_format="dummy", structured_outputs_config={
        "reasoning_parser": "deepseek_r1", "enable_in_reasoning": True, "backend": "xgrammar"})
    assert eager._after_thinking(params, [1, 2]) is params
    import pytest

    for bad in ({"backend": "outlines"}, {"whitespace": 1}):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            LLM("flock/tiny", load_format="dummy", structured_outputs_config=bad)
    with pytest.raises(ValueError, match="reasoning_parser"):
        LLM("flock/tiny", load_format="dummy", reasoning_parser="nope")
