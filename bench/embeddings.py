"""Embeddings of a RAG corpus: Flock's LLM.embed side by side with vLLM's (CPU build, runner="pooling"), the same
token ids, one engine after the other.

    python -m bench.embeddings --vllm-venv /root/V                       # Qwen3-0.6B's shape, random bf16
    python -m bench.embeddings --model tiny --inputs 16 --skip-vllm       # a dry run in seconds

The workload is what an instruction-aware embedding model (Qwen3-Embedding, e5-mistral) is sent: --inputs
texts, each an instruction of --instruction tokens shared by all, then a distinct passage of --min-len to
--max-len tokens. Both engines pool the last token's final hidden state, L2-normalized, with prefix caching on.
Printed: the CPU and kernel paths, wall s, input tokens/s, speed vs vLLM, the prompt tokens each engine computed,
and how close the two engines' vectors are (cosine similarity; bf16 weights, so not 1). Results:
bench/out/embeddings.json.
"""

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness import machine, vllm
from bench.harness.offline import hf_folder, random_tokens
from bench.harness.report import args_dict, markdown_table, write_json

MODELS = {"tiny": "flock/bench-tiny", "mid": "flock/bench-mid", "qwen3": "flock/bench-qwen3"}
CHILD = Path(__file__).resolve().parent / "harness" / "vllm_embed_child.py"


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    instruction = random_tokens(rng, args.instruction)
    return [instruction + random_tokens(rng, rng.randint(args.min_len, args.max_len)) for _ in range(args.inputs)]


def warmup(args) -> list[list[int]]:
    """Two inputs sharing nothing with the workload."""
    rng = random.Random(args.seed + 1)
    return [random_tokens(rng, args.max_len) for _ in range(2)]


def run_flock(folder: Path, prompts: list[list[int]], args) -> dict:
    from flock import LLM

    llm = LLM(str(folder), dtype="bfloat16", scheduler=args.scheduler, max_num_batched_tokens=args.max_batched_tokens)
    llm.embed(warmup(args), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.stats()
    return {"engine": f"Flock {args.scheduler}", "wall_s": wall, "computed": stats["computed_prefill_tokens"],
            "embeddings": [o.outputs.embedding for o in outs]}


def run_vllm(folder: Path, prompts: list[list[int]], args) -> dict:
    job = {"model": str(folder), "prefix_caching": True, "max_model_len": args.max_model_len, "warmup": warmup(args),
           "prompts": prompts}
    data = vllm.run_child(CHILD, job, "embeddings-vllm", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    return {"engine": vllm.VLLM_ENGINE, "wall_s": data["wall_s"], "startup_s": data["startup_s"],
            "computed": sum(map(len, prompts)) - data["cached_tokens"], "embeddings": data["embeddings"]}


def report(results: list[dict], prompts: list[list[int]]) -> str:
    tokens = sum(map(len, prompts))

    def cosine(r: dict, ref: dict) -> str:
        a, b = (torch.tensor(x["embeddings"], dtype=torch.float64) for x in (r, ref))
        sims = torch.nn.functional.cosine_similarity(a, b, dim=1)
        return f"mean {sims.mean():.4f}, min {sims.min():.4f}"

    return versus_vllm(results, ("input tok/s", lambda r: f"{tokens / r['wall_s']:,.0f}"), ("cosine", cosine))


def versus_vllm(results: list[dict], rate: tuple[str, Callable], closeness: tuple[str, Callable]) -> str:
    """Each engine's wall s, `rate` (its column and value of a result), speed and computed prompt tokens, and
    `closeness` to the first vLLM result (its column and value of a result and vLLM's)."""
    ref = next((r for r in results if r["engine"].startswith("vLLM") and "error" not in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["engine"], r["error"], "", "", "", ""])
            continue
        close = closeness[1](r, ref) if ref is not None and r is not ref else ""
        speed = f"{ref['wall_s'] / r['wall_s']:.2f}x" if ref else "-"
        rows.append([r["engine"], f"{r['wall_s']:.2f}", rate[1](r), speed, f"{r['computed']:,}", close])
    head = ["engine", "wall s", rate[0], "speed vs vLLM", "computed prompt tok", f"{closeness[0]} vs vLLM"]
    return markdown_table(head, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3", help="shape (tiny, mid, qwen3), built-in name or HF folder")
    p.add_argument("--inputs", type=int, default=128)
    p.add_argument("--instruction", type=int, default=128, help="tokens of the instruction every input starts with")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--scheduler", default="batchllm")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("embeddings"), flush=True)
    folder = hf_folder(MODELS.get(args.model, args.model), args.out)
    prompts = workload(args)
    tokens = sum(map(len, prompts))
    print(f"# {folder.name}: {len(prompts)} inputs, {tokens:,} tokens, a {args.instruction}-token instruction "
          f"shared by all; {machine.load_note()}", flush=True)
    results = [run_flock(folder, prompts, args)]
    if not args.skip_vllm:
        results.append(run_vllm(folder, prompts, args))
    print(report(results, prompts))
    write_json(args.out / "embeddings.json", {"args": args_dict(args), "cpu": machine.cpu_line(), "results": [
        {k: v for k, v in r.items() if k != "embeddings"} for r in results]})


if __name__ == "__main__":
    main()
