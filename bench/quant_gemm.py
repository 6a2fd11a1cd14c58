"""The quantized GEMM alone (flock.model.quant), per quant type and weight layout, side by side with torch's
float32 matmul on the same shape, in one run:
- GFLOP/s at M activation rows (1: decode, 16 and 256: prefill) on one N x K weight that stays in cache;
- GB/s of GEMMs of --stream-rows rows (default 1) over weights streamed from memory (copies of a --stream-n x K
  weight past the last-level cache, on 2 MiB pages as a model's; with --glu as an MLP's gate_up calls), the figure
  a decode step lives by, next to this machine's read bandwidth measured in the same run.
Every kernel path this CPU runs but the baseline, side by side (on a VNNI CPU: avx2 and the VNNI path; on an
AMX-INT8 CPU also amxint8, whose tiles take the calls of 3 rows or more on the 8-row layout). With --sources,
each path of each build of the kernel (copies of flock/model/csrc/quant_gemm.c beside it), one after the other
in every cell: a change to the kernel measured against the source before it.

    python -m bench.quant_gemm                          # about a minute per path
    python -m bench.quant_gemm --types Q4_K --n 16384 --k 2048 --paths avx2
    python -m bench.quant_gemm --sources OLD.c,flock/model/csrc/quant_gemm.c --paths avx512vnni
    python -m bench.quant_gemm --types Q4_K --m 1 --stream-n 16384 --stream-rows 1,4 --glu
"""

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from flock import native
from flock.model import huge_pages, quant

# the float16 fields' offsets
SCALE_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2),
            "Q5_1": (0, 2)}


def random_weight(name: str, n: int, k: int, seed: int = 0) -> quant.QuantTensor:
    """Random bytes as blocks of `name`, their float16 scales small and finite (any other bytes are valid); a type
    the kernels take rewritten (IQ4_NL, the lattice IQ types) as the blocks it runs as."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALE_AT.get(name, (0,)):
        blocks[:, :, at:at + 2] = rng.uniform(1e-4, 1e-3, (n, k // block, 1)).astype(np.float16).view(np.uint8)
    return quant.transcode(int(qtype), torch.from_numpy(blocks.reshape(n, -1)))


def layouts(name: str, n: int, k: int) -> dict[str, quant.QuantWeight]:
    rows = random_weight(name, n, k)
    out = {"rows": quant.QuantWeight([rows])}
    if rows.name in quant.X8_BYTES:
        out["x8"] = quant.QuantWeight([quant.interleave(rows)])
    return out


def seconds(fn, min_s: float = 0.3) -> float:
    """Mean seconds of fn() over at least min_s, after a warm-up call."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


@contextlib.contextmanager
def built(kernel: native.Library | None):
    """quant.linear on `kernel` (None: the engine's own) inside the block."""
    own = quant.KERNEL
    quant.KERNEL = kernel or own
    try:
        yield
    finally:
        quant.KERNEL = own


def variants(paths: list[str], sources: list[Path]) -> list[tuple[str, native.Library | None, str]]:
    """(column label, kernel, path) of every kernel the run compares: each path, of each source's build."""
    if not sources:
        return [(path, None, path) for path in paths]
    builds = [(source.name, dataclasses.replace(quant.KERNEL, source=source.resolve())) for source in sources]
    return [(f"{path} {name}", kernel, path) for path in paths for name, kernel in builds]


def gflops(args, kernels) -> list[list]:
    rows = []
    w32 = torch.randn(args.n, args.k) * 0.02
    for m in args.m:
        x = torch.randn(m, args.k)
        flop = 2 * m * args.n * args.k
        row = [m, f"{flop / seconds(lambda: x @ w32.T) / 1e9:.1f}"]
        for name in args.types:
            for w in layouts(name, args.n, args.k).values():
                for _, kernel, path in kernels:
                    with built(kernel):
                        row.append(f"{flop / seconds(lambda: quant.linear(x, w, path=path)) / 1e9:.1f}")
        rows.append(row)
    return rows


def on_huge_pages(w: quant.QuantWeight) -> quant.QuantWeight:
    """A copy of w on 2 MiB pages, as a model's weights are (a clone's 4 KiB pages stream slower)."""
    parts = []
    for p in w.parts:
        blocks = huge_pages.empty(tuple(p.blocks.shape), torch.uint8)
        parts.append(quant.QuantTensor(p.qtype, blocks.copy_(p.blocks), p.interleaved))
    return quant.QuantWeight(parts)


def streamed(args, kernels) -> list[list]:
    rows = []
    for name in args.types:
        for layout, w in layouts(name, args.stream_n, args.k).items():
            copies = [on_huge_pages(w) for _ in range(int(args.stream_mb * 1e6 // w.nbytes) + 1)]
            for m in args.stream_rows:
                x = torch.randn(m, args.k)
                for label, kernel, path in kernels:
                    with built(kernel):
                        s = seconds(lambda: [quant.linear(x, c, glu=args.glu, path=path) for c in copies]) / len(copies)
                    rows.append([name, layout, m, label, f"{w.nbytes / 1e6:.1f}", f"{s * 1e6:.0f}",
                                 f"{w.nbytes / s / 1e9:.1f}"])
            copies.clear()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", type=lambda s: s.split(","), default=["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
    p.add_argument("--n", type=int, default=2048, help="weight rows")
    p.add_argument("--k", type=int, default=2048, help="weight columns")
    p.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 256])
    p.add_argument("--stream-n", type=int, default=8192, help="weight rows of the streamed GEMMs")
    p.add_argument("--stream-mb", type=float, default=400.0, help="weights streamed per pass")
    p.add_argument("--stream-rows", type=lambda s: [int(v) for v in s.split(",")], default=[1],
                   help="activation rows of the streamed GEMMs (decode steps: 1 to a few)")
    p.add_argument("--glu", action="store_true",
                   help="the streamed GEMMs as an MLP's gate_up calls: [gate | up] rows, silu(gate) * up out")
    p.add_argument("--paths", type=lambda s: s.split(","),
                   default=[p for p in quant.KERNEL.runnable() if p != "baseline"] or ["baseline"],
                   help="comma-separated kernel paths (default: every one this CPU runs but the baseline)")
    p.add_argument("--sources", type=lambda s: [Path(v) for v in s.split(",")], default=[],
                   help="comma-separated builds of the kernel to compare (copies of quant_gemm.c beside it)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=OUT / "quant_gemm.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = variants(args.paths, args.sources)
    print(machine.header("quant_gemm", dtype=torch.float32))
    print(f"# quantized GEMM paths: {', '.join(args.paths)} (the engine's: {quant.isa()}); weight {args.n} x {args.k}")
    head = ["M", "fp32 matmul"] + [f"{name} {layout} {label}" for name in args.types for layout in layouts(name, 8, 256)
                                   for label, _, _ in kernels]
    table = gflops(args, kernels)
    print("\nGFLOP/s, weight in cache\n")
    print(markdown_table(head, table))
    bandwidth = machine.memory_bandwidth(0.5)["read_sum_GBps"]
    stream = streamed(args, kernels)
    print(f"\n{'GLU ' if args.glu else ''}GEMMs of few rows, weights streamed from memory (this machine's read "
          f"bandwidth, best of 7 sums: {bandwidth:.1f} GB/s)\n")
    print(markdown_table(["type", "layout", "M", "kernel", "weight MB", "us per GEMM", "GB/s"], stream, "llrlrrr"))
    print(f"# wrote {write_json(args.out, {'args': args_dict(args), 'gflops': table, 'streamed': stream})}")


if __name__ == "__main__":
    main()
