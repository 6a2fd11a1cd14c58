"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`, and `/v1/messages` batch lines), as
vLLM and SGLang serve it: a body is a chat request (`system` the system message, content blocks as chat parts,
tool_use and tool_result blocks as tool calls and tool messages, thinking blocks as the assistant's reasoning, an
assistant message last as the start of the answer), and the answer comes back as content blocks: the thinking (with
a reasoning parser), the text, each tool call as a tool_use block. A stream sends Anthropic's events for the same
blocks.

Usage counts as Anthropic's does: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens` those
read from the prefix cache (every prefix is cached, so no request writes one on purpose).
"""

from __future__ import annotations

import functools
import json
import uuid

import jinja2
import jinja2.ext
import jinja2.sandbox
from dataclasses import dataclass, field

from flock.api.protocol import (APIError, Choice, GenerationRequest, check_fields, parse_request, typed_field,
                                 with_defaults)
from flock.chat_content import CLAUDE_CODE_BILLING_HEADER
from flock.sample.thinking import ThinkMarkers

# fields a body may carry as a chat body carries them (vLLM's extra sampling fields among them)
_CHAT_FIELDS = {"model", "temperature", "top_p", "top_k", "stream", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "include_stop_str_in_output", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids",
                "chat_template_kwargs", "request_id", "priority", "cache_salt", "thinking_token_budget",
                "kv_transfer_params", "ec_transfer_params", "watermarking", "vllm_xargs", "mm_payload",
                "return_mm_kwargs"}
# fields that do not change what is generated (every prefix is cached whether or not cache_control asks; one
# server has one speed)
_IGNORED_FIELDS = {"metadata", "service_tier", "inference_geo", "cache_control", "speed", "diagnostics",
                   "user_profile_id", "workspace_id"}
MESSAGES_FIELDS = _CHAT_FIELDS | _IGNORED_FIELDS | {"messages", "system", "max_tokens", "stop_sequences", "tools",
                                                    "tool_choice", "thinking", "output_config", "output_format"}
# Anthropic's hosted features: refused when set
_HOSTED = {"container": "code execution containers", "mcp_servers": "MCP servers",
           "context_management": "context management (clearing old tool results)"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# an Anthropic error's type by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


@dataclass
class MessagesRequest:
    """A parsed Messages body: the chat request it runs as."""

    gen: GenerationRequest
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks come back empty
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)

    def message(self, model: str, choice: Choice, final) -> dict:
        """The Message object of a finished answer (`final`: its last output, with the token counts)."""
        content = blocks(choice.reasoning, choice.text, choice.tool_calls, self.show_thinking)
        return self.shell(model, final) | {"content": content, **self.stop(choice)}

    def shell(self, model: str, counts) -> dict:
        """The Message object before its content (what message_start sends), with the token counts so far."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage(counts)}

    def stop(self, choice: Choice) -> dict:
        """stop_reason and stop_sequence: a stop_sequences string that matched, or why else the answer ended."""
        stop = self.gen.params.stop or []
        if choice.finish_reason == "length":  # vLLM's: max_tokens wins, whatever the answer holds
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if choice.tool_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if choice.finish_reason == "stop" and isinstance(choice.stop_reason, str) and choice.stop_reason in stop:
            return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(counts) -> dict:
    """Anthropic's usage of an output's token counts (num_prompt_tokens, num_cached_tokens, num_output_tokens)."""
    cached = counts.num_cached_tokens
    return {"input_tokens": counts.num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": counts.num_output_tokens}


def blocks(reasoning: str | None, text: str | None, tool_calls: list[dict] | None, show_thinking: bool = True
           ) -> list[dict]:
    """An answer's content blocks, in order: its thinking, its text (also when there is nothing else), its calls."""
    out = [thinking_block(reasoning if show_thinking else "", uuid.uuid4().hex)] if reasoning else []
    if text or not (out or tool_calls):
        out.append(text_block(text or ""))
    return out + [tool_use_block(call) for call in tool_calls or []]


def thinking_block(text: str, signature: str = "") -> dict:
    """A thinking block; a whole message's signed as vLLM signs it (a random id: nothing verifies it here, but
    clients that drop unsigned thinking keep it)."""
    return {"type": "thinking", "thinking": text, "signature": signature}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(call: dict, whole: bool = True) -> dict:
    f = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": f["name"],
            "input": json.loads(f["arguments"]) if whole else {}}


