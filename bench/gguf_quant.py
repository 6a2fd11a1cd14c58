"""Quantized GGUF weights: Flock side by side with llama.cpp on the same files and thread count, in one run.

For each of Q4_K_M and Q8_0 of a ~1B Llama-shaped model (bench/harness/gguf_models.py makes the files with
llama.cpp's own tools on first use):
- resident memory: RSS after an engine is built (64 MiB of KV), in a child process per case, minus that of a
  flock/tiny engine with the same KV budget, as a ratio to the file's size (bar: <= 1.25x, quantized engine);
- single-stream decode: `llama-bench -p 0 -n N -t T` (tg: random tokens) vs Flock's decode phase (one short
  prompt, N new tokens sampled at temperature 1, ignore_eos; tokens/s after the first token), quantized and
  quantization="none" (bars: >= 1.0x llama.cpp, >= 2.5x "none"); with --decode-rounds N the two again,
  alternating, N rounds in all, and the median of the rounds' ratios;
- a shared-prefix batch (two 600-token prefixes x 8 distinct 40-token tails, 32 new tokens each): llama-server
  with 16 slots driven by 16 concurrent requests vs Flock scheduler="batchllm" (bars: >= 10x, >= 1.5x "none");
  with --batch-rounds N the two again, alternating, N rounds in all, and the median of the rounds' ratios.

    python -m bench.gguf_quant                     # the full run (first use: minutes to make the 1B files)
    python -m bench.gguf_quant --model qwen3-0.6b  # the same on Qwen3-0.6B's shape (q/k norms, 128-wide heads)
    python -m bench.gguf_quant --model qwen3moe    # a mixture of experts (Qwen3-30B-A3B's layout, 1.2B parameters)
    python -m bench.gguf_quant --model qwen3moe-a3b  # its layer shapes, 8 layers (5.2B parameters; ~20 GB to make)
    python -m bench.gguf_quant --model gemma3-1b   # Gemma 3 1B's shape (windows on five layers of six, GeGLU)
    python -m bench.gguf_quant --model smollm2 --quants Q8_0 --decode-tokens 16 --decode-repeats 1 \\
        --bench-repetitions 1 --prefix-len 64 --tail-len 8 --gen 4     # a dry run in about three minutes
"""

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench.harness import gguf_models, llama_cpp, machine
from bench.harness.quant_engine import engine_kwargs, engine_paths, has_quantization_field, quant_path, rss_bytes
from bench.harness.report import OUT, args_dict, markdown_table, write_json

QUANTS = ("Q4_K_M", "Q8_0")
SECTIONS = ("memory", "decode", "batch")
MODES = ("quantized", "none")  # Flock with quantization "gguf" (weights stay quantized) and "none" (dequantized)
KV_BYTES_MEMORY = 64 << 20
DECODE_PROMPT = "The history of the old harbour town begins with"
MB = 1e6


