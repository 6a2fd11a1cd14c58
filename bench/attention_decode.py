"""Decode attention per step: per-request paged attention ("torch") vs prefix-sharing cascade ("torch-cascade")
and the fused prefix-sharing kernels: every ISA path of the CPU kernel this CPU runs ("cpu-amx",
"cpu-avx512bf16", "cpu-avx512", "cpu-avx2": flock/attention/csrc/cascade_cpu.c).

    python -m bench.attention_decode            # full grid, both dtypes (a few minutes on 2 cores)
    python -m bench.attention_decode --quick    # smoke: fewer cells, fewer repeats
    python -m bench.attention_decode --head-dim 128 --heads 32 --kv-heads 8 --requests 64 --tail 32

One step of one layer: REQUESTS decode requests (1 new token each). Requests come in groups of DEGREE that
share a PREFIX-token prefix (the same physical blocks); each request also has its own TAIL tokens plus the
new one. Degree 1 means no sharing. Physical blocks are shuffled over the pool. Every cell:

  * forward time: median over repeats (after warm-up) of `backend.forward` for one layer, i.e. the KV write
    of the new tokens + attention. The two backends are run alternately, so background load hits both alike.
    Before every timed call the caches are flushed (a 512 MiB buffer is read; `--flush-mib 0` turns it off):
    in a real model the other layers' KV and weights pass through the cache between two visits of a layer,
    so a layer's KV comes from memory, not from the (here 300 MiB) last-level cache.
  * metadata time: `backend.build_metadata`, reported separately; it runs once per step for all layers, so
    its cost per layer is 1/layers of it.
  * KV bytes: the KV a step must read at the least. Per-request: every request's whole context, K and V.
    Cascade: each group's prefix once + every request's own tokens (degree 1: no groups, same as
    per-request). Effective bandwidth = bytes / forward time; "% of BW" compares it with the memory
    bandwidth measured at start (reading a 1 GiB tensor, and copying one).
  * roofline: both backends do the same arithmetic (4 * head_dim FLOPs per query head per context token;
    the cascade saves reads, not FLOPs), so the time bound is max(bytes / bandwidth, FLOPs / peak), with the
    peak of a large matmul in that dtype measured at start (bf16's at least fp32's: bf16 inputs can always be
    multiplied in fp32).
  * fused kernels: each path this CPU runs, timed alternately with the other two and reported
    in its own columns (same KV bytes as the cascade); the goal (within 2x of the roofline at degree 16,
    prefix 2048) is judged for each cascade implementation.
  * correctness: the outputs are compared with per-request attention once per cell (max abs difference).
  * other load: CPU time other processes used while the cell's metadata and forward calls were timed, in
    cores (from /proc/stat, less this process's own CPU time). On a shared machine a busy neighbour stalls
    torch's threads at every parallel op, and the cascade, with many small ops per group, suffers far more
    than per-request (10x slower, seen here). Cells with other load above 0.2 cores are measured again
    (--retries) and flagged if still noisy. Before each cell the script waits (up to --wait-quiet s, 40 s in
    all) for a quiet half second; `--threads 1` is robust to one busy neighbour on two cores.
  * profile: for the goal cell (degree 16, prefix 2048), a cProfile of the cascade forward and the time of
    the bare attention kernel on contiguous prefixes (no gather, tail or merge).

matplotlib (for the plot) is not a dependency of flock: `pip install matplotlib`; without it the plot is skipped.

Outputs: a markdown table per dtype, bench/out/attention_decode.json and bench/out/attention_decode.png.
"""

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import machine
from bench.harness.layer import DTYPES, Flusher, fused_paths, make, model_config, ms
from bench.harness.report import OUT, pyplot, save_figure, write_json
from bench.harness.timing import median_time

from flock.attention import cpu, make_backend
from flock.attention.base import StepLayout

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}  # max |cascade - per-request| accepted
NOISY = 0.2  # cores of other load during a cell above which its times are flagged
GOAL = dict(degree=16, prefix=2048, roofline_factor=2.0)


