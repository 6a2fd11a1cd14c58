"""OpenAI request bodies -> Flock requests, Flock results -> OpenAI response bodies.

Shared by `flock run` (OpenAI Batch lines) and `flock serve` (HTTP), so both accept and reject the same
things. Fields Flock cannot honour are rejected with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from flock.api.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from flock.api.reasoning import REASONING_PARSERS, THINKING_END, ReasoningFormat, reasoning_token_count, thinking_open
from flock.api.tools import ToolCalling, ToolError, parse_tools
from flock.beam_search import BeamSearch, BeamSearchParams
from flock.lora import LoRARequest
from flock.multimodal import ImageInputs
from flock.multimodal.images import load_image
from flock.multimodal.processor import IMAGES_REFUSED, has_images, image_prompts, split_images
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import KINDS, SamplingParams, StructuredOutputsParams
from flock.chat_content import TEXT_PARTS, joined_text
from flock.tokenizer import ChatOptions, bos_prefix, chat_options, chat_text, encode_chat, fim_prompt, fim_tokens

# llama.cpp's samplers, as frontends written for llama-server-like backends send them (SamplingParams fields)
LLAMA_CPP_SAMPLING = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                      "dynatemp_exponent", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                      "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta")
_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "allowed_token_ids",
                    "bad_words", "truncate_prompt_tokens", "truncation_side", "cache_salt", "priority",
                    "thinking_token_budget", "repetition_detection", "logprob_token_ids", "stream_interval",
                    *LLAMA_CPP_SAMPLING}
# OpenAI fields that do not change what is generated: accepted and not used (vLLM's spaces_between_special_tokens
# changes only slow tokenizers' decoding; Flock's and vLLM's incremental detokenizers take fast ones; OpenAI's
# prompt caching keys, predicted outputs and GPT-5's verbosity hint are routing and latency hints; vLLM's session_id
# routes, its mm_payload and return_mm_kwargs shape only its /render endpoint's answers)
_IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "spaces_between_special_tokens", "prompt_cache_key",
                   "prompt_cache_retention", "safety_identifier", "prediction", "verbosity", "guided_decoding_backend",
                   "session_id", "mm_payload", "return_mm_kwargs"}
# fields accepted at the one value Flock runs with (text only; JSON's whitespace as structured outputs allow it;
# vLLM's fields at their defaults: what its SDK-built requests send)
_NEUTRAL_FIELDS = {"modalities": ["text"], "guided_whitespace_pattern": None, "vllm_xargs": {},
                   "return_token_offsets": False, "routed_experts_prompt_start": 0, "watermarking": False,
                   "kv_transfer_params": {}, "ec_transfer_params": {}}
_CHAT_NEUTRAL_FIELDS = {"return_prompt_text": False, "mm_processor_kwargs": {}, "media_io_kwargs": {}}
# vLLM's guided decoding fields before structured_outputs (removed in vLLM 0.12): the kind each sets; the backend
# it named is xgrammar's here, whatever it says
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# what beam search does not combine with (vLLM's: it returns texts and scores)
_NOT_WITH_BEAMS = ("stream", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "logprob_token_ids",
                   "response_format", "structured_outputs")
_COMMON_FIELDS = _SAMPLING_FIELDS | _IGNORED_FIELDS | set(_NEUTRAL_FIELDS) | {
    "use_beam_search", "length_penalty", "model", "n", "stream", "stream_options", "logprobs", "prompt_logprobs", "response_format", "structured_outputs",
    *GUIDED_FIELDS,
    "echo", "return_token_ids", "request_id", "return_tokens_as_token_ids", "best_of"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix", "add_special_tokens"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                "continue_final_message", "chat_template_kwargs", "tools", "tool_choice",
                                "parallel_tool_calls", "include_reasoning", "add_special_tokens", "documents",
                                "reasoning_effort", "chat_template", *_CHAT_NEUTRAL_FIELDS}
# OpenAI's and vLLM's fields for what Flock does not run (legacy functions, audio, web search, prompt embeddings,
# vLLM's Responses message echo): refused when set; a generation field sent where it does not apply is refused too;
# any other field is ignored (and logged), as vLLM and SGLang ignore fields they do not know
UNRUN_FIELDS = {"functions", "function_call", "audio", "web_search_options", "prompt_embeds",
                "enable_response_messages", "previous_input_messages"}
_REFUSED_FIELDS = UNRUN_FIELDS | CHAT_FIELDS | COMPLETION_FIELDS
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
STRUCTURED_FIELDS = {*KINDS, "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # n times the number of prompts, per request

log = logging.getLogger(__name__)


class APIError(ValueError):
    """An OpenAI-style error: HTTP status, message, and the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = code or ("invalid_value" if status == 400 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """One parsed completion or chat request, ready for the engine: n samples of each prompt."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams
    n: int = 1
    texts: list[str | None] = field(default_factory=list)  # each prompt as sent, None for token ids
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk
    echo: bool = False  # the prompt (completions, with its logprobs if asked) or the last message (chat) comes
    # back before the output: texts[i] (None: the prompt's ids decoded)
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt alone (one token generated, unsent)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was set: the response carries them
    structured_param: str | None = None  # the field that asked for structured outputs
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids come back too
    tools: ToolCalling | None = None  # how a chat's answer may call tools (None: it is text)
    reasoning: ReasoningFormat | None = None  # how a chat's thinking is split from its answer (None: it is not)
    request_id: str | None = None  # vLLM's: the client's id for the response
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    include_reasoning: bool = True  # vLLM's: the thinking is returned (as `reasoning`)
    counts_reasoning: bool = False  # a reasoning parser reads the chat: usage counts reasoning tokens (maybe 0)
    beam: BeamSearchParams | None = None  # vLLM's use_beam_search: n beams (max_tokens 0: up to max_model_len)
    max_tokens_field: str | None = None  # the field that set max_tokens (max_tokens, max_completion_tokens), if any
    role: str = "assistant"  # a chat answer's
    extra: dict = field(default_factory=dict)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The one prompt's token ids, for callers that take a body as one engine request."""
        if len(self.prompts) != 1 or self.n != 1:
            raise APIError("only one prompt and n=1 are supported here", param="n" if self.n != 1 else "prompt")
        return self.prompts[0]

    @property
    def prompt(self) -> str | None:
        return self.texts[0] if len(self.texts) == 1 else None

    def use_lora(self, lora: LoRARequest | None) -> None:
        """Run with this LoRA adapter (the one its model names), beam search included."""
        self.params.lora_request = lora
        if self.beam is not None:
            self.beam.lora_request = lora

    def fit(self, max_model_len: int, max_tokens_cap: int | None = None) -> None:
        """Refuse a max_tokens beyond max_model_len (as vLLM), cap it at the server's limit (`max_tokens_cap`), and
        apply truncate_prompt_tokens now, so that usage, returned ids and a completion's echo show the prompts that
        run (a chat's echo stays its last message)."""
        if self.max_tokens_field and self.params.max_tokens > max_model_len:
            raise APIError(f"{self.max_tokens_field}={self.params.max_tokens} cannot be greater than max_model_len="
                           f"{max_model_len}; request fewer output tokens", param=self.max_tokens_field)
        if max_tokens_cap is not None:
            self.params.max_tokens = min(self.params.max_tokens or max_tokens_cap, max_tokens_cap)
        for i, ids in enumerate(self.prompts):
            try:
                kept = self.params.truncated(ids, max_model_len)
            except ValueError as e:
                raise APIError(str(e), param="truncate_prompt_tokens") from None
            if len(kept) < len(ids):
                self.prompts[i] = kept
                if self.kind == "completion":
                    self.texts[i] = None

    def beam_searches(self, max_model_len: int, eos_token_ids: list[int]) -> list[BeamSearch]:
        """A beam search of each prompt (use_beam_search), to step through an engine."""
        return [BeamSearch(ids, self.beam.fitted(len(ids), max_model_len), eos_token_ids) for ids in self.prompts]

    def beam_choices(self, searches: list[BeamSearch], token_text: TokenText) -> tuple[list[Choice], dict]:
        """The choices (each prompt's n best beams, best first, shaped as make_choice shapes any answer: thinking
        split off, token ids) and the usage of finished searches. As vLLM's, the EOS that ended a beam is left out
        of its text, and out of its ids unless include_stop_str_in_output."""
        choices, generated = [], 0
        for i, beam in enumerate(b for s in searches for b in s.result()):
            ids, stop = beam.output_token_ids, None
            if beam.finish_reason == "stop":
                ids, stop = ids[:-1], ids[-1]
            text = token_text.tokenizer.decode(ids, skip_special_tokens=self.beam.skip_special_tokens)
            if stop is not None and self.beam.include_stop_str_in_output:
                ids = [*ids, stop]
            generated += len(ids)
            choices.append(make_choice(self, i, text, beam.finish_reason, ids, None, None, token_text, stop))
        return choices, usage(sum(map(len, self.prompts)), generated)

    def engine_requests(self) -> list[tuple[list[int], SamplingParams]]:
        """(token ids, params) of each choice in choice order: prompt i's sample j is choice i * n + j. With a
        seed, sample j uses seed + j, as vLLM's child requests do."""
        return [(ids, p) for ids in self.prompts for p in self.params.samples()]


def parse_request(kind: str, body, tokenizer, default_max_tokens: int | None = COMPLETION_MAX_TOKENS,
                  tool_parser: str | None = None, reasoning_parser: str | None = None) -> GenerationRequest:
    """Check and convert a /v1/completions (kind="completion") or /v1/chat/completions (kind="chat") body.
    Raises APIError naming the bad parameter. `default_max_tokens` applies when the body sets none; a chat's tool
    calls are parsed with `tool_parser` (`flock.api.tools.TOOL_PARSERS`; None: tool_choice must be 'none'), its
    thinking split off with `reasoning_parser` (`flock.api.reasoning.REASONING_PARSERS`)."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
    _check_unsupported(body, kind)
    bad = lone_surrogate(body)
    if bad:
        raise APIError(f"the request body {bad}")
    echo = typed_field(body, "echo", bool, False)
    echo_only = echo and kind == "completion" and body.get("max_tokens") == 0
    if echo_only:  # as vLLM: one token is generated and not returned
        body = body | {"max_tokens": 1}
    tools, role = None, "assistant"
    if kind == "completion":
        texts, prompts = _completion_prompts(body, tokenizer)
        prompts = _with_suffix(body, texts, prompts, tokenizer, echo)
    else:
        texts, prompts, tools, images, role = _chat_prompt(body, tokenizer, tool_parser)
    n = typed_field(body, "n", int, 1)
    if n < 1:
        raise APIError(f"n must be at least 1, got {n}", param="n")
    if n * len(prompts) > MAX_CHOICES:
        raise APIError(f"n times the number of prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}",
                       param="n")
    stream = typed_field(body, "stream", bool, False)
    options = typed_field(body, "stream_options", dict, None) or {}
    if options and not stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = bool(options.get("include_usage", False))
    params = _sampling_params(body, kind, default_max_tokens, n)
    if kind == "chat":
        params.multi_modal = images
    params.logprobs = _logprobs(body, kind)
    params.logprob_token_ids = _logprob_token_ids(body, params.logprobs, echo_only)
    params.prompt_logprobs = _bounded(body, "prompt_logprobs")
    if stream and params.prompt_logprobs:  # as vLLM: 0 (the sampled token's alone) is allowed
        raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if echo and kind == "completion" and params.logprobs is not None:
        params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
    params.structured_outputs, structured_param = _structured_outputs(body)
    if tools is not None:
        structured_param = _tool_constraint(tools, params, structured_param, body) or structured_param
    include_reasoning = typed_field(body, "include_reasoning", bool, True)
    reasoning = _reasoning(kind, body, tokenizer, prompts[0], reasoning_parser)
    if reasoning and params.structured_outputs is not None:  # the grammar follows the thinking
        params.structured_outputs = replace(params.structured_outputs, after=THINKING_END)
    if reasoning and body.get("skip_special_tokens") is None:  # a special </think> stays, to split at (as vLLM)
        params.skip_special_tokens = False
    beam = _beam_search(body, params, n, tools)
    return GenerationRequest(kind, prompts, params, n=n, texts=texts, model=typed_field(body, "model", str, None),
                             stream=stream, include_usage=include_usage, echo=echo,
                             continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
                             echo_only=echo_only,
                             prompt_logprobs=body.get("prompt_logprobs") is not None,
                             structured_param=structured_param, tools=tools,
                             return_token_ids=typed_field(body, "return_token_ids", bool, False),
                             reasoning=reasoning, include_reasoning=include_reasoning,
                             counts_reasoning=kind == "chat" and reasoning_parser is not None,
                             request_id=typed_field(body, "request_id", str, None),
                             tokens_as_ids=typed_field(body, "return_tokens_as_token_ids", bool, False), beam=beam,
                             max_tokens_field=_max_tokens_field(body, kind), role=role)


def _max_tokens_field(body: dict, kind: str) -> str | None:
    """The field the request's max_tokens came from (chat's max_completion_tokens wins), None where it sets none."""
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens" if body.get("max_tokens") is not None else None


def chat_token_ids(body: dict, tokenizer) -> list[int]:
    """The prompt token ids of a chat body as /v1/chat/completions makes them (its tools shown, not called)."""
    return _chat_prompt(body, tokenizer, None, tokens_only=True)[1][0]


def _tool_constraint(tools: ToolCalling, params: SamplingParams, structured_param: str | None,
                     body: dict) -> str | None:
    """Constrain a forced tool call (required or named) to its format, in place of a response_format (as vLLM),
    and strict tools' calls with tool_choice auto where no response_format constrains the answer; the field that
    asked for it, if any. Hermes', Qwen's, Mistral's and Granite's tags may be special tokens: they stay in the text
    unless the body says otherwise (as vLLM)."""
    if tools.parser in ("hermes", "mistral", "qwen3_coder", "granite") and body.get("skip_special_tokens") is None:
        params.skip_special_tokens = False
    try:
        spec = tools.constraint()
    except ToolError as e:
        raise APIError(str(e), param=e.param) from None
    if spec is None or tools.choice == "auto" and params.structured_outputs is not None:  # auto: the format wins
        return None
    if tools.named and structured_param == "structured_outputs":
        raise APIError("a named tool_choice and structured_outputs cannot both constrain the answer",
                       param="tool_choice")
    params.structured_outputs = spec
    return "tools"


def engine_error(e: ValueError, gen: GenerationRequest) -> APIError:
    """The engine's rejection of a parsed request as an APIError naming the field: a sampling field when the
    message starts with one, the field that asked for structured outputs when the grammar engine rejected it,
    else the prompt (or the messages of a chat)."""
    message = str(e)
    first = message.split(" ", 1)[0]
    if first.startswith("structured_outputs"):
        if gen.structured_param != "structured_outputs":
            message = f"{gen.structured_param}: {message}"
        return APIError(message, param=gen.structured_param)
    if first == "logprobs" and gen.kind == "chat":
        first = "top_logprobs"  # a chat's count of them
    param = first if first in _SAMPLING_FIELDS | {"logprobs", "top_logprobs", "prompt_logprobs"} else \
        "prompt" if gen.kind == "completion" else "messages"
    return APIError(message, param=param)


def model_defaults(defaults: dict, kind: str) -> dict:
    """The generation config's defaults a body of `kind` takes: a completion's max_tokens is 16 whatever it says,
    as vLLM's (a chat takes its max_new_tokens)."""
    return {k: v for k, v in defaults.items() if k != "max_tokens"} if kind == "completion" else defaults


