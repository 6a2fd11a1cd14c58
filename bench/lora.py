"""LoRA adapters: Flock and vLLM (CPU build) serving the same PEFT adapters of SmolLM2-135M-Instruct on the same
chat-templated token ids, greedy, bf16, prefix caching on.

    python -m bench.lora --vllm-venv /root/V
    python -m bench.lora --docs 2 --questions 2 --gen 16 --skip-vllm      # a dry run

The workload: DOCS reference documents (bench/harness/documents.py), QUESTIONS questions about each, every
question asked through ADAPTERS adapters in turn (a RAG service whose tenants each fine-tuned the model): a
document's prompts share its tokens, but only those of one adapter may share KV. Conditions: `base` (no
adapter, the engine started without LoRA), `one` (every request through one adapter), `mixed` (ADAPTERS adapters
in one batch). The adapters are PEFT's (rank RANK on every attention and MLP projection, small random B so the
answers stay text). Printed: the CPU and kernel paths, wall s, generated tokens/s, Flock / vLLM, each engine's
LoRA cost (its time over its base time), and how many answers equal the other engine's. The mixed condition
computes each document once per adapter (the prefill Flock computed says how much): its cost over the base run
is mostly that, not the adapters' products.
Results: bench/out/lora.json.
"""

import argparse
import time
from pathlib import Path

import torch

from bench.harness import machine, vllm
from bench.harness.documents import documents
from bench.harness.offline import hf_folder
from bench.harness.report import args_dict, markdown_table, write_json

CHILD = Path(__file__).resolve().parent / "harness" / "vllm_lora_child.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = ("Summarize the text above in two sentences.", "What is the main topic of the text above?",
             "List three terms the text above defines.", "Who would read the text above, and why?")


def make_adapters(folder: Path, out: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: no change at all
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        paths.append(out / f"adapter-{i}")
        peft.save_pretrained(paths[-1])
    return paths


def workload(tokenizer, args) -> tuple[list[list[int]], list[int]]:
    """The prompts, and the adapter of each (its index) in the mixed condition."""
    docs = [text for _, text in documents(args.docs, seed=5, min_chars=1200, max_chars=2000)]
    prompts, adapters = [], []
    for d in docs:
        for q in range(args.questions):
            text = tokenizer.apply_chat_template([{"role": "user", "content": f"{d}\n\n{QUESTIONS[q % len(QUESTIONS)]}"}],
                                                 add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
            adapters.append(q % args.adapters)
    return prompts, adapters


def conditions(adapters: list[int]) -> dict[str, list[int | None]]:
    return {"base": [None] * len(adapters), "one": [0] * len(adapters), "mixed": adapters}


def run_flock(folder: Path, paths: list[Path], prompts: list[list[int]], adapters: list[int], args) -> dict:
    from flock import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    runs = {}
    for name, which in conditions(adapters).items():
        llm = LLM(str(folder), dtype="bfloat16", scheduler="batchllm", max_model_len=args.max_model_len,
                  enable_lora=name != "base")
        loras = [None if i is None else requests[i] for i in which]
        warm = [{"prompt_token_ids": p[:64]} for p in prompts[:2]]
        llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False, lora_request=loras[:2])  # loads them too
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        runs[name] = {"wall_s": time.perf_counter() - t, "computed_prefill_tokens": llm.stats()["computed_prefill_tokens"],
                      "output_token_ids": [list(o.outputs[0].token_ids) for o in outs]}
        del llm
    return {"engine": "Flock", "paths": machine.kernel_paths(), "runs": runs}


def run_vllm(folder: Path, paths: list[Path], prompts: list[list[int]], adapters: list[int], args) -> dict:
    job = {"model": str(folder), "max_model_len": args.max_model_len, "gen": args.gen, "rank": args.rank,
           "adapters": [str(p) for p in paths], "prompts": prompts, "conditions": conditions(adapters)}
    data = vllm.run_child(CHILD, job, "lora-vllm", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    return {"engine": vllm.VLLM_ENGINE, "version": data["vllm_version"], "runs": data["runs"]}


def table(results: dict, tokens: int) -> str:
    flock, peer = results["Flock"]["runs"], results.get("vLLM", {}).get("runs", {})
    rows = []
    for name, run in flock.items():
        other = peer.get(name)
        row = [name, f"{run['computed_prefill_tokens']:,}", f"{run['wall_s']:.2f}", f"{tokens / run['wall_s']:.0f}",
               f"{run['wall_s'] / flock['base']['wall_s']:.2f}x"]
        if other:
            same = sum(a == b for a, b in zip(run["output_token_ids"], other["output_token_ids"]))
            row += [f"{other['wall_s']:.2f}", f"{tokens / other['wall_s']:.0f}",
                    f"{other['wall_s'] / peer['base']['wall_s']:.2f}x", f"**{other['wall_s'] / run['wall_s']:.2f}x**",
                    f"{same} / {len(run['output_token_ids'])}"]
        else:
            row += ["-"] * 5
        rows.append(row)
    return markdown_table(["condition", "Flock prefill computed", "Flock wall s", "Flock tok/s", "Flock / its base", "vLLM wall s", "vLLM tok/s",
                           "vLLM / its base", "Flock / vLLM", "same answers"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=4, help="questions per document")
    p.add_argument("--adapters", type=int, default=4, help="adapters in the mixed condition")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--gen", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--max-model-len", type=int, default=2048)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("lora"), flush=True)
    folder = hf_folder("flock/smollm2", args.out)
    paths = make_adapters(folder, args.out / "lora", args.adapters, args.rank)
    from transformers import AutoTokenizer

    prompts, adapters = workload(AutoTokenizer.from_pretrained(folder), args)
    print(f"# {len(prompts)} prompts ({args.docs} documents x {args.questions} questions, {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), {args.gen} tokens each; {args.adapters} adapters of rank {args.rank}",
          flush=True)
    results = {"Flock": run_flock(folder, paths, prompts, adapters, args)}
    if not args.skip_vllm:
        results["vLLM"] = run_vllm(folder, paths, prompts, adapters, args)
        if "error" in results["vLLM"]:
            print(f"# vLLM: {results['vLLM']['error']}", flush=True)
    print(table(results, len(prompts) * args.gen), flush=True)
    write_json(args.out / "lora.json", {"args": args_dict(args), "cpu": machine.cpu_line(), "results": results})


if __name__ == "__main__":
    main()
