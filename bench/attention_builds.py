"""Builds of the CPU attention kernel side by side: the C call alone, the builds alternating in one process.

    python -m bench.attention_builds OLD.c flock/attention/csrc/cascade_cpu.c          # decode, 1 x 1,568 tokens
    python -m bench.attention_builds A.c B.c --requests 64 --degree 16 --prefix 2048   # the decode goal cell
    python -m bench.attention_builds A.c B.c --new 2048                                # a fresh 2K prefill
    python -m bench.attention_builds A.c B.c --requests 64 --degree 1 --prefix 0 --tail 2048 --kv fp8

Each source (a copy of `flock/attention/csrc/cascade_cpu.c` beside it, so that it finds the same headers) is
built for this CPU's best path and called through `flock_cpu_cascade` with one step's arguments: `--requests`
requests in groups of `--degree` sharing `--prefix` tokens, each with `--tail` own tokens and one new one (decode),
or with `--new` new tokens after `--prefix` cached ones (prefill). The KV caches are rotated over copies that
together outgrow the last-level cache, as a model's layers pass the cache between two visits of a layer, unless
`--hot`. Times are medians over rounds, each round every build in turn; a build whose outputs differ from the
first's bits is marked. A change to the kernel measured here, not in a whole engine, is not drowned by the
step's other work or the Python around a layer's call (the ~0.25 ms `bench.attention_decode` pays per call).
"""

import argparse
import ctypes
import dataclasses
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.attention_decode import make_layout, pool_blocks
from bench.harness import machine
from bench.harness.layer import make, model_config
from flock.attention import cpu
from flock.attention.base import StepLayout
from flock.kv import fp8

BLOCK = 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", type=Path, help="copies of cascade_cpu.c in flock/attention/csrc/")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--degree", type=int, default=1, help="decode: requests per group sharing the prefix")
    p.add_argument("--prefix", type=int, default=1536, help="shared (decode) or cached (prefill) tokens")
    p.add_argument("--tail", type=int, default=32, help="decode: each request's own tokens before the new one")
    p.add_argument("--new", type=int, default=0, help="prefill: new tokens per request (0: decode)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--kv", choices=["auto", *fp8.FP8], default="auto", help="the caches' dtype (kv_cache_dtype)")
    p.add_argument("--hot", action="store_true", help="one copy of the caches (KV from cache)")
    p.add_argument("--rounds", type=int, default=9)
    return p.parse_args()


def prefill_layout(rng, requests: int, cached: int, new: int) -> StepLayout:
    per = -(-(cached + new) // BLOCK)
    blocks = rng.permutation(requests * per + 8)
    tables = [blocks[i * per:(i + 1) * per].astype(np.int64) for i in range(requests)]
    slots = np.concatenate([t[np.arange(cached, cached + new) // BLOCK] * BLOCK + np.arange(cached, cached + new) % BLOCK
                            for t in tables])
    return StepLayout(np.arange(requests + 1) * new, np.full(requests, cached + new), tables, BLOCK,
                      torch.from_numpy(slots))


def main():
    args = parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rng = np.random.default_rng(0)
    if args.new:
        layout = prefill_layout(rng, args.requests, args.prefix, args.new)
        kv_tokens = args.requests * (args.prefix + args.new)
    else:
        shape = SimpleNamespace(block_size=BLOCK, requests=args.requests, tail=args.tail)
        layout = make_layout(rng, shape, args.degree, args.prefix, pool_blocks(shape, [args.degree], args.prefix) + 8)
        kv_tokens = args.requests // args.degree * args.prefix + args.requests * (args.tail + 1)
    blocks = 1 + max(int(t.max()) for t in layout.block_tables)
    kv_dtype = fp8.cache_dtype(args.kv, dtype)
    elsize = kv_dtype.itemsize * fp8.row_width(args.head_dim, kv_dtype) / args.head_dim
    cache_bytes = 2 * blocks * BLOCK * args.kv_heads * args.head_dim * elsize
    copies = 1 if args.hot else min(32, max(2, int(400e6 // cache_bytes)))
    caches = [tuple(fp8.quantize(torch.randn(blocks, BLOCK, args.kv_heads, args.head_dim), kv_dtype)
                    if fp8.is_fp8(kv_dtype) else torch.randn(blocks, BLOCK, args.kv_heads, args.head_dim).to(dtype)
                    for _ in range(2))
              for _ in range(copies)]
    isa = cpu.chosen_isa()
    backend = make(f"cpu-{isa}", model_config(args.heads, args.kv_heads, args.head_dim), dtype)
    meta = backend.build_metadata(layout)
    q = torch.randn(len(layout.slot_mapping), args.heads, args.head_dim).to(dtype)
    libs = [dataclasses.replace(cpu.KERNEL, source=s.resolve()).load(isa) for s in args.sources]
    outs = [torch.empty_like(q) for _ in libs]
    calls = [[backend.kernel_args(q, k, v, out, meta) for k, v in caches] for out in outs]
    for lib, call in zip(libs, calls):
        if lib.flock_cpu_cascade(ctypes.byref(call[0])) != 0:
            raise SystemExit("the kernel failed")
    same = [torch.equal(outs[0], o) for o in outs]
    repeats = max(copies, 8 if args.new else 64)
    times = [[] for _ in libs]
    for _ in range(args.rounds):
        for lib, call, t in zip(libs, calls, times):
            start = time.perf_counter()
            for r in range(repeats):
                lib.flock_cpu_cascade(ctypes.byref(call[r % copies]))
            t.append((time.perf_counter() - start) / repeats)
    mb = kv_tokens * args.kv_heads * args.head_dim * elsize * 2 / 1e6
    work = (f"prefill {args.requests} x ({args.prefix} cached + {args.new} new)" if args.new else
            f"decode: {args.requests} request(s) in groups of {args.degree} sharing {args.prefix} tokens, {args.tail} own")
    print(f"# attention_builds: {machine.cpu_line()}; the cpu kernel's {isa} path\n# {work}; heads "
          f"{args.heads}/{args.kv_heads} x {args.head_dim}, {args.dtype}, KV {args.kv}; {mb:.2f} MB of KV, "
          f"{'hot' if args.hot else f'{copies} copies rotated'}")
    for s, t, ok in zip(args.sources, times, same):
        m = statistics.median(t)
        print(f"{s.name}: {m * 1e6:.1f} us ({mb / m / 1e3:.1f} GB/s of KV; rounds {min(t) * 1e6:.1f}-{max(t) * 1e6:.1f})"
              + ("" if ok else "  (outputs differ from the first build's)"))


if __name__ == "__main__":
    main()
