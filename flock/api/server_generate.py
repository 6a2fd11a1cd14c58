"""POST /v1/completions and /v1/chat/completions (and /v1/embeddings, SGLang's /generate): parse, submit to the
engine, answer whole or as SSE.

A body with several choices (n samples of each of its prompts) is one engine request per choice, their outputs
merged as they come. A request ends with its client: a streaming response closes its generator when the client
goes away, and a whole response polls `is_disconnected`; either way all of its engine requests are aborted and
their KV blocks freed, as they are when one of them fails.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from flock.api import llama_cpp
from flock.api.answer_stream import AnswerStream
from flock.api.generative_scores import parse_label_scores
from flock.api.infill import parse_infill
from flock.api.logprobs import TokenText, chat_logprobs, completion_logprobs
from flock.engine.detokenizer import PIECE_CONTEXT_TOKENS
from flock.api.pooling import pooling_request
from flock.api.messages import MessageEvents, MessagesRequest, parse_messages
from flock.api.messages import renamed as messages_renamed
from flock.api.metrics import Metrics
from flock.api.protocol import (
    APIError,
    Choice,
    GenerationRequest,
    choices_usage,
    chunk_body,
    engine_error,
    make_choice,
    max_tokens_cap,
    model_defaults,
    new_id,
    parse_request,
    reasoning_usage,
    refuse_adapter_embeddings,
    response_body,
    usage,
    with_defaults,
)
from flock.api.responses import ResponseEvents, ResponsesRequest, ResponseStore, parse_responses, renamed
from flock.api.sglang import NativeRequest, output_object, parse_generate
from flock.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestStream,
    StreamOutput,
)
from flock.lora import LoRARequest
from flock.pooling_params import PoolingParams
from flock.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerContext:
    engine: AsyncEngine
    metrics: Metrics
    model_names: list[str]  # the first one is reported in responses
    api_keys: list[str] | None = None  # any of them opens /v1 (None: no key)
    tool_parser: str | None = None  # flock.api.tools.TOOL_PARSERS; None: no tool calls
    reasoning_parser: str | None = None  # flock.api.reasoning.REASONING_PARSERS; None: thinking is content
    responses: ResponseStore = field(default_factory=ResponseStore)
    batch_dir: str | None = None  # where /v1/files keeps uploads and batch outputs (None: a temporary folder)
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # the LoRA adapters (--lora-modules) by model name
    # completions' and chats' fields a body that leaves them unset gets (vLLM's --return-tokens-as-token-ids)
    body_defaults: dict = field(default_factory=dict)
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: every stream ends with its usage
    token_text: TokenText = field(init=False)
    # where bodies are parsed (prompts tokenized, chat templates rendered): one thread, off the event loop, so a
    # huge prompt holds up no other client's stream or /health (vLLM tokenizes on an executor too)
    parse_pool: ThreadPoolExecutor = field(init=False)

    @property
    def max_tokens_cap(self) -> int | None:
        return max_tokens_cap(self.engine.config, self.engine.sampling_defaults)

    def __post_init__(self):
        self.token_text = TokenText(self.engine.tokenizer)
        self.parse_pool = ThreadPoolExecutor(1, thread_name_prefix="flock-parse")

    async def parsed(self, parse: Callable, *args, **kwargs):
        """parse(*args, **kwargs) on the parsing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.parse_pool, partial(parse, *args, **kwargs))


@dataclass
class Reply:
    kind: str
    id: str
    model: str
    created: int
    role: str = "assistant"  # a chat answer's

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool = False,
              logprobs: dict | None = None, stop_reason: int | str | None = None, **ids_and_calls) -> str:
        return _sse(chunk_body(self.kind, self.id, self.model, text, finish_reason, self.created, first=first,
                               index=index, logprobs=logprobs, stop_reason=stop_reason, role=self.role,
                               **ids_and_calls))


