"""vLLM side of bench/embeddings.py and bench/rerank.py; runs under the vLLM virtual environment's python.

usage: python vllm_embed_child.py JOB.json RESULT.json

JOB: {"model", "prefix_caching", "max_model_len", "warmup": [[ids]], "prompts": [[ids]], optional "task" ("embed",
the default, "classify", or "score": then warmup and prompts are [text, text] pairs a cross-encoder scores),
"hf_overrides" and "block_size"}
RESULT: {"vllm_version", "startup_s", "wall_s", "cached_tokens", "embeddings": [[floats]]} (a classification's
probabilities, a score, as its "embeddings")
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

    job = json.loads(open(job_path).read())
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], runner="pooling", dtype="bfloat16", max_model_len=job["max_model_len"],
              enable_prefix_caching=job["prefix_caching"], seed=0, hf_overrides=job.get("hf_overrides"),
              **({"block_size": job["block_size"]} if job.get("block_size") else {}))
    startup_s = time.perf_counter() - t0
    classify, score = job.get("task") == "classify", job.get("task") == "score"

    def embed(prompts):
        if score:
            return llm.score([a for a, _ in prompts], [b for _, b in prompts], use_tqdm=False)
        run = llm.classify if classify else llm.embed
        return run([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)

    embed(job["warmup"])
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = embed(job["prompts"])
    wall = time.perf_counter() - t
    result = {"vllm_version": vllm.__version__, "startup_s": startup_s, "wall_s": wall,
              "cached_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs),
              "embeddings": [[o.outputs.score] if score else list(o.outputs.probs if classify else o.outputs.embedding)
                             for o in outs]}
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns workers that re-import this file
    main(sys.argv[1], sys.argv[2])
