"""BERT-family encoders, a RAG pipeline's embedding model and cross-encoder reranker: Flock's LLM.embed and
LLM.score side by side with vLLM's (CPU build, runner="pooling"), one engine after the other.

    python -m bench.encoders --vllm-venv /root/V                  # bge-base's shape (BERT, 110M), random bf16
    python -m bench.encoders --arch modernbert --vllm-venv /root/V   # ModernBERT-base's shape (149M)
    python -m bench.encoders --shape small --inputs 16 --queries 2 --skip-vllm     # a dry run in seconds

Two jobs on one random-weight encoder of --arch and --shape (BERT: small, bge-small / all-MiniLM-L12's 384 x 12
layers; base, bge-base's 768 x 12; large, bge-large's 1024 x 24. ModernBERT: base, 768 x 22; large, 1024 x 28; its
local layers seeing 64 positions on either side), bf16 in both engines:
- embed: --inputs passages of --min-len to --max-len tokens ([CLS] ... [SEP]), each pooled at [CLS] and
  L2-normalized (BertModel's default in both engines);
- rerank: --queries queries of --query tokens, each scored against --docs passages by the same encoder as a
  BertForSequenceClassification with one label: each (query, passage) pair as text, tokenized by each engine as
  the tokenizer's pair encoding (token types 0, then 1), the score the sigmoid of its logit.
Printed: the CPU and kernel paths, wall s, tokens/s or pairs/s, speed vs vLLM, and how close the two engines'
outputs are (cosine similarity, score difference; bf16 weights, so not equal). Results: bench/out/encoders.json.
"""

import argparse
import random
import time
from pathlib import Path

import torch

from bench.embeddings import CHILD, versus_vllm
from bench.harness import machine, vllm
from bench.harness.report import args_dict, write_json

SHAPES = {"bert": {"small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=1536),
                   "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                intermediate_size=3072),
                   "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096)},
          "modernbert": {"base": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                      intermediate_size=1152),
                         "large": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                       intermediate_size=2624)}}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 30522  # BERT's
CLS, SEP = 2, 3


def save_encoder(out: Path, arch: str, shape: str, num_labels: int) -> Path:
    """A random bf16 encoder of `arch` and `shape` (a classifier of `num_labels`, else a base model) with a
    WordPiece tokenizer whose words are w0, w1, ..."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, BertTokenizerFast

    folder = out / (f"{arch}-{shape}" + ("-ce" if num_labels else ""))
    if (folder / "model.safetensors").exists():
        return folder
    vocab = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    special = {"pad_token_id": 0, "bos_token_id": CLS, "eos_token_id": SEP, "cls_token_id": CLS,
               "sep_token_id": SEP} if arch == "modernbert" else {}
    config = AutoConfig.for_model(arch, vocab_size=VOCAB, **SHAPES[arch][shape], **special,
                                  **({"num_labels": num_labels} if num_labels else {}))
    torch.manual_seed(0)
    model = (AutoModelForSequenceClassification if num_labels else AutoModel).from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(folder)
    return folder


def words(rng: random.Random, n: int) -> str:
    """A text of n tokens: each word w<i> is one vocabulary entry."""
    return " ".join(f"w{rng.randrange(VOCAB - len(SPECIAL))}" for _ in range(n))


def embed_workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[CLS, *(rng.randrange(len(SPECIAL), VOCAB) for _ in range(rng.randint(args.min_len, args.max_len))), SEP]
            for _ in range(args.inputs)]


def rerank_workload(args) -> list[tuple[str, str]]:
    rng = random.Random(args.seed + 1)
    pairs = []
    for _ in range(args.queries):
        query = words(rng, args.query)
        pairs += [(query, words(rng, rng.randint(args.min_len, args.max_len))) for _ in range(args.docs)]
    return pairs


def run_flock(folder: Path, job: list, task: str, args) -> dict:
    from flock import LLM

    llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=args.max_batched_tokens)
    run = (lambda x: llm.score([a for a, _ in x], [b for _, b in x], use_tqdm=False)) if task == "score" else \
        (lambda x: llm.embed([{"prompt_token_ids": p} for p in x], use_tqdm=False))
    run(job[:2])
    start = time.perf_counter()
    outs = run(job)
    wall = time.perf_counter() - start
    paths = llm.engine.runner.paths
    return {"engine": "Flock", "wall_s": wall, "computed": llm.stats()["computed_prefill_tokens"], "paths": paths,
            "outputs": [[o.outputs.score] if task == "score" else o.outputs.embedding for o in outs]}


def run_vllm(folder: Path, job: list, task: str, args) -> dict:
    data = vllm.run_child(CHILD, {"model": str(folder), "prefix_caching": False, "max_model_len": 512,
                                  "warmup": job[:2], "prompts": job, "task": task}, f"encoders-{task}-vllm", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "error": data}
    return {"engine": vllm.VLLM_ENGINE, "wall_s": data["wall_s"], "startup_s": data["startup_s"],
            "computed": None, "outputs": data["embeddings"]}


def closeness(task: str):
    def close(r: dict, ref: dict) -> str:
        a, b = (torch.tensor(x["outputs"], dtype=torch.float64) for x in (r, ref))
        if task == "score":
            return f"max |diff| {(a - b).abs().max():.4f}"
        sims = torch.nn.functional.cosine_similarity(a, b, dim=1)
        return f"cosine mean {sims.mean():.4f}, min {sims.min():.4f}"
    return close


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="bert", choices=sorted(SHAPES))
    p.add_argument("--shape", default="base", help="small (BERT only), base or large")
    p.add_argument("--inputs", type=int, default=256, help="passages embedded")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--docs", type=int, default=32, help="passages reranked per query")
    p.add_argument("--query", type=int, default=16, help="tokens of a query")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# encoders: {machine.cpu_line()}", flush=True)  # each task prints the paths Flock ran
    runs = []
    if args.shape not in SHAPES[args.arch]:
        p.error(f"--shape of {args.arch}: one of {', '.join(SHAPES[args.arch])}")
    for task, folder, job in (("embed", save_encoder(args.out, args.arch, args.shape, 0), embed_workload(args)),
                              ("score", save_encoder(args.out, args.arch, args.shape, 1), rerank_workload(args))):
        what = f"{len(job)} passages, {sum(map(len, job)):,} tokens" if task == "embed" else \
            f"{args.queries} queries x {args.docs} passages"
        print(f"# {task}: {args.arch} {args.shape}, {what}; {machine.load_note()}", flush=True)
        results = [run_flock(folder, job, task, args)]
        if not args.skip_vllm:
            results.append(run_vllm(folder, job, task, args))
        print(f"# Flock's paths: {results[0]['paths']}")
        for r in results:
            r["computed"] = r["computed"] or results[0]["computed"]  # neither engine caches an encoder's prompts
        rate = ("input tok/s", lambda r: f"{results[0]['computed'] / r['wall_s']:,.0f}") if task == "embed" else \
            ("pairs/s", lambda r: f"{len(job) / r['wall_s']:,.1f}")
        print(versus_vllm(results, rate, (task if task == "score" else "embedding", closeness(task))), flush=True)
        runs.append({"task": task, "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]})
    write_json(args.out / "encoders.json", {"args": args_dict(args), "cpu": machine.cpu_line(), "runs": runs})


if __name__ == "__main__":
    main()
