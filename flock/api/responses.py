"""OpenAI's Responses API (`POST /v1/responses`, and `/v1/responses` batch lines) as vLLM serves it for chat
models: a body is a chat request (its `input` items as messages, `instructions` the system message, its flat
function tools, `text.format` and `reasoning.effort` as the chat fields), and the answer comes back as output
items: the thinking (with a reasoning parser) as a `reasoning` item, the content as a `message`, each tool call as
a `function_call`. A stream sends OpenAI's events for the same items, and ends with the same Response object.

An `output_text`'s logprobs are those of the answer's tokens after its thinking (a tool call's tokens included).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from flock.api.protocol import (APIError, Choice, GenerationRequest, check_fields, cursor_page, parse_request,
                                 typed_field, with_defaults)
from flock.api.reasoning import answer_start

# chat fields a Responses body may carry as they are (vLLM's extra sampling fields among them)
_CHAT_FIELDS = {"model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "include_stop_str_in_output", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids",
                "structured_outputs", "chat_template_kwargs", "request_id", "include_reasoning", "priority",
                "stream", "parallel_tool_calls", "cache_salt", "kv_transfer_params", "ec_transfer_params",
                "watermarking", "vllm_xargs", "mm_processor_kwargs", "media_io_kwargs", "mm_payload",
                "return_mm_kwargs", "session_id"}
# fields that do not change what is generated: accepted, and those of the Response object repeated in it
_IGNORED_FIELDS = {"store", "metadata", "user", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                   "safety_identifier", "stream_options"}
RESPONSES_FIELDS = _CHAT_FIELDS | _IGNORED_FIELDS | {
    "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "truncation",
    "top_logprobs", "include", "previous_response_id", "background", "max_tool_calls", "conversation", "prompt"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values Flock has nothing to add for (no encrypted reasoning: the thinking is returned as text)
_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content"}
_TEXT_PARTS = {"input_text", "output_text", "text", "reasoning_text", "summary_text"}
_ROLES = {"user", "assistant", "system", "developer"}


@dataclass
class ResponsesRequest:
    """A parsed Responses body: the chat request it runs as, and what its Response object repeats."""

    gen: GenerationRequest
    body: dict
    messages: list[dict]  # the conversation it answers, the previous response's included, but not instructions
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    storable: bool = True  # whether its server keeps responses at all

    @property
    def store(self) -> bool:
        return self.storable and self.body.get("store") is not False

    def response(self, model: str, choice: Choice | None = None, final=None, logprobs: list[dict] | None = None,
                 error: str | None = None) -> dict:
        """The Response object: in progress (no choice yet), failed (an error), or of the finished choice (`final`
        its last output, with the token counts; `logprobs` its output_text's)."""
        b, effort = self.body, self.body.get("reasoning") or {}
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": "in_progress",
               "background": False, "error": None, "incomplete_details": None,
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "max_tool_calls": b.get("max_tool_calls"), "model": model, "output": [],
               "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
               "previous_response_id": b.get("previous_response_id"),
               "reasoning": {"effort": effort.get("effort"), "summary": effort.get("summary")},
               "service_tier": b.get("service_tier") or "auto", "store": self.store,
               "temperature": self.gen.params.temperature, "text": b.get("text") or {"format": {"type": "text"}},
               "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
               "top_logprobs": b.get("top_logprobs") or 0, "top_p": self.gen.params.top_p,
               "truncation": b.get("truncation") or "disabled", "usage": None, "user": b.get("user"),
               "metadata": b.get("metadata")}
        if error is not None:
            return out | {"status": "failed", "error": {"code": "server_error", "message": error}}
        if choice is None:
            return out
        incomplete = choice.finish_reason == "length"
        return out | {
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": self.items(choice.reasoning, choice.text, choice.tool_calls, logprobs),
            "usage": {"input_tokens": final.num_prompt_tokens,
                      "input_tokens_details": {"cached_tokens": final.num_cached_tokens,
                                               "cache_write_tokens": final.num_prompt_tokens - final.num_cached_tokens},
                      "output_tokens": final.num_output_tokens,
                      "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens or 0},
                      "total_tokens": final.num_prompt_tokens + final.num_output_tokens}}

    def whole(self, model: str, choice: Choice, final, output_ids: list[int], tokenizer) -> dict:
        """The Response object of a choice finished whole (not streamed)."""
        start = answer_start(tokenizer, output_ids, self.gen.reasoning) if self.gen.reasoning else 0
        logprobs = None if choice.logprobs is None else choice.logprobs["content"][start:]
        return self.response(model, choice, final, logprobs)

    def items(self, reasoning: str | None, content: str | None, tool_calls: list[dict] | None,
              logprobs: list[dict] | None) -> list[dict]:
        """The output items of an answer, in order: its thinking, its content (also when there is nothing else),
        its tool calls (at most max_tool_calls)."""
        out = [self.reasoning_item(reasoning)] if reasoning else []
        calls = self.calls(tool_calls)
        if content or not (out or calls):
            out.append(self.message_item(content or "", logprobs))
        return out + [self.call_item(k, call) for k, call in enumerate(calls)]

    def calls(self, tool_calls: list[dict] | None) -> list[dict]:
        return (tool_calls or [])[: self.body.get("max_tool_calls")]

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        return {"id": self.item_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
                "status": status}

    def message_item(self, text: str, logprobs: list[dict] | None, status: str = "completed") -> dict:
        content = [output_text(text, logprobs)] if status == "completed" else []
        return {"id": self.item_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": content}

    def call_item(self, k: int, call: dict, status: str = "completed") -> dict:
        f = call["function"]
        return {"id": self.item_id("fc", k), "type": "function_call", "call_id": call["id"], "name": f["name"],
                "arguments": f["arguments"] if status == "completed" else "", "status": status}

    def item_id(self, kind: str, k: int = 0) -> str:
        return f"{kind}_{self.id.removeprefix('resp_')}" + (f"_{k}" if k else "")


def output_text(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def parse_responses(body, tokenizer, tool_parser: str | None = None, reasoning_parser: str | None = None,
                    history: list[dict] | None = None, defaults: dict | None = None) -> ResponsesRequest:
    """Check a /v1/responses body and make it a chat request. `history`: the conversation of its
    previous_response_id (from the caller's store); `defaults`: chat fields for what the body leaves unset (the
    model's generation config). Raises APIError naming the Responses field at fault."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, RESPONSES_FIELDS)
    _check_unsupported(body, history)
    messages = copy.deepcopy(history or []) + input_messages(body)
    chat = {k: body[k] for k in _CHAT_FIELDS if k in body} | {"messages": _instructions(body) + messages}
    chat |= _tools(body) | _format(body) | _logprobs(body)
    if typed_field(body, "max_output_tokens", int, None) is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    effort = typed_field(body, "reasoning", dict, {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if typed_field(body, "truncation", str, "disabled") not in ("auto", "disabled"):
        raise APIError("truncation must be 'auto' or 'disabled'", param="truncation")
    if body.get("truncation") == "auto":
        chat["truncate_prompt_tokens"] = -1
    partial = [m.pop("partial", False) for m in messages]
    if partial[-1]:  # vLLM's partial assistant message (in progress or incomplete, last): the answer continues it
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    try:
        gen = parse_request("chat", with_defaults(chat, defaults or {}), tokenizer, None, tool_parser,
                            reasoning_parser)
    except APIError as e:
        raise renamed(e) from None
    return ResponsesRequest(gen, body, messages)


# a chat field's name in a Responses body
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort",
           "truncate_prompt_tokens": "truncation"}


def renamed(e: APIError) -> APIError:
    """A chat request's error as the Responses body's: the field named as that body names it."""
    name = "input" if e.param and e.param.startswith("messages[") else _PARAMS.get(e.param)
    if name is None:
        return e
    message = name + e.message.removeprefix(e.param) if e.message.startswith(e.param) else e.message
    return APIError(message, name, e.status, e.type, e.code)


def _check_unsupported(body: dict, history: list[dict] | None) -> None:
    if typed_field(body, "background", bool, False):
        raise APIError("background responses are not supported", param="background")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise APIError(f"{name} is not supported", param=name)
    if body.get("previous_response_id") is not None and history is None:
        raise APIError(f"no stored response {body['previous_response_id']!r}", param="previous_response_id",
                       status=404, code="not_found")
    for name, kind in (("store", bool), ("metadata", dict), ("user", str), ("instructions", str)):
        typed_field(body, name, kind, None)
    if typed_field(body, "max_tool_calls", int, 0) < 0:
        raise APIError("max_tool_calls must be at least 0", param="max_tool_calls")
    include = typed_field(body, "include", list, [])
    bad = [x for x in include if x not in _INCLUDES]
    if bad:
        raise APIError(f"include: {bad[0]!r} is not supported (supported: {sorted(_INCLUDES)})", param="include")


def _instructions(body: dict) -> list[dict]:
    text = typed_field(body, "instructions", str, None)
    return [{"role": "system", "content": text}] if text else []


def input_messages(body: dict) -> list[dict]:
    """The chat messages of `input`: a string is a user message; a list holds messages (with text parts) and the
    items of earlier turns (reasoning, function_call, function_call_output), merged into the assistant and tool
    messages a chat template reads."""
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise APIError("input is empty", param="input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("input must be a non-empty string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}] must be an object", param=f"input[{i}]")
        _add_item(messages, item, f"input[{i}]")
    if not messages:
        raise APIError("input has no message", param="input")
    return messages


def _add_item(messages: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", param=f"{where}.role")
        text = _with_images(item.get("content"), f"{where}.content") or _text(item.get("content"), f"{where}.content")
        message = {"role": role, "content": text}  # a developer's: as the chat template takes it (tokenizer.py)
        if role == "assistant" and item.get("status") in ("in_progress", "incomplete"):
            message["partial"] = True
        if role == "assistant" and last is not None and not last["content"]:  # the answer after its reasoning
            last["content"] = text
            if message.get("partial"):
                last["partial"] = True
        else:
            messages.append(message)
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        text = _text(parts, f"{where}.content")
        if last is not None and "reasoning_content" not in last:
            last["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    else:
        raise APIError(f"{where}: items of type {kind!r} are not supported (message, reasoning, function_call, "
                       "function_call_output are)", param=where)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _text(content, where: str) -> str:
    """A message's text: a string, or its text parts joined (as vLLM joins a chat message's parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(f"{where}: only text parts ({', '.join(sorted(_TEXT_PARTS))}) and a user message's "
                           "input_image parts are supported", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def _with_images(content, where: str) -> list[dict] | None:
    """A message's content as chat parts (text and image_url) when it holds input_image parts, else None."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return None
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise APIError(f"{where}[{i}]: an input_image needs its image_url (file_id is not supported)",
                               param=f"{where}[{i}]")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([part], f"{where}[{i}]")})
    return parts


def _tools(body: dict) -> dict:
    """Chat's tools and tool_choice from the Responses' flat function tools."""
    tools = typed_field(body, "tools", list, None)
    out = {}
    if tools:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise APIError(f"tools[{i}] must be {{'type': 'function', 'name': str, 'parameters': object, ...}} "
                               "(only function tools are supported)", param=f"tools[{i}]")
        out["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                        for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError("a named tool_choice is {'type': 'function', 'name': NAME}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (tools or choice != "auto"):
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict:
    """Chat's response_format from `text.format` (whose json_schema is flat: name, schema, strict)."""
    fmt = typed_field(body, "text", dict, {}).get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise APIError("text.format must be an object", param="text.format")
    if fmt.get("type") != "json_schema":
        return {"response_format": fmt}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _logprobs(body: dict) -> dict:
    top = typed_field(body, "top_logprobs", int, 0)
    if LOGPROBS_INCLUDE not in typed_field(body, "include", list, []) and not top:
        return {}
    return {"logprobs": True, "top_logprobs": top}


class ResponseEvents:
    """A streamed response's events, in OpenAI's order: created and in_progress; for each output item, added, its
    deltas, done; then completed (or failed) with the Response object a whole answer gets."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.seq = 0
        self.open: str | None = None  # the item being streamed: "reasoning" | "message"
        self.index = 0  # its output_index
        self.reasoning = self.content = ""
        self.entries: list[dict] = []  # every output token's logprobs so far, chat-shaped
        self.sent_entries = 0  # how many went out with a text delta

    def start(self) -> list[dict]:
        response = self.req.response(self.model)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def add(self, reasoning: str, content: str, entries: list[dict] | None, answer_start: int | None) -> list[dict]:
        """The events of an output: its thinking and content deltas, and its tokens' logprobs (`entries`), those
        from `answer_start` on (once known) going with the content."""
        self.entries += entries or []
        events = []
        if reasoning:
            events += self._open("reasoning")
            self.reasoning += reasoning
            events.append(self._event("response.reasoning_text.delta", **self._at(), delta=reasoning))
        if content:
            events += self._open("message")
            self.content += content
            start = max(self.sent_entries, answer_start or 0) if answer_start is not None else len(self.entries)
            logprobs, self.sent_entries = self.entries[start:], max(self.sent_entries, len(self.entries))
            events.append(self._event("response.output_text.delta", **self._at(), delta=content, logprobs=logprobs))
        return events

    def finish(self, choice: Choice, final, answer_start: int, logprobs: bool) -> list[dict]:
        """The rest: the open item done, the tool calls, and the finished Response."""
        answer = self.entries[answer_start:] if logprobs else None
        events = self._close(answer)
        calls = self.req.calls(choice.tool_calls)
        if not self.index and not calls:  # nothing said: an empty message, as a whole answer has
            events += self._open("message") + self._close(answer)
        for k, call in enumerate(calls):
            item = self.req.call_item(k, call)
            at = {"item_id": item["id"], "output_index": self.index}
            events += [self._event("response.output_item.added", output_index=self.index,
                                   item=self.req.call_item(k, call, "in_progress")),
                       self._event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", **at, arguments=item["arguments"],
                                   name=item["name"]),
                       self._event("response.output_item.done", output_index=self.index, item=item)]
            self.index += 1
        # an incomplete response ends with response.completed too, as vLLM's does (the openai client's stream
        # helper waits for it), its status saying so
        return events + [self._event("response.completed", response=self.req.response(self.model, choice, final,
                                                                                     answer))]

    def failed(self, message: str) -> list[dict]:
        return [self._event("response.failed", response=self.req.response(self.model, error=message))]

    def _open(self, kind: str) -> list[dict]:
        if self.open == kind:
            return []
        events = self._close(None)
        self.open = kind
        item = self.req.reasoning_item("", "in_progress") if kind == "reasoning" else \
            self.req.message_item("", None, "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("", None)
        return events + [self._event("response.output_item.added", output_index=self.index, item=item),
                         self._event("response.content_part.added", **self._at(), part=part)]

    def _close(self, logprobs: list[dict] | None) -> list[dict]:
        """The open item's done events (a message's part with `logprobs`)."""
        if self.open is None:
            return []
        if self.open == "reasoning":
            item = self.req.reasoning_item(self.reasoning)
            text_done = self._event("response.reasoning_text.done", **self._at(), text=self.reasoning)
        else:
            item = self.req.message_item(self.content, logprobs)
            text_done = self._event("response.output_text.done", **self._at(), text=self.content,
                                    logprobs=logprobs or [])
        events = [text_done, self._event("response.content_part.done", **self._at(), part=item["content"][0]),
                  self._event("response.output_item.done", output_index=self.index, item=item)]
        self.open, self.index = None, self.index + 1
        return events

    def _at(self) -> dict:
        kind = "rs" if self.open == "reasoning" else "msg"
        return {"item_id": self.req.item_id(kind), "output_index": self.index, "content_index": 0}

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}


def input_items(req: ResponsesRequest) -> list[dict]:
    """A request's input as OpenAI lists it: items with ids (a string input: one user message of input_text)."""
    given = req.body["input"]
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    key = req.id.removeprefix("resp_")
    return [{"id": f"{prefixes.get(item.get('type', 'message'), 'item')}_{key}_in{i}"}
            | ({"type": "message", "status": "completed"} if "type" not in item else {}) | _listed(item)
            for i, item in enumerate(given)]


def _listed(item: dict) -> dict:
    """A message item whose content is a string as OpenAI lists it: one text part (an assistant's output_text)."""
    if item.get("type", "message") != "message" or not isinstance(item.get("content"), str):
        return item
    part = {"type": "output_text", "text": item["content"], "annotations": []} if item.get("role") == "assistant" \
        else {"type": "input_text", "text": item["content"]}
    return item | {"content": [part]}


class ResponseStore:
    """The last `capacity` responses whose body did not say store: false, for GET /v1/responses/{id} and a later
    request's previous_response_id (in memory: a restart forgets them)."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self.responses: OrderedDict[str, tuple[dict, list[dict], list[dict]]] = OrderedDict()

    def put(self, req: ResponsesRequest, response: dict) -> None:
        if req.store and self.capacity:
            self.responses[req.id] = (response, req.messages, input_items(req))
            while len(self.responses) > self.capacity:
                self.responses.popitem(last=False)

    def get(self, response_id: str) -> dict | None:
        entry = self.responses.get(response_id)
        return entry and entry[0]

    def input_items(self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
                    ) -> dict | None:
        """OpenAI's list of a stored response's input items (GET /v1/responses/{id}/input_items), or None."""
        entry = self.responses.get(response_id)
        if entry is None:
            return None
        return cursor_page(entry[2] if order == "asc" else entry[2][::-1], after, limit)

    def delete(self, response_id: str) -> bool:
        return self.responses.pop(response_id, None) is not None

    def history(self, response_id: str | None) -> list[dict] | None:
        """The conversation a response closed (its input, the earlier turns' and its output; not instructions,
        which do not carry over), or None when it is not stored."""
        entry = self.responses.get(response_id) if isinstance(response_id, str) else None
        if entry is None:
            return None
        response, messages, _ = entry
        messages = copy.deepcopy(messages)
        for item in response["output"]:
            _add_item(messages, item, "previous output")
        return messages