def parse_args():
    p = argparse.ArgumentParser(prog="python -m bench.attention_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=64, help="decode requests per step")
    p.add_argument("--tail", type=int, default=32, help="each request's own tokens before the new one")
    p.add_argument("--degrees", help="sharing degrees, must divide --requests (default 1,4,16,64; --quick 1,16)")
    p.add_argument("--prefixes", help="prefix lengths in tokens, multiples of the block size "
                   "(default 512,2048,8192; --quick 512,2048)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per backend after the correctness call")
    p.add_argument("--repeats", type=int, default=15, help="at most this many timed runs per backend and cell")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--cell-budget", type=float, default=3.0,
                   help="stop repeating a cell (after --min-repeats) once both backends spent this many seconds")
    p.add_argument("--layers", type=int, default=32, help="layers the metadata is amortised over (in the note)")
    p.add_argument("--bw-gib", type=float, default=1.0, help="size of the bandwidth probe tensor")
    p.add_argument("--flush-mib", type=int, default=512, help="buffer read before each timed call (0: no flush)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retries", type=int, default=1,
                   help="measure a cell again (keeping the quieter) when other processes used > 0.2 cores")
    p.add_argument("--wait-quiet", type=float, default=5.0,
                   help="before each cell wait up to this long for a quiet half second (40 s in all)")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile of the goal cell's cascade path")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: degrees 1,16, prefixes 512,2048, 2 repeats, 1 warm-up, 0.25 GiB probe")
    a = p.parse_args()
    if a.quick:
        a.warmup, a.repeats, a.min_repeats, a.cell_budget, a.bw_gib, a.flush_mib = 1, 2, 2, 0.5, 0.25, 384
    a.degrees = a.degrees or ("1,16" if a.quick else "1,4,16,64")
    a.prefixes = a.prefixes or ("512,2048" if a.quick else "512,2048,8192")
    a.degrees = [int(x) for x in a.degrees.split(",")]
    a.prefixes = [int(x) for x in a.prefixes.split(",")]
    a.dtypes = a.dtypes.split(",")
    for d in a.degrees:
        assert a.requests % d == 0, f"sharing degree {d} does not divide {a.requests} requests"
    return a


# ------------------------------------------------------------------------------------------------ machine


class QuietWaits:
    """Waits for a quiet machine before each cell (other processes under 0.15 cores over half a second), at
    most `budget_s` seconds over the whole run."""

    def __init__(self, budget_s: float = 40.0):
        self.budget_s, self.waited = budget_s, 0.0

    def __call__(self, max_s: float) -> float:
        """Wait up to `max_s` seconds; returns the last reading of other processes' load, in cores."""
        allowed = max(0.0, min(max_s, self.budget_s - self.waited))
        t = time.perf_counter()
        cores = machine.wait_quiet(allowed, 0.15, window_s=0.5 if allowed > 0 else 0.2)
        self.waited += time.perf_counter() - t
        return cores


# ------------------------------------------------------------------------------------------------ layout