# -- Flock, each case in a fresh child process ------------------------------------------------------------------
def in_child(fn, *args):
    """`fn(*args)` in a fresh spawned interpreter (own RSS, no allocator state carried from an earlier case)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _engine(model: str, threads: int, **kwargs):
    torch.set_num_threads(threads)
    from flock import LLM

    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    return llm, time.perf_counter() - start


def child_memory(model: str, threads: int, kwargs: dict) -> dict:
    import gc

    llm, load_s = _engine(model, threads, kv_cache_memory_bytes=KV_BYTES_MEMORY, **kwargs)
    gc.collect()
    return {**rss_bytes(), "load_s": load_s, **engine_paths(llm, model)}


def _greedy(n: int):
    from flock import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _sampled(n: int, seed: int):
    """Temperature 1: each step's token varies as llama-bench's random ones do (a random model's greedy pick
    repeats one token, whose experts of a mixture would stay in cache)."""
    from flock import SamplingParams

    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True)


def _decode_once(engine, prompt: list[int], n: int, seed: int) -> dict:
    """One request alone: time to the first token, then tokens/s of the decode phase (after the first token)."""
    from flock.engine.loop import run

    req = engine.add_request(prompt, _sampled(n, seed))
    start, first = time.perf_counter(), None
    for _ in run(engine):
        if first is None and req.output_token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - start, "decode_s": end - first, "tokens": len(req.output_token_ids),
            "tokens_per_s": (len(req.output_token_ids) - 1) / (end - first)}


def child_speed(model: str, threads: int, kwargs: dict, decode_tokens: int, decode_repeats: int,
                batch: list[list[int]], gen: int, warmup: list[list[int]]) -> dict:
    """One Flock engine (batchllm): warmed up, then the single-stream decode runs and the shared-prefix batch."""
    llm, load_s = _engine(model, threads, scheduler="batchllm", **kwargs)
    out = {"load_s": load_s, **engine_paths(llm, model)}
    llm.generate(warmup, _greedy(4), use_tqdm=False)
    if decode_tokens:
        prompt = llm.get_tokenizer().encode(DECODE_PROMPT, add_special_tokens=True)
        with machine.OthersCPU() as others:
            runs = [_decode_once(llm.engine, prompt, decode_tokens, seed) for seed in range(decode_repeats)]
        out["decode"] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
                         "best_tokens_per_s": max(r["tokens_per_s"] for r in runs), "runs": runs,
                         "prompt_tokens": len(prompt), "others_cpu": others.fraction}
    if batch:
        with machine.OthersCPU() as others:
            start = time.perf_counter()
            outputs = llm.generate(batch, _greedy(gen), use_tqdm=False)
            wall = time.perf_counter() - start
        stats = llm.stats()
        out["batch"] = {"wall_s": wall, "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                        "computed_prompt_tokens": stats.get("computed_prefill_tokens"),
                        "steps": stats.get("steps"), "others_cpu": others.fraction}
    return out


# -- workload ----------------------------------------------------------------------------------------------------
def shared_prefix_batch(seed: int, vocab: int, prefixes: int, tails: int, prefix_len: int, tail_len: int):
    """prefixes x tails prompts of random token ids inside the vocabulary (clear of the first 100, where the
    special tokens sit), each a group prefix + its own tail, in a seeded shuffled order."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randint(100, vocab - 1) for _ in range(n)]  # noqa: E731
    groups = [draw(prefix_len) for _ in range(prefixes)]
    prompts = [p + draw(tail_len) for p in groups for _ in range(tails)]
    rng.shuffle(prompts)
    return prompts


def vocab_size(gguf: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(str(gguf)).fields["tokenizer.ggml.tokens"].data)


# -- llama.cpp ---------------------------------------------------------------------------------------------------
def quiet(args) -> None:
    """Before a measurement: wait up to --wait-quiet seconds for other processes to leave the CPUs."""
    if args.wait_quiet:
        machine.wait_quiet(args.wait_quiet, machine.QUIET * (os.cpu_count() or 1), window_s=1.0, pause_s=2.0)


def llama_decode(llama: llama_cpp.LlamaCpp, gguf: Path, args) -> dict:
    quiet(args)
    with machine.OthersCPU() as others:
        result = llama.bench_decode(gguf, args.threads, args.decode_tokens, args.bench_repetitions)
    return {**result, "others_cpu": others.fraction}


def llama_batch(llama: llama_cpp.LlamaCpp, gguf: Path, batch: list[list[int]], warmup: list[list[int]], args) -> dict:
    slots = len(batch)
    ctx = max(map(len, batch)) + args.gen + 16
    with llama.server(gguf, args.threads, slots, ctx) as server:
        llama_cpp.send_prompts(server, warmup[:1], 4, 1)
        quiet(args)
        with machine.OthersCPU(server.pid) as others:
            result = llama_cpp.send_prompts(server, batch, args.gen, slots)
    return {**result, "slots": slots, "ctx_per_slot": ctx, "others_cpu": others.fraction}


