"""The `flock` command: `flock run` an OpenAI Batch JSONL job (resumable), `flock serve` the OpenAI API,
`flock analyze` a batch's prefix sharing, `flock save-model` saves a built-in model or a GGUF file as a Hugging
Face folder."""

import argparse
import logging
import shutil
import sys
import tempfile

from flock.api.batch_urls import download, is_url, local_path, upload
from flock.api.server import add_serve_parser, serve_main
from flock.api.tools import add_parser_arguments, tool_parser
from flock.api.vllm_args import CONFIG_EPILOG, add_vllm_arguments, apply_vllm_arguments, chat_options, vllm_argv
from flock.engine.args import DEFAULT_MODEL, add_engine_args, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flock", description="Flock: a prefix-aware LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_run(sub)
    add_serve_parser(sub)

    save = sub.add_parser("save-model", help="save a model (built-in, e.g. flock/smollm2, or a GGUF file) as a "
                                             "Hugging Face folder that transformers and vLLM load")
    save.add_argument("model")
    save.add_argument("output")
    save.add_argument("--dtype", default="auto")
    save.add_argument("--seed", type=int, default=0)

    analyze = sub.add_parser("analyze", help="plan the prefix sharing of a JSONL batch (BatchLLM) and report it")
    analyze.add_argument("input", help="JSONL: OpenAI Batch lines, {'prompt': ...}, {'messages': [...]} or {'prompt_token_ids': [...]}")
    analyze.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer turns text into token ids")
    analyze.add_argument("--method", default="batchllm", choices=["batchllm", "optimal", "none"],
                         help="first-level plan: BatchLLM Algorithm 1, the exact optimum, or the raw tree")
    analyze.add_argument("--json", action="store_true", help="print one JSON object")
    analyze.add_argument("--plot", metavar="PATH", help="draw group sizes and prefix lengths (needs matplotlib)")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("run", "serve"):
        try:
            argv = vllm_argv(argv, sub.choices[argv[0]])
        except ValueError as e:
            sub.choices[argv[0]].error(str(e))
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_batch(args)
    if args.command == "serve":
        return serve_main(args)
    if args.command == "analyze":
        from flock.api.analyze import analyze_file

        return analyze_file(args)
    if args.command == "save-model":
        from flock.model import save_model

        try:
            print(f"saved {args.model} to {save_model(args.model, args.output, args.dtype, args.seed)}")
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    parser.error(f"unknown command {args.command}")


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run an OpenAI Batch (or plain prompt) JSONL job; resumable after a crash",
                         epilog=CONFIG_EPILOG)
    run.add_argument("input", nargs="?", help="JSONL (or gzipped): OpenAI Batch lines, or plain lines with "
                                              "'prompt', 'prompt_token_ids' or 'messages' and any sampling fields")
    run.add_argument("-i", "--input-file", help="the input, as `vllm run-batch -i` names it (a path or an http(s) "
                                                "URL to GET)")
    run.add_argument("-o", "--output", "--output-file", required=True,
                     help="OpenAI Batch output JSONL, appended as requests finish (an http(s) URL: PUT there at the "
                          "end, the failed lines after)")
    run.add_argument("--errors", metavar="PATH", help="error records (default: <output stem>.errors.jsonl)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="finish the job in OUTPUT: skip the lines already done")
    mode.add_argument("--overwrite", action="store_true", help="delete OUTPUT and the error file and start again")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no notes, a one-line summary")
    run.add_argument("--strict", action="store_true", help="exit with status 1 if any line failed (by default a "
                                                           "job that ran to the end exits 0, failed lines or not)")
    add_parser_arguments(run)
    add_engine_args(run, scheduler="batchllm")
    defaults = run.add_argument_group("sampling defaults for lines that set none (else OpenAI's: temperature 1, "
                                      "max_tokens 16 for completions, none for chat)")
    defaults.add_argument("--max-tokens", type=int)
    defaults.add_argument("--temperature", type=float)
    defaults.add_argument("--top-p", type=float)
    defaults.add_argument("--top-k", type=int)
    v = add_vllm_arguments(run)
    v.add_argument("--served-model-name", nargs="+", help="the model name the outputs carry (default: --model)")
    v.add_argument("--output-tmp-dir", help="where an http(s) input is downloaded and an http(s) output written "
                   "before its upload (default: a temporary folder, deleted once the output is uploaded)")
    v.add_argument("--host", "--url", dest="metrics_host", help="accepted: no metrics server")
    v.add_argument("--port", type=int, help="accepted: no metrics server")
    v.add_argument("--enable-metrics", action="store_true", help="accepted: the summary reports the job")
    cluster = run.add_argument_group("scale-out on Ray (pip install 'flock-llm[ray]')")
    cluster.add_argument("--workers", type=int, metavar="N", help="run the job on N Ray actors, one engine each, "
                                                              "sharded by prefix group")
    cluster.add_argument("--ray-address", metavar="ADDR", help="an existing Ray cluster (default: start a local one)")
    cluster.add_argument("--worker-cpus", type=float, metavar="C",
                         help="CPUs per worker (fractions allowed; default 1)")
    cluster.add_argument("--worker-gpus", type=float, metavar="G", help="GPUs per worker (default 0)")
    cluster.add_argument("--worker-threads", type=int, metavar="T", help="torch threads per engine (default: --worker-cpus)")
    cluster.add_argument("--max-worker-restarts", type=int, metavar="R",
                         help="restarts of a lost worker before its requests go to the others (default 1)")


RAY_FLAGS = ("ray_address", "worker_cpus", "worker_gpus", "worker_threads", "max_worker_restarts")


def run_batch(args) -> int:
    from flock.api.batch import JobConfig

    sampling = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
    try:
        apply_vllm_arguments(args)
        parser = tool_parser(args)
        if (args.input is None) == (args.input_file is None):
            raise ValueError("give the input file once: flock run INPUT, or -i INPUT as vllm run-batch takes it")
        args.input = args.input or args.input_file
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    own_folder = args.output_tmp_dir is None and (is_url(args.input) or is_url(args.output))
    folder = tempfile.mkdtemp(prefix="flock-run-") if own_folder else args.output_tmp_dir
    try:
        local_input = str(download(args.input, folder)) if is_url(args.input) else args.input
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = str(local_path(args.output, folder)) if is_url(args.output) else args.output
    cfg = JobConfig(local_input, output, args.errors, args.resume, args.overwrite, args.quiet, args.max_tokens,
                    sampling, engine_kwargs(args), args.strict, parser, args.reasoning_parser, chat_options(args),
                    (args.served_model_name or [None])[0])
    logger = logging.getLogger("flock")
    level = logger.level
    if not args.quiet:  # Flock's notes on stderr (kernels compiled on a fresh machine, weights dequantized, ...)
        logging.basicConfig(format="%(message)s")
        logger.setLevel(logging.INFO)
    try:
        code = _run(cfg, args)
    finally:  # a caller's own level back (cli.main called from Python)
        logger.setLevel(level)
    if is_url(args.output):
        code = _uploaded(cfg, args, folder, code)
    elif own_folder:  # only the downloaded input is there
        shutil.rmtree(folder, ignore_errors=True)
    return code


def _uploaded(cfg, args, folder: str, code: int) -> int:
    """A job's exit status once its output is uploaded to the URL -o named (kept in `folder` if it is not; a
    folder of its own deleted once it is)."""
    if code not in (0, 1):
        print(f"the output so far is in {cfg.output_path} (run again with --output-tmp-dir {folder} --resume)",
              file=sys.stderr)
        return code
    try:
        upload([cfg.output_path, cfg.errors_path], args.output)
    except OSError as e:
        print(f"error: {e}; the output is in {cfg.output_path}", file=sys.stderr)
        return 2
    if args.output_tmp_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return code


def _run(cfg, args) -> int:
    from flock.api.batch import run_job

    if args.workers is None:
        if any(getattr(args, k) is not None for k in RAY_FLAGS):
            given = [f"--{k.replace('_', '-')}" for k in RAY_FLAGS if getattr(args, k) is not None]
            print(f"error: {', '.join(given)} need(s) --workers", file=sys.stderr)
            return 2
        return run_job(cfg)
    try:
        from flock.distributed.driver import ClusterConfig, run_cluster_job
    except ImportError as e:
        print(f"error: --workers needs Ray ({e}): pip install 'flock-llm[ray]'", file=sys.stderr)
        return 2
    names = {"ray_address": "address", "worker_cpus": "worker_cpus", "worker_gpus": "worker_gpus",
             "worker_threads": "worker_threads", "max_worker_restarts": "max_restarts"}
    given = {name: getattr(args, flag) for flag, name in names.items() if getattr(args, flag) is not None}
    return run_cluster_job(cfg, ClusterConfig(args.workers, **given))


if __name__ == "__main__":
    sys.exit(main())
