"""fp8 KV caches (kv_cache_dtype fp8 = e4m3, fp8_e5m2) against the model's bf16 KV: what they cost, what they keep.

    python -m bench.kv_fp8 --vllm-venv V     # kernel times, then SmolLM2's perplexity in Flock and in vLLM
    python -m bench.kv_fp8 --skip-vllm --tokens 4096                          # a dry run
    python -m bench.kv_fp8 --sections kernel                                    # the kernel's cells alone

1. Attention of one layer on the CPU kernel (bf16 queries, 16-token blocks; SmolLM2's 9 query / 3 KV heads of 64,
   and 8 / 4 of 64, whose decode units of two rows read bf16 K and V in place), each cache dtype timed in turn, the
   caches flushed from the last-level cache before each call: decode steps (16 requests with 2,080 tokens of
   context; 64 sharing a 2,048-token prefix 16 at a time; 4 with 8,224) and a fresh 2,048-token prefill; the KV
   bytes each reads (fp8: codes and a 4-byte scale a row) and the rate. The KV write of a 2,048-token step
   (quantizing vs copying) too.
2. Quality: SmolLM2-135M-Instruct's perplexity (bf16) on the standard library's docstrings, in 512-token chunks
   with the second half of each scored (as llama-perplexity -c 512), from prompt logprobs, with each KV cache dtype;
   with the vLLM venv, vLLM's on the same token ids with kv_cache_dtype auto and fp8 (one scale per layer, 1.0
   unless the checkpoint has one). The weights are SmolLM2's as a float32 folder loaded in bf16 by both.
"""

import argparse
import gc
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.gguf_perplexity import stdlib_text
from bench.harness import machine, vllm
from bench.harness.gguf_models import smollm2_folder
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.timing import median_time, timed
from flock.attention import make_backend
from flock.attention.base import StepLayout
from flock.kv import fp8
from flock.model.config import ModelConfig

CHILD = Path(__file__).resolve().parent / "harness" / "vllm_perplexity_child.py"
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SHAPES = {"9 / 3 heads": (9, 3), "8 / 4 heads": (8, 4)}  # query heads, KV heads
HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16  # SmolLM2's
# (name, requests, sharing degree, prefix, tail, new tokens a request)
CELLS = [("decode, 16 x 2,080", 16, 1, 2048, 32, 1), ("decode, 64 sharing 2,048 by 16", 64, 16, 2048, 32, 1),
         ("decode, 4 x 8,224", 4, 1, 8192, 32, 1), ("prefill, 2,048 fresh", 1, 1, 0, 0, 2048)]