def measure(gguf: Path, args, llama: llama_cpp.LlamaCpp, sections: list[str], modes: list[str],
            batch: list[list[int]], warmup: list[list[int]], tiny: dict | None) -> dict:
    """Every section asked for, on one file: Flock's resident memory (each mode), llama.cpp's decode and batch,
    then Flock's decode and batch (an engine per mode)."""
    decode_tokens = args.decode_tokens if "decode" in sections else 0
    r = {"file": str(gguf), "file_bytes": gguf.stat().st_size, "decode_tokens": decode_tokens,
         "batch_prompts": len(batch), "flock": {}}
    if tiny is not None:
        r["memory"] = {"tiny": tiny}
        for mode in modes:
            m = in_child(child_memory, str(gguf), args.threads, engine_kwargs(mode))
            r["memory"][mode] = {**m, "above_tiny": m["VmRSS"] - tiny["VmRSS"]}
            r["flock"][mode] = {"dtype": m["dtype"], "paths": m["paths"]}
    if decode_tokens and not args.skip_llama:
        r["llama_decode"] = llama_decode(llama, gguf, args)
    if "batch" in sections and not (args.skip_llama or args.skip_server):
        r["llama_batch"] = llama_batch(llama, gguf, batch, warmup, args)
    if decode_tokens or "batch" in sections:
        for mode in modes:
            quiet(args)
            r["flock"][mode] = in_child(child_speed, str(gguf), args.threads, engine_kwargs(mode), decode_tokens,
                                        args.decode_repeats, batch if "batch" in sections else [], args.gen, warmup)
    if "llama_decode" in r and "decode" in r["flock"].get("quantized", {}):
        r["decode_rounds"] = [decode_round(r["llama_decode"], r["flock"]["quantized"]["decode"])]
        for _ in range(args.decode_rounds - 1):
            ll = llama_decode(llama, gguf, args)
            quiet(args)
            fq = in_child(child_speed, str(gguf), args.threads, engine_kwargs("quantized"), decode_tokens,
                          args.decode_repeats, [], args.gen, warmup)
            r["decode_rounds"].append(decode_round(ll, fq["decode"]))
    if "llama_batch" in r and "batch" in r["flock"].get("quantized", {}):
        r["batch_rounds"] = [batch_round(r["llama_batch"], r["flock"]["quantized"]["batch"])]
        for _ in range(args.batch_rounds - 1):
            ll = llama_batch(llama, gguf, batch, warmup, args)
            quiet(args)
            fq = in_child(child_speed, str(gguf), args.threads, engine_kwargs("quantized"), 0, 0, batch, args.gen,
                          warmup)
            r["batch_rounds"].append(batch_round(ll, fq["batch"]))
    return r


def decode_round(llama: dict, flock: dict) -> dict:
    return {"llama_tokens_per_s": llama["tokens_per_s"], "quantized_tokens_per_s": flock["tokens_per_s"],
            "ratio": flock["tokens_per_s"] / llama["tokens_per_s"]}


def batch_round(llama: dict, flock: dict) -> dict:
    return {"llama_s": llama["wall_s"], "quantized_s": flock["wall_s"], "ratio": llama["wall_s"] / flock["wall_s"]}


