"""What runs beside what on AMX tiles: tile operations alone, 128 AVX-512 FMAs alone (a softmax's share of vector
work), and both in one instruction stream, in nanoseconds per iteration with every operand in L1
(bench/csrc/amx_overlap.c). Overlap is (alone + alone - together) / the shorter alone: 1 when the shorter one
hides entirely under the other, 0 when they run one after the other, below 0 when together is slower still.

It explains the AMX attention kernel's limits: the scores and P V products can hide under the softmax only as far
as their tile loads and stores let the vector work past them.

    python -m bench.amx_overlap
"""

import argparse
import ctypes
from pathlib import Path

from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from flock import native

LIB = native.Library(Path(__file__).resolve().parent / "csrc" / "amx_overlap.c", "the AMX overlap benchmark",
                     paths=("amx",), signatures={"flock_amx_overlap": ([ctypes.c_int] * 3, ctypes.c_double)})
PARTS = ["8 tdpbf16ps", "5 tile loads", "4 tile stores", "8 tdpbf16ps, then 4 tile stores of their sums",
         "a 16 x 64 x 64 product (10 loads, 8 tdpbf16ps, 4 stores)", "128 AVX-512 FMAs"]
VECTOR, NONE = 5, 6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20000, help="iterations per timed run (the best of 7 runs)")
    p.add_argument("--out", type=Path, default=OUT / "amx_overlap.json")
    args = p.parse_args()
    print(machine.header("amx_overlap", kernels=False))
    if why := LIB.unavailable("amx"):
        raise SystemExit(f"# no AMX here: {why}")
    lib = LIB.load("amx")

    def ns(first: int, second: int) -> float:
        t = lib.flock_amx_overlap(first, second, args.iters)
        if t < 0:
            raise SystemExit("# Linux refused the AMX tile state")
        return t

    vector = ns(VECTOR, NONE)
    rows, record = [], []
    for i, name in enumerate(PARTS[:VECTOR]):
        alone, together = ns(i, NONE), ns(i, VECTOR)
        overlap = (alone + vector - together) / min(alone, vector)
        rows.append([name, f"{alone:.1f}", f"{vector:.1f}", f"{together:.1f}", f"{overlap:.2f}"])
        record.append(dict(tiles=name, tiles_ns=alone, vector_ns=vector, together_ns=together, overlap=overlap))
    head = ["tile operations", "alone ns", f"{PARTS[VECTOR]} ns", "together ns", "overlap"]
    print(markdown_table(head, rows, "lrrrr"))
    print(f"# wrote {write_json(args.out, {'args': args_dict(args), 'cpu': machine.cpu_line(), 'cells': record})}")


if __name__ == "__main__":
    main()