async def generate(kind: str, raw: Request, ctx: ServerContext):
    defaults = model_defaults(ctx.engine.sampling_defaults, kind) | ctx.body_defaults
    gen = await ctx.parsed(parse_request, kind, with_defaults(await json_body(raw), defaults),
                           ctx.engine.tokenizer, default_max_tokens=16 if kind == "completion" else None,
                           tool_parser=ctx.tool_parser, reasoning_parser=ctx.reasoning_parser)
    check_model({"model": gen.model}, ctx)
    gen.include_usage = gen.include_usage or ctx.force_include_usage
    gen.use_lora(ctx.loras.get(gen.model))
    gen.fit(ctx.engine.max_model_len, ctx.max_tokens_cap)
    given = raw.headers.get("x-request-id") or gen.request_id  # vLLM's order: the header first
    reply = Reply(kind, new_id(kind, given), reported_model(gen.model, ctx), int(time.time()), gen.role)
    if gen.beam is not None:
        return JSONResponse(await _beam_search(reply, gen, raw, ctx))
    streams = await _submit(gen.engine_requests(), ctx, lambda e: engine_error(e, gen), gen.n)
    if gen.stream:
        return _SSEResponse(_stream(reply, gen, streams, ctx), media_type="text/event-stream")
    parts = await _collect(streams, raw, ctx)
    choices = [make_choice(gen, i, "".join(p.texts), p.last.finish_reason, p.token_ids, p.logprobs,
                           p.prompt_logprobs, ctx.token_text, p.last.stop_reason) for i, p in enumerate(parts)]
    usage_ = choices_usage([p.last for p in parts], gen.n, reasoning_usage(gen, choices))
    return JSONResponse(response_body(reply.kind, reply.id, reply.model, choices, usage_, reply.created, reply.role))


async def _beam_search(reply: Reply, gen: GenerationRequest, raw: Request, ctx: ServerContext) -> dict:
    """vLLM's use_beam_search (flock/beam_search.py): each step's requests through the engine."""
    searches = gen.beam_searches(ctx.engine.max_model_len, ctx.engine.eos_token_ids)
    while live := [s for s in searches if not s.done]:
        try:
            streams = await _submit([r for s in live for r in s.requests()], ctx, lambda e: engine_error(e, gen))
        except APIError as e:
            if e.status != 503 or not any(s.steps for s in searches):
                raise
            for search in live:  # the engine stopped between steps: the beams as they are
                search.abort()
            break
        parts = iter(await _collect(streams, raw, ctx))
        for search in live:
            results = [next(parts).logprobs for _ in search.beams]
            if all(results):
                search.advance([r[0] for r in results])
            else:  # aborted (the client went away, the server stops): the beams as they are
                search.abort()
    choices, usage_ = gen.beam_choices(searches, ctx.token_text)
    return response_body(reply.kind, reply.id, reply.model, choices, usage_, reply.created, reply.role)


async def generate_native(raw: Request, ctx: ServerContext):
    """SGLang's POST /generate (flock/api/sglang.py)."""
    req = await ctx.parsed(parse_generate, await json_body(raw), ctx.engine.tokenizer, ctx.loras,
                           ctx.engine.max_model_len, ctx.engine.config.scheduler == "priority")
    streams = await _submit(req.requests, ctx, lambda e: APIError(str(e)))
    start = time.monotonic()
    if req.stream:
        return _SSEResponse(_native_stream(req, streams, ctx), media_type="text/event-stream")
    parts = await _collect(streams, raw, ctx)
    objects = [_native_object(req, i, p, ctx, time.monotonic() - start) for i, p in enumerate(parts)]
    return JSONResponse(objects[0] if req.single else objects)


async def generate_llama_cpp(raw: Request, ctx: ServerContext, infill: bool = False):
    """llama-server's POST /completion (flock/api/llama_cpp.py), or its /infill (flock/api/infill.py)."""
    body, tokenizer = await json_body(raw), ctx.engine.tokenizer
    req = await ctx.parsed(parse_infill, body, tokenizer, ctx.engine.max_model_len) if infill else \
        await ctx.parsed(llama_cpp.parse_completion, body, tokenizer)
    start = time.monotonic()
    streams = await _submit(req.requests, ctx, lambda e: APIError(str(e)))
    if req.stream:
        return _SSEResponse(_llama_cpp_stream(req, streams, ctx, start), media_type="text/event-stream")
    parts = await _collect(streams, raw, ctx)
    objects = [_llama_cpp_object(req, i, p, ctx, start) for i, p in enumerate(parts)]
    return JSONResponse(objects[0] if req.single else objects)


