"""Write a synthetic token-id workload as JSONL: `python -m bench.workload KIND -o OUT.jsonl [--scale S]`."""

import argparse
import sys

from bench.harness.workloads import WORKLOADS, make_workload, write_jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workload", description=__doc__)
    parser.add_argument("kind", choices=list(WORKLOADS))
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every length (0.1: 2000/200 -> 200/20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=8000, help="token ids in [100, VOCAB_SIZE)")
    parser.add_argument("--sharing-degree", type=int, help="micro-*: prompts per group (default 16)")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
