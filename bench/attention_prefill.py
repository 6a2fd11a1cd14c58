"""Prefill attention per step: PyTorch ("torch", "torch-cascade", both on PyTorch's CPU flash attention) vs the
fused CPU kernel on every ISA path this CPU runs, against the roofline.

    python -m bench.attention_prefill                 # fresh 2K prefill and 2K in 4 chunks, fp32 and bf16
    python -m bench.attention_prefill --context 4096 --chunks 1,8 --dtypes bf16

One layer, one request of CONTEXT tokens (head_dim, heads and KV heads as bench.attention_decode). Cells:
  * fresh (chunks 1): the whole prompt in one step, causal, the context is the chunk itself;
  * chunked (chunks N): the same prompt in N steps of CONTEXT / N tokens, each causal against the cache
    written by the steps before (time: all N steps). Both do the same arithmetic.
Each step's time is the median over repeats of `forward` (KV write + attention), backends run alternately, caches
flushed before each step. FLOPs = 4 * head_dim * heads * (query, key) pairs a causal prefill has (context
(context + 1) / 2); roofline = max(FLOPs / matmul peak, KV bytes / bandwidth), both measured in the same run
(bf16's peak at least fp32's: bf16 inputs can always be multiplied in fp32; the KV is read once per KV head: the
bound is the arithmetic's). Outputs are checked against "torch".
Results: a markdown table per dtype and bench/out/attention_prefill.json.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import machine
from bench.harness.layer import DTYPES, Flusher, fused_paths, make, model_config, ms
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from flock.attention.base import StepLayout

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def parse_args():
    p = argparse.ArgumentParser(prog="python -m bench.attention_prefill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chunks", default="1,4", help="steps the prompt is prefilled in (1: fresh)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--flush-mib", type=int, default=512)
    p.add_argument("--bw-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    a.chunks = [int(x) for x in a.chunks.split(",")]
    a.dtypes = a.dtypes.split(",")
    for n in a.chunks:
        assert a.context % n == 0, f"{n} chunks do not divide the context {a.context}"
    return a


def step_layouts(args, chunks: int, table: np.ndarray) -> list[StepLayout]:
    """One request prefilled in `chunks` steps through block table `table`."""
    bs, n = args.block_size, args.context // chunks
    out = []
    for i in range(chunks):
        pos = np.arange(i * n, (i + 1) * n)
        slots = torch.from_numpy(table[pos // bs] * bs + pos % bs)
        out.append(StepLayout(np.array([0, n]), np.array([(i + 1) * n]), [table], bs, slots))
    return out


def run_cell(args, dtype_name: str, chunks: int, flush) -> dict:
    dtype = DTYPES[dtype_name]
    cfg = model_config(args.heads, args.kv_heads, args.head_dim)
    blocks = -(-args.context // args.block_size)
    table = np.random.default_rng(0).permutation(blocks + 64)[:blocks]
    shape = (blocks + 64, args.block_size, args.kv_heads, args.head_dim)
    caches = {}
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(args.context, h, args.head_dim, generator=gen).to(dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    names = ("torch", "torch-cascade", *fused_paths(dtype))
    backends = {n: make(n, cfg, dtype) for n in names}
    layouts = step_layouts(args, chunks, table)
    metas = {n: [backends[n].build_metadata(x) for x in layouts] for n in names}
    n_tok = args.context // chunks
    for n in names:
        caches[n] = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def steps(n: str, timed: bool) -> tuple[float, torch.Tensor]:
        total, outs = 0.0, []
        for i, meta in enumerate(metas[n]):
            sl = slice(i * n_tok, (i + 1) * n_tok)
            flush()
            t = time.perf_counter()
            outs.append(backends[n].forward(q[sl], k[sl], v[sl], *caches[n], meta))
            total += time.perf_counter() - t
        return total, torch.cat(outs)

    ref = steps("torch", False)[1].float()
    diffs = {n: (steps(n, False)[1].float() - ref).abs().max().item() for n in names[1:]}
    times = {n: [] for n in names}
    with machine.OthersCPU() as others:
        for _ in range(args.repeats):
            for n in names:  # alternate, so background load falls on all alike
                times[n].append(steps(n, True)[0])
    other = others.cores
    flops = 4 * args.head_dim * args.heads * args.context * (args.context + 1) / 2
    kv_bytes = args.context * args.kv_heads * args.head_dim * 2 * torch.finfo(dtype).bits // 8
    return {"dtype": dtype_name, "chunks": chunks, "flops": flops, "kv_bytes": kv_bytes, "other_load_cores": other,
            "backends": {n: {"time_s": statistics.median(times[n]), "min_s": min(times[n]),
                             "max_abs_diff": diffs.get(n, 0.0),
                             "agree": diffs.get(n, 0.0) <= TOLERANCE[dtype_name]} for n in names}}


def table(rows: list[dict], bw: float, gflops: dict) -> str:
    names = list(dict.fromkeys(n for c in rows for n in c["backends"]))
    head = ["cell", "roofline ms", *[f"{n} ms (GFLOP/s, / roofline)" for n in names], "other load"]
    cells = []
    for c in rows:
        roof = max(c["flops"] / (gflops[c["dtype"]] * 1e9), c["kv_bytes"] / (bw * 1e9))
        cols = []
        for n in names:
            b = c["backends"].get(n)
            cols.append("-" if b is None else f"{ms(b['time_s'])} ({c['flops'] / b['time_s'] / 1e9:.0f}, "
                        f"{b['time_s'] / roof:.2f}x)" + ("" if b["agree"] else " MISMATCH"))
        cell = "fresh" if c["chunks"] == 1 else f"{c['chunks']} chunks"
        cells.append([cell, ms(roof), *cols, f"{c['other_load_cores']:.2f}"])
    return markdown_table(head, cells)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("attention_prefill"))
    print(f"attention kernel paths this CPU runs: {', '.join(fused_paths(torch.bfloat16)) or 'none'}; "
          f"{os.cpu_count()} cores; load average {machine.load_average()}")
    bwinfo = machine.memory_bandwidth(args.bw_gib)
    bw = bwinfo["limit_GBps"]
    gflops = machine.arithmetic_peaks({d: DTYPES[d] for d in args.dtypes})
    print(f"memory bandwidth {bw:.1f} GB/s; matmul peak (2048^3) "
          + ", ".join(f"{d} {x:.0f} GFLOP/s" for d, x in gflops.items()) + " (measured now)", flush=True)
    flush = Flusher(args.flush_mib)
    rows = []
    for d in args.dtypes:
        for chunks in args.chunks:
            rows.append(run_cell(args, d, chunks, flush))
            print(f"  {d} chunks {chunks}: " + ", ".join(f"{n} {ms(b['time_s'])} ms"
                                                          for n, b in rows[-1]["backends"].items()), flush=True)
    print(f"\nPrefill attention, one layer: one request of {args.context} tokens, head_dim {args.head_dim}, "
          f"{args.heads} query / {args.kv_heads} KV heads, block size {args.block_size}; median of {args.repeats}, "
          "caches flushed before each step; GFLOP/s = causal attention FLOPs / time.")
    for d in args.dtypes:
        print(f"\n### {d}\n")
        print(table([c for c in rows if c["dtype"] == d], bw, gflops))
    result = {"config": args_dict(args), "cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(), "bandwidth": bwinfo, "matmul_GFLOPs": gflops, "cells": rows}
    path = write_json(args.out / "attention_prefill.json", result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
