"""vLLM side of bench/images.py; runs under the vLLM virtual environment's python.

usage: python vllm_images_child.py JOB.json RESULT.json

JOB: {"model", "max_model_len", "gen", "rounds": [[[text, image path]] per round], "image_mark"}.
RESULT: {"vllm_version", "walls": [s per round], "output_token_ids" (of the last round)}; the prefix cache is
reset before each round.
"""

import json
import os
import sys
import time

# run as a script, this folder leads sys.path, and its vllm.py would shadow the vllm package
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]


def main(job_path: str, result_path: str) -> None:
    import vllm
    from PIL import Image
    from vllm import LLM, SamplingParams

    job = json.loads(open(job_path).read())
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=True, limit_mm_per_prompt={"image": 1})
    llm.generate({"prompt": f"{job['image_mark']} warm up", "multi_modal_data": {"image": Image.new("RGB", (64, 64))}},
                 SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(max_tokens=job["gen"], temperature=0, ignore_eos=True)
    walls = []
    for batch in job["rounds"]:
        llm.reset_prefix_cache()
        prompts = [{"prompt": text, "multi_modal_data": {"image": Image.open(path)}} for text, path in batch]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    open(result_path, "w").write(json.dumps({"vllm_version": vllm.__version__, "walls": walls,
                                             "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
