"""POST /v1/completions and /v1/chat/completions: parse, submit to the engine, answer whole or as SSE.

A request ends with its client: a streaming response closes its generator when the client goes away, and a
whole response polls `is_disconnected`; either way the request is aborted and its KV blocks freed.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from flock.api.metrics import Metrics
from flock.api.protocol import (
    APIError,
    GenerationRequest,
    chunk_body,
    engine_error,
    new_id,
    parse_request,
    response_body,
    usage,
)
from flock.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestStream,
    StreamOutput,
)

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerContext:
    engine: AsyncEngine
    metrics: Metrics
    model_names: list[str]  # the first one is reported in responses
    api_key: str | None = None


@dataclass
class Reply:
    kind: str
    id: str
    model: str
    created: int

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> str:
        return _sse(chunk_body(self.kind, self.id, self.model, text, finish_reason, self.created, first=first))


async def generate(kind: str, raw: Request, ctx: ServerContext):
    gen = parse_request(kind, await _json_body(raw), ctx.engine.tokenizer,
                        default_max_tokens=16 if kind == "completion" else None)
    if gen.model is not None and gen.model not in ctx.model_names:
        raise APIError(f"the model `{gen.model}` does not exist", param="model", status=404, code="model_not_found")
    stream = _submit(gen, ctx)
    reply = Reply(kind, new_id(kind), ctx.model_names[0], int(time.time()))
    if gen.stream:
        return _SSEResponse(_stream(reply, gen, stream, ctx.metrics), media_type="text/event-stream")
    return await _whole(reply, stream, raw, ctx.metrics)


async def _json_body(raw: Request):
    try:
        return json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None


def _submit(gen: GenerationRequest, ctx: ServerContext) -> RequestStream:
    try:
        stream = ctx.engine.add_request(gen.prompt_token_ids, gen.params)
    except QueueFull as e:
        raise APIError(str(e), status=429, type="rate_limit_error", code="rate_limit_exceeded") from None
    except EngineDead as e:
        raise APIError(str(e), status=503, type="server_error", code="engine_unavailable") from None
    except ValueError as e:
        raise engine_error(e, gen.kind) from None
    ctx.metrics.prompt_tokens.inc(len(gen.prompt_token_ids))
    return stream


async def _whole(reply: Reply, stream: RequestStream, raw: Request, metrics: Metrics) -> JSONResponse:
    watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
    parts, last = [], None
    try:
        async for out in _observed(stream, metrics):
            parts.append(out.text)
            last = out
    finally:
        watcher.cancel()
        _close(stream, metrics)
    if last.error:
        raise APIError(last.error, status=500, type="server_error")
    body = response_body(reply.kind, reply.id, reply.model, "".join(parts), last.finish_reason, _usage(last),
                         reply.created)
    return JSONResponse(body)


async def _stream(reply: Reply, gen: GenerationRequest, stream: RequestStream, metrics: Metrics) -> AsyncIterator[str]:
    first, last = True, None
    try:
        async for out in _observed(stream, metrics):
            last = out
            if out.error:
                yield _sse(APIError(out.error, status=500, type="server_error").body())
                break
            if out.text or out.finished or (first and reply.kind == "chat"):
                yield reply.chunk(out.text, out.finish_reason, first=first)
                first = False
        if gen.include_usage and last is not None and not last.error:
            yield _sse(chunk_body(reply.kind, reply.id, reply.model, "", None, reply.created, usage_=_usage(last)))
        yield "data: [DONE]\n\n"
    finally:
        _close(stream, metrics)


async def _observed(stream: RequestStream, metrics: Metrics) -> AsyncIterator[StreamOutput]:
    """The request's outputs, recording token counts, time to first token and the finish reason."""
    seen = 0
    async for out in stream:
        if seen == 0 and out.num_output_tokens:
            metrics.ttft.observe(time.monotonic() - stream.created)
        metrics.generation_tokens.inc(out.num_output_tokens - seen)
        seen = out.num_output_tokens
        if out.finished:
            metrics.finished.labels(out.finish_reason).inc()
        yield out


def _close(stream: RequestStream, metrics: Metrics) -> None:
    if not stream.finished:
        stream.abort()
        metrics.finished.labels("abort").inc()


async def _abort_on_disconnect(raw: Request, stream: RequestStream) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
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


def _usage(out: StreamOutput) -> dict:
    return usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
