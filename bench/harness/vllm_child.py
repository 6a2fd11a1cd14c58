"""vLLM side of bench.harness.vllm.run_batch; runs under the vLLM virtual environment's python.

usage: python vllm_child.py JOB.json RESULT.json

JOB: {"model", "prefix_caching", "gen", "max_model_len", "kv_cache_memory_bytes" (null: VLLM_CPU_KVCACHE_SPACE),
"kv_cache_dtype" (default auto), "sampling" (SamplingParams fields; default greedy), "warmup": [[ids]],
"workloads": {name: [[ids]]}}
RESULT: {"vllm_version", "startup_s", "workloads": {name: {"wall_s", "prompt_tokens", "generated_tokens",
"cached_tokens", "output_token_ids", "metrics"}}}; metrics: vLLM's counters and histogram counts / sums over the
workload (e.g. "vllm:num_preemptions", "vllm:iteration_tokens_total:count" = engine steps).
"""

import json
import os
import sys
import time

# run as a script, this folder leads sys.path, and its vllm.py would shadow the vllm package
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]


def main(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_path).read())
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype="bfloat16",
        max_model_len=job["max_model_len"],
        enable_prefix_caching=job["prefix_caching"],
        seed=0,
        disable_log_stats=False,  # keeps the metrics
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
        **({"kv_cache_memory_bytes": job["kv_cache_memory_bytes"]} if job.get("kv_cache_memory_bytes") else {}),
    )
    startup_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], gen: int):
        params = SamplingParams(**{"max_tokens": gen, "temperature": 0, "ignore_eos": True, **job.get("sampling", {})})
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def metrics() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if hasattr(m, "count"):  # histogram
                out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
                out[m.name + ":sum"] = out.get(m.name + ":sum", 0) + m.sum
            elif isinstance(getattr(m, "value", None), (int, float)) and type(m).__name__ == "Counter":
                out[m.name] = out.get(m.name, 0) + m.value
        return out

    run(job["warmup"], 4)
    results = {}
    for name, prompts in job["workloads"].items():
        llm.reset_prefix_cache()
        before = metrics()
        t = time.perf_counter()
        outs = run(prompts, job["gen"])
        wall = time.perf_counter() - t
        after = metrics()
        results[name] = {
            "wall_s": wall,
            "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "metrics": {k: v - before.get(k, 0) for k, v in after.items()},
        }
    result = {"vllm_version": vllm.__version__, "startup_s": startup_s, "workloads": results}
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
