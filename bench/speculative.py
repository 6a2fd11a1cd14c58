"""Speculative decoding: Flock and vLLM (CPU build), each with and without the same `speculative_config`, the same
chat-templated token ids, greedy (or sampled at `--temperature`, seeded). `--method ngram` (prompt lookup) runs SmolLM2-135M-Instruct; `--method
draft_model` runs a target 1 + `--copies` times SmolLM2's depth (bench/harness/deep_target.py: SmolLM2's layers,
each followed by copies whose outputs are scaled by `--scale`, so its answers follow SmolLM2's often, not always)
with SmolLM2 itself as the draft.

    python -m bench.speculative --vllm-venv /root/V
    python -m bench.speculative --method draft_model --vllm-venv /root/V
    python -m bench.speculative --docs 2 --gen 32 --skip-vllm      # a dry run
    python -m bench.speculative --method draft_model --temperature 0.8 --draft-sample-method probabilistic

Workloads (real text: standard-library reference documents, bench/harness/documents.py):
- copy: "Repeat the following text exactly" + a document (the answer copies it: drafts hold);
- quote: questions about a document that ask for its own words (drafts hold in part);
- extract: a JSON schema's answer (structured outputs) quoting a document: the grammar's forced tokens and the
  quotes' n-grams as drafts;
- chat: short questions without a document (little to look up: what drafting costs).
Each runs as one batch (offline) and one request after another (online, a single stream: where a CPU has
compute to spare for the drafts). Printed: the CPU and kernel paths, wall s, generated tokens/s, the speed-up
drafts give each engine, Flock / vLLM, the acceptance, and whether outputs with drafts equal those without.
Results: bench/out/speculative-METHOD.json.
"""

import argparse
import json
import time
from pathlib import Path

from bench.harness import machine, vllm
from bench.harness.deep_target import deep_target
from bench.harness.documents import documents
from bench.harness.offline import hf_folder
from bench.harness.report import args_dict, markdown_table, write_json

CHILD = Path(__file__).resolve().parent / "harness" / "vllm_spec_child.py"
SCHEMAS = {"extract": {"type": "object", "properties": {
    "topic": {"type": "string"},
    "quotes": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}},
    "required": ["topic", "quotes"], "additionalProperties": False}}
QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Who wrote Romeo and Juliet?", "What gas do plants take in?", "How many days are in a leap year?",
             "What is the boiling point of water in Celsius?", "Name the largest planet in our solar system.")


def workloads(tokenizer, n: int) -> dict[str, list[list[int]]]:
    docs = [text for _, text in documents(n, seed=3, min_chars=1200, max_chars=2000)]

    def chat(content: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    return {
        "copy": [chat(f"Repeat the following text exactly, word for word.\n\n{d}") for d in docs],
        "quote": [chat(f"{d}\n\nQuote the first two sentences of the text above, then explain them.") for d in docs],
        "extract": [chat(f"{d}\n\nAnswer in JSON: the topic of the text above, and two sentences quoted from it "
                         "word for word.") for d in docs],
        "chat": [chat(q) for q in (QUESTIONS * n)[:n]],
    }


def run_flock(folder: Path, loads: dict, spec: dict | None, args) -> dict:
    from flock import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(str(folder), dtype="bfloat16", max_model_len=args.max_model_len, speculative_config=spec)
    llm.generate([{"prompt_token_ids": p} for p in loads["chat"][:2]], SamplingParams(max_tokens=8), use_tqdm=False)
    runs = {}
    for name, prompts in loads.items():
        schema = SCHEMAS.get(name)  # a structured answer ends with its grammar
        params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.gen,
                                ignore_eos=schema is None, structured_outputs=
                                None if schema is None else StructuredOutputsParams(json=schema))
        for mode in args.modes:
            llm.reset_prefix_cache()
            run = {"wall_s": 0.0, "steps": 0, "drafts": 0, "accepted": 0, "output_token_ids": []}
            for batch in [prompts] if mode == "batch" else [[p] for p in prompts]:
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                run["wall_s"] += time.perf_counter() - t
                s = llm.stats()  # of this call
                run["steps"] += s["steps"]
                run["drafts"] += s["draft_tokens"]
                run["accepted"] += s["accepted_draft_tokens"]
                run["output_token_ids"] += [list(o.outputs[0].token_ids) for o in outs]
            runs[f"{name}/{mode}"] = run
    return {"engine": "Flock", "runs": runs}