# -- report ------------------------------------------------------------------------------------------------------
def _x(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _bar(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def _others(*parts: dict | None) -> str:
    """Other processes' share of the CPUs during each measurement (llama.cpp / quantized / none)."""
    return " / ".join("-" if not p or p.get("others_cpu") is None else f"{p['others_cpu']:.0%}" for p in parts)


def table_rows(quant: str, r: dict) -> list[list]:
    rows = []
    flock = r.get("flock", {})
    q, n = flock.get("quantized", {}), flock.get("none", {})
    if "memory" in r:
        m, size = r["memory"], r["file_bytes"]
        above = {mode: m[mode]["above_tiny"] for mode in MODES if mode in m}
        cell = {mode: f"{b / MB:,.0f} ({b / size:.2f}x file)" for mode, b in above.items()}
        ok = above["quantized"] / size <= 1.25 if "quantized" in above else None
        rows.append([quant, f"resident above flock/tiny, MB (file {size / MB:,.0f} MB)", "-",
                     cell.get("quantized", "-"), cell.get("none", "-"), "-",
                     _x(above.get("quantized"), above.get("none")), f"<= 1.25x file: {_bar(ok)}", "-"])
    if "decode" in q or "decode" in n or "llama_decode" in r:
        ll = r.get("llama_decode", {}).get("tokens_per_s")
        fq, fn = q.get("decode", {}).get("tokens_per_s"), n.get("decode", {}).get("tokens_per_s")
        ok = None if fq is None or ll is None or fn is None else (fq >= ll and fq >= 2.5 * fn)
        rows.append([quant, f"decode tokens/s, {r['decode_tokens']} tokens", _f(ll, ".1f"), _f(fq, ".1f"),
                     _f(fn, ".1f"), _x(fq, ll), _x(fq, fn), f">= 1.0x and >= 2.5x: {_bar(ok)}",
                     _others(r.get("llama_decode"), q.get("decode"), n.get("decode"))])
        best = [part.get("best_tokens_per_s") for part in (r.get("llama_decode", {}), q.get("decode", {}),
                                                            n.get("decode", {}))]
        rows.append([quant, "decode tokens/s, best run", _f(best[0], ".1f"), _f(best[1], ".1f"), _f(best[2], ".1f"),
                     _x(best[1], best[0]), _x(best[1], best[2]), "(memory bandwidth here swings: peak vs peak)", "-"])
    rounds = r.get("decode_rounds", [])
    if len(rounds) > 1:
        median = {key: statistics.median(x[key] for x in rounds)
                  for key in ("llama_tokens_per_s", "quantized_tokens_per_s", "ratio")}
        rows.append([quant, f"decode in {len(rounds)} alternating rounds, median tokens/s",
                     _f(median["llama_tokens_per_s"], ".1f"), _f(median["quantized_tokens_per_s"], ".1f"), "-",
                     f"{median['ratio']:.2f}x", "-", f">= 1.0x: {_bar(median['ratio'] >= 1)}; rounds " +
                     ", ".join(f"{x['ratio']:.2f}x" for x in rounds), "-"])
    if "batch" in q or "batch" in n or "llama_batch" in r:
        ll = r.get("llama_batch", {}).get("wall_s")
        fq, fn = q.get("batch", {}).get("wall_s"), n.get("batch", {}).get("wall_s")
        ok = None if fq is None or ll is None or fn is None else (ll >= 10 * fq and fn >= 1.5 * fq)
        rows.append([quant, f"shared-prefix batch of {r['batch_prompts']}, s", _f(ll, ".1f"), _f(fq, ".2f"),
                     _f(fn, ".2f"), _x(ll, fq), _x(fn, fq), f">= 10x and >= 1.5x: {_bar(ok)}",
                     _others(r.get("llama_batch"), q.get("batch"), n.get("batch"))])
    rounds = r.get("batch_rounds", [])
    if len(rounds) > 1:
        median = {key: statistics.median(x[key] for x in rounds) for key in ("llama_s", "quantized_s", "ratio")}
        rows.append([quant, f"the batch in {len(rounds)} alternating rounds, median s", _f(median["llama_s"], ".1f"),
                     _f(median["quantized_s"], ".2f"), "-", f"{median['ratio']:.2f}x", "-",
                     f">= 10x: {_bar(median['ratio'] >= 10)}; rounds " +
                     ", ".join(f"{x['ratio']:.2f}x" for x in rounds), "-"])
    return rows


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_paths(results: dict) -> None:
    seen = set()
    for quant, r in results.items():
        for mode, f in r.get("flock", {}).items():
            line = f"{f['dtype'].removeprefix('torch.')}, " + "; ".join(f"{k}: {v}" for k, v in f["paths"].items())
            if (mode, line) not in seen:
                seen.add((mode, line))
                print(f"# Flock {mode} ({quant}): {line}")


# -- main --------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama_cpp.add_argument(p)
    p.add_argument("--work", type=Path, default=gguf_models.WORK, help="where the GGUF files are kept (%(default)s)")
    p.add_argument("--model", default="llama-1b",
                   choices=("llama-1b", "qwen3-0.6b", "qwen3moe", "qwen3moe-a3b", "gemma3-1b", "smollm2"),
                   help="llama-1b: the ~1B random Llama (the bench); qwen3-0.6b: Qwen3-0.6B's shape, random; "
                        "qwen3moe: Qwen3-30B-A3B's layout at 1,024 hidden, random; qwen3moe-a3b: its layer shapes, 8 "
                        "layers; gemma3-1b: Gemma 3 1B's shape, "
                        "random; smollm2: the 135M model (quick dry runs)")
    p.add_argument("--quants", default=",".join(QUANTS), help="comma-separated llama-quantize types")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: memory, decode, batch")
    p.add_argument("--modes", default=",".join(MODES), help="Flock runs: quantized (auto), none (dequantized)")
    p.add_argument("--skip-server", action="store_true", help="no llama-server batch")
    p.add_argument("--skip-llama", action="store_true", help="no llama.cpp run at all (its files must exist)")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines (%(default)s)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=3, help="Flock decode runs, averaged")
    p.add_argument("--bench-repetitions", type=int, default=5, help="llama-bench -r")
    p.add_argument("--prefixes", type=int, default=2)
    p.add_argument("--tails", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=600)
    p.add_argument("--tail-len", type=int, default=40)
    p.add_argument("--gen", type=int, default=32, help="new tokens per batch prompt")
    p.add_argument("--decode-rounds", type=int, default=1,
                   help="llama.cpp's and Flock quantized's decode again, alternating, this many rounds in all: the "
                        "ratio of each round and their median (memory bandwidth here swings over minutes)")
    p.add_argument("--batch-rounds", type=int, default=1,
                   help="llama-server's and Flock quantized's batch again, alternating, this many rounds in all: the "
                        "ratio of each round and their median (both engines' speed drifts over minutes here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each measurement, wait up to S seconds for a quiet machine")
    p.add_argument("--out", type=Path, default=OUT / "gguf_quant.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llama = llama_cpp.find_or_exit(args.llama_cpp) if not args.skip_llama else llama_cpp.LlamaCpp(args.llama_cpp)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children's OpenMP pools, as torch.set_num_threads
    torch.set_num_threads(args.threads)
    quants, sections = args.quants.split(","), args.sections.split(",")
    modes = args.modes.split(",")
    files = gguf_models.ensure(args.model, quants, llama, args.work) if not args.skip_llama else \
        {q: gguf_models.gguf_file(args.model, q, args.work) for q in quants}

    print(f"# gguf_quant: {machine.cpu_line()}")
    print(f"# threads: {args.threads} for both engines (torch.set_num_threads / llama.cpp -t {args.threads}); "
          f"{machine.load_note(args.wait_quiet)}")
    print(f"# Flock's quantized GEMM (flock.model.quant): {quant_path()}")
    if not has_quantization_field():
        print("# NOTE: this Flock has no `quantization` engine field: both Flock runs dequantize at load")
    print(f"# model: {args.model}; files: " + ", ".join(f"{q} {p} ({p.stat().st_size / MB:,.0f} MB)"
                                                     for q, p in files.items()))

    vocab = vocab_size(next(iter(files.values())))
    batch = shared_prefix_batch(args.seed, vocab, args.prefixes, args.tails, args.prefix_len, args.tail_len)
    warmup = shared_prefix_batch(args.seed + 1, vocab, 1, 2, 32, 8)
    tiny = in_child(child_memory, "flock/tiny", args.threads, {}) if "memory" in sections else None
    results = {quant: measure(gguf, args, llama, sections, modes, batch, warmup, tiny) for quant, gguf in files.items()}

    print_paths(results)
    print()
    head = ["file", "measure", "llama.cpp", "Flock quantized", "Flock none", "quantized vs llama.cpp",
            "quantized vs none", "bar", "others' CPU"]
    print(markdown_table(head, [row for q, r in results.items() for row in table_rows(q, r)], "llrrrrrlr"))
    print("\nSpeed ratios are Flock quantized's advantage (tokens/s over tokens/s; the other's seconds over its "
          "seconds); memory: quantized's resident bytes over none's. Others' CPU: the share of the machine other "
          "processes took during the llama.cpp / quantized / none measurement (above ~10% the figure is noisy).")
    path = write_json(args.out, {"args": args_dict(args), "cpu": machine.cpu_line(),
                                 "quantization_field": has_quantization_field(), "results": results})
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