# -- kernel --------------------------------------------------------------------------------------------------------
def layout(requests: int, degree: int, prefix: int, tail: int, new: int, blocks: int) -> StepLayout:
    """Groups of `degree` requests on one prefix's blocks, each with its own tail and `new` tokens; blocks shuffled."""
    free = list(np.random.default_rng(0).permutation(blocks))
    tables, starts = [], []
    for _ in range(requests // degree):
        shared = [free.pop() for _ in range(prefix // BS)]
        for _ in range(degree):
            end = prefix + tail + new
            tables.append(np.array(shared + [free.pop() for _ in range(-(-end // BS) - prefix // BS)]))
            starts.append(prefix + tail)
    starts, news = np.array(starts), np.full(len(starts), new)
    slots = np.concatenate([t[np.arange(s, s + new) // BS] * BS + np.arange(s, s + new) % BS for t, s in zip(tables, starts)])
    return StepLayout(np.concatenate([[0], np.cumsum(news)]), starts + news, tables, BS, torch.from_numpy(slots))


def read_bytes(requests: int, degree: int, prefix: int, tail: int, new: int, kv_heads: int, dtype: torch.dtype) -> int:
    row = fp8.row_width(DIM, dtype) * dtype.itemsize
    tokens = requests // degree * prefix + requests * (tail + new)
    return 2 * tokens * kv_heads * row


def kernel_cells(args) -> list[dict]:
    return [row for shape in SHAPES for row in shape_cells(args, shape)] + write_cells(args)


def shape_cells(args, shape: str) -> list[dict]:
    heads, kv_heads = SHAPES[shape]
    config = ModelConfig("llama", 100, heads * DIM, 16, 1, heads, kv_heads, DIM)
    flush = torch.empty(args.flush_mib << 18)
    rows = []
    for name, requests, degree, prefix, tail, new in CELLS:
        blocks = requests // degree * prefix // BS + requests * (-(-(tail + new) // BS) + 1) + 4
        lay = layout(requests, degree, prefix, tail, new, blocks)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(requests * new, h, DIM, generator=gen).bfloat16() for h in (heads, kv_heads, kv_heads))
        base = torch.randn(blocks, BS, kv_heads, DIM, generator=gen)
        runs = {}
        for label, dtype in DTYPES.items():
            cache = base.bfloat16() if dtype == torch.bfloat16 else fp8.quantize(base, dtype)
            k_cache, v_cache = cache, cache.clone()
            backend = make_backend("cpu", config, torch.device("cpu"), torch.bfloat16, dtype)
            meta = backend.build_metadata(lay)
            runs[label] = (backend, meta, k_cache, v_cache)
        times = {label: [] for label in DTYPES}
        for _ in range(args.repeats):
            for label, (backend, meta, k_cache, v_cache) in runs.items():  # in turn: load falls on all alike
                flush.add_(1)
                times[label].append(timed(lambda: backend.forward(q, k, v, k_cache, v_cache, meta)))
        for label, dtype in DTYPES.items():
            t = statistics.median(times[label])
            b = read_bytes(requests, degree, prefix, tail, new, kv_heads, dtype)
            rows.append({"cell": f"{shape}, {name}", "kv": label, "ms": t * 1e3, "MB": b / 1e6, "GBps": b / t / 1e9,
                         "vs_bf16": statistics.median(times["bf16"]) / t})
        runs = None
        gc.collect()
    return rows


def write_cells(args) -> list[dict]:
    """The KV write of a 2,048-token step of one layer: a copy into a bf16 cache, quantizing into fp8 ones."""
    from flock.attention.cpu import CpuCascadeBackend

    tokens = 2048
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM).bfloat16()
    _, k, v = qkv.view(tokens, -1, DIM).split([HEADS, KV_HEADS, KV_HEADS], 1)
    slots = torch.randperm(tokens * 2)[:tokens]
    backend = CpuCascadeBackend(HEADS, KV_HEADS, DIM, None, torch.bfloat16)
    rows = []
    for label, dtype in DTYPES.items():
        caches = [torch.zeros(tokens * 2 // BS, BS, KV_HEADS, fp8.row_width(DIM, dtype), dtype=dtype) for _ in range(2)]
        t = median_time(lambda: backend._write_kv(k, v, *caches, slots), args.repeats)
        rows.append({"cell": f"KV write, {tokens:,} tokens", "kv": label, "ms": t * 1e3})
    return rows


# -- quality -------------------------------------------------------------------------------------------------------
def text_chunks(folder: Path, tokens: int, ctx: int) -> list[list[int]]:
    """The standard library's docstrings as token ids (SmolLM2's vocabulary adds no BOS), in chunks of ctx."""
    from flock.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    ids = tok.encode(stdlib_text(tokens, lambda s: len(tok.encode(s))))
    return [ids[i * ctx:(i + 1) * ctx] for i in range(min(len(ids), tokens) // ctx)]


def nll_of(chunks: list[list[int]], entries_of) -> tuple[float, int]:
    """Sum of -log p over each chunk's scored second half; entries_of(i, p) is the logprob of chunk i's token p."""
    nll, count = 0.0, 0
    for i, chunk in enumerate(chunks):
        for p in range(len(chunk) // 2 + 1, len(chunk)):
            nll -= entries_of(i, p)
            count += 1
    return nll, count


def flock_perplexity(folder: Path, chunks: list[list[int]], kv: str = "auto", **engine) -> dict:
    from flock import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", kv_cache_dtype=kv, **engine)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    wall = time.perf_counter() - start
    nll, count = nll_of(chunks, lambda i, p: outs[i].prompt_logprobs[p].logprob)
    llm = outs = None
    gc.collect()
    return {"engine": "Flock", "kv": kv, "ppl": math.exp(nll / count), "scored": count, "wall_s": wall}


def vllm_perplexity(folder: Path, chunks: list[list[int]], kv: str, args, name: str | None = None) -> dict:
    """vLLM's perplexity of the chunks (its child's files named `name`, by default after the KV cache dtype)."""
    data = vllm.run_child(CHILD, {"model": str(folder), "kv_cache_dtype": kv, "chunks": chunks},
                          name or f"kv_fp8-vllm-{kv}", args)
    if isinstance(data, str):
        return {"engine": vllm.VLLM_ENGINE, "kv": kv, "error": data}
    nll, count = nll_of(chunks, lambda i, p: data["logprobs"][i][p])
    return {"engine": f"vLLM {data['vllm_version']}", "kv": kv, "ppl": math.exp(nll / count), "scored": count,
            "wall_s": data["wall_s"]}


def quality(args) -> list[dict]:
    folder = smollm2_folder()
    chunks = text_chunks(folder, args.tokens, args.ctx)
    print(f"\n# perplexity: {len(chunks)} chunks of {args.ctx} tokens", flush=True)
    rows = [flock_perplexity(folder, chunks, kv) for kv in ("auto", "fp8", "fp8_e5m2")]
    if not args.skip_vllm:
        rows += [vllm_perplexity(folder, chunks, kv, args) for kv in ("auto", "fp8", "fp8_e5m2")]
    for r in rows:
        base = next((b for b in rows if b["engine"] == r["engine"] and b["kv"] == "auto" and "ppl" in b), None)
        if "ppl" in r and base:
            r["vs_auto"] = r["ppl"] / base["ppl"] - 1
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="kernel,quality", help="comma-separated: kernel, quality")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per cache dtype and cell")
    p.add_argument("--flush-mib", type=int, default=256, help="buffer written before each timed call")
    p.add_argument("--tokens", type=int, default=32768, help="text tokens for the perplexity")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=vllm.DEFAULT_VENV)
    p.add_argument("--vllm-timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.sections = args.sections.split(",")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    print(machine.header("kv_fp8"))
    print(f"# {machine.load_note()}", flush=True)
    kernel = kernel_cells(args) if "kernel" in args.sections else []
    if kernel:
        print("\n## attention of one layer and the KV write (CPU kernel, bf16 queries)\n")
        print(markdown_table(["cell", "KV cache", "ms", "KV read MB", "GB/s", "bf16 / this"],
                             [[r["cell"], r["kv"], f"{r['ms']:.3f}", f"{r['MB']:.1f}" if "MB" in r else "-",
                               f"{r['GBps']:.1f}" if "GBps" in r else "-",
                               f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"] for r in kernel]), flush=True)
    ppl = quality(args) if "quality" in args.sections else []
    if ppl:
        print("\n## SmolLM2-135M-Instruct perplexity, bf16 weights\n")
        print(markdown_table(["engine", "kv_cache_dtype", "perplexity", "vs auto", "scored tokens", "wall s"],
                             [[r["engine"], r["kv"], r.get("error") or f"{r['ppl']:.4f}",
                               f"{r['vs_auto']:+.2%}" if "vs_auto" in r else "-", r.get("scored", "-"),
                               f"{r['wall_s']:.1f}" if "wall_s" in r else "-"] for r in ppl]))
    path = write_json(args.out / "kv_fp8.json", {"args": args_dict(args), "kernel": kernel, "perplexity": ppl})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