async def _llama_cpp_stream(req: llama_cpp.Completion, streams: list[RequestStream], ctx: ServerContext,
                            start: float) -> AsyncIterator[str]:
    """llama-server's events: each new piece of text with its token ids, then a completion's final object (no
    [DONE])."""
    parts = [ChoiceParts() for _ in streams]
    try:
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for i, out in outs:
                if out.error:
                    yield _sse({"error": {"code": 500, "message": out.error, "type": "server_error"}})
                    break
                parts[i].add(out)
                if (out.text or out.token_ids) and not req.prefill_only:
                    yield _sse(llama_cpp.partial_object(req, i, out.text, out.token_ids, len(parts[i].token_ids),
                                                        out.num_prompt_tokens, out.logprobs, ctx.token_text))
                if out.finished:
                    yield _sse(_llama_cpp_object(req, i, parts[i], ctx, start))
    finally:
        _close(streams, ctx.metrics)


def _llama_cpp_object(req: llama_cpp.Completion, i: int, part: "ChoiceParts", ctx: ServerContext, start: float) -> dict:
    last, first = part.last, part.first_token_at or part.last_at
    predicted = 0 if req.prefill_only else len(part.token_ids)
    timings = llama_cpp.timings(last.num_cached_tokens, last.num_prompt_tokens, first - start, predicted,
                                part.last_at - first)
    return llama_cpp.completion_object(req, i, "".join(part.texts), part.token_ids, req.requests[i][0],
                                       last.num_cached_tokens, last.finish_reason, last.stop_reason, part.logprobs,
                                       ctx.model_names[0], ctx.engine.tokenizer, ctx.token_text, timings,
                                       ctx.engine.max_model_len)


async def score(raw: Request, ctx: ServerContext):
    """POST /v1/score: SGLang's label scoring when the body has label_token_ids, else vLLM's pair scores."""
    body = await json_body(raw)
    if isinstance(body, dict) and "label_token_ids" in body:
        return await score_labels(raw, ctx, "sglang", body)
    return await embed(raw, ctx, "score", body)


async def score_labels(raw: Request, ctx: ServerContext, kind: str = "vllm", body=None):
    """POST /generative_scoring (kind "vllm") or SGLang's /v1/score (kind "sglang", flock/api/generative_scores.py):
    one token after each item, the labels' probabilities from its logprobs."""
    body = check_model(await json_body(raw) if body is None else body, ctx)
    engine = ctx.engine
    req = await ctx.parsed(parse_label_scores, kind, body, engine.tokenizer, engine.vocab_size, engine.max_model_len)
    req.params.lora_request = ctx.loras.get(body.get("model"))
    streams = await _submit([(ids, req.params) for ids in req.prompts], ctx, req.rejected)
    parts = await _collect(streams, raw, ctx)
    tops = [p.logprobs[0].top for p in parts]
    return JSONResponse(req.body(reported_model(body.get("model"), ctx), tops, sum(map(len, req.prompts))))


async def embed(raw: Request, ctx: ServerContext, kind: str = "embedding", body=None):
    """POST /v1/embeddings (flock/api/embeddings.py), the score / rerank APIs (kind "score" / "rerank",
    flock/api/scores.py) or /classify (kind "classify", flock/api/classify.py): the prompts pooled, the response
    made of their vectors (embeddings, or a classifier's probabilities)."""
    body = check_model(await json_body(raw) if body is None else body, ctx)
    refuse_adapter_embeddings(body, ctx.loras)
    req = pooling_request(kind, body, ctx.engine.tokenizer, ctx.engine.tasks)
    streams = await _submit([(ids, req.params) for ids in req.prompts], ctx, req.rejected)
    parts = await _collect(streams, raw, ctx)
    prompt_tokens = sum(p.last.num_prompt_tokens for p in parts)
    return JSONResponse(req.body(ctx.model_names[0], [p.last.embedding for p in parts], prompt_tokens))