def max_tokens_cap(config, defaults: dict) -> int | None:
    """vLLM's server-wide limit on a request's output tokens: the max_new_tokens of a generation config folder
    given, else of override_generation_config; None where neither sets one."""
    if config.generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (config.override_generation_config or {}).get("max_new_tokens")


def with_defaults(body, defaults: dict):
    """The body with `defaults` (the model's generation config) in the fields it leaves unset (absent or null)."""
    if not isinstance(body, dict) or not defaults:
        return body
    return body | {name: value for name, value in defaults.items() if body.get(name) is None}


def _reasoning(kind: str, body: dict, tokenizer, prompt_ids: list[int], parser: str | None) -> ReasoningFormat | None:
    """The format a chat answer's thinking is split off in, unless it does not think: no parser, the prompt
    closed the thinking, or the parser's chat_template_kwargs switch turned it off."""
    fmt = REASONING_PARSERS[parser] if parser is not None and kind == "chat" else None
    if fmt is None or not thinking_open(tokenizer, prompt_ids):
        return None
    switch = fmt.switch and template_kwargs(body).get(fmt.switch)
    return None if switch is False else fmt


def refuse_adapter_embeddings(body, loras: dict) -> None:
    """An embedding or score body naming a LoRA adapter as its model: a 400 (adapters generate)."""
    if isinstance(body, dict) and body.get("model") in loras:
        raise APIError(f"{body['model']} is a LoRA adapter: adapters generate; embeddings and scores come from the "
                       "base model", param="model")


