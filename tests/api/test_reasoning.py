import pytest

from flock.api.reasoning import ReasoningStream, split_reasoning


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("Two and two.</think>\n\nFour.", "Two and two.", "\n\nFour."),  # the template opened the thinking
    ("Still thinking <thi", "Still thinking <thi", None),  # never closed: all reasoning
    ("<think>Done.</think>", "Done.", None),
    ("", "", None),
])
def test_thinking_splits_as_vllms_deepseek_r1_parser(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text", ["<think>Two and two.</think>Four.", "Two and two.</think>\n\nFour.",
                                  "Still thinking <thi", "<thi", "a</thinkx</think>b<think>c", "</think>"])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_a_stream_splits_as_the_whole_answer(text, step):
    """Deltas of any size add up to the whole answer's reasoning and content; nothing that could be a tag goes
    out before it is known."""
    stream, reasoning, content = ReasoningStream(), "", ""
    for at in range(0, len(text), step):
        r, c = stream.delta(text[at : at + step], finished=at + step >= len(text))
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content or None) == split_reasoning(text)


def test_reasoning_and_tool_calls_over_the_api():
    """With --reasoning-parser the thinking comes back as message.reasoning (streamed as delta.reasoning), the
    rest as content, or as tool calls with --tool-call-parser; include_reasoning false leaves it out. The tiny
    model is held to such answers by a regex."""
    import openai

    from bench.harness.server_process import ServerProcess

    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    call = r'<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
    with ServerProcess("--model", "flock/tiny", "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes",
                       env={"OMP_NUM_THREADS": "1"}) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for after, tools, content, called in [(r"Yes\.", {}, "Yes.", []), (call, {"tools": [now]}, None, ["now"])]:
            kw = dict(model="flock/tiny", messages=[{"role": "user", "content": "Yes?"}], max_tokens=60,
                      temperature=0, extra_body={"structured_outputs": {"regex": "<think>[a-c]{2}</think>" + after}})
            whole = client.chat.completions.create(**kw | tools).choices[0]
            message = whole.message.model_dump()
            assert len(message["reasoning"]) == 2 and set(message["reasoning"]) <= set("abc")
            assert message["content"] == content
            assert [c["function"]["name"] for c in message.get("tool_calls") or []] == called
            deltas = [c.choices[0].delta.model_dump() for c in client.chat.completions.create(stream=True, **kw | tools)]
            assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
            assert "".join(d.get("content") or "" for d in deltas) == (content or "")
            assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []] == called
            hidden = client.chat.completions.create(**kw | tools | {"extra_body": kw["extra_body"] | {
                "include_reasoning": False}}).choices[0].message.model_dump()
            assert hidden.get("reasoning") is None and hidden["content"] == content
