"""Beam search: Flock's LLM.beam_search side by side with vLLM's (CPU build), the same token ids, one engine after
the other.

    python -m bench.beam_search --vllm-venv /root/V --model SMOLLM2_HF   # SmolLM2 (a HF folder), bf16
    python -m bench.beam_search --model tiny --prompts 2 --skip-vllm      # a dry run in seconds

The workload: --prompts prompts, each a --shared-token prefix shared by all and --own distinct tokens; beams of
--beam-width, --max-tokens new tokens each (ignore_eos, so both engines run every step). Both engines step the
search outside the engine, one token of every live beam a step, with prefix caching on. Printed: the CPU and
kernel paths, wall s, beam tokens/s, speed vs vLLM, and how many prompts' best beams are the same token ids (bf16
weights: near ties can part them). Results: bench/out/beam_search.json.
"""

import argparse
import random
import time
from pathlib import Path

from bench.harness import machine, vllm
from bench.harness.offline import hf_folder, random_tokens
from bench.harness.report import args_dict, markdown_table, write_json

MODELS = {"tiny": "flock/bench-tiny", "mid": "flock/bench-mid"}
CHILD = Path(__file__).resolve().parent / "harness" / "vllm_beam_child.py"


def workload(args, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = random_tokens(rng, args.shared)
    return [shared + random_tokens(rng, args.own) for _ in range(args.prompts)]


def run_flock(folder: Path, prompts: list[list[int]], args) -> dict:
    from flock import LLM, BeamSearchParams

    llm = LLM(str(folder), dtype="bfloat16", max_model_len=args.max_model_len)
    params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=True, length_penalty=args.length_penalty)
    llm.beam_search(workload(args, args.seed + 1)[:2], params)
    start = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    wall = time.perf_counter() - start
    return {"engine": "Flock", "wall_s": wall,
            "beams": [[[s.output_token_ids, s.cum_logprob] for s in o.sequences] for o in outs]}


def run_vllm(folder: Path, prompts: list[list[int]], args) -> dict:
    job = {"model": str(folder), "max_model_len": args.max_model_len, "beam_width": args.beam_width,
           "max_tokens": args.max_tokens, "length_penalty": args.length_penalty,
           "warmup": workload(args, args.seed + 1)[:2], "prompts": prompts}
    data = vllm.run_child(CHILD, job, "beam-search-vllm", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    return {"engine": vllm.VLLM_ENGINE, "wall_s": data["wall_s"], "startup_s": data["startup_s"],
            "beams": data["beams"]}


def report(results: list[dict], args) -> str:
    tokens = args.prompts * args.beam_width * args.max_tokens
    ref = next((r for r in results if r["engine"].startswith("vLLM") and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["engine"], r["error"], "", "", ""])
            continue
        same = ""
        if ref is not None and r is not ref:
            same = f"{sum(a[0][0] == b[0][0] for a, b in zip(r['beams'], ref['beams']))}/{args.prompts}"
        speed = f"{ref['wall_s'] / r['wall_s']:.2f}x" if ref else "-"
        rows.append([r["engine"], f"{r['wall_s']:.2f}", f"{tokens / r['wall_s']:,.0f}", speed, same])
    return markdown_table(["engine", "wall s", "beam tokens/s", "speed vs vLLM", "best beams equal"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mid", help="shape (tiny, mid), built-in name or HF folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--shared", type=int, default=512, help="tokens every prompt starts with")
    p.add_argument("--own", type=int, default=64, help="distinct tokens of each prompt")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("beam_search"), flush=True)
    folder = hf_folder(MODELS.get(args.model, args.model), args.out)
    prompts = workload(args, args.seed)
    print(f"# {folder.name}: {args.prompts} prompts of {args.shared} shared + {args.own} own tokens, beam width "
          f"{args.beam_width}, {args.max_tokens} tokens; {machine.load_note()}", flush=True)
    results = [run_flock(folder, prompts, args)]
    if not args.skip_vllm:
        results.append(run_vllm(folder, prompts, args))
    print(report(results, args))
    write_json(args.out / "beam_search.json", {"args": args_dict(args), "cpu": machine.cpu_line(),
                                               "results": results})


if __name__ == "__main__":
    main()
