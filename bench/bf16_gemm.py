"""Flock's bf16 GEMM (flock.model.gemm: AMX tiles, or vdpbf16ps) side by side with oneDNN's prepacked linear
and the roofline, in one run, on the projections of SmolLM2 and bench-mid at 1, 8, 64 and 2,048 rows.

Each cell multiplies by enough copies of the weight to stream them from memory, as a model's layers do: the
roofline is max(weight bytes / bandwidth, FLOPs / peak), with this machine's memory bandwidth and its best bf16
rate (oneDNN's or Flock's own 4096^3 product, --peak-n) measured in the same run. Columns: microseconds per GEMM, each
path against the roofline, and oneDNN / Flock. Flock's GEMM is timed twice: through `gemm.linear` (Python, a
fresh output: how prefill calls it) and at its C entry into one output, a pass over the copies run as one step
program (flock_run_program, no Python between the GEMMs: how a decode step calls it).

    python -m bench.bf16_gemm                       # a few minutes on 2 cores
    python -m bench.bf16_gemm --models smollm2 --rows 1,8
"""

import argparse
import ctypes

import numpy as np
import torch

from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.timing import best_time
from flock.model import fused_ops, gemm, linear, program, resolve_model

MODELS = {"smollm2": "flock/smollm2", "bench-mid": "flock/bench-mid"}


def projections(model: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a Llama layer's fused projections."""
    c = resolve_model(MODELS[model]).config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def per_call(multiply, weights: list, x: torch.Tensor) -> float | None:
    """Seconds of one GEMM: the best of 5 passes over every copy of the weight (None: no copies, no path). Each
    output is dropped before the next call, as a model's layers drop theirs: kept, every call would write fresh
    pages (page faults, not the GEMM)."""
    def one_pass():
        for w in weights:
            multiply(x, w)

    return best_time(one_pass, 5) / len(weights) if weights else None


def c_entry(path: str | None, n: int, weights: list, x: torch.Tensor) -> float | None:
    """Seconds of one GEMM at its C entry into one preallocated output, each pass over the copies one step program
    (a record per GEMM, as a decode step's program holds them) run by flock_run_program."""
    if not weights:
        return None
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    op = ctypes.cast(gemm._lib(path).flock_gemm_op, ctypes.c_void_p).value
    records = np.zeros((len(weights), program.WIDTH), dtype=np.int64)
    records[:, :11] = [[op, x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), n, x.shape[0], n, x.shape[1],
                        gemm.OUT_BF16, torch.get_num_threads()] for w in weights]
    run = fused_ops.KERNEL.load(fused_ops.isa()).flock_run_program

    def one_pass():
        if failed := run(records.ctypes.data, len(records), x.shape[0]):
            raise RuntimeError(f"the bf16 GEMM failed (record {failed - 1})")

    return best_time(one_pass, 5) / len(weights)


def peak(path: str | None, with_onednn: bool, n: int) -> float:
    """The best bf16 GFLOP/s of an n^3 product here: oneDNN's prepacked, or Flock's GEMM."""
    a, b = torch.randn(n, n).to(torch.bfloat16), torch.randn(n, n).to(torch.bfloat16)
    rates = []
    if with_onednn:
        w = torch.ops.mkldnn._reorder_linear_weight(b, None)
        rates.append(2 * n**3 / best_time(lambda: onednn(a, w), 3) / 1e9)
    if path is not None:
        pairs = gemm.pack(b)
        rates.append(2 * n**3 / best_time(lambda: gemm.linear(a, pairs, n, path=path), 3) / 1e9)
    return max(rates)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def cells(args, bandwidth: float, gflops: float) -> list[list]:
    rows = []
    for model in args.models:
        try:
            shapes = projections(model)
        except FileNotFoundError as e:  # the SmolLM2 wheel is not installed (a GPU machine, say)
            print(f"# {model} skipped: {e}", flush=True)
            continue
        for name, (n, k) in shapes.items():
            weight = torch.randn(n, k).to(torch.bfloat16) * 0.02
            copies = max(1, int(args.stream_mb * 1e6 // weight.nbytes))
            theirs = [torch.ops.mkldnn._reorder_linear_weight(weight.clone(), None)
                      for _ in range(copies * args.onednn)]
            ours = [gemm.pack(weight) for _ in range(copies * (args.path is not None))]
            for m in args.rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                roof = max(weight.nbytes / bandwidth / 1e9, 2 * m * n * k / gflops / 1e9)
                flock = per_call(lambda v, p: gemm.linear(v, p, n, path=args.path), ours, x)
                entry = c_entry(args.path, n, ours, x)
                dnn = per_call(onednn, theirs, x)
                rows.append([model, name, f"{n} x {k}", m, f"{roof * 1e6:.0f}",
                             *(f"{t * 1e6:.0f}" if t else "-" for t in (flock, entry, dnn)),
                             ratio(flock, roof), ratio(entry, roof), ratio(dnn, roof), ratio(dnn, flock)])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 64, 2048])
    p.add_argument("--path", default=gemm.isa(), help=f"Flock's GEMM (default: this CPU's; {gemm.EMULATED_AMX} "
                                                      "checks the bench itself on any CPU, slowly)")
    p.add_argument("--stream-mb", type=float, default=256.0, help="weight copies streamed per pass")
    p.add_argument("--peak-n", type=int, default=4096, help="size of the products that measure the peak")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=OUT / "bf16_gemm.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine.header("bf16_gemm"))
    if args.path is None:
        print(f"# Flock's bf16 GEMM does not run here: {gemm.unavailable(torch.bfloat16, torch.device('cpu'))}")
    if why := linear.unavailable(torch.bfloat16, torch.device("cpu")):
        print(f"# oneDNN's bf16 linear does not run here: {why}")
    args.onednn = why is None
    if args.path is None and not args.onednn:
        raise SystemExit("no bf16 GEMM to measure")
    bandwidth = machine.memory_bandwidth(0.5)["limit_GBps"]
    gflops = peak(args.path, args.onednn, args.peak_n)
    print(f"# Flock's GEMM: {args.path or 'none'}; bandwidth {bandwidth:.1f} GB/s, bf16 peak {gflops:.0f} GFLOP/s")
    table = cells(args, bandwidth, gflops)
    head = ["model", "projection", "N x K", "rows", "roofline us", "Flock us", "Flock C entry us", "oneDNN us",
            "Flock / roofline", "C entry / roofline", "oneDNN / roofline", "oneDNN / Flock"]
    print(markdown_table(head, table, "lllrrrrrrrrr"))
    record = {"args": args_dict(args), "bandwidth_GBps": bandwidth, "peak_GFLOPs": gflops, "cells": table}
    print(f"# wrote {write_json(args.out, record)}")


if __name__ == "__main__":
    main()
