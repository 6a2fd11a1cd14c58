"""`flock serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

    flock serve --model flock/tiny [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-waiting N] ...

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (whole or SSE-streamed), /health, /metrics.
"""

import argparse
import logging
import sys

from flock.sched import SCHEDULERS

log = logging.getLogger("flock")

ENGINE_KEYS = ("dtype", "load_format", "device", "seed", "scheduler", "attention", "block_size", "max_num_seqs",
               "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_cache_memory_bytes",
               "enable_prefix_caching", "tokenizer")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP")
    add_serve_arguments(p)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flock/tiny", help="built-in model name or local Hugging Face folder")
    p.add_argument("--served-model-name", nargs="+", help="model name(s) clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--max-waiting", type=_positive, default=1024,
                   help="at most this many requests wait for admission; more get 429")
    p.add_argument("--scheduler", default="fcfs", choices=sorted(SCHEDULERS))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention", default="auto")
    p.add_argument("--tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before cancelling them")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from flock.api.metrics import Metrics
    from flock.api.server_app import build_app
    from flock.api.server_generate import ServerContext
    from flock.config import EngineConfig
    from flock.engine.async_engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_kwargs(args.model, **{k: getattr(args, k) for k in ENGINE_KEYS})
        engine = AsyncEngine(config, max_waiting=args.max_waiting).start()
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        ctx = ServerContext(engine, Metrics(engine), args.served_model_name or [args.model], args.api_key)
        log.info("engine ready: %s, %d KV blocks, max_model_len %d, scheduler %s", args.model,
                 engine.state.kv_blocks_total, engine.max_model_len, config.scheduler)
        server = uvicorn.Server(uvicorn.Config(
            build_app(ctx), host=args.host, port=args.port, log_level=args.log_level,
            access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout))
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
