"""The FastAPI app of `flock serve`: routes, API-key check, OpenAI-style errors, metrics."""

import asyncio
import hashlib
import hmac
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

import flock
from flock.api.metrics import StatusCounter
from flock.api import llama_cpp
from flock.api.batches import BatchService, FileStore
from flock.api.message_batches import MessageBatches
from flock.api.messages import error_body as anthropic_error
from flock.api.protocol import APIError, chat_token_ids
from flock.api.server_generate import (
    ServerContext,
    answer_messages,
    check_model,
    count_message_tokens,
    embed,
    generate,
    generate_llama_cpp,
    generate_native,
    json_body,
    respond,
    score,
    score_labels,
)
from flock.api.sglang import model_info
from flock.api.tokenize import detokenize, tokenize
from flock.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from flock.lora import LoRARequest
from flock.pooling_params import PoolingParams
from flock.sampling_params import SamplingParams

HEALTH_GENERATE_SECONDS = 20.0  # /health_generate's one token must come within this
# requests counted by status
COUNTED_PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                 "/v1/embeddings",
                 "/v1/score", "/v1/rerank", "/v1/classify", "/classify", "/generate", "/completion", "/completions",
                 "/infill", "/generative_scoring", "/pooling"}


def http_app(ctx: ServerContext, args) -> FastAPI:
    """The server's app with the HTTP layers `flock serve`'s flags ask for: CORS (as vLLM's, no origin by
    default), X-Request-Id headers, and vLLM's root path (a proxy's prefix: paths with and without it are served)."""
    app = build_app(ctx)
    app.root_path = args.root_path
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                       allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    return app