async def respond(raw: Request, ctx: ServerContext):
    """POST /v1/responses (flock/api/responses.py)."""
    body = check_model(await json_body(raw), ctx)
    history = ctx.responses.history(body.get("previous_response_id")) if isinstance(body, dict) else None
    req = await ctx.parsed(parse_responses, body, ctx.engine.tokenizer, ctx.tool_parser, ctx.reasoning_parser,
                           history, ctx.engine.sampling_defaults)
    gen, model = req.gen, reported_model(body.get("model"), ctx)
    gen.use_lora(ctx.loras.get(body.get("model")))
    req.storable = ctx.responses.capacity > 0
    try:
        gen.fit(ctx.engine.max_model_len, ctx.max_tokens_cap)
    except APIError as e:
        raise renamed(e) from None
    if gen.request_id:  # the body's, as vLLM's (an X-Request-Id header, which proxies repeat, names no response)
        req.id = gen.request_id if gen.request_id.startswith("resp_") else "resp_" + gen.request_id
        if ctx.responses.get(req.id) is not None:
            raise APIError(f"a stored response already has the id {req.id!r}", param="request_id")
    streams = await _submit(gen.engine_requests(), ctx, lambda e: renamed(engine_error(e, gen)), gen.n)
    if gen.stream:
        return _SSEResponse(_response_events(req, streams, ctx), media_type="text/event-stream")
    p = (await _collect(streams, raw, ctx))[0]
    choice = make_choice(gen, 0, "".join(p.texts), p.last.finish_reason, p.token_ids, p.logprobs, p.prompt_logprobs,
                         ctx.token_text, p.last.stop_reason)
    response = req.whole(model, choice, p.last, p.token_ids, ctx.engine.tokenizer)
    ctx.responses.put(req, response)
    return JSONResponse(response)


async def _response_events(req: ResponsesRequest, streams: list[RequestStream], ctx: ServerContext
                           ) -> AsyncIterator[str]:
    gen = req.gen
    events, answer = ResponseEvents(req, reported_model(gen.model, ctx)), AnswerStream(gen, ctx.engine.tokenizer)
    hidden = gen.reasoning and not gen.include_reasoning  # the thinking's logprobs too (as vLLM)
    logprobs = gen.params.logprobs is not None and not hidden
    token_text = ctx.token_text.for_request(gen.tokens_as_ids)
    seen: list[int] = []  # the last output tokens, that the next one's text may complete
    try:
        for event in events.start():
            yield _named_sse(event)
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for _, out in outs:
                if out.error:
                    sent = events.failed(out.error)
                else:
                    reasoning, content, calls, finish_reason = answer.split(out)
                    entries = chat_logprobs(token_text, out.logprobs, seen)["content"] \
                        if logprobs and out.logprobs else None
                    seen = [*seen, *(e.token_id for e in out.logprobs or [])][-PIECE_CONTEXT_TOKENS:]
                    sent = events.add("" if hidden else reasoning, content, entries, answer.answer_start)
                    if out.finished:
                        choice = Choice(events.content, finish_reason, tool_calls=calls or None,
                                        reasoning=events.reasoning, reasoning_tokens=answer.reasoning_tokens)
                        sent += events.finish(choice, out, answer.answer_start, logprobs)
                for event in sent:
                    yield _named_sse(event)
                if out.error or out.finished:
                    ctx.responses.put(req, sent[-1]["response"])
                    break
    finally:
        _close(streams, ctx.metrics)


async def answer_messages(raw: Request, ctx: ServerContext):
    """POST /v1/messages (flock/api/messages.py)."""
    body = check_model(await json_body(raw), ctx)
    req = await ctx.parsed(parse_messages, body, ctx.engine.tokenizer, ctx.tool_parser, ctx.reasoning_parser,
                           ctx.engine.sampling_defaults)
    gen, model = req.gen, reported_model(body.get("model"), ctx)
    gen.use_lora(ctx.loras.get(body.get("model")))
    try:
        gen.fit(ctx.engine.max_model_len, ctx.max_tokens_cap)
    except APIError as e:
        raise messages_renamed(e) from None
    streams = await _submit(gen.engine_requests(), ctx, lambda e: messages_renamed(engine_error(e, gen)), gen.n)
    given = raw.headers.get("x-request-id") or gen.request_id
    if given:
        req.id = given if given.startswith("msg_") else "msg_" + given
    if gen.stream:
        return _SSEResponse(_message_events(req, model, streams, ctx), media_type="text/event-stream")
    p = (await _collect(streams, raw, ctx))[0]
    choice = make_choice(gen, 0, "".join(p.texts), p.last.finish_reason, p.token_ids, None, None, ctx.token_text,
                         p.last.stop_reason)
    return JSONResponse(req.message(model, choice, p.last))


