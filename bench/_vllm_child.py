"""vLLM side of bench/engine_speed.py; runs under the vLLM virtual environment's python.

usage: python _vllm_child.py JOB.json RESULT.json

JOB: {"model", "prefix_caching", "gen", "max_model_len", "warmup": [[ids]], "workloads": {name: [[ids]]}}
RESULT: {"vllm_version", "startup_s", "workloads": {name: {"wall_s", "prompt_tokens", "generated_tokens",
"cached_tokens", "output_token_ids"}}}
"""

import json
import sys
import time


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
    )
    startup_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], gen: int):
        params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    run(job["warmup"], 4)
    results = {}
    for name, prompts in job["workloads"].items():
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = run(prompts, job["gen"])
        wall = time.perf_counter() - t
        results[name] = {
            "wall_s": wall,
            "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
        }
    result = {"vllm_version": vllm.__version__, "startup_s": startup_s, "workloads": results}
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