def _beam_search(body: dict, params: SamplingParams, n: int, tools: ToolCalling | None) -> BeamSearchParams | None:
    """vLLM's use_beam_search: n beams of each prompt, ranked with length_penalty (flock/beam_search.py)."""
    length_penalty = _number(body, "length_penalty", 1.0)
    if not typed_field(body, "use_beam_search", bool, False):
        return None
    clash = next((name for name in _NOT_WITH_BEAMS
                  if not (body.get(name) is None or body[name] is False or body[name] == {"type": "text"})), None)
    if clash or tools is not None:
        name = clash or "tool_choice"
        raise APIError(f"{name} is not supported with use_beam_search", param=name)
    beam = BeamSearchParams(n, params.max_tokens or 0, params.ignore_eos, params.temperature, length_penalty,
                            params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens,
                            cache_salt=params.cache_salt, priority=params.priority, lora_request=params.lora_request,
                            multi_modal=params.multi_modal)
    try:
        beam.validate(max_tokens_set=params.max_tokens is not None)
    except ValueError as e:
        raise APIError(str(e), param="n" if str(e).startswith("beam_width") else "max_tokens") from None
    return beam


def _check_unsupported(body: dict, kind: str) -> None:
    neutral = _NEUTRAL_FIELDS | (_CHAT_NEUTRAL_FIELDS if kind == "chat" else {})
    for name, value in neutral.items():
        if body.get(name) is not None and body[name] != value:
            raise APIError(f"{name}={body[name]!r} is not supported (Flock runs {name}={value!r})", param=name)
    if typed_field(body, "best_of", int, 1) != 1:
        raise APIError("only best_of=1 is supported", param="best_of")


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per output token: completions' logprobs=N; chat's logprobs=true with top_logprobs."""
    if kind == "completion":
        return _bounded(body, "logprobs")
    top = _bounded(body, "top_logprobs")
    if not typed_field(body, "logprobs", bool, False):
        if top:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        return None
    return top or 0


def _logprob_token_ids(body: dict, logprobs: int | None, echo_only: bool) -> list[int] | None:
    """vLLM's: the tokens whose logprobs each output token lists; it needs logprobs asked (chat's true)."""
    ids = _int_list(body, "logprob_token_ids") or None
    if ids is not None and logprobs is None:
        raise APIError("logprob_token_ids needs logprobs to be set", param="logprob_token_ids")
    if ids is not None and echo_only:
        raise APIError("logprob_token_ids needs generated tokens (echo with max_tokens 0 has none)",
                       param="logprob_token_ids")
    return ids


def _bounded(body: dict, name: str) -> int | None:
    """A logprobs count: at least 0, or -1 (the whole vocabulary); the engine's max_logprobs bounds it."""
    value = typed_field(body, name, int, None)
    if value is not None and value < -1:
        raise APIError(f"{name} must be at least 0, or -1 (the whole vocabulary), got {value}", param=name)
    return value


