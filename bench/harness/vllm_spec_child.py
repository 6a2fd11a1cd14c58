"""vLLM side of bench/speculative.py; runs under the vLLM virtual environment's python.

usage: python vllm_spec_child.py JOB.json RESULT.json

JOB: {"model", "max_model_len", "speculative_config" (null: none), "gen", "temperature", "seed",
"modes": ["batch", "single"],
"warmup": [[ids]], "workloads": {name: [[ids]]}, "schemas": {name: JSON schema of its answers}}
RESULT: {"vllm_version", "startup_s", "runs": {"NAME/MODE": {"wall_s", "output_token_ids", "metrics"}}}: "batch"
sends a workload's prompts in one generate call, "single" one prompt after the other; metrics: vLLM's counters
over the run (spec_decode ones included).
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
    from vllm.sampling_params import StructuredOutputsParams

    job = json.loads(open(job_path).read())
    t0 = time.perf_counter()
    spec = {"speculative_config": job["speculative_config"]} if job["speculative_config"] else {}
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], seed=0,
              disable_log_stats=False, **spec)
    startup_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]], gen: int, schema: dict | None = None):
        structured = None if schema is None else StructuredOutputsParams(json=schema)
        params = SamplingParams(max_tokens=gen, temperature=job.get("temperature", 0), seed=job.get("seed"),
                                ignore_eos=schema is None, structured_outputs=structured)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def metrics() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if type(m).__name__ == "Counter":
                out[m.name] = out.get(m.name, 0) + m.value
        return out

    generate(job["warmup"], 8)
    runs = {}
    for name, prompts in job["workloads"].items():
        for mode in job["modes"]:
            llm.reset_prefix_cache()
            before = metrics()
            t = time.perf_counter()
            schema = job["schemas"].get(name)
            outs = generate(prompts, job["gen"], schema) if mode == "batch" else \
                [o for p in prompts for o in generate([p], job["gen"], schema)]
            wall = time.perf_counter() - t
            after = metrics()
            runs[f"{name}/{mode}"] = {"wall_s": wall, "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
                                      "metrics": {k: v - before.get(k, 0) for k, v in after.items()}}
    open(result_path, "w").write(json.dumps({"vllm_version": vllm.__version__, "startup_s": startup_s, "runs": runs}))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
