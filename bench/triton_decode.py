"""Decode-step attention time of the attention backends on a CUDA GPU, on a prefix-sharing batch.

    python -m bench.triton_decode                     # 64 groups x 16 requests, 2,048-token prefix, bf16
    python -m bench.triton_decode --groups 8 --per-group 4 --prefix 512 --iters 5
    TRITON_INTERPRET=1 python -m bench.triton_decode --device cpu --groups 2 --per-group 2 --prefix 32 \
        --distinct 8 --heads 4 --kv-heads 2 --head-dim 16 --iters 1 --dtype float32      # smoke test, no GPU

One decode step: GROUPS x PER_GROUP requests, each with its group's PREFIX tokens (shared physical blocks)
plus DISTINCT +- DISTINCT/2 own tokens, one new query token each; physical blocks shuffled. Times one layer's
`forward` (KV write included; `build_metadata`, once per step in the engine, timed apart on the host) of
"torch" (per request), "torch-cascade" and "triton", and checks that they agree.
"""

import argparse
import time

import numpy as np
import torch

from bench.harness import machine
from flock.attention.base import StepLayout
from flock.attention.cascade import TorchCascadeBackend
from flock.attention.torch_paged import TorchPagedBackend
from flock.attention.triton_cascade import TritonCascadeBackend, TritonCascadeMetadata

BACKENDS = {"torch": TorchPagedBackend, "torch-cascade": TorchCascadeBackend, "triton": TritonCascadeBackend}


def decode_layout(rng, groups: int, per_group: int, prefix: int, distinct: int, bs: int, device) -> tuple:
    prefix_blocks = prefix // bs
    lens = distinct + rng.integers(-distinct // 2, distinct // 2 + 1, size=groups * per_group)
    own = -(-(prefix_blocks * bs + lens + 1) // bs) - prefix_blocks
    num_blocks = groups * prefix_blocks + int(own.sum())
    free = list(rng.permutation(num_blocks))
    tables, seq = [], []
    for g in range(groups):
        shared = [free.pop() for _ in range(prefix_blocks)]
        for m in range(per_group):
            r = g * per_group + m
            tables.append(np.array(shared + [free.pop() for _ in range(int(own[r]))], dtype=np.int64))
            seq.append(prefix_blocks * bs + int(lens[r]) + 1)
    seq = np.array(seq)
    slots = np.array([t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(tables, seq)])
    layout = StepLayout(np.arange(len(seq) + 1), seq, tables, bs, torch.from_numpy(slots).to(device))
    return layout, num_blocks


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.triton_decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--distinct", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1, not a timing")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    assert device.type != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU: TRITON_INTERPRET on the CPU"
    print(f"# triton_decode: {machine.cpu_line()}\n# device: {gpu}; kernel paths: the backends below (triton: "
          f"the Triton cascade kernel, {'compiled' if device.type == 'cuda' else 'interpreted'})")
    rng = np.random.default_rng(0)
    layout, num_blocks = decode_layout(rng, args.groups, args.per_group, args.prefix, args.distinct,
                                       args.block_size, device)
    n = len(layout.seq_lens)
    gen = torch.Generator(device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(n, args.kv_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(n, args.kv_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    print(f"# decode: {args.groups} groups x {args.per_group} requests, prefix {args.prefix} + ~{args.distinct} "
          f"own tokens, {args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}, block {args.block_size}, "
          f"{args.dtype}, KV cache {2 * k_cache.numel() * k_cache.element_size() / 2**30:.2f} GiB")
    print(f"{'backend':<14} {'forward ms':>11} {'vs torch':>9} {'build_metadata ms':>18} {'max |diff| vs torch':>20}")
    results = {}
    for name, cls in BACKENDS.items():
        backend = cls(args.heads, args.kv_heads, args.head_dim, None, dtype)
        backend.build_metadata(layout)  # first call imports triton
        t0 = time.perf_counter()
        meta = backend.build_metadata(layout)
        build_ms = (time.perf_counter() - t0) * 1e3
        if name == "triton":
            assert isinstance(meta, TritonCascadeMetadata), "the Triton kernel path was not taken"
        for _ in range(3):  # warm-up, Triton compilation
            out = backend.forward(q, k, v, k_cache, v_cache, meta)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            backend.forward(q, k, v, k_cache, v_cache, meta)
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        results[name] = (ms, out.float())
        diff = (out.float() - results["torch"][1]).abs().max().item()
        print(f"{name:<14} {ms:>11.3f} {results['torch'][0] / ms:>8.2f}x {build_ms:>18.2f} {diff:>20.3g}")
        del backend, meta
        if device.type == "cuda":
            torch.cuda.empty_cache()
    worst = max((results[n_][1] - results["torch"][1]).abs().max().item() for n_ in results)
    assert worst < 5e-2 if dtype != torch.float32 else worst < 1e-4, f"backends disagree: {worst}"


if __name__ == "__main__":
    main()
