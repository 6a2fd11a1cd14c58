"""Hugging Face checkpoints of GPTQ, AWQ and compressed-tensors weights: Flock beside vLLM on the same folders.

    python -m bench.hf_quant --vllm-venv V                        # both sections, the default formats
    python -m bench.hf_quant --sections quality --formats gptq,awq --skip-vllm --tokens 4096    # a dry run
    python -m bench.hf_quant --sections quality --formats fp8-block,ct-fp8 --vllm-venv V      # fp8 checkpoints

The checkpoints are written by bench/harness/int_checkpoints.py (round to nearest, in each method's layout) from a
float folder, under --out:
1. Quality: SmolLM2-135M-Instruct (its float32 folder) as each format, groups of --group inputs; the perplexity of
   each, and of the float weights, on the standard library's docstrings (512-token chunks, second halves scored,
   from prompt logprobs; bench/kv_fp8.py's method) in Flock (bf16 activations on the int8 kernels) and in vLLM
   (its CPU kernels: W4A16 for GPTQ, AWQ and compressed-tensors' int4, int8 W8A8) on the same token ids, and in
   Flock with the weights dequantized at load (quantization="none": the values the checkpoint holds, in bf16).
   Equal perplexities across the engines say both read the layout alike; the float row says what rounding costs,
   the dequantized one what Flock's int8 activations cost.
2. Speed: a random-weight Llama of ~1B parameters (--speed-model; bf16, 2,048 wide, 16 layers) as each format:
   single-stream decode (one 64-token prompt, --decode-gen new tokens) and a shared-prefix batch (--groups x
   --per-group prompts of --prefix shared + --distinct own tokens, --gen new each), greedy, Flock's batchllm
   beside vLLM with prefix caching, one engine after the other, and each engine on the float folder too.
Each run prints the CPU, Flock's kernel paths, tables, and writes bench/out/hf_quant.json.
"""

import argparse
import random
from pathlib import Path

import torch

from bench.harness import gguf_models, int_checkpoints, machine, vllm
from bench.harness.offline import Workload, run_flock, shared_workload, warmup_prompts
from bench.harness.report import args_dict, markdown_table, write_json
from bench.kv_fp8 import flock_perplexity, text_chunks, vllm_perplexity

FLOAT = "float"  # the unquantized folder, beside the formats


def checkpoint(base: Path, kind: str, group: int, out: Path) -> Path:
    """`base` written as `kind` under `out` (kept between runs: the folder is named by its source and group)."""
    if kind == FLOAT:
        return base
    folder = out / "hf_quant" / f"{base.name}-{kind}-g{group}"
    if not (folder / "config.json").is_file():
        print(f"# writing {folder}", flush=True)
        int_checkpoints.write(base, folder, kind, group, reference=False)
    return folder


def flock_paths(folder: Path, quantization: str = "auto") -> str:
    """The GEMM paths Flock runs a checkpoint on (its engine's `paths`), for the report."""
    from flock import LLM

    llm = LLM(str(folder), dtype="bfloat16", quantization=quantization, kv_cache_memory_bytes=1 << 24)
    paths = llm.engine.runner.paths
    return paths.get("quantized") or paths.get("gemm", "?")


# -- quality -------------------------------------------------------------------------------------------------------
def quality(args) -> list[dict]:
    base = gguf_models.smollm2_folder()
    chunks = text_chunks(base, args.tokens, args.ctx)
    print(f"\n# perplexity: SmolLM2 ({base}), {len(chunks)} chunks of {args.ctx} tokens, groups of {args.group}",
          flush=True)
    rows = []
    for kind in (FLOAT, *args.formats):
        folder = checkpoint(base, kind, args.group, args.out)
        for engine, quantization in (("Flock", "auto"), ("Flock, dequantized", "none"))[:1 if kind == FLOAT else 2]:
            flock = flock_perplexity(folder, chunks, quantization=quantization)
            rows.append({"engine": engine, "format": kind, "ppl": flock["ppl"], "wall_s": flock["wall_s"],
                         "path": flock_paths(folder, quantization)})
        if not args.skip_vllm:
            rows.append(vllm_perplexity(folder, chunks, "auto", args, f"hf_quant-vllm-{kind}") | {"format": kind})
    for r in rows:
        base_row = next((b for b in rows if b["engine"] == r["engine"].split(",")[0] and b["format"] == FLOAT
                         and "ppl" in b), None)
        if "ppl" in r and base_row:
            r["vs_float"] = r["ppl"] / base_row["ppl"] - 1
    return rows