def make_layout(rng, args, degree: int, prefix: int, num_blocks: int) -> StepLayout:
    """REQUESTS decode requests in groups of `degree` sharing `prefix` tokens; own tail + 1 new token each.
    Physical blocks are drawn at random from the whole pool; request order is shuffled."""
    bs, r = args.block_size, args.requests
    prefix_blocks, own_blocks = prefix // bs, own_block_count(args, prefix)
    need = (r // degree) * prefix_blocks + r * own_blocks
    assert need <= num_blocks, (need, num_blocks)
    free = iter(rng.permutation(num_blocks)[:need].tolist())
    tables = []
    for _ in range(r // degree):
        shared = [next(free) for _ in range(prefix_blocks)]
        for _ in range(degree):
            tables.append(np.array(shared + [next(free) for _ in range(own_blocks)], dtype=np.int64))
    tables = [tables[i] for i in rng.permutation(r)]
    seq_len = prefix + args.tail + 1
    pos = seq_len - 1  # the new token's position
    slots = np.array([t[pos // bs] * bs + pos % bs for t in tables], dtype=np.int64)
    return StepLayout(np.arange(r + 1), np.full(r, seq_len), tables, bs, torch.from_numpy(slots))


def own_block_count(args, prefix: int) -> int:
    """Blocks of a request's own: a prefix's partial last block (each request writes its own copy), its tail and
    its new token."""
    return -(-(prefix % args.block_size + args.tail + 1) // args.block_size)


def pool_blocks(args, degrees, prefix: int) -> int:
    own_blocks = own_block_count(args, prefix)
    return max((args.requests // d) * (prefix // args.block_size) + args.requests * own_blocks for d in degrees)


def kv_bytes(args, tokens: int, elsize: int) -> int:
    return tokens * args.kv_heads * args.head_dim * elsize * 2  # K and V


# ------------------------------------------------------------------------------------------------ cells


def attention_flops(args, tokens: int) -> int:
    return args.heads * tokens * 4 * args.head_dim  # QK^T and PV, 2 FLOPs per multiply-add


def run_cell(args, dtype_name: str, degree: int, prefix: int, k_cache, v_cache, rng, flush, quiet) -> dict:
    dtype = DTYPES[dtype_name]
    cfg = model_config(args.heads, args.kv_heads, args.head_dim)
    layout = make_layout(rng, args, degree, prefix, k_cache.shape[0])
    r = args.requests
    q = torch.randn(r, args.heads, args.head_dim).to(dtype)
    k = torch.randn(r, args.kv_heads, args.head_dim).to(dtype)
    v = torch.randn(r, args.kv_heads, args.head_dim).to(dtype)
    fused = fused_paths(dtype)
    names = ("torch", "torch-cascade", *fused)
    backends = {n: make(n, cfg, dtype) for n in names}
    # One gather workspace for both, as in an engine that runs one backend: two would hold 2 x 2.7 GB at fp32,
    # prefix 8192, degree 1. They run one after the other, so sharing it changes no timing.
    if hasattr(backends["torch"], "_buffers"):
        backends["torch-cascade"]._buffers = backends["torch"]._buffers
    metas = {n: backends[n].build_metadata(layout) for n in names}
    groups = len(metas["torch-cascade"].groups or [])

    # correctness, once per cell: both write the same new K/V to the same slots, so sharing the cache is safe
    outs = {n: backends[n].forward(q, k, v, k_cache, v_cache, metas[n]) for n in names}
    diffs = {n: (outs["torch"].float() - outs[n].float()).abs().max().item() for n in names[1:]}
    max_diff = diffs["torch-cascade"]
    del outs


    def step(n):
        flush()
        t = time.perf_counter()
        backends[n].forward(q, k, v, k_cache, v_cache, metas[n])
        return time.perf_counter() - t

    for _ in range(args.warmup):
        for n in names:
            step(n)

    def measure():
        before = quiet(args.wait_quiet)
        with machine.OthersCPU() as others:
            meta_t = {n: median_time(lambda n=n: backends[n].build_metadata(layout), 9) for n in names}
            times = {n: [] for n in names}
            spent = 0.0
            while len(times[names[0]]) < args.repeats:
                for n in names:  # alternate, so background load falls on both alike
                    times[n].append(step(n))
                    spent += times[n][-1]
                if len(times[names[0]]) >= args.min_repeats and spent >= args.cell_budget:
                    break
        return others.cores, before, times, meta_t

    other_load, before_quiet, times, meta_t = measure()
    tries = 1
    while other_load > NOISY and tries <= args.retries:  # a busy neighbour: measure again, keep the quieter
        tries += 1
        again = measure()
        if again[0] < other_load:
            other_load, before_quiet, times, meta_t = again

    el = torch.finfo(dtype).bits // 8
    seq_len = prefix + args.tail + 1
    bytes_pr = kv_bytes(args, r * seq_len, el)
    bytes_cc = kv_bytes(args, groups * prefix + (r - groups * degree) * seq_len + groups * degree * (args.tail + 1), el)
    res = {"dtype": dtype_name, "degree": degree, "prefix": prefix, "groups": groups, "requests": r,
           "repeats": len(times[names[0]]), "flops": attention_flops(args, r * seq_len),
           "other_load_cores": other_load, "other_load_before_cores": before_quiet, "tries": tries,
           "max_abs_diff": max_diff, "agree": max_diff <= TOLERANCE[dtype_name]}
    def timing(n: str, b: int) -> dict:
        t = statistics.median(times[n])
        return {"forward_s": t, "forward_min_s": min(times[n]), "metadata_s": meta_t[n], "kv_bytes": b,
                "GBps": b / t / 1e9}

    res["per_request"], res["cascade"] = timing("torch", bytes_pr), timing("torch-cascade", bytes_cc)
    res["speedup"] = res["per_request"]["forward_s"] / res["cascade"]["forward_s"]
    res["fused"] = {n: timing(n, bytes_cc) | {"max_abs_diff": diffs[n], "agree": diffs[n] <= TOLERANCE[dtype_name]}
                    for n in fused}
    for f in res["fused"].values():
        f["speedup"] = res["per_request"]["forward_s"] / f["forward_s"]
    backends = metas = None  # freed (the closures above refer to the names)
    gc.collect()
    return res


def profile_cascade(args, dtype_name: str, k_cache, v_cache, rng, flush, calls: int = 5) -> dict:
    """Where the cascade's time goes on the goal cell: cProfile of its forward (by Python function and torch op),
    and, for reference, the bare attention kernel on the groups' prefixes laid out contiguously (no gather,
    no tail, no merge): the floor of any cascade built on PyTorch's CPU attention kernel."""
    dtype = DTYPES[dtype_name]
    layout = make_layout(rng, args, GOAL["degree"], GOAL["prefix"], k_cache.shape[0])
    r = args.requests
    q = torch.randn(r, args.heads, args.head_dim).to(dtype)
    k = torch.randn(r, args.kv_heads, args.head_dim).to(dtype)
    v = torch.randn(r, args.kv_heads, args.head_dim).to(dtype)
    be = make_backend("torch-cascade", model_config(args.heads, args.kv_heads, args.head_dim), torch.device("cpu"), dtype)
    meta = be.build_metadata(layout)
    for _ in range(2):
        be.forward(q, k, v, k_cache, v_cache, meta)
    prof = cProfile.Profile()
    for _ in range(calls):
        flush()
        prof.enable()
        be.forward(q, k, v, k_cache, v_cache, meta)
        prof.disable()
    # the bare kernel: each group's 16 x 32 query heads against its contiguous prefix, as grouped_attention does
    g = args.heads // args.kv_heads
    qg = torch.randn(1, args.kv_heads, g * GOAL["degree"], args.head_dim).to(dtype)
    kp = torch.randn(1, args.kv_heads, GOAL["prefix"], args.head_dim).to(dtype)
    vp = torch.randn(1, args.kv_heads, GOAL["prefix"], args.head_dim).to(dtype)
    ngroups = len(meta.groups)

    def kernel():
        for _ in range(ngroups):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, kp, vp, scale=be.scale)

    def kernel_cold():
        flush()
        t = time.perf_counter()
        kernel()
        return time.perf_counter() - t

    kernel_hot = median_time(kernel, 9, warmup=2)
    kernel_flushed = statistics.median(kernel_cold() for _ in range(7))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    text = (f"cProfile, cascade forward, {dtype_name}, degree {GOAL['degree']}, prefix {GOAL['prefix']}, {calls} calls"
            f" (caches flushed before each; times are totals over the calls):\n" + "\n".join(lines[start - 1:]))
    return {"cprofile": text, "groups": ngroups, "bare_kernel_s": kernel_hot, "bare_kernel_flushed_s": kernel_flushed}


# ------------------------------------------------------------------------------------------------ report


def roofline(c: dict, bw: float, gflops: float) -> float:
    """max(KV bytes / bandwidth, FLOPs / matmul peak): the time bound of the cascade's work."""
    return max(c["cascade"]["kv_bytes"] / (bw * 1e9), c["flops"] / (gflops * 1e9))


def table(args, rows: list[dict], bw: float, gflops: float) -> str:
    fused = list(dict.fromkeys(n for c in rows for n in c["fused"]))
    head = ["degree", "prefix", "groups", "per-req ms", "cascade ms", "speed-up", "per-req MB", "cascade MB",
            "per-req GB/s (% BW)", "cascade GB/s (% BW)", "cascade / roofline",
            *[f"{n} {col}" for n in fused for col in ("ms", "speed-up", "GB/s (% BW)", "/ roofline")],
            "roofline ms", "metadata ms, per-req / cascade", "max abs diff", "other load"]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in rows:
        pr, cc = c["per_request"], c["cascade"]
        roof = roofline(c, bw, gflops)
        cols = []
        for n in fused:
            fu = c["fused"].get(n)
            cols += [ms(fu["forward_s"]) + ("" if fu["agree"] else " (MISMATCH)"), f"{fu['speedup']:.2f}x",
                     f"{fu['GBps']:.1f} ({100 * fu['GBps'] / bw:.0f}%)", f"{fu['forward_s'] / roof:.2f}x"] \
                if fu else ["-"] * 4
        out.append("| " + " | ".join([
            str(c["degree"]), str(c["prefix"]), str(c["groups"]), ms(pr["forward_s"]), ms(cc["forward_s"]),
            f"{c['speedup']:.2f}x", f"{pr['kv_bytes'] / 1e6:.1f}", f"{cc['kv_bytes'] / 1e6:.1f}",
            f"{pr['GBps']:.1f} ({100 * pr['GBps'] / bw:.0f}%)", f"{cc['GBps']:.1f} ({100 * cc['GBps'] / bw:.0f}%)",
            f"{cc['forward_s'] / roof:.1f}x", *cols, ms(roof),
            f"{ms(pr['metadata_s'])} / {ms(cc['metadata_s'])}",
            f"{c['max_abs_diff']:.1e}" + ("" if c["agree"] else " (MISMATCH)"),
            f"{c['other_load_cores']:.2f}" + (" (!)" if c["other_load_cores"] > NOISY else ""),
        ]) + " |")
    return "\n".join(out)


def goal_verdict(rows: list[dict], bw: float, gflops: dict) -> list[dict]:
    """For each cascade implementation on the goal cell: time / roofline, met when <= GOAL's factor."""
    verdicts = []
    for c in rows:
        if c["degree"] != GOAL["degree"] or c["prefix"] != GOAL["prefix"]:
            continue
        roof = roofline(c, bw, gflops[c["dtype"]])
        for backend, t in [("torch-cascade", c["cascade"]["forward_s"]),
                           *((n, f["forward_s"]) for n, f in c["fused"].items())]:
            verdicts.append({"dtype": c["dtype"], "backend": backend, "time_s": t, "roofline_s": roof,
                             "bandwidth_bound_s": c["cascade"]["kv_bytes"] / (bw * 1e9),
                             "compute_bound_s": c["flops"] / (gflops[c["dtype"]] * 1e9),
                             "over_roofline": t / roof, "met": t / roof <= GOAL["roofline_factor"]})
    return verdicts


def plot(args, rows: list[dict], bw: float, path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    dtypes = [d for d in args.dtypes if any(c["dtype"] == d for c in rows)]
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 8), squeeze=False)
    for col, d in enumerate(dtypes):
        ax, ax2 = axes[0][col], axes[1][col]
        for prefix in args.prefixes:
            cells = sorted((c for c in rows if c["dtype"] == d and c["prefix"] == prefix), key=lambda c: c["degree"])
            if not cells:
                continue
            xs = [c["degree"] for c in cells]
            line, = ax.plot(xs, [c["speedup"] for c in cells], "o-", label=f"prefix {prefix}")
            noisy = [c for c in cells if c["other_load_cores"] > NOISY]
            if noisy:
                ax.plot([c["degree"] for c in noisy], [c["speedup"] for c in noisy], "o", ms=11, mfc="none",
                        color="red", label=f"busy neighbour (> {NOISY} cores) during the cell")
            ax.plot(xs, [c["per_request"]["kv_bytes"] / c["cascade"]["kv_bytes"] for c in cells], ":",
                    color=line.get_color(), lw=1, label=f"prefix {prefix}: KV bytes ratio (ideal)")
            ax2.plot(xs, [100 * c["cascade"]["GBps"] / bw for c in cells], "o-", color=line.get_color(),
                     label=f"cascade, prefix {prefix}")
            ax2.plot(xs, [100 * c["per_request"]["GBps"] / bw for c in cells], "x--", color=line.get_color(),
                     alpha=0.6, label=f"per-request, prefix {prefix}")
            for n, marker in zip(dict.fromkeys(n for c in cells for n in c["fused"]), "sD^v"):
                fused = [c for c in cells if n in c["fused"]]
                fx = [c["degree"] for c in fused]
                ax.plot(fx, [c["fused"][n]["speedup"] for c in fused], marker + "--", color=line.get_color(),
                        label=f"{n} kernel, prefix {prefix}")
                ax2.plot(fx, [100 * c["fused"][n]["GBps"] / bw for c in fused], marker + "-.",
                         color=line.get_color(), label=f"{n} kernel, prefix {prefix}")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set(xscale="log", yscale="log", xlabel="sharing degree (requests per prefix)",
               ylabel="speed-up, cascade vs per-request", title=f"{d}: decode attention, one layer, "
               f"{args.requests} requests")
        ax.set_xticks(args.degrees, [str(x) for x in args.degrees])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        h, lab = ax.get_legend_handles_labels()  # the "busy neighbour" entry may come from any prefix
        seen = {}
        for hh, ll in zip(h, lab):
            seen.setdefault(ll, hh)
        ax.legend(seen.values(), seen.keys(), fontsize=7)
        ax2.axhline(100, color="black", lw=0.6)
        ax2.axhline(50, color="grey", ls=":", lw=1)
        ax2.text(args.degrees[0], 50, " within 2x of the bandwidth bound", fontsize=7, va="bottom", color="grey")
        ax2.set_ylim(0, 110)
        ax2.set(xscale="log", xlabel="sharing degree", ylabel=f"effective KV bandwidth, % of {bw:.1f} GB/s",
                title=f"{d}: KV bytes needed / time")
        ax2.set_xticks(args.degrees, [str(x) for x in args.degrees])
        ax2.grid(alpha=0.3, which="both")
        ax2.legend(fontsize=6, ncol=2, loc="upper right", framealpha=0.6)
    fig.suptitle(f"head_dim {args.head_dim}, {args.heads} q heads / {args.kv_heads} KV heads, block {args.block_size},"
                 f" tail {args.tail}, {torch.get_num_threads()} threads, caches "
                 + ("flushed" if args.flush_mib else "NOT flushed") + " before each call", fontsize=10)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------ main


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    load_start = machine.load_average()
    print(machine.header("attention_decode"))
    print(f"attention kernel paths this CPU runs: {', '.join(fused_paths(torch.bfloat16)) or 'none'}")
    print(f"load average at start: {load_start}  (cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()},"
          f" torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()})")
    waits = QuietWaits()
    quiet = waits(args.wait_quiet)
    print(f"other load now: {quiet:.2f} cores" + ("  -- the machine is busy: 2-thread times will be inflated, the "
          "cascade's most; consider --threads 1" if quiet > NOISY else ""), flush=True)
    with machine.OthersCPU() as others:
        bwinfo = machine.memory_bandwidth(args.bw_gib)
        gflops = machine.arithmetic_peaks({d: DTYPES[d] for d in args.dtypes})
    bw = bwinfo["limit_GBps"]
    bwinfo["other_load_cores"] = probe_load = others.cores
    print(f"memory bandwidth ({args.bw_gib:g} GiB fp32): read (sum) {bwinfo['read_sum_GBps']:.1f} GB/s, "
          f"copy (read+write) {bwinfo['copy_rw_GBps']:.1f} GB/s -> limit {bw:.1f} GB/s; matmul peak (2048^3): "
          + ", ".join(f"{d} {x:.0f} GFLOP/s" for d, x in gflops.items()) + f"; other load {probe_load:.2f} cores"
          + (" (NOISY: the limits are underestimated)" if probe_load > NOISY else ""), flush=True)
    flush = Flusher(args.flush_mib)

    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    rows, profiles = [], {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for prefix in args.prefixes:
            # one single-layer pool per (dtype, prefix), sized for the cell that needs most blocks (degree 1)
            nb = pool_blocks(args, args.degrees, prefix) + 64
            shape = (nb, args.block_size, args.kv_heads, args.head_dim)
            k_cache = torch.empty(shape, dtype=dtype).normal_()
            v_cache = torch.empty(shape, dtype=dtype).normal_()
            for degree in args.degrees:
                c = run_cell(args, dtype_name, degree, prefix, k_cache, v_cache, rng, flush, waits)
                rows.append(c)
                print(f"  {dtype_name} prefix {prefix:5d} degree {degree:2d}: per-request "
                      f"{ms(c['per_request']['forward_s'])} ms, cascade {ms(c['cascade']['forward_s'])} ms, "
                      f"{c['speedup']:.2f}x"
                      + "".join(f", {n} {ms(f['forward_s'])} ms" for n, f in c["fused"].items())
                      + f", {c['repeats']} repeats, max diff {c['max_abs_diff']:.1e}, other load "
                      f"{c['other_load_cores']:.2f} cores" + (" (NOISY)" if c["other_load_cores"] > NOISY else "")
                      + ("" if c["agree"] else "  MISMATCH"), flush=True)
            if prefix == GOAL["prefix"] and GOAL["degree"] in args.degrees and not args.no_profile:
                profiles[dtype_name] = profile_cascade(args, dtype_name, k_cache, v_cache, rng, flush)
            del k_cache, v_cache
            gc.collect()

    print()
    print(f"Decode attention, one layer, one step: {args.requests} requests x 1 new token, head_dim {args.head_dim}, "
          f"{args.heads} query / {args.kv_heads} KV heads, block size {args.block_size}, own tail {args.tail} tokens"
          f" + 1; {torch.get_num_threads()} torch threads; memory bandwidth {bw:.1f} GB/s and matmul peak "
          + ", ".join(f"{d} {x:.0f} GFLOP/s" for d, x in gflops.items()) + " (measured).")
    print("Times: medians of `forward` (KV write + attention), caches flushed before each call"
          + ("" if args.flush_mib else " [flush OFF]") + ". Metadata (`build_metadata`) is timed apart: it runs once "
          f"per step for all layers (with {args.layers} layers its share per layer is 1/{args.layers} of it). "
          "MB = KV bytes a step must read (K+V); % BW = (MB / time) / bandwidth; 'cascade / BW bound' = cascade time"
          " / (cascade MB / bandwidth); 'cascade / roofline' = cascade time / max(MB / bandwidth, FLOPs / matmul peak)"
          " (both backends do the same FLOPs). Other load: cores used by other processes during the cell.")
    for dtype_name in args.dtypes:
        sel = [c for c in rows if c["dtype"] == dtype_name]
        print(f"\n### {dtype_name}\n")
        print(table(args, sel, bw, gflops[dtype_name]))
    verdicts = goal_verdict(rows, bw, gflops)
    print()
    for v in verdicts:
        print(f"goal ({v['dtype']}, {v['backend']}, degree {GOAL['degree']}, prefix {GOAL['prefix']}): "
              f"{ms(v['time_s'])} ms vs roofline {ms(v['roofline_s'])} ms (bandwidth {ms(v['bandwidth_bound_s'])}, "
              f"arithmetic {ms(v['compute_bound_s'])}) = {v['over_roofline']:.2f}x (need <= "
              f"{GOAL['roofline_factor']:.0f}x) -> {'MET' if v['met'] else 'NOT MET'}")
    if not verdicts:
        print("goal cell (degree 16, prefix 2048) not in this run")
    for name, p in profiles.items():
        print("\n" + p["cprofile"])
        print(f"bare attention kernel, {p['groups']} groups x ({GOAL['degree']} requests x {args.heads} heads) over "
              f"{GOAL['prefix']} contiguous prefix tokens: {ms(p['bare_kernel_s'])} ms hot, "
              f"{ms(p['bare_kernel_flushed_s'])} ms after a flush")
    noisy = [c for c in rows if c["other_load_cores"] > NOISY]
    if noisy:
        print(f"\nWARNING: {len(noisy)} of {len(rows)} cells ran while other processes used > {NOISY} cores "
              "(column 'other load'); their times, the cascade's most, are inflated. Rerun on a quiet machine.")
    mismatches = [c for c in rows if not c["agree"] or not all(f["agree"] for f in c["fused"].values())]
    if mismatches:
        print(f"\nWARNING: {len(mismatches)} cells where cascade and per-request outputs differ beyond tolerance")

    load_end = machine.load_average()
    print(f"\nload average at end: {load_end}; peak RSS {machine.peak_rss_gib():.2f} GiB; wall {time.time() - t_start:.0f} s")
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(), "cores": os.cpu_count(), "cpu_isa_paths": cpu.isa_paths(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "load_average_start": load_start, "load_average_end": load_end,
                    "other_load_at_start_cores": quiet, "waited_for_quiet_s": waits.waited},
        "bandwidth": bwinfo, "matmul_GFLOPs": gflops, "tolerance": TOLERANCE, "goal": GOAL, "goal_verdicts": verdicts,
        "cells": rows,
        "profiles": profiles, "peak_rss_gib": machine.peak_rss_gib(), "wall_s": time.time() - t_start,
    }
    write_json(args.out / "attention_decode.json", result)
    print(f"wrote {args.out / 'attention_decode.json'}")
    if not args.no_plot:
        try:
            plot(args, rows, bw, args.out / "attention_decode.png")
            print(f"wrote {args.out / 'attention_decode.png'}")
        except ImportError:
            print("no plot: matplotlib is missing (pip install matplotlib)")


if __name__ == "__main__":
    main()