def _structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint of `response_format` (OpenAI's) or `structured_outputs` (vLLM's), and which field set it."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    legacy = {kind: body[name] for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None}
    if legacy:  # vLLM's fields before structured_outputs, which pipelines written for it still send
        name = next(n for n in GUIDED_FIELDS if body.get(n) is not None)
        if extra is not None or len(legacy) > 1:
            raise APIError(f"{name}: give one guided_* field, and not beside structured_outputs", param=name)
        return _checked(StructuredOutputsParams(**legacy), name), "structured_outputs"
    if fmt is not None and extra is not None and fmt != {"type": "text"}:
        raise APIError("set response_format or structured_outputs, not both", param="structured_outputs")
    if isinstance(extra, dict):
        extra = {k: v for k, v in extra.items() if v is not None}  # null is absent, as everywhere in a body
    if extra is not None:
        if not isinstance(extra, dict) or not extra.keys() <= STRUCTURED_FIELDS:
            raise APIError(f"structured_outputs must be an object with some of {sorted(STRUCTURED_FIELDS)}",
                           param="structured_outputs")
        if isinstance(extra.get("structural_tag"), dict):
            extra = extra | {"structural_tag": json.dumps(extra["structural_tag"])}
        spec = StructuredOutputsParams(**extra)
        return _checked(spec, "structured_outputs"), "structured_outputs"
    if fmt is None:
        return None, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind == "structural_tag":  # xgrammar's (and vLLM's) {"type": "structural_tag", "format": {...}}
        return StructuredOutputsParams(structural_tag=json.dumps(fmt)), "response_format"
    if kind != "json_schema":
        raise APIError("response_format.type must be text, json_object, json_schema or structural_tag",
                       param="response_format")
    schema = fmt.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), (dict, str)):
        raise APIError("response_format.json_schema must be an object with a 'schema' object",
                       param="response_format")
    if not isinstance(schema.get("name"), str):  # required by OpenAI and vLLM alike
        raise APIError("response_format.json_schema.name is required (a string)", param="response_format")
    spec = StructuredOutputsParams(json=schema.get("schema", {}))  # no schema: any JSON value
    return _checked(spec, "response_format"), "response_format"