# -- speed ---------------------------------------------------------------------------------------------------------
def workloads(args) -> list[Workload]:
    rng = random.Random(args.seed)
    decode = Workload("decode", [[rng.randrange(1000, 40000) for _ in range(64)]], args.decode_gen, 0.0)
    return [decode, shared_workload("shared", rng, args.groups, args.per_group, args.prefix, args.distinct, args.gen)]


def speed(args, python) -> list[dict]:
    base = args.out / "hf_quant" / f"{args.speed_model}-bf16"
    if not (base / "config.json").is_file():
        print(f"# writing {base} (random weights)", flush=True)
        gguf_models.random_folder(base, gguf_models.smollm2_folder(), gguf_models.RANDOM_SHAPES[args.speed_model])
    rows = []
    for kind in (FLOAT, *args.formats):
        folder = checkpoint(base, kind, args.speed_group, args.out)
        path = flock_paths(folder)
        for w in workloads(args):
            print(f"[{kind} {w.name}] {machine.load_note()}", flush=True)
            results = [run_flock(folder, w, "Flock batchllm", warmup_prompts(args.seed, 64), scheduler="batchllm")]
            if python is not None:
                results += vllm.run_batch(folder, [w], True, python, warmup=warmup_prompts(args.seed, 64),
                                          out=args.out, timeout=args.vllm_timeout)
            for r in results:
                rows.append({"format": kind, "workload": w.name, "engine": r.engine, "wall_s": r.wall_s,
                             "error": r.error, "generated": r.generated_tokens, "path": path if "Flock" in r.engine
                             else None})
    for r in rows:
        peer = next((p for p in rows if p["format"] == r["format"] and p["workload"] == r["workload"]
                     and p["engine"].startswith("vLLM") and not p["error"]), None)
        if peer and not r["error"]:
            r["vs_vllm"] = peer["wall_s"] / r["wall_s"]
    return rows


# -- main ----------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hf_quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="quality,speed", help="comma-separated: quality, speed")
    p.add_argument("--formats", default="gptq,gptq-act-order,awq,ct-w4a16,ct-w8a8",
                   help=f"comma-separated, of {', '.join(int_checkpoints.FORMATS)}")
    p.add_argument("--group", type=int, default=64, help="inputs per scale of SmolLM2's checkpoints (576 = 9 x 64)")
    p.add_argument("--tokens", type=int, default=32768, help="text tokens for the perplexity")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--speed-model", default="llama-1b", choices=list(gguf_models.RANDOM_SHAPES))
    p.add_argument("--speed-group", type=int, default=128)
    p.add_argument("--decode-gen", type=int, default=128)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--distinct", type=int, default=64)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    vllm.add_arguments(p)
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.sections, args.formats = args.sections.split(","), [f for f in args.formats.split(",") if f]
    unknown = set(args.formats) - set(int_checkpoints.FORMATS)
    if unknown:
        p.error(f"unknown formats {sorted(unknown)} (of {', '.join(int_checkpoints.FORMATS)})")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    print(machine.header("hf_quant"))
    print(f"# {machine.load_note()}", flush=True)
    python = None if args.skip_vllm else vllm.existing_python(args.vllm_venv)
    ppl = quality(args) if "quality" in args.sections else []
    if ppl:
        print("\n## SmolLM2-135M-Instruct perplexity, bf16 activations\n")
        print(markdown_table(["format", "engine", "perplexity", "vs float", "wall s", "Flock's GEMMs"],
                             [[r["format"], r["engine"], r.get("error") or f"{r['ppl']:.4f}",
                               f"{r['vs_float']:+.2%}" if "vs_float" in r else "-",
                               f"{r['wall_s']:.1f}" if "wall_s" in r else "-", r.get("path") or ""] for r in ppl]))
    fast = speed(args, python) if "speed" in args.sections else []
    if fast:
        print(f"\n## speed: {args.speed_model} (random bf16 weights), groups of {args.speed_group}; decode: one "
              f"64-token prompt, {args.decode_gen} new tokens; shared: {args.groups} x {args.per_group} x "
              f"({args.prefix} + {args.distinct}), {args.gen} new each\n")
        print(markdown_table(["format", "workload", "engine", "wall s", "generated tok/s", "Flock vs vLLM",
                              "Flock's GEMMs"],
                             [[r["format"], r["workload"], r["engine"], r["error"] or f"{r['wall_s']:.2f}",
                               "-" if r["error"] else f"{r['generated'] / r['wall_s']:.1f}",
                               f"{r['vs_vllm']:.2f}x" if "vs_vllm" in r and "Flock" in r["engine"] else "-",
                               r["path"] or ""] for r in fast]))
    path = write_json(args.out / "hf_quant.json", {"args": args_dict(args), "perplexity": ppl, "speed": fast})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