def count_message_tokens(body, ctx: ServerContext) -> dict:
    """POST /v1/messages/count_tokens: the prompt tokens a Messages body would run with."""
    req = parse_messages(check_model(body, ctx), ctx.engine.tokenizer, ctx.tool_parser, ctx.reasoning_parser,
                         count_only=True)
    return {"input_tokens": len(req.gen.prompts[0])}


async def _message_events(req: MessagesRequest, model: str, streams: list[RequestStream], ctx: ServerContext
                          ) -> AsyncIterator[str]:
    events, answer = MessageEvents(req, model), AnswerStream(req.gen, ctx.engine.tokenizer)
    try:
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for _, out in outs:
                if out.error:
                    sent = events.failed(out.error)
                else:
                    reasoning, content, calls, finish_reason = answer.split(out)
                    sent = events.add(out, reasoning, content)
                    if out.finished:
                        choice = Choice("", finish_reason, stop_reason=out.stop_reason, tool_calls=calls or None)
                        sent += events.finish(choice, out)
                for event in sent:
                    yield _named_sse(event)
                if out.error or out.finished:
                    break
    finally:
        _close(streams, ctx.metrics)


def check_model(body, ctx: ServerContext):
    """The body, if it names no model or one this server serves, a LoRA adapter included (else a 404)."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model not in ctx.model_names and model not in ctx.loras:
        raise APIError(f"the model `{model}` does not exist", param="model", status=404, code="model_not_found")
    return body


def reported_model(model: str | None, ctx: ServerContext) -> str:
    """The model name a response gives: the LoRA adapter's where the request named one (as vLLM), else the first
    served name."""
    return model if model in ctx.loras else ctx.model_names[0]


async def json_body(raw: Request):
    """The request's JSON body; a 400 for another media type (as vLLM: a page's form post is no API call)."""
    media = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(f"the request body must be sent as application/json, not {media or 'without a type'}",
                       code="unsupported_media_type")
    try:
        body = await raw.body()
    except ClientDisconnect:  # nobody to answer; not a server error
        raise APIError("the client disconnected while sending the request body", status=400) from None
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None


async def _submit(requests: list[tuple[list[int], SamplingParams | PoolingParams]], ctx: ServerContext,
                  rejected: Callable[[ValueError], APIError], n: int = 1) -> list[RequestStream]:
    """One engine request each, their grammars compiled first (on a worker thread, not the event loop); if one
    cannot be added, those already added are aborted. `rejected` words the engine's ValueError; each `n`
    consecutive requests are one prompt's choices."""
    if len(requests) > ctx.engine.max_waiting:  # would be refused however long it waited
        raise APIError(f"this request needs {len(requests)} engine requests (one per prompt and choice), more than "
                       f"the waiting queue holds (max_waiting={ctx.engine.max_waiting})", param="n")
    specs = {id(s): s for _, p in requests if isinstance(p, SamplingParams) and (s := p.structured_outputs)}
    for spec in specs.values():
        try:
            await ctx.engine.compile_grammar(spec)
        except EngineDead as e:
            raise APIError(str(e), status=503, type="server_error", code="engine_unavailable") from None
        except ValueError as e:
            raise rejected(e) from None
    streams = []
    try:
        for ids, params in requests:
            streams.append(ctx.engine.add_request(ids, params))
            ctx.metrics.prompt_tokens.inc(len(ids))
    except QueueFull as e:
        _close(streams, ctx.metrics)
        raise APIError(str(e), status=429, type="rate_limit_error", code="rate_limit_exceeded") from None
    except EngineDead as e:
        _close(streams, ctx.metrics)
        raise APIError(str(e), status=503, type="server_error", code="engine_unavailable") from None
    except ValueError as e:
        _close(streams, ctx.metrics)
        raise rejected(e) from None
    for i, (ids, params) in enumerate(requests):
        if isinstance(params, SamplingParams):
            streams[i].max_tokens = params.max_tokens or ctx.engine.max_model_len - len(ids)
        streams[i].siblings = streams[i - i % n : i - i % n + n]
    return streams