def _checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    try:
        spec.validate()
        if isinstance(spec.json, str):
            spec.json = json.loads(spec.json)
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None
    return spec


def _completion_prompts(body: dict, tokenizer) -> tuple[list[str | None], list[list[int]]]:
    return prompt_list(body, "prompt", tokenizer)


def _with_suffix(body: dict, texts: list[str | None], prompts: list[list[int]], tokenizer, echo: bool
                 ) -> list[list[int]]:
    """OpenAI's `suffix` (insertion): each prompt as the prefix of the model's fill-in-the-middle prompt, [BOS]
    [PRE]prompt[SUF]suffix[MID]; the completion is the text between them."""
    suffix = typed_field(body, "suffix", str, "")
    if not suffix:
        return prompts
    fim = fim_tokens(tokenizer)
    if not {"pre", "suf", "mid"} <= fim.keys():
        raise APIError("suffix needs a model with fill-in-the-middle tokens (<|fim_prefix|>, <fim_prefix>, <PRE>, "
                       "...); this one has none", param="suffix")
    if echo:
        raise APIError("suffix and echo cannot be combined", param="suffix")
    bos, tail = bos_prefix(tokenizer), tokenizer.encode(suffix, add_special_tokens=False)
    return [fim_prompt(fim, bos, ids if text is None else tokenizer.encode(text, add_special_tokens=False), tail)
            for text, ids in zip(texts, prompts)]


def prompt_list(body: dict, name: str, tokenizer) -> tuple[list[str | None], list[list[int]]]:
    """(texts, token ids) of the field `name` (completions' prompt, embeddings' input): a string, a list of token
    ids, or a list of either (not mixed); strings tokenized with add_special_tokens (default true)."""
    if name not in body:
        raise APIError(f"'{name}' is required", param=name)
    p = body[name]
    if isinstance(p, str) or _is_token_ids(p):
        p = [p]
    if not isinstance(p, list) or not p or not (all(isinstance(x, str) for x in p) or all(map(_is_token_ids, p))):
        raise APIError(f"{name} must be a non-empty string, a non-empty list of token ids, or a non-empty list of "
                       "either (all strings or all token-id lists)", param=name)
    if any(x == "" for x in p):
        raise APIError(f"{name} is empty", param=name)
    texts = [x if isinstance(x, str) else None for x in p]
    special = typed_field(body, "add_special_tokens", bool, True)
    return texts, [tokenizer.encode(x, add_special_tokens=special) if isinstance(x, str) else list(x) for x in p]


def _is_token_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("function"), dict)
                for c in calls)):
            raise APIError(f"messages[{i}].tool_calls must be a list of {{'type': 'function', 'function': {{...}}}}",
                           param=f"messages[{i}].tool_calls")
        out.append(m | {"content": _content(m.get("content"), i)})  # name, tool_calls, ... as sent
    return out