class RequestIdHeader:
    """Each response carries X-Request-Id: the request's own, else a new one (vLLM's
    --enable-request-id-headers). Plain ASGI, as StatusCounter."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, with_id)


def build_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batches.shutdown()
        message_batches.shutdown()
        ctx.parse_pool.shutdown(wait=False)
        ctx.engine.shutdown()  # uvicorn has let in-flight requests finish (or cancelled them) by now

    app = FastAPI(title="flock", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    batches = BatchService(FileStore(ctx.batch_dir), app, ctx.api_keys[0] if ctx.api_keys else None)
    message_batches = MessageBatches(app, batches.headers)
    auth = [Depends(_auth(ctx.api_keys))] if ctx.api_keys else []
    app.include_router(_v1_router(ctx), dependencies=auth)
    app.include_router(_batch_router(batches), dependencies=auth)
    app.include_router(_message_batch_router(message_batches), dependencies=auth)

    @app.get("/health")
    async def health():
        return _health(ctx)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/generate", methods=["POST", "PUT"], dependencies=auth)
    async def generate_(raw: Request):  # SGLang's native endpoint
        return await generate_native(raw, ctx)

    @app.get("/get_model_info", dependencies=auth)
    async def model_info_():
        return model_info(ctx.model_names[0], ctx.engine.tokenizer.name_or_path)

    @app.get("/health_generate")
    async def health_generate():
        return await _health_generate(ctx)

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
    async def ping():
        return _health(ctx)

    @app.post("/invocations", dependencies=auth)  # vLLM's (SageMaker's inference route)
    async def invocations(raw: Request):
        body = await json_body(raw)
        if not isinstance(body, dict) or not ({"messages", "prompt"} & body.keys()):
            raise APIError("/invocations takes a chat completion body (messages) or a completion body (prompt)")
        return await generate("chat" if "messages" in body else "completion", raw, ctx)

    @app.get("/version")
    async def version():
        return {"version": flock.__version__}

    @app.post("/reset_prefix_cache", dependencies=auth)  # vLLM's
    async def reset_prefix_cache():
        return {"success": await _reset_prefix_cache(ctx)}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=auth)  # SGLang's
    async def flush_cache():
        if await _reset_prefix_cache(ctx):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/score", dependencies=auth)  # vLLM's unversioned paths, and /v2/rerank (Cohere's)
    async def score_(raw: Request):
        return await score(raw, ctx)

    @app.post("/pooling", dependencies=auth)
    async def pooling(raw: Request):
        return await embed(raw, ctx, "pooling")

    @app.post("/generative_scoring", dependencies=auth)
    async def generative_scoring(raw: Request):
        return await score_labels(raw, ctx)

    @app.post("/rerank", dependencies=auth)
    @app.post("/v2/rerank", dependencies=auth)
    async def rerank_(raw: Request):
        return await embed(raw, ctx, "rerank")

    @app.post("/classify", dependencies=auth)  # vLLM's (SGLang's under /v1)
    async def classify_(raw: Request):
        return await embed(raw, ctx, "classify")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_(raw: Request):
        body = check_model(await json_body(raw), ctx)
        if isinstance(body, dict) and "content" in body:  # llama-server's
            return llama_cpp.tokenize_content(body, ctx.engine.tokenizer, ctx.token_text)
        return tokenize(body, ctx.engine.tokenizer, ctx.engine.max_model_len)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_(raw: Request):  # vLLM's "prompt", and llama-server's "content"
        text = detokenize(check_model(await json_body(raw), ctx), ctx.engine.tokenizer)["prompt"]
        return {"prompt": text, "content": text}

    @app.post("/completion", dependencies=auth)  # llama-server's native endpoint, and its other name
    @app.post("/completions", dependencies=auth)
    async def completion_(raw: Request):
        return await generate_llama_cpp(raw, ctx)

    @app.post("/infill", dependencies=auth)  # llama-server's fill-in-the-middle, for code editors
    async def infill_(raw: Request):
        return await generate_llama_cpp(raw, ctx, infill=True)

    @app.post("/apply-template", dependencies=auth)  # llama-server's: a chat through the template, as text
    async def apply_template(raw: Request):
        body = check_model(await json_body(raw), ctx)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        ids = chat_token_ids(body, ctx.engine.tokenizer)
        return {"prompt": ctx.engine.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.get("/props", dependencies=auth)  # llama-server's
    async def props_():
        settings = llama_cpp.DEFAULTS | {"n_predict": -1, "seed": -1}
        return llama_cpp.props(ctx.model_names[0], settings, ctx.engine.max_model_len, ctx.engine.tokenizer,
                               ctx.engine.config.max_num_seqs)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(StatusCounter, metrics=ctx.metrics, paths=COUNTED_PATHS)
    return app


def _v1_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))

    def model_card(name: str) -> dict:
        """vLLM's card (a LoRA adapter's root is its folder and its parent the base model), with the fields of
        Anthropic's model object too."""
        lora = ctx.loras.get(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "flock",
                "root": lora.lora_path if lora else ctx.engine.config.model,
                "parent": ctx.model_names[0] if lora else None, "max_model_len": ctx.engine.max_model_len,
                "type": "model", "display_name": name, "created_at": created_at}

    @router.get("/models")
    async def models():
        names = [*ctx.model_names, *ctx.loras]
        return {"object": "list", "data": [model_card(name) for name in names], "has_more": False,
                "first_id": names[0], "last_id": names[-1]}

    @router.get("/models/{name:path}")  # OpenAI's retrieve (names may hold slashes: "org/model")
    async def model(name: str):
        check_model({"model": name}, ctx)
        return model_card(name)

    if runtime_lora_updates():  # vLLM's, behind the same switch
        @router.post("/load_lora_adapter")
        async def load_lora_adapter(raw: Request):
            body = await json_body(raw)
            name, path = _strings(body, "lora_name", "lora_path")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise APIError(f"load_inplace must be a boolean, got {inplace!r}", param="load_inplace")
            if name in ctx.model_names:
                raise APIError(f"the LoRA adapter {name!r} conflicts with a served base model", param="lora_name")
            if name in ctx.loras and not inplace:
                raise APIError(f"the LoRA adapter {name!r} has already been loaded; to load it again in place, set "
                               "load_inplace to true", param="lora_name")
            known = ctx.loras.get(name)
            lora = LoRARequest(name, known.lora_int_id if known else 1 + max(
                (a.lora_int_id for a in ctx.loras.values()), default=0), path)
            await _engine_call(ctx, lambda engine: engine.load_lora(lora, inplace))
            ctx.loras[name] = lora
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @router.post("/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request):
            name = _strings(await json_body(raw), "lora_name")
            if name not in ctx.loras:
                raise APIError(f"the LoRA adapter {name!r} cannot be found", param="lora_name", status=404,
                               code="model_not_found")
            lora = ctx.loras.pop(name)  # new requests no longer find it; those admitted finish with it
            try:
                await _engine_call(ctx, lambda engine: engine.unload_lora(name))
            except APIError:
                ctx.loras[name] = lora
                raise
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @router.post("/completions")
    async def completions(raw: Request):
        return await generate("completion", raw, ctx)

    @router.post("/chat/completions")
    async def chat_completions(raw: Request):
        return await generate("chat", raw, ctx)

    @router.post("/responses")
    async def responses(raw: Request):
        return await respond(raw, ctx)

    @router.post("/messages")  # Anthropic's, its errors in Anthropic's shape
    async def messages(raw: Request):
        return await answer_messages(raw, ctx)

    @router.post("/messages/count_tokens")
    async def count_tokens(raw: Request):
        return count_message_tokens(await json_body(raw), ctx)

    @router.get("/responses/{response_id}")
    async def stored_response(response_id: str):
        return _stored(ctx, response_id)

    @router.get("/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20, after: str | None = None):
        _stored(ctx, response_id)
        return ctx.responses.input_items(response_id, _order(order), _page_limit(limit, 100), after)

    @router.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        _stored(ctx, response_id)  # every stored response has finished: Flock runs no background ones
        raise APIError("Cannot cancel a synchronous response.", param="response_id")

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str):
        _stored(ctx, response_id)
        ctx.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/embeddings")
    async def embeddings(raw: Request):
        return await embed(raw, ctx)

    @router.post("/score")
    async def score_v1(raw: Request):
        return await score(raw, ctx)

    @router.post("/rerank")
    async def rerank(raw: Request):
        return await embed(raw, ctx, "rerank")

    @router.post("/classify")
    async def classify(raw: Request):
        return await embed(raw, ctx, "classify")

    return router


def _batch_router(batches: BatchService) -> APIRouter:
    """OpenAI's Files and Batch APIs (flock/api/batches.py)."""
    router, files = APIRouter(prefix="/v1"), batches.files

    @router.post("/files")
    async def create_file(raw: Request):
        form = await raw.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if not hasattr(upload, "read"):
            raise APIError("file is required, as multipart/form-data", param="file")
        return files.create(upload.filename or "upload.jsonl", await upload.read(), purpose)

    @router.get("/files")
    async def list_files(purpose: str | None = None, order: str = "desc", limit: int = 10000,
                         after: str | None = None):
        return files.listing(purpose, _order(order), _page_limit(limit, 10000), after)

    @router.get("/files/{file_id}")
    async def get_file(file_id: str):
        return files.get(file_id)

    @router.get("/files/{file_id}/content")
    async def file_content(file_id: str):
        files.get(file_id)
        return Response(files.path(file_id).read_bytes(), media_type="application/octet-stream")

    @router.delete("/files/{file_id}")
    async def delete_file(file_id: str):
        return files.delete(file_id)

    @router.post("/batches")
    async def create_batch(raw: Request):
        return batches.create(await json_body(raw))

    @router.get("/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        return batches.listing(after, _page_limit(limit, 100))

    @router.get("/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return batches.get(batch_id)

    @router.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        return batches.cancel(batch_id)

    return router


def _message_batch_router(batches: MessageBatches) -> APIRouter:
    """Anthropic's Message Batches API (flock/api/message_batches.py); its errors in Anthropic's shape."""
    router = APIRouter(prefix="/v1/messages/batches")

    @router.post("")
    async def create(raw: Request):
        return batches.create(await json_body(raw)).body(str(raw.base_url))

    @router.get("")
    async def listing(raw: Request, after_id: str | None = None, limit: int = 20):
        return batches.listing(str(raw.base_url), after_id, _page_limit(limit, 1000))

    @router.get("/{batch_id}")
    async def get(raw: Request, batch_id: str):
        return batches.get(batch_id).body(str(raw.base_url))

    @router.post("/{batch_id}/cancel")
    async def cancel(raw: Request, batch_id: str):
        return batches.cancel(batch_id).body(str(raw.base_url))

    @router.delete("/{batch_id}")
    async def delete(batch_id: str):
        return batches.delete(batch_id)

    @router.get("/{batch_id}/results")
    async def results(batch_id: str):
        return Response(batches.results(batch_id), media_type="application/x-jsonl")

    return router


def _order(order: str) -> str:
    if order not in ("asc", "desc"):
        raise APIError(f"order must be asc or desc, got {order!r}", param="order")
    return order


def _page_limit(limit: int, most: int) -> int:
    """A list endpoint's page size: OpenAI's lists take 1 to 100, Anthropic's 1 to 1,000."""
    if not 1 <= limit <= most:
        raise APIError(f"limit must be in [1, {most}], got {limit}", param="limit")
    return limit


def _stored(ctx: ServerContext, response_id: str) -> dict:
    response = ctx.responses.get(response_id)
    if response is None:
        raise APIError(f"no stored response {response_id!r}", param="response_id", status=404, code="not_found")
    return response


def _auth(api_keys: list[str]):
    """Any of the API keys, as OpenAI's clients send it (Authorization: Bearer KEY, the scheme in any case, as
    vLLM reads it) or Anthropic's (x-api-key: KEY); each key compared in constant time, by its digest."""
    expected = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def known(key: str) -> bool:
        digest = hashlib.sha256(key.encode()).digest()
        return any([hmac.compare_digest(digest, e) for e in expected])  # a list: every key compared

    async def check(raw: Request) -> None:
        scheme, _, key = raw.headers.get("authorization", "").partition(" ")
        anthropic = raw.headers.get("x-api-key")
        if not (scheme.lower() == "bearer" and known(key)) and not (anthropic is not None and known(anthropic)):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           status=401, code="invalid_api_key")

    return check


async def _reset_prefix_cache(ctx: ServerContext) -> bool:
    return await _engine_call(ctx, lambda engine: engine.reset_prefix_cache())


async def _engine_call(ctx: ServerContext, fn):
    """fn(the engine) between steps; its ValueError a 400, a stopped engine a 503."""
    try:
        return await ctx.engine.call(fn)
    except EngineDead as e:
        raise APIError(str(e), status=503, type="server_error", code="engine_unavailable") from None
    except ValueError as e:
        raise APIError(str(e)) from None


def runtime_lora_updates() -> bool:
    """vLLM's switch for loading and unloading LoRA adapters while serving (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


def _strings(body, *fields: str):
    """The body's fields, each a non-empty string (else a 400 naming the first that is not): one, or a tuple."""
    for f in fields:
        if not isinstance(body, dict) or not isinstance(body.get(f), str) or not body[f]:
            raise APIError(f"the body must be a JSON object with {' and '.join(fields)} (non-empty strings)", param=f)
    return body[fields[0]] if len(fields) == 1 else tuple(body[f] for f in fields)


def _health(ctx: ServerContext) -> JSONResponse:
    engine = ctx.engine
    body = {"status": "ok" if engine.is_running else "error"} | asdict(engine.state)
    body["num_waiting"] = engine.num_waiting
    return JSONResponse(body, status_code=200 if engine.is_running else 503)


async def _health_generate(ctx: ServerContext) -> JSONResponse:
    """SGLang's: one token generated through the engine (its steps run, not only its thread; a model that does not
    generate pools it), else a 503 saying why: a dead engine, a full queue, an error, or no token within
    HEALTH_GENERATE_SECONDS."""
    tasks = ctx.engine.tasks
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True) if tasks.refusal("generate") is None \
        else PoolingParams(task="classify" if tasks.num_labels else "embed")
    try:
        stream = ctx.engine.add_request([0], params)
    except (EngineDead, QueueFull) as e:
        return JSONResponse({"status": "error", "error": str(e)}, status_code=503)

    async def one_token() -> str | None:
        why = None
        async for out in stream:
            why = out.error or (None if out.num_output_tokens or out.embedding is not None else out.finish_reason)
        return why

    try:
        why = await asyncio.wait_for(one_token(), HEALTH_GENERATE_SECONDS)
    except asyncio.TimeoutError:
        stream.abort()
        why = f"no token within {HEALTH_GENERATE_SECONDS:g} s"
    if why is not None:
        return JSONResponse({"status": "error", "error": why}, status_code=503)
    return _health(ctx)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    headers = {"retry-after": "1"} if e.status == 429 else None
    body = anthropic_error(e) if request.url.path.startswith("/v1/messages") else e.body()
    return JSONResponse(body, status_code=e.status, headers=headers)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    return await _api_error(request, APIError(str(e.detail), status=e.status_code, type="invalid_request_error"))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    # Starlette re-raises after sending this, so uvicorn logs the traceback
    return await _api_error(request, APIError("internal server error", status=500, type="server_error"))


class DrainingServer(uvicorn.Server):
    """On SIGINT / SIGTERM, in-flight requests get `drain_s` seconds to finish; then the engine ends them (finish
    reason "abort", with what they generated so far) so that they answer before uvicorn cancels their handlers."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_s: float):
        super().__init__(config)
        self.timer = threading.Timer(drain_s, engine.shutdown)
        self.timer.daemon = True

    def handle_exit(self, sig, frame) -> None:
        if not self.timer.is_alive() and not self.timer.finished.is_set():
            self.timer.start()
        super().handle_exit(sig, frame)