@dataclass
class ChoiceParts:
    """A choice's outputs so far."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    last: StreamOutput | None = None
    first_token_at: float | None = None  # time.monotonic() of the first output token
    last_at: float = 0.0  # of the last event

    def add(self, out: StreamOutput) -> None:
        self.last_at = time.monotonic()
        if self.first_token_at is None and out.token_ids:
            self.first_token_at = self.last_at
        self.texts.append(out.text)
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        self.last = out


async def _collect(streams: list[RequestStream], raw: Request, ctx: ServerContext) -> list[ChoiceParts]:
    """Each stream's outputs, whole; the requests are aborted if the client leaves first."""
    watcher = asyncio.create_task(_abort_on_disconnect(raw, streams))
    parts = [ChoiceParts() for _ in streams]
    try:
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for i, out in outs:
                if out.error:
                    raise APIError(out.error, status=500, type="server_error")
                parts[i].add(out)
    finally:
        watcher.cancel()
        _close(streams, ctx.metrics)
    return parts


async def _stream(reply: Reply, gen: GenerationRequest, streams: list[RequestStream],
                  ctx: ServerContext) -> AsyncIterator[str]:
    choices = [_StreamedChoice(reply, gen, i, ctx) for i in range(len(streams))]
    last: list[StreamOutput | None] = [None] * len(streams)
    try:
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for i, out in outs:
                if out.error:
                    yield _sse(APIError(out.error, status=500, type="server_error").body())
                    break
                last[i] = out
                for chunk in choices[i].chunks(out):
                    yield chunk
            else:
                if gen.include_usage:
                    usage_ = choices_usage(last, gen.n, reasoning_usage(gen, choices))
                    yield _sse(chunk_body(reply.kind, reply.id, reply.model, "", None, reply.created, usage_=usage_))
        yield "data: [DONE]\n\n"
    finally:
        _close(streams, ctx.metrics)


async def _native_stream(req: NativeRequest, streams: list[RequestStream], ctx: ServerContext
                         ) -> AsyncIterator[str]:
    """SGLang's events: each with the text and ids so far (and its index in a batch), then [DONE]."""
    start = time.monotonic()
    parts = [ChoiceParts() for _ in streams]
    try:
        async with aclosing(_merged(streams, ctx.metrics)) as outs:
            async for i, out in outs:
                if out.error:
                    yield _sse({"error": {"message": out.error}})
                    break
                parts[i].add(out)
                obj = _native_object(req, i, parts[i], ctx, time.monotonic() - start if out.finished else None)
                yield _sse(obj if req.single else obj | {"index": i})
        yield "data: [DONE]\n\n"
    finally:
        _close(streams, ctx.metrics)


def _native_object(req: NativeRequest, i: int, part: ChoiceParts, ctx: ServerContext,
                   latency: float | None) -> dict:
    last = part.last
    return output_object(req, i, "".join(part.texts), part.token_ids, last.num_prompt_tokens, last.num_cached_tokens,
                         last.finish_reason, last.stop_reason, req.requests[i][0], part.logprobs,
                         part.prompt_logprobs, ctx.token_text, latency)