def _content(content, i: int) -> str | list[dict] | None:
    """A message's content, checked: a string, or image_url and text parts, a bare string among them a text part
    (as vLLM reads it; the template's content format decides how they reach it: flock.chat_content)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in content]
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "image_url" and not (kind in TEXT_PARTS and isinstance(part.get(TEXT_PARTS[kind]), str)):
                raise APIError(f"messages[{i}].content: only image_url and text parts ({', '.join(TEXT_PARTS)}, "
                               "with their text) are supported", param=f"messages[{i}].content")
        return content
    raise APIError(f"messages[{i}].content must be a string or a list of content parts", param=f"messages[{i}].content")


def encode_messages(tokenizer, messages: list[dict], **template_options) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template (a ChatML fallback when it has none); the
    options of `flock.tokenizer.encode_chat`."""
    try:
        return encode_chat(tokenizer, messages, **template_options)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def lone_surrogate(value) -> str | None:
    """Why a decoded JSON value cannot be tokenized or written back as UTF-8 (a lone \\udXXX escape), or None."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        return f"contains a lone UTF-16 surrogate escape ({e.object[e.start]!r}), which is not valid Unicode"
    return None


def _chat_prompt(body: dict, tokenizer, tool_parser: str | None, tokens_only: bool = False
                 ) -> tuple[list[str], list[list[int]], ToolCalling | None]:
    """The chat's echo text and token ids, with vLLM's template options, and how it may call tools (with
    `tokens_only`, none: its tools are shown, whatever parser could call them). The echo is the last message's
    content when the answer continues it (continue_final_message, or an assistant message last), else empty."""
    messages = _messages(body)
    try:
        shown = body | {"tool_choice": "none"} if tokens_only and body.get("tools") else body
        tools, calling = parse_tools(shown, tool_parser)
    except ToolError as e:
        raise APIError(str(e), param=e.param) from None
    add = typed_field(body, "add_generation_prompt", bool, True)
    chat = chat_options(tokenizer)
    if chat.exclude_tools_when_none and body.get("tool_choice") == "none":
        tools = None
    options = dict(add_generation_prompt=add, tools=tools, chat_template_kwargs=template_kwargs(body),
                   continue_final_message=typed_field(body, "continue_final_message", bool, False),
                   chat_template=request_template(body, chat))
    special = typed_field(body, "add_special_tokens", bool, False)
    images = None
    if has_images(messages):
        ids, images = _image_chat(tokenizer, messages, options, special)
    else:
        ids = encode_messages(tokenizer, messages, add_special_tokens=special, **options)
    last = messages[-1]
    echo = joined_text(last["content"]) if not add or last["role"] == "assistant" else ""
    role = chat.response_role if add else last["role"]  # vLLM's
    return [echo], [ids], calling, images, role


def _image_chat(tokenizer, messages: list[dict], options: dict, add_special_tokens: bool
                ) -> tuple[list[int], ImageInputs]:
    """Token ids and images of a chat with image_url parts, through the model's processor (data: and http(s)
    URLs; no local files)."""
    param = f"messages[{next(i for i, m in enumerate(messages) if isinstance(m['content'], list))}].content"
    processor = image_prompts(tokenizer.name_or_path)
    if processor is None:
        raise APIError(IMAGES_REFUSED, param=param)
    images, rendered = [], []
    for i, m in enumerate(messages):
        if isinstance(m["content"], list):
            try:  # each message's images read here, so that a bad one is named by its message
                parts, found = split_images(m["content"])
                images += [load_image(source, allow_files=False) for source in found]
            except ValueError as e:
                raise APIError(str(e), param=f"messages[{i}].content") from None
            m = m | {"content": parts}
        rendered.append(m)
    try:
        text = chat_text(tokenizer, rendered, image_text=processor.placeholder, **options)
        return processor.encode(text, images, add_special_tokens, allow_files=False)
    except ValueError as e:
        raise APIError(str(e), param=param) from None


def request_template(body: dict, chat: ChatOptions) -> str | None:
    """A body's own chat_template: used if the server trusts it (vLLM's --trust-request-chat-template)."""
    template = typed_field(body, "chat_template", str, None)
    if template is not None and not chat.trust_request_template:
        raise APIError("chat_template is passed with the request, but the server was not started with "
                       "--trust-request-chat-template", param="chat_template")
    return template


def template_kwargs(body: dict) -> dict:
    """What a chat body hands its template, as vLLM: chat_template_kwargs, and `documents` (RAG templates) and
    `reasoning_effort`, which also sets enable_thinking (false for "none") unless chat_template_kwargs does."""
    kwargs = dict(typed_field(body, "chat_template_kwargs", dict, None) or {})
    documents = typed_field(body, "documents", list, None)
    if documents is not None:
        if not all(isinstance(d, dict) for d in documents):
            raise APIError("documents must be a list of objects", param="documents")
        kwargs["documents"] = documents
    effort = typed_field(body, "reasoning_effort", str, None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           param="reasoning_effort")
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def _sampling_params(body: dict, kind: str, default_max_tokens: int | None, n: int = 1) -> SamplingParams:
    max_tokens = typed_field(body, "max_tokens", int, None)
    if kind == "chat":
        max_tokens = typed_field(body, "max_completion_tokens", int, max_tokens)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise APIError("stop must be a string or a list of strings", param="stop")
    params = SamplingParams(
        n=n,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=typed_field(body, "top_k", int, -1),
        min_p=_number(body, "min_p", 0.0),
        seed=typed_field(body, "seed", int, None),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stop=stop,
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=typed_field(body, "ignore_eos", bool, False),
        skip_special_tokens=typed_field(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=typed_field(body, "include_stop_str_in_output", bool, False),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=typed_field(body, "logit_bias", dict, None),
        min_tokens=typed_field(body, "min_tokens", int, 0),
        allowed_token_ids=typed_field(body, "allowed_token_ids", list, None),
        bad_words=typed_field(body, "bad_words", list, None),
        truncate_prompt_tokens=typed_field(body, "truncate_prompt_tokens", int, None),
        truncation_side=typed_field(body, "truncation_side", str, "left"),
        cache_salt=typed_field(body, "cache_salt", str, None),
        priority=typed_field(body, "priority", int, 0),
        thinking_token_budget=typed_field(body, "thinking_token_budget", int, None),
        repetition_detection=typed_field(body, "repetition_detection", dict, None),
        stream_interval=typed_field(body, "stream_interval", int, None),
    )
    for name in LLAMA_CPP_SAMPLING:
        if body.get(name) is not None:
            type_ = type(getattr(params, name))
            value = typed_field(body, name, type_, None) if type_ is not float else _number(body, name, 0)
            setattr(params, name, value)
    try:
        params.validate()
    except ValueError as e:
        message, param = str(e), str(e).split()[0]
        if param == "max_tokens" and _max_tokens_field(body, kind) == "max_completion_tokens":  # the field sent
            message, param = message.replace(param, "max_completion_tokens", 1), "max_completion_tokens"
        raise APIError(message, param=param) from None
    return params


def check_fields(body: dict, allowed) -> None:
    """An APIError naming a field outside `allowed` that Flock knows (_REFUSED_FIELDS); the body's other fields
    outside `allowed` are ignored, as vLLM ignores them (a proxy's or another provider's), and logged once. A null
    counts as absent."""
    extra = tuple(sorted(name for name, value in body.items() if name not in allowed and value is not None))
    refused = [name for name in extra if name in _REFUSED_FIELDS]
    if refused:
        raise APIError(f"{refused[0]} is not supported here", param=refused[0])
    if extra:
        _log_ignored(extra)


@functools.lru_cache(maxsize=256)
def _log_ignored(names: tuple[str, ...]) -> None:
    log.warning("ignoring request field(s) Flock does not know: %s", ", ".join(names))


def typed_field(body: dict, name: str, kind: type, default):
    """body[name] if it is a `kind`, `default` if it is absent or null; else an APIError naming it. As vLLM's
    models read JSON: a whole number written as a float is an int (3.0), 0 and 1 are booleans."""
    value = body.get(name)
    if value is None:
        return default
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is bool and type(value) is int and value in (0, 1):
        return bool(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise APIError(f"{name} must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise APIError(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name) or []
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in value):
        raise APIError(f"{name} must be a list of integers", param=name)
    return value


# ---- responses -------------------------------------------------------------------------------------------


def new_id(kind: str, given: str | None = None) -> str:
    """A response id: the client's (vLLM's request_id field or X-Request-Id header), else a fresh one."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + (given or uuid.uuid4().hex)