def run_vllm(folder: Path, loads: dict, spec: dict | None, args) -> dict:
    job = {"model": str(folder), "max_model_len": args.max_model_len, "speculative_config": spec, "gen": args.gen,
           "temperature": args.temperature, "seed": args.seed,
           "modes": args.modes, "warmup": loads["chat"][:2], "workloads": loads, "schemas": SCHEMAS}
    data = vllm.run_child(CHILD, job, f"speculative-vllm-{'spec' if spec else 'plain'}", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    for r in data["runs"].values():
        m = r.pop("metrics")
        r["drafts"] = m.get("vllm:spec_decode_num_draft_tokens", 0)
        r["accepted"] = m.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"engine": vllm.VLLM_ENGINE, "version": data["vllm_version"], "runs": data["runs"]}


def table(results: dict, args) -> str:
    rows = []
    for key in results["Flock"]["plain"]["runs"]:
        row = [key]
        for engine in ("Flock", "vLLM"):
            plain, spec = (results.get(engine, {}).get(c, {}).get("runs", {}).get(key) for c in ("plain", "spec"))
            if not plain or not spec:
                row += ["-"] * 4
                continue
            tokens = sum(map(len, spec["output_token_ids"]))
            rate = spec["accepted"] / spec["drafts"] if spec["drafts"] else 0.0
            same = "-" if args.temperature else "yes" if spec["output_token_ids"] == plain["output_token_ids"] else "NO"
            row += [f"{plain['wall_s']:.2f} / {spec['wall_s']:.2f}", f"{tokens / spec['wall_s']:.0f}",
                    f"{plain['wall_s'] / spec['wall_s']:.2f}x", f"{rate:.2f}, {same}"]
        flock, peer = (results.get(e, {}).get("spec", {}).get("runs", {}).get(key) for e in ("Flock", "vLLM"))
        row.append(f"{peer['wall_s'] / flock['wall_s']:.2f}x" if flock and peer else "-")
        rows.append(row)
    head = ["workload/mode"] + [f"{e} {h}" for e in ("Flock", "vLLM") for h in
                                ("wall s plain / drafts", "tok/s drafts", "drafts speed-up", "accepted, same")]
    return markdown_table(head + ["Flock / vLLM with drafts"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=8, help="prompts per workload")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--modes", default="batch,single", type=lambda s: s.split(","))
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"), help="prompt_lookup_min/max")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--copies", type=int, default=4, help="draft_model: the target's copies of each SmolLM2 layer")
    p.add_argument("--scale", type=float, default=0.05, help="draft_model: the copies' output scale")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0, help="sampled runs: outputs with drafts differ")
    p.add_argument("--seed", type=int, default=1, help="every request's seed when sampled")
    p.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default="greedy",
                   help="draft_model: how drafts of sampled requests are drawn")
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("speculative"), flush=True)
    folder = small = hf_folder("flock/smollm2", args.out)
    from transformers import AutoTokenizer

    loads = workloads(AutoTokenizer.from_pretrained(folder), args.docs)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1]}
    if args.method == "draft_model":
        folder = deep_target(small, args.out / f"smollm2-deep-{args.copies}-{args.scale}", args.copies, args.scale)
        spec = {"method": "draft_model", "model": str(small), "num_speculative_tokens": args.k,
                "draft_sample_method": args.draft_sample_method}
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        print(f"# target: SmolLM2 with {args.copies} copies of each layer (MLP outputs x {args.scale}), {layers} "
              "layers; draft: SmolLM2", flush=True)
    print(f"# {spec}; {args.docs} prompts a workload, {args.gen} tokens each, prompts of "
          f"{min(map(len, loads['copy']))}-{max(map(len, loads['copy']))} tokens (copy)", flush=True)
    results = {"Flock": {c: run_flock(folder, loads, s, args) for c, s in (("plain", None), ("spec", spec))}}
    if not args.skip_vllm:
        results["vLLM"] = {c: run_vllm(folder, loads, s, args) for c, s in (("plain", None), ("spec", spec))}
    print(table(results, args), flush=True)
    name = args.method + (f"-t{args.temperature:g}-{args.draft_sample_method}" if args.temperature else "")
    write_json(args.out / f"speculative-{name}.json", {"args": args_dict(args), "cpu": machine.cpu_line(),
                                                              "spec": spec, "results": results})


if __name__ == "__main__":
    main()
