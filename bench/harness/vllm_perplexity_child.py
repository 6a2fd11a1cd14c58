"""vLLM side of bench/kv_fp8.py's perplexity; runs under the vLLM virtual environment's python.

usage: python vllm_perplexity_child.py JOB.json RESULT.json

JOB: {"model", "kv_cache_dtype", "chunks": [[ids]]}.
RESULT: {"vllm_version", "wall_s", "logprobs": [[logprob of each chunk token (None for the first)]]}.
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

    job = json.loads(open(job_path).read())
    chunks = job["chunks"]
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=max(len(c) for c in chunks) + 8, seed=0,
              enable_prefix_caching=False, kv_cache_dtype=job["kv_cache_dtype"])
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    wall = time.perf_counter() - start
    logprobs = [[None if e is None else e[c[i]].logprob for i, e in enumerate(o.prompt_logprobs)]
                for c, o in zip(chunks, outs)]
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "wall_s": wall, "logprobs": logprobs}, f)
    os._exit(0)  # vLLM 0.32's shutdown can hang on its engine process once the result is written


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