def cursor_page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list page: the `limit` items after the one whose id is `after` (from the start when none is)."""
    start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), 0) if after else 0
    page = items[start : start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def choices_usage(finals: list, n: int, reasoning_tokens: int | None = None) -> dict:
    """Usage of a request's finished choices (in choice order, each with num_prompt/output/cached_tokens): each
    prompt counts once however many samples it has, as vLLM counts it; with a reasoning parser, vLLM's
    completion_tokens_details too."""
    firsts = finals[::n]
    out = usage(sum(f.num_prompt_tokens for f in firsts), sum(f.num_output_tokens for f in finals),
                sum(f.num_cached_tokens for f in firsts))
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class Choice(NamedTuple):
    """One choice of a response: its text and finish reason, and its logprobs in the response's shape."""

    text: str
    finish_reason: str | None
    logprobs: dict | None = None
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it
    tool_calls: list[dict] | None = None  # a chat answer's calls, parsed out of its text (then None or the rest)
    reasoning: str | None = None  # a chat answer's thinking, split off its text
    reasoning_tokens: int | None = None  # and how many output tokens it took
    token_ids: list[int] | None = None  # with return_token_ids: the output's
    prompt_token_ids: list[int] | None = None  # and the prompt's


def make_choice(gen: GenerationRequest, index: int, text: str, finish_reason: str | None, output_ids: list[int],
                logprobs: list[TokenLogprobs] | None, prompt_entries: list[TokenLogprobs | None] | None,
                token_text: TokenText, stop_reason: int | str | None = None) -> Choice:
    """Choice `index` of a finished request (prompt index // n), echoed, with logprobs and its tool calls as the
    body asked."""
    if gen.tokens_as_ids:
        token_text = token_text.for_request(True)
    prompt_ids = gen.prompts[index // gen.n]
    if gen.echo_only:
        text, output_ids, logprobs = "", [], [] if logprobs is not None else None
    tool_calls = reasoning = reasoning_tokens = None
    if gen.reasoning:
        reasoning, text = gen.reasoning.split(text)
        reasoning_tokens = reasoning_token_count(token_text.tokenizer, output_ids, gen.reasoning)
        if not gen.include_reasoning:  # nor its tokens, in logprobs or ids (as vLLM)
            reasoning = logprobs = None
            gen = replace(gen, return_token_ids=False)
    if gen.tools is not None and text is not None:
        text, tool_calls = gen.tools.extract(text)
        finish_reason = gen.tools.finish_reason(tool_calls, finish_reason)
        if gen.tools.choice != "auto":  # a forced call's content is "", not null (as vLLM's)
            text = text or ""
    if gen.echo:
        prompt_text = gen.texts[index // gen.n]
        text = (prompt_text if prompt_text is not None else token_text.tokenizer.decode(prompt_ids)) + (text or "")
    shaped = None
    if logprobs is not None and gen.kind == "chat":
        shaped = chat_logprobs(token_text, logprobs)
    elif logprobs is not None:
        echoed = prompt_entries if prompt_entries is not None else [None] * len(prompt_ids)
        ids, entries = (prompt_ids + output_ids, echoed + logprobs) if gen.echo else (output_ids, logprobs)
        shaped = completion_logprobs(token_text, ids, entries)
    prompt = prompt_logprobs(token_text, prompt_ids, prompt_entries) \
        if gen.prompt_logprobs and prompt_entries is not None else None
    ids = (output_ids, prompt_ids) if gen.return_token_ids else (None, None)
    return Choice(text, finish_reason, shaped, prompt, stop_reason, tool_calls or None, reasoning, reasoning_tokens,
                  *ids)


def response_body(kind: str, request_id: str, model: str, choices: list[Choice | tuple[str, str | None]],
                  usage_: dict, created: int | None = None, role: str = "assistant") -> dict:
    """A complete (non-streaming) completion or chat.completion object."""
    created = created or int(time.time())
    choices = [Choice(*c) for c in choices]
    if kind == "completion":
        out = [{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
               | ({"prompt_logprobs": c.prompt_logprobs} if c.prompt_logprobs is not None else {})
               | _token_ids(c.token_ids, c.prompt_token_ids) for i, c in enumerate(choices)]
        obj = "text_completion"
    else:
        out = [{"index": i, "message": {"role": role, "content": c.text}
                | ({"reasoning": c.reasoning} if c.reasoning is not None else {})
                | ({"tool_calls": c.tool_calls} if c.tool_calls else {}),
                "logprobs": c.logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               | _token_ids(c.token_ids) for i, c in enumerate(choices)]
        obj = "chat.completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": out, "usage": usage_}
    if kind == "chat" and choices:
        body |= _token_ids(prompt_token_ids=choices[0].prompt_token_ids)  # vLLM's place for a chat's
    if kind == "chat" and choices and choices[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = choices[0].prompt_logprobs  # vLLM's place for a chat's
    return body


def chunk_body(kind: str, request_id: str, model: str, delta: str, finish_reason: str | None, created: int,
               first: bool = False, usage_: dict | None = None, index: int = 0, logprobs: dict | None = None,
               stop_reason: int | str | None = None, tool_calls: list[dict] | None = None,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
               reasoning: str = "", usage_so_far: dict | None = None, role: str = "assistant") -> dict:
    """One streamed chunk of choice `index` (with the logprobs of its tokens, when asked; a chat's with whole
    tool calls; with return_token_ids its token ids, and the prompt's in the first; with `usage_so_far` the
    choice's usage until now, as vLLM's continuous_usage_stats). With `usage_` it is the final usage-only chunk
    (empty choices), as OpenAI sends it."""
    if usage_ is not None:
        choices = []
    elif kind == "completion":
        choices = [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason} | _token_ids(token_ids, prompt_token_ids)]
    else:
        d = {"role": role, "content": delta} if first else ({"content": delta} if delta else {})
        if reasoning:
            d["reasoning"] = reasoning
        if tool_calls:
            d["tool_calls"] = [{"index": k} | call for k, call in enumerate(tool_calls)]
        choices = [{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason} | _token_ids(token_ids)]
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if kind == "chat":
        body |= _token_ids(prompt_token_ids=prompt_token_ids)
    if usage_ is not None or usage_so_far is not None:
        body["usage"] = usage_ if usage_ is not None else usage_so_far
    return body


def _token_ids(token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """vLLM's return_token_ids fields, those that are set."""
    return ({} if prompt_token_ids is None else {"prompt_token_ids": prompt_token_ids}) | \
        ({} if token_ids is None else {"token_ids": token_ids})


def reasoning_usage(gen: GenerationRequest, choices: list) -> int | None:
    """The choices' reasoning tokens (each a Choice or a streamed choice, with `reasoning_tokens`) of a chat a
    reasoning parser reads (0 when its thinking was off, as vLLM reports it)."""
    if not gen.counts_reasoning:
        return None
    return sum(c.reasoning_tokens for c in choices) if gen.reasoning else 0


def is_int(x) -> bool:
    """An integer, not a bool (JSON's true is not 1 here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def given(body: dict, name: str, default):
    """A field of a body, `default` when absent or null (as llama-server and SGLang read theirs)."""
    value = body.get(name)
    return default if value is None else value


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A bool field of a body, `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{name} must be a bool, got {value!r}", param=name)
    return value
