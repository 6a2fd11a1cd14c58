"""Chat contents as templates read them (vLLM's content formats), and the server's chat options."""

import copy
import inspect

import pytest

from flock import LLM
from flock.api.protocol import APIError, parse_request
from flock.chat_content import detect_content_format, template_message
from flock.model import resolve_model
from flock.tokenizer import ChatOptions, load_tokenizer

PARTS_ONLY = ("{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}{% if p.type == 'text' %}{{ p.text }}"
              "{% else %}[{{ p.type }}]{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
STRING = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("flock/tiny").folder)


def with_template(tok, template: str, **options):
    t = copy.copy(tok)
    t.chat_template, t.chat_options = template, ChatOptions(**options)
    return t


@pytest.mark.parametrize("template,expected", [
    (STRING, "string"),
    (PARTS_ONLY, "openai"),
    ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content | list %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),  # a slice of the messages, a filter on the content
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% macro show(body) %}{% for p in body %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m.content) }}{% endfor %}", "openai"),
    ("{% macro show(xs) %}{% for x in xs %}{{ x }}{% endfor %}{% endmacro %}{{ show(tools) }}"
     "{% for m in messages %}{{ m.content }}{% endfor %}", "string"),  # a macro never given a content
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
     "{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),  # both: vLLM gives such templates parts
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% for t in tools %}{{ t }}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m.content", "string"),  # does not parse
])
def test_content_format_is_detected_from_the_template(template, expected):
    assert detect_content_format(template) == expected


def test_messages_take_the_templates_content_format():
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    image = {"type": "image"}
    both = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    cases = [({"role": "user", "content": parts}, "a\nb", both),
             ({"role": "user", "content": "hi"}, "hi", [{"type": "text", "text": "hi"}]),
             ({"role": "user", "content": []}, "", []),
             ({"role": "assistant", "content": None}, "", []),
             ({"role": "tool", "content": parts}, "a\nb", "a\nb"),  # a tool's result: text either way
             ({"role": "tool", "content": "r"}, "r", "r"),
             ({"role": "user", "content": [image, parts[0]]}, [image, parts[0]], [image, parts[0]])]
    for message, as_string, as_parts in cases:
        assert template_message(message, "string")["content"] == as_string, message
        assert template_message(message, "openai")["content"] == as_parts, message


def test_an_assistants_reasoning_reaches_the_template_as_vllm_passes_it():
    """`reasoning` before `reasoning_content`, under both names; other roles' fields as sent."""
    both = {"role": "assistant", "content": "a", "reasoning": "R1", "reasoning_content": "R2"}
    assert template_message(both, "string") == both | {"reasoning_content": "R1"}
    old = {"role": "assistant", "content": "a", "reasoning_content": "R2"}
    assert template_message(old, "string") == old | {"reasoning": "R2"}
    user = {"role": "user", "content": "u", "reasoning": "x"}
    assert template_message(user, "string") == user


def test_claude_codes_billing_header_leaves_system_prompts():
    header = "x-anthropic-billing-header: cc_version=2.1; cch=7f3a;"
    system = {"role": "system", "content": f"{header}\nYou are X."}
    assert template_message(system, "string")["content"] == "You are X."
    blocks = {"role": "system", "content": [{"type": "text", "text": header}, {"type": "text", "text": "Be brief."}]}
    assert template_message(blocks, "openai")["content"] == [{"type": "text", "text": "Be brief."}]
    user = {"role": "user", "content": f"{header}\nhi"}
    assert template_message(user, "string") == user


def test_requests_render_with_the_templates_format_and_the_servers_options(tok):
    """A template that only loops over parts sees a string message's text (it saw none before); the server's
    content format, default template variables, request templates, tools and response role, as vLLM's flags."""
    user = [{"role": "user", "content": "hello"}]
    parts_only = with_template(tok, PARTS_ONLY)
    gen = parse_request("chat", {"messages": user}, parts_only)
    assert tok.decode(gen.prompts[0]) == "<user>hello<a>" and gen.role == "assistant"
    forced = with_template(tok, PARTS_ONLY, content_format="string")
    forced_ids = parse_request("chat", {"messages": user}, forced).prompts[0]
    assert tok.decode(forced_ids) == "<user>" + "[]" * 5 + "<a>"  # the string's characters, as vLLM would loop

    kwargs = "{{ flag }}|{{ other }}|" + STRING
    defaults = with_template(tok, kwargs, default_kwargs={"flag": "on", "other": "x"})
    body = {"messages": user, "chat_template_kwargs": {"other": "y", "add_generation_prompt": False}}
    assert tok.decode(parse_request("chat", body, defaults).prompts[0]) == "on|y|<user>hello<a>"  # the field wins

    body = {"messages": user, "chat_template": "[{{ messages[0].content }}]"}
    with pytest.raises(APIError, match="--trust-request-chat-template") as e:
        parse_request("chat", body, tok)
    assert e.value.param == "chat_template"
    trusted = with_template(tok, STRING, trust_request_template=True)
    assert tok.decode(parse_request("chat", body, trusted).prompts[0]) == "[hello]"

    tools = [{"type": "function", "function": {"name": "f", "extra": 1}}]
    shown = "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}" + STRING
    body = {"messages": user, "tools": tools, "tool_choice": "none"}
    text = tok.decode(parse_request("chat", body, with_template(tok, shown)).prompts[0])
    assert text.startswith('{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}')
    hidden = with_template(tok, shown, exclude_tools_when_none=True)
    assert tok.decode(parse_request("chat", body, hidden).prompts[0]) == "<user>hello<a>"

    role = with_template(tok, STRING, response_role="model")
    assert parse_request("chat", {"messages": user}, role).role == "model"
    body = {"messages": user, "add_generation_prompt": False}
    assert parse_request("chat", body, role).role == "user"  # vLLM's: the last message's


def test_prompts_leave_room_for_a_token_as_vllms():
    """A generation's prompt of max_model_len tokens is refused (no room for its token), in vLLM's words; an
    embedding's is not."""
    llm = LLM("flock/tiny", max_model_len=32)
    with pytest.raises(ValueError, match=r"\(length 32\) plus the number of requested output tokens \(at least 1\)"):
        llm.generate({"prompt_token_ids": [5] * 32}, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
        llm.generate({"prompt_token_ids": [5] * 33}, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [5] * 31}, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.embed({"prompt_token_ids": [5] * 32}, use_tqdm=False)[0].outputs.embedding


def test_chat_takes_vllms_arguments_in_vllms_order():
    names = list(inspect.signature(LLM.chat).parameters)[1:]
    assert names == ["messages", "sampling_params", "use_tqdm", "lora_request", "priority", "chat_template",
                     "chat_template_content_format", "add_generation_prompt", "continue_final_message", "tools",
                     "chat_template_kwargs", "tokenization_kwargs", "mm_processor_kwargs"]
