"""vLLM side of bench/beam_search.py; runs under the vLLM virtual environment's python.

usage: python vllm_beam_child.py JOB.json RESULT.json

JOB: {"model", "max_model_len", "beam_width", "max_tokens", "length_penalty", "warmup": [[ids]], "prompts": [[ids]]}
RESULT: {"vllm_version", "startup_s", "wall_s", "beams": [[[output ids], cum_logprob], ...] per prompt}
"""

import json
import os
import sys
import time

# run as a script, this folder leads sys.path, and its vllm.py would shadow the vllm package
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]


def main(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    job = json.loads(open(job_path).read())
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], enable_prefix_caching=True,
              seed=0)
    startup_s = time.perf_counter() - t0
    params = BeamSearchParams(beam_width=job["beam_width"], max_tokens=job["max_tokens"], ignore_eos=True,
                              length_penalty=job["length_penalty"])

    def search(prompts):
        return llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)

    search(job["warmup"])
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = search(job["prompts"])
    wall = time.perf_counter() - t
    beams = [[[s.tokens[len(p):], s.cum_logprob] for s in o.sequences] for p, o in zip(job["prompts"], outs)]
    open(result_path, "w").write(json.dumps({"vllm_version": vllm.__version__, "startup_s": startup_s,
                                             "wall_s": wall, "beams": beams}))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
