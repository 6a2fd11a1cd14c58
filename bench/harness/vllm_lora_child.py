"""vLLM side of bench/lora.py; runs under the vLLM virtual environment's python.

usage: python vllm_lora_child.py JOB.json RESULT.json

JOB: {"model", "max_model_len", "gen", "rank", "adapters": [PEFT folders], "prompts": [[ids]],
"conditions": {name: [adapter index or null per prompt]}}; "base" runs on an engine without LoRA, the others on
one with enable_lora (max_loras: the adapters).
RESULT: {"vllm_version", "runs": {name: {"wall_s", "output_token_ids"}}}.
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
    from vllm.lora.request import LoRARequest

    job = json.loads(open(job_path).read())
    params = SamplingParams(max_tokens=job["gen"], temperature=0, ignore_eos=True)
    loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    runs, engines = {}, {}
    for name, which in job["conditions"].items():
        lora = name != "base"
        if lora not in engines:
            engines.clear()  # one engine at a time
            extra = {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": job["rank"]} if lora else {}
            engines[lora] = LLM(model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], seed=0,
                                enable_prefix_caching=True, **extra)
        llm = engines[lora]
        requests = [None if i is None else loras[i] for i in which]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False,
                     lora_request=requests[:2] if lora else None)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests if lora else None)
        runs[name] = {"wall_s": time.perf_counter() - t, "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    open(result_path, "w").write(json.dumps({"vllm_version": vllm.__version__, "runs": runs}))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