class _StreamedChoice:
    """One choice of a streamed response: each engine output as the chunks to send, shaped as the body asked (echo,
    logprobs, token ids; a chat's thinking split off, its tool calls held back and parsed at the end)."""

    def __init__(self, reply: Reply, gen: GenerationRequest, index: int, ctx: ServerContext):
        self.reply, self.gen, self.index, self.ctx = reply, gen, index, ctx
        self.first = True
        self.usage_so_far: dict | None = None  # with continuous_usage_stats, set by each output
        self.token_text = ctx.token_text.for_request(gen.tokens_as_ids)
        self.offset = 0  # a completion's text_offset of its next token
        self.context: list[int] = []  # the last tokens sent with logprobs, that the next one's text may complete
        self.answer = AnswerStream(gen, ctx.engine.tokenizer)
        self.hidden = gen.reasoning and not gen.include_reasoning  # the thinking's logprobs and ids too (as vLLM)

    @property
    def reasoning_tokens(self) -> int:
        return self.answer.reasoning_tokens

    def chunks(self, out: StreamOutput) -> list[str]:
        gen = self.gen
        if gen.continuous_usage:
            self.usage_so_far = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        reasoning, text, tool_calls, finish_reason = self.answer.split(out)
        ids, entries = out.token_ids, None if self.hidden else out.logprobs
        fields = {"reasoning": reasoning} if reasoning and not self.hidden else {}
        if gen.echo_only:
            text, ids, entries = "", [], [] if entries is not None else None
        if gen.return_token_ids and not self.hidden:
            fields["token_ids"] = ids
            if self.first:
                fields["prompt_token_ids"] = gen.prompts[self.index // gen.n]
        if self.first and gen.echo:
            prompt, echoed = gen.prompts[self.index // gen.n], gen.texts[self.index // gen.n]
            text = (echoed if echoed is not None else self.ctx.engine.tokenizer.decode(prompt)) + text
            if entries is not None and gen.kind == "completion":
                ids, entries = prompt + ids, (out.prompt_logprobs or [None] * len(prompt)) + entries
        logprobs = self._logprobs(ids, entries)
        chunks = []
        if tool_calls:  # whole, in their own chunk before the finish
            chunks.append(self._chunk(text, None, logprobs, tool_calls=tool_calls, **fields))
            text, logprobs, fields = "", None, {"token_ids": []} if "token_ids" in fields else {}
        if text or fields or logprobs is not None or out.finished or (self.first and gen.kind == "chat"):
            chunks.append(self._chunk(text, finish_reason, logprobs, stop_reason=out.stop_reason, **fields))
        return chunks

    def _logprobs(self, ids: list[int], entries) -> dict | None:
        if entries is None:
            return None
        context, self.context = self.context, [*self.context, *ids][-PIECE_CONTEXT_TOKENS:]
        if self.gen.kind == "chat":
            return chat_logprobs(self.token_text, entries, context)
        shaped = completion_logprobs(self.token_text, ids, entries, self.offset, context)
        self.offset += sum(len(t) for t in shaped["tokens"])
        return shaped

    def _chunk(self, text: str, finish_reason: str | None, logprobs: dict | None, **fields) -> str:
        chunk = self.reply.chunk(self.index, text, finish_reason, first=self.first, logprobs=logprobs,
                                 usage_so_far=self.usage_so_far, **fields)
        self.first = False
        return chunk


async def _merged(streams: list[RequestStream], metrics: Metrics) -> AsyncIterator[tuple[int, StreamOutput]]:
    """The outputs of all the streams as they come, each with its stream's index."""
    queue: asyncio.Queue[tuple[int, StreamOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in _observed(stream, metrics):
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for p in pumps:
            p.cancel()


async def _observed(stream: RequestStream, metrics: Metrics) -> AsyncIterator[StreamOutput]:
    """The request's outputs, recorded in the metrics (token counts, latencies, the finish reason)."""
    seen, last, first = 0, None, None
    async for out in stream:
        now = time.monotonic()
        if first is None and out.num_output_tokens:
            first = now - stream.created
        metrics.output(out, out.num_output_tokens - seen, now - stream.created, None if last is None else now - last,
                       first)
        if out.finished:
            metrics.request_finished(stream)
        seen, last = out.num_output_tokens, now
        yield out


def _close(streams: list[RequestStream], metrics: Metrics) -> None:
    for stream in streams:
        if not stream.finished:
            stream.abort()
            metrics.aborted()


async def _abort_on_disconnect(raw: Request, streams: list[RequestStream]) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    for stream in streams:
        stream.abort()


class _SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a client that goes away aborts its request now
    rather than when the generator is garbage collected."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _named_sse(event: dict) -> str:
    """A Responses or Messages stream event, named by its type as OpenAI and Anthropic send them."""
    return f"event: {event['type']}\n" + _sse(event)
