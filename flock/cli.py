"""The `flock` command: `flock run` a JSONL batch, `flock analyze` its prefix sharing, `flock workload` writes a
synthetic batch, `flock save-model` saves a built-in model as a HF folder."""

import argparse
import json
import sys

from flock.analyze import key_value_table

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flock", description="Flock: a prefix-aware LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate for every line of a JSONL batch")
    run.add_argument("input", help="JSONL: {'prompt': ...} or {'prompt_token_ids': [...]} lines")
    run.add_argument("-o", "--output", help="output JSONL (default: print a summary only)")
    _engine_args(run)
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=-1)
    run.add_argument("--show", type=int, default=3, help="print this many completions")

    save = sub.add_parser("save-model", help="save a model (e.g. flock/tiny) as a Hugging Face folder")
    save.add_argument("model")
    save.add_argument("output")
    save.add_argument("--dtype", default="auto")
    save.add_argument("--seed", type=int, default=0)

    analyze = sub.add_parser("analyze", help="plan the prefix sharing of a JSONL batch (BatchLLM) and report it")
    analyze.add_argument("input", help="JSONL: OpenAI Batch lines, {'prompt': ...}, {'messages': [...]} or {'prompt_token_ids': [...]}")
    analyze.add_argument("--model", default="flock/tiny", help="whose tokenizer turns text into token ids")
    analyze.add_argument("--method", default="batchllm", choices=["batchllm", "optimal", "none"],
                         help="first-level plan: BatchLLM Algorithm 1, the exact optimum, or the raw tree")
    analyze.add_argument("--json", action="store_true", help="print one JSON object")
    analyze.add_argument("--plot", metavar="PATH", help="draw group sizes and prefix lengths (needs matplotlib)")

    from flock.workloads import WORKLOADS

    workload = sub.add_parser("workload", help="write a synthetic token-id workload as JSONL")
    workload.add_argument("kind", choices=list(WORKLOADS))
    workload.add_argument("-o", "--output", required=True)
    workload.add_argument("--scale", type=float, default=1.0, help="multiply every length (0.1: 2000/200 -> 200/20)")
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument("--vocab-size", type=int, default=8000, help="token ids in [100, VOCAB_SIZE)")
    workload.add_argument("--sharing-degree", type=int, help="micro-*: prompts per group (default 16)")

    args = parser.parse_args(argv)
    if args.command == "analyze":
        from flock.analyze import analyze_file

        return analyze_file(args)
    if args.command == "workload":
        return write_workload(args)
    if args.command == "save-model":
        from flock.model import save_model

        print(f"saved {args.model} to {save_model(args.model, args.output, args.dtype, args.seed)}")
        return 0
    return run_batch(args)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flock/tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--scheduler", default="batchllm", help="offline jobs default to BatchLLM group scheduling")
    p.add_argument("--attention", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--seed", type=int, default=0)


def read_prompts(path: str) -> tuple[list[tuple[int, dict]], list[str]]:
    """(line number, prompt) for each good line, and an error message for each bad one."""
    good, errors = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append(f"{path}:{number}: not valid JSON ({e.msg})")
                continue
            if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & item.keys()):
                errors.append(f"{path}:{number}: needs a 'prompt' or 'prompt_token_ids' field")
                continue
            good.append((number, item))
    return good, errors


def run_batch(args) -> int:
    from flock import LLM, SamplingParams

    engine_keys = ("dtype", "load_format", "scheduler", "attention", "block_size", "max_num_seqs",
                   "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "seed")
    llm = LLM(args.model, **{k: getattr(args, k) for k in engine_keys})
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    items, errors = read_prompts(args.input)
    prompts, numbers = [], []
    for number, item in items:
        try:
            ids = llm.encode_prompt(item, number)[1]
            llm.engine.check_request(ids, params)
        except (ValueError, TypeError) as e:
            errors.append(f"{args.input}:{number}: {e}")
            continue
        prompts.append(item)
        numbers.append(number)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    outputs = llm.generate(prompts, params)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for number, out in zip(numbers, outputs):
                c = out.outputs[0]
                f.write(json.dumps({"line": number, "text": c.text, "token_ids": c.token_ids,
                                    "finish_reason": c.finish_reason}) + "\n")
    for out in outputs[: args.show]:
        print(f"--- {out.prompt!r:.70}\n    -> {out.outputs[0].text!r:.200}")
    print(format_stats(llm.stats()))
    print(f"{len(outputs)} done, {len(errors)} failed" + (f"; results in {args.output}" if args.output else ""))
    return 1 if errors else 0


def write_workload(args) -> int:
    from flock.workloads import make_workload, write_jsonl

    kw = {"scale": args.scale, "seed": args.seed, "vocab_size": args.vocab_size}
    if args.sharing_degree is not None:
        if not args.kind.startswith("micro-"):
            print("error: --sharing-degree applies to micro-* workloads only", file=sys.stderr)
            return 2
        kw["sharing_degree"] = args.sharing_degree
    try:
        prompts = make_workload(args.kind, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(prompts, args.output)
    print(f"wrote {len(prompts)} prompts ({sum(map(len, prompts))} tokens) to {args.output}")
    return 0


def format_stats(s: dict) -> str:
    rows = [
        ("requests", f"{s['num_requests']}"),
        ("prefill tokens (logical / computed)", f"{s['logical_prefill_tokens']} / {s['computed_prefill_tokens']}"),
        ("saving rate", f"{s['saving_rate']:.1%}"),
        ("generated tokens", f"{s['generated_tokens']}"),
        ("steps (mean / max tokens per step)", f"{s['steps']} ({s['mean_tokens_per_step']:.1f} / {s['max_tokens_per_step']})"),
        ("preemptions", f"{s['preemptions']}"),
        ("time: wall / model / scheduling", f"{s['wall_seconds']:.2f} s / {s['model_seconds']:.2f} s / {s['schedule_seconds'] * 1e3:.1f} ms"),
        ("KV blocks (peak / total)", f"{s['peak_kv_blocks']} / {s['num_kv_blocks']}"),
        ("tok/s (prompt / generated / total)", f"{s['prompt_tokens_per_s']:.0f} / {s['generated_tokens_per_s']:.0f} / {s['total_tokens_per_s']:.0f}"),
    ]
    return key_value_table(rows)


if __name__ == "__main__":
    sys.exit(main())
