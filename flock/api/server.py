"""`flock serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

    flock serve --model flock/tiny [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-waiting N] ...
    flock serve MODEL --max-model-len 4096 --enable-prefix-caching ...   # a `vllm serve` command line

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (whole or SSE-streamed), /v1/responses, Anthropic's
/v1/messages, /v1/messages/count_tokens and /v1/messages/batches, OpenAI's /v1/files and /v1/batches,
/v1/embeddings, vLLM's /v1/score, /v1/rerank, /classify, /pooling and /generative_scoring, /tokenize, /detokenize,
/health, /metrics, and SGLang's /generate, /get_model_info, /health_generate and /v1/score with label_token_ids.
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from flock.api.reasoning import THINKING_END
from flock.api.tools import add_parser_arguments, tool_parser
from flock.api.vllm_args import CONFIG_EPILOG, add_vllm_arguments, apply_vllm_arguments, chat_options
from flock.engine.args import DEFAULT_MODEL, add_engine_args, engine_kwargs
from flock.lora import lora_requests

log = logging.getLogger("flock")
LOG_LEVELS = ["debug", "info", "warning", "error"]

# At most this many requests decode at once (`flock run` and LLM keep 256, for throughput). A burst of
# requests then waits in the queue instead of each sitting through every other's prefill chunks: on SmolLM2
# with 200 requests at once this cut mean TPOT by 11-12% for 0-3% of req/s (README, "Online: flock serve vs
# vllm serve"); vLLM's CPU server uses 128 too.
SERVE_MAX_NUM_SEQS = 128
# Seconds uvicorn waits past --shutdown-timeout for the requests the engine ended then to answer.
ANSWER_AFTER_ABORT_S = 5


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the model over HTTP: OpenAI's API (completions, chat, responses, "
                              "embeddings, files and batches), Anthropic's messages, vLLM's, SGLang's and "
                              "llama-server's endpoints", epilog=CONFIG_EPILOG)
    add_serve_arguments(p)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", help="model name(s) clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument("--api-key", nargs="+", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on the "
                   "endpoints that run the model, KEY any of these (default: the VLLM_API_KEY environment "
                   "variable's, as vLLM)")
    p.add_argument("--max-waiting", type=_positive, default=1024,
                   help="at most this many requests wait for admission; more get 429")
    p.add_argument("--stream-interval", type=_positive, default=1,
                   help="output tokens per streamed event (the first and the last sent at once), as vLLM's; a "
                        "request's stream_interval may raise it")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses kept in memory for GET and previous_response_id, the latest first (0: none)")
    p.add_argument("--batch-dir", help="where /v1/files keeps uploads and /v1/batches outputs (default: a new "
                   "temporary folder); a restart forgets them")
    add_parser_arguments(p)
    add_engine_args(p, scheduler="feather")
    p.set_defaults(max_num_seqs=SERVE_MAX_NUM_SEQS)
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="on SIGINT/SIGTERM, seconds to let in-flight requests finish; then they end with "
                        "finish_reason abort and what they generated")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    add_serve_vllm_arguments(p)


def add_serve_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flags (flock.api.vllm_args), and those only `vllm serve` takes."""
    v = add_vllm_arguments(p)
    v.add_argument("model_tag", nargs="?", help="the model, as `vllm serve MODEL` names it (else --model)")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="accepted: Flock logs requests only with --access-log")
    v.add_argument("--uvicorn-log-level", type=str.lower, choices=[*LOG_LEVELS, "critical", "trace"],
                   help="as --log-level")
    v.add_argument("--allowed-origins", type=json.loads, default=[],
                   help="CORS: the origins browsers may call the API from, a JSON list (default none, as vLLM)")
    v.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: the methods, a JSON list")
    v.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: the headers, a JSON list")
    v.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    v.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    v.add_argument("--ssl-keyfile", help="serve HTTPS with this key file ...")
    v.add_argument("--ssl-certfile", help="... and this certificate file")
    v.add_argument("--ssl-ca-certs", help="CA certificates to check clients' certificates against")
    v.add_argument("--ssl-cert-reqs", type=int, default=0, help="whether a client certificate is required (Python's "
                   "ssl.CERT_* value)")
    v.add_argument("--enable-request-id-headers", action="store_true",
                   help="each response carries X-Request-Id (the request's own, else a new one)")
    v.add_argument("--enable-log-requests", action="store_true", help="as --access-log")
    v.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens as 'token_id:N' for requests that do not say (the field of that name)")
    v.add_argument("--disable-uvicorn-access-log", action="store_true", help="accepted: no access log without "
                   "--access-log")


def apply_serve_vllm_arguments(args: argparse.Namespace) -> None:
    """vLLM's flags as Flock's (flock.api.vllm_args); ValueError for what Flock cannot run."""
    apply_vllm_arguments(args)
    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    elif args.model == DEFAULT_MODEL and len(args.served_model_name or []) > 1 and \
            _names_a_model(args.served_model_name[-1]):
        raise ValueError(f"--served-model-name took {args.served_model_name[-1]!r}, a model: give the model first "
                         f"(flock serve MODEL --served-model-name NAME) or as --model")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: not a port (0-65535)")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, flag) and not Path(getattr(args, flag)).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no such file")
    args.log_level = args.uvicorn_log_level or args.log_level
    args.access_log = args.access_log or args.enable_log_requests


def api_keys(args) -> list[str] | None:
    """The keys that open /v1: --api-key's, else the VLLM_API_KEY environment variable's (as vLLM), else none."""
    return args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else None)


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from flock.api.metrics import Metrics
    from flock.api.server_app import DrainingServer, http_app
    from flock.api.responses import ResponseStore
    from flock.api.server_generate import ServerContext
    from flock.config import EngineConfig
    from flock.engine.async_engine import AsyncEngine

    try:
        apply_serve_vllm_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level="DEBUG" if args.log_level == "trace" else args.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        parser, chat = tool_parser(args), chat_options(args)
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        engine = AsyncEngine(config, max_waiting=args.max_waiting, stream_interval=args.stream_interval).start()
        engine.tokenizer.chat_options = chat
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        names = args.served_model_name or [args.model]
        ctx = ServerContext(engine, Metrics(engine, names[0]), names, api_keys(args), parser, args.reasoning_parser,
                            ResponseStore(max(args.max_stored_responses, 0)), args.batch_dir,
                            lora_requests(config.lora_modules or []),
                            {"return_tokens_as_token_ids": True} if args.return_tokens_as_token_ids else {},
                            args.enable_force_include_usage)
        log.info("engine ready: %s, %d KV blocks, max_model_len %d, scheduler %s, attention %s", args.model,
                 engine.state.kv_blocks_total, engine.max_model_len, engine.state.scheduler, engine.state.attention)
        if args.reasoning_parser and THINKING_END not in engine.tokenizer.get_vocab():
            log.warning("--reasoning-parser %s: the tokenizer has no %s token, so every answer that does not write "
                        "the tag is all reasoning (vLLM refuses to start)", args.reasoning_parser, THINKING_END)
        server = DrainingServer(uvicorn.Config(
            http_app(ctx, args), host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            timeout_graceful_shutdown=args.shutdown_timeout + ANSWER_AFTER_ABORT_S), engine, args.shutdown_timeout)
        server.run()  # after a graceful shutdown uvicorn re-raises SIGTERM / SIGINT
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="flock serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    sys.exit(serve_main(parser.parse_args()))


def _names_a_model(name: str) -> bool:
    """A built-in's name, a GGUF file or a folder here: a model, not a name for one."""
    return name.startswith("flock/") or name.endswith(".gguf") or Path(name).expanduser().exists()