def error_body(e: APIError) -> dict:
    """An error as Anthropic's API sends it."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def parse_messages(body, tokenizer, tool_parser: str | None = None, reasoning_parser: str | None = None,
                   defaults: dict | None = None, count_only: bool = False) -> MessagesRequest:
    """Check a /v1/messages body and make it a chat request. `defaults`: chat fields for what the body leaves unset
    (the model's generation config); `count_only`: a count_tokens body (no max_tokens). Raises APIError naming the
    Messages field at fault."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, MESSAGES_FIELDS | set(_HOSTED))
    for name, what in _HOSTED.items():
        if body.get(name) is not None:
            raise APIError(f"{name}: {what} are Anthropic's hosted features; not supported", param=name)
    template = getattr(tokenizer, "chat_template", None)
    merge = system_first(template if isinstance(template, str) else None)
    chat = {k: body[k] for k in _CHAT_FIELDS if k in body} | {"messages": chat_messages(body, merge)}
    chat |= _max_tokens(body, count_only) | _stop(body) | _tools(body) | _format(body)
    chat = _thinking(body, chat, tokenizer)
    if count_only and "tools" in chat and tool_parser is None:  # shown to the template, though none can be called
        chat["tool_choice"] = "none"
    if chat["messages"][-1]["role"] == "assistant":  # a prefilled answer: the model continues it
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    try:
        gen = parse_request("chat", with_defaults(chat, defaults or {}), tokenizer, None, tool_parser, reasoning_parser)
    except APIError as e:
        if e.param and e.param.startswith("messages["):  # a chat message's index is not the body's
            raise APIError(e.message, "messages", e.status, e.type, e.code) from None
        raise renamed(e) from None
    return MessagesRequest(gen, (body.get("thinking") or {}).get("display") != "omitted")


# a chat field's name in a Messages body
_PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort", "parallel_tool_calls": "tool_choice"}


def renamed(e: APIError) -> APIError:
    """A chat request's error as the Messages body's: the field named as that body names it."""
    name = _PARAMS.get(e.param)
    if name is None:
        return e
    message = name + e.message.removeprefix(e.param) if e.message.startswith(e.param) else e.message
    return APIError(message, name, e.status, e.type, e.code)


def _max_tokens(body: dict, count_only: bool) -> dict:
    value = typed_field(body, "max_tokens", int, None)
    if count_only:
        return {}
    if value is None or value < 1:
        raise APIError("max_tokens must be an integer of at least 1 (it is required)", param="max_tokens")
    return {"max_tokens": value}


def _stop(body: dict) -> dict:
    stop = typed_field(body, "stop_sequences", list, None)
    if stop is None:
        return {}
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError("stop_sequences must be a list of non-empty strings", param="stop_sequences")
    return {"stop": stop}


def chat_messages(body: dict, merge_system: bool = True) -> list[dict]:
    """The chat messages of `system` and `messages`: `system` first, the system turns' text joined to it where
    `merge_system` (a template that takes a system message only first, see `system_first`) or in their places, as
    vLLM places them; the user and assistant turns' blocks become chat parts, tool calls and tool messages,
    thinking."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    system = [_system_text(body["system"], "system")] if body.get("system") is not None else []
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise APIError(f"{where} must be an object whose role is 'user' or 'assistant'", param=f"{where}.role")
        content = m.get("content")
        if m["role"] == "system" and merge_system:
            system.append(_system_text(content, f"{where}.content"))
        elif m["role"] == "system":
            out += [{"role": "system", "content": text}] if (text := _system_text(content, f"{where}.content")) else []
        elif isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list) and content:
            out += (_user if m["role"] == "user" else _assistant)(content, f"{where}.content")
        else:
            raise APIError(f"{where}.content must be a string or a non-empty list of content blocks",
                           param=f"{where}.content")
    if not any(m["role"] != "system" for m in out):
        raise APIError("messages has no user or assistant turn", param="messages")
    system_text = "".join(system)
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def _blocks(content: list, where: str):
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise APIError(f"{where}[{j}] must be a content block (an object with a type)", param=f"{where}[{j}]")
        yield f"{where}[{j}]", block


def _user(content: list, where: str) -> list[dict]:
    """A user turn: its tool results as tool messages (they come first, as Anthropic has them), then its text,
    images and documents as one user message (images a tool returned join it)."""
    tools, parts = [], []
    for at, block in _blocks(content, where):
        kind = block["type"]
        if kind == "tool_result":
            text, images = _tool_result(block, at)
            tools.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text})
            parts += images
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind in ("text", "document", "search_result"):
            parts.append({"type": "text", "text": _block_text(block, at)})
        else:
            raise APIError(f"{at}: blocks of type {kind!r} are not supported in a user turn (text, image, document, "
                           "search_result, tool_result are)", param=at)
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _assistant(content: list, where: str) -> list[dict]:
    """An assistant turn: its text, its thinking as reasoning_content, its tool_use blocks as tool calls."""
    message: dict = {"role": "assistant", "content": ""}
    texts, thinking, calls = [], [], []
    for at, block in _blocks(content, where):
        kind = block["type"]
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise APIError(f"{at}.input must be an object", param=f"{at}.input")
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind != "redacted_thinking":  # Anthropic's encrypted thinking: nothing a template can show
            raise APIError(f"{at}: blocks of type {kind!r} are not supported in an assistant turn (text, thinking, "
                           "redacted_thinking, tool_use are)", param=at)
    message["content"] = "\n".join(texts)
    if thinking:
        message["reasoning_content"] = "".join(thinking)  # as vLLM joins a turn's thinking blocks
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool_result(block: dict, where: str) -> tuple[str, list[dict]]:
    """A tool result's text, and its images as chat parts."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
    texts, images = [], []
    for at, part in _blocks(content, f"{where}.content"):
        if part["type"] == "image":
            images.append(_image(part, at))
        else:
            texts.append(_block_text(part, at))
    return "\n".join(texts), images


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise APIError(f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', "
                       "'url'}} (files are not supported)", param=f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _text(content, where: str) -> str:
    """The text of a string or of a list of text, document (a text source) and search_result blocks, joined (as
    a chat message's text parts are joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of text blocks", param=where)
    return "\n".join(_block_text(block, at) for at, block in _blocks(content, where))


@functools.lru_cache(maxsize=16)
def system_first(template: str | None) -> bool:
    """Whether a chat template takes a system message only first (Qwen's `loop.first` guard raises on another):
    vLLM's test, a [system, user, system, user] chat rendered (no template: True)."""
    if not template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _system_text(content, where: str) -> str:
    """A system prompt's text: its blocks joined as vLLM joins them (directly), Claude Code's billing header block
    left out (its value changes with every request, so the prompt would share no prefix past it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of text blocks", param=where)
    texts = (_block_text(block, at) for at, block in _blocks(content, where))
    return "".join(t for t in texts if not t.startswith(CLAUDE_CODE_BILLING_HEADER))


def _block_text(block: dict, where: str) -> str:
    kind = block["type"]
    if kind == "text":
        return _string(block, "text", where)
    if kind == "document":
        return _document(block, where)
    if kind == "search_result":
        parts = [block.get("title"), block.get("source"), _text(block.get("content"), f"{where}.content")]
        return "\n".join(p for p in parts if isinstance(p, str) and p)
    raise APIError(f"{where}: only text, document and search_result blocks are supported here", param=where)


def _document(block: dict, where: str) -> str:
    """A document's title, context and text (a text source, or a content source of text blocks)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content":
        text = _text(source.get("content"), f"{where}.source.content")
    else:
        raise APIError(f"{where}.source must be a text source ({{'type': 'text', 'data'}}) or a content source; "
                       "PDF and file documents are not supported", param=f"{where}.source")
    parts = [block.get("title"), block.get("context"), text]
    return "\n\n".join(p for p in parts if isinstance(p, str) and p)


def _string(block: dict, name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise APIError(f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _tools(body: dict) -> dict:
    """Chat's tools, tool_choice and parallel_tool_calls from Anthropic's client tools and tool_choice."""
    tools = typed_field(body, "tools", list, None)
    out = {}
    if tools:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str) \
                    or not isinstance(t.get("input_schema"), dict):
                raise APIError(f"tools[{i}] must be {{'name': str, 'input_schema': object, 'description': str}} "
                               "(server tools are not supported)", param=f"tools[{i}]")
        out["tools"] = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}
                         | ({"description": t["description"]} if isinstance(t.get("description"), str) else {})}
                        for t in tools]
    choice = typed_field(body, "tool_choice", dict, None)
    if choice is None:
        return out
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError("a tool_choice of type 'tool' needs the tool's name", param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise APIError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    if choice.get("disable_parallel_tool_use") is not None:
        out["parallel_tool_calls"] = not typed_field(choice, "disable_parallel_tool_use", bool, False)
    return out


def _format(body: dict) -> dict:
    """Chat's response_format and reasoning_effort from output_config (and the beta's output_format)."""
    config = typed_field(body, "output_config", dict, {})
    fmt = config.get("format", body.get("output_format"))
    param = "output_config.format" if "format" in config else "output_format"
    out = {}
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(f"{param} must be {{'type': 'json_schema', 'schema': object}}", param=param)
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["reasoning_effort"] = config["effort"]
    return out


def _thinking(body: dict, chat: dict, tokenizer) -> dict:
    """`thinking` as the chat template's enable_thinking, and its budget_tokens as thinking_token_budget where the
    model thinks between <think> tokens (another model's thinking is not bounded but by max_tokens)."""
    thinking = typed_field(body, "thinking", dict, None)
    if thinking is None:
        return chat
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", param="thinking.type")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise APIError("thinking.display must be summarized or omitted", param="thinking.display")
    kwargs = dict(typed_field(body, "chat_template_kwargs", dict, None) or {})
    if kind != "adaptive":
        kwargs.setdefault("enable_thinking", kind == "enabled")
    chat = chat | {"chat_template_kwargs": kwargs}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise APIError("thinking.budget_tokens must be an integer of at least 1", param="thinking.budget_tokens")
        if ThinkMarkers.of(tokenizer) is not None and chat.get("thinking_token_budget") is None:
            chat["thinking_token_budget"] = budget
    return chat


class MessageEvents:
    """A streamed message's events, in Anthropic's order: message_start; for each content block, its start, deltas
    and stop; message_delta with the stop reason and usage; message_stop."""

    def __init__(self, req: MessagesRequest, model: str):
        self.req, self.model = req, model
        self.started = False
        self.open: str | None = None  # the block being streamed: "thinking" | "text"
        self.index = 0  # its index

    def add(self, out, reasoning: str, content: str) -> list[dict]:
        """The events of an output (with its token counts): the message's start, first; its thinking and text."""
        events = []
        if not self.started:
            self.started = True
            events.append({"type": "message_start", "message": self.req.shell(self.model, out)})
        if reasoning:
            events += self._open("thinking")
            if self.req.show_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            events += self._open("text")
            events.append(self._delta({"type": "text_delta", "text": content}))
        return events

    def finish(self, choice: Choice, final) -> list[dict]:
        """The rest: the open block's stop, the tool calls, the stop reason and usage."""
        events = self._close()
        calls = choice.tool_calls or []
        if not self.index and not calls:  # nothing said: an empty text block, as a whole message has
            events += self._open("text") + self._close()
        for call in calls:
            start = tool_use_block(call, whole=False)
            events += [{"type": "content_block_start", "index": self.index, "content_block": start},
                       self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                       {"type": "content_block_stop", "index": self.index}]
            self.index += 1
        return events + [{"type": "message_delta", "delta": self.req.stop(choice), "usage": usage(final)},
                         {"type": "message_stop"}]

    @staticmethod
    def failed(message: str) -> list[dict]:
        return [{"type": "error", "error": {"type": "api_error", "message": message}}]

    def _open(self, kind: str) -> list[dict]:
        if self.open == kind:
            return []
        events = self._close()
        self.open = kind
        block = thinking_block("") if kind == "thinking" else text_block("")
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        signed = [self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex})] \
            if self.open == "thinking" else []
        self.open, self.index = None, self.index + 1
        return signed + [{"type": "content_block_stop", "index": self.index - 1}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
