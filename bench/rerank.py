"""Reranking a RAG retrieval with a causal LM reranker (Qwen3-Reranker's recipe): Flock's LLM.classify side by
side with vLLM's (CPU build, runner="pooling", the same hf_overrides), the same token ids, one engine after the
other.

    python -m bench.rerank --vllm-venv /root/V                      # Qwen3-Reranker-0.6B's shape, random bf16
    python -m bench.rerank --model tiny --queries 2 --docs 4 --skip-vllm   # a dry run in seconds

The workload is what a RAG pipeline sends its reranker: --queries queries, each with --docs retrieved passages,
one prompt per (query, passage) pair as Qwen3-Reranker's template lays it out: a system prompt and instruction of
--system tokens shared by all, the query's --query tokens shared by its passages, the passage's own --min-len to
--max-len tokens, and a fixed --suffix (the assistant turn). The model is a causal LM turned classifier by
hf_overrides (architectures Qwen3ForSequenceClassification, classifier_from_token, is_original_qwen3_reranker):
each pair's score is the softmax probability of the second token against the first at its last position. Prefix
caching is on in both engines. Printed: the CPU and kernel paths, wall s, pairs/s, speed vs vLLM, the prompt
tokens each engine computed, how close the two engines' scores are (bf16 weights, so not equal), and how often
they pick the same best passage. Results: bench/out/rerank.json.
"""

import argparse
import random
import time
from pathlib import Path

from bench.embeddings import CHILD, MODELS, versus_vllm
from bench.harness import machine, vllm
from bench.harness.offline import hf_folder, random_tokens
from bench.harness.report import args_dict, write_json

# two tokens of the bench models' vocabulary stand for Qwen3-Reranker's "no" and "yes"
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "part"],
            "is_original_qwen3_reranker": True}


def workload(args) -> list[list[int]]:
    """The pairs' prompts, query by query (a pipeline reranks one retrieval at a time, but batches them)."""
    rng = random.Random(args.seed)
    system, suffix = random_tokens(rng, args.system), random_tokens(rng, args.suffix)
    prompts = []
    for _ in range(args.queries):
        query = system + random_tokens(rng, args.query)
        prompts += [query + random_tokens(rng, rng.randint(args.min_len, args.max_len)) + suffix
                    for _ in range(args.docs)]
    return prompts


def warmup(args) -> list[list[int]]:
    """Two prompts sharing nothing with the workload."""
    rng = random.Random(args.seed + 1)
    return [random_tokens(rng, args.max_len) for _ in range(2)]


def overrides(args) -> dict:
    """RERANKER for the model's class; the method spelled out (vLLM infers it for Qwen3 alone)."""
    return {**RERANKER, "architectures": [f"{args.arch}ForSequenceClassification"], "method": "from_2_way_softmax"}


def run_flock(folder: Path, prompts: list[list[int]], args) -> dict:
    from flock import LLM

    llm = LLM(str(folder), dtype="bfloat16", scheduler=args.scheduler, max_num_batched_tokens=args.max_batched_tokens,
              hf_overrides=overrides(args))
    llm.classify(warmup(args), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.classify(prompts, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"engine": f"Flock {args.scheduler}", "wall_s": wall, "computed": llm.stats()["computed_prefill_tokens"],
            "scores": [o.outputs.probs[0] for o in outs]}


def run_vllm(folder: Path, prompts: list[list[int]], args) -> dict:
    job = {"model": str(folder), "prefix_caching": True, "max_model_len": args.max_model_len, "warmup": warmup(args),
           "prompts": prompts, "task": "classify", "hf_overrides": overrides(args), "block_size": args.vllm_block_size}
    data = vllm.run_child(CHILD, job, "rerank-vllm", args)
    engine = vllm.VLLM_ENGINE + (f" (block_size {args.vllm_block_size})" if args.vllm_block_size else "")
    if isinstance(data, str):
        return {"engine": engine, "error": data}
    return {"engine": engine, "wall_s": data["wall_s"], "startup_s": data["startup_s"],
            "computed": sum(map(len, prompts)) - data["cached_tokens"], "scores": [e[0] for e in data["embeddings"]]}


def agreement(a: list[float], b: list[float], docs: int) -> str:
    """The largest score difference, and the share of queries whose best passage both engines pick."""
    best = lambda s, q: max(range(q * docs, (q + 1) * docs), key=s.__getitem__)  # noqa: E731
    same = sum(best(a, q) == best(b, q) for q in range(len(a) // docs))
    return f"max diff {max(abs(x - y) for x, y in zip(a, b)):.4f}, same best {same}/{len(a) // docs}"


def report(results: list[dict], prompts: list[list[int]], args) -> str:
    return versus_vllm(results, ("pairs/s", lambda r: f"{len(prompts) / r['wall_s']:,.1f}"),
                       ("scores", lambda r, ref: agreement(r["scores"], ref["scores"], args.docs)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3", help="shape (tiny, mid, qwen3), built-in name or HF folder")
    p.add_argument("--arch", default="Qwen3", help="the *ForSequenceClassification class the overrides name "
                   "(Llama for the tiny and mid shapes)")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--docs", type=int, default=32, help="passages per query")
    p.add_argument("--system", type=int, default=64, help="tokens of the system prompt and instruction")
    p.add_argument("--query", type=int, default=32, help="tokens of each query")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--suffix", type=int, default=12, help="tokens of the template's end (the assistant turn)")
    p.add_argument("--scheduler", default="batchllm")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-block-size", type=int, default=None, help="vLLM's KV block size (its CPU default: 128 "
                   "tokens, so it caches no prefix shorter than that; 32 at least)")
    vllm.add_arguments(p)
    args = p.parse_args()
    if args.model in ("tiny", "mid") and args.arch == "Qwen3":
        args.arch = "Llama"
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("rerank"), flush=True)
    folder = hf_folder(MODELS.get(args.model, args.model), args.out)
    prompts = workload(args)
    print(f"# {folder.name} as a reranker: {args.queries} queries x {args.docs} passages = {len(prompts)} pairs, "
          f"{sum(map(len, prompts)):,} tokens; {machine.load_note()}", flush=True)
    results = [run_flock(folder, prompts, args)]
    if not args.skip_vllm:
        results.append(run_vllm(folder, prompts, args))
    print(report(results, prompts, args))
    write_json(args.out / "rerank.json", {"args": args_dict(args), "cpu": machine.cpu_line(), "results": [
        {k: v for k, v in r.items() if k != "scores"} for r in results]})


if __name__ == "__main__":
    main()
