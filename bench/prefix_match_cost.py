"""Prefix-matching cost per scheduling decision: Feather's Chunked Hash Tree vs SGLang's LPM and DFS-weight.

Workload: W waiting requests of L tokens in G prefix groups (shared prefix = 80% of L rounded down to a whole
KV block, the rest distinct), an active batch of B requests from group 0. Per decision:
- CHT: `best()`, `add_to_batch` of it and `insert` of a new arrival (W steady). The oldest active request
  then finishes (`remove_from_batch`, B steady); that completion is timed separately ("finish"). The mean
  over --decisions decisions: it includes the rare costly ones (a group switch updates the misses of every
  waiting request of the groups that enter or leave the working set).
- LPM (SGLang): `match_prefix` of every waiting request against a RadixTree of the active batch's sequences,
  then a stable sort by matched length.
- DFS-weight (SGLang): `dfs_order` over a RadixTree of the waiting requests (weights recomputed, as the
  queue changes every decision), SGLang's match of every waiting request against the active tree, then the
  admission (remove the first, insert an arrival).
  Both: the median of up to 50 decisions after a warm-up (their cost is the same every decision).
Build costs (token generation, hashing, tree construction) are reported apart, and so are `best()` alone and
the finish. The radix trees compare edges in numpy, so their times are a lower bound on SGLang's per-token
Python loop; `ops` counts the same work either way (CHT: node visits, hash probes, dict/set/heap operations;
radix: tokens compared + nodes visited; sorts: W log2 W).
GC is frozen after each build and off while timing, so a collection over millions of index objects does not
land in one method's numbers.

    python -m bench.prefix_match_cost [--quick] [--mem-gb 8] [--max-s 60]
"""

import argparse
import gc
import math
import os
import time
from pathlib import Path

import numpy as np

from bench.harness import machine
from bench.harness.report import OUT, pyplot, save_figure, write_json
from bench.harness.timing import gc_paused, repeat_within
from flock.kv.hashing import chained_hashes
from flock.prefix.cht import ChunkedHashTree
from flock.prefix.radix import RadixTree

BS = 16  # KV block size = CHT chunk


def shape(L: int) -> tuple[int, int, int]:
    """(shared prefix tokens, chunks per request, distinct chunks per request)."""
    prefix = int(0.8 * L) // BS * BS
    return prefix, L // BS, L // BS - prefix // BS


def estimate(W: int, L: int, n_extra: int, budget_s: float) -> tuple[float, float]:
    """(GB, seconds) for one grid point. Per request: int32 tokens, its hash tuple (8 B a chunk), its distinct
    hashes' int objects (~40 B each) and ~1.5 KB of tree nodes (CHT and radix, a few per request, none per
    chunk); time is token generation (~10 ns/token), hashing (~3 us per distinct chunk), building the trees
    and LPM / DFS decisions (~100 us/request), plus the time budgets. Calibrated on a loaded 2-CPU machine,
    where W=10^4, L=8000 peaked at ~0.5 GB above the baseline and took ~9 s."""
    _, chunks, distinct = shape(L)
    per_req = 4 * L + 8 * chunks + 40 * distinct + 1500
    n = W + n_extra
    return n * per_req / 1e9, n * (1e-8 * L + 3e-6 * distinct) + W * 1e-4 + 2 * budget_s


def available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return float("inf")


class Workload:
    """Token rows: [0, W) waiting, [W, W+B) active (group 0), then arrivals; hashes per row."""

    def __init__(self, W: int, L: int, groups: int, batch: int, arrivals: int, seed: int):
        rng = np.random.default_rng(seed)
        self.W, self.B, self.prefix = W, batch, shape(L)[0]
        n = W + batch + arrivals
        group = rng.integers(0, groups, n)
        group[W:W + batch] = 0
        t = time.perf_counter()
        prefixes = rng.integers(0, 32000, (groups, self.prefix), dtype=np.int32)
        self.tokens = np.empty((n, L), dtype=np.int32)
        self.tokens[:, self.prefix:] = rng.integers(0, 32000, (n, L - self.prefix), dtype=np.int32)
        for g in range(groups):  # per group, not prefixes[group]: no n x prefix temporary
            self.tokens[group == g, :self.prefix] = prefixes[g]
        self.rows = list(self.tokens)  # views, like a queue of requests holding their prompts
        self.gen_s = time.perf_counter() - t
        t = time.perf_counter()
        shared = [tuple(chained_hashes(p, BS)) for p in prefixes]  # the caller hashes each prompt once;
        self.hashes = [shared[g] + tuple(chained_hashes(r[self.prefix:], BS, shared[g][-1] if shared[g] else 0))
                       for g, r in zip(group.tolist(), self.rows)]  # a group's prefix once, then the rest
        self.hash_s = time.perf_counter() - t
        assert self.hashes[0] == tuple(chained_hashes(self.tokens[0].tolist(), BS))


def timed(fn, min_runs: int, max_runs: int, budget_s: float) -> tuple[float, list]:
    """fn() between min_runs and max_runs times after a warm-up (GC off), the median seconds (a baseline's
    decision costs the same every time, so the spread is noise from the shared machine) and the results."""
    with gc_paused():
        seconds, results = repeat_within(fn, min_runs, max_runs, budget_s)
    return float(np.median(seconds)), results


def bench_cht(wl: Workload, decisions: int) -> dict:
    t = time.perf_counter()
    cht = ChunkedHashTree()
    for k in range(wl.W + wl.B):
        cht.insert(k, wl.hashes[k])
    active = list(range(wl.W, wl.W + wl.B))
    for k in active:
        cht.add_to_batch(k)
    build = time.perf_counter() - t
    gc.collect()
    gc.freeze()
    arrivals = iter(range(wl.W + wl.B, len(wl.rows)))
    decide_s = finish_s = best_s = 0.0
    decide_ops = finish_ops = 0
    gc.disable()
    for _ in range(decisions):
        ops, t0 = cht.ops, time.perf_counter()
        key = cht.best()
        t1 = time.perf_counter()
        cht.add_to_batch(key)
        new = next(arrivals)
        cht.insert(new, wl.hashes[new])
        t2 = time.perf_counter()
        decide_ops += cht.ops - ops
        active.append(key)
        ops = cht.ops
        cht.remove_from_batch(active.pop(0))
        finish_s += time.perf_counter() - t2
        finish_ops += cht.ops - ops
        decide_s += t2 - t0
        best_s += t1 - t0
    gc.enable()
    gc.unfreeze()
    return dict(cht_build_s=build, cht_us=decide_s / decisions * 1e6, cht_ops=decide_ops / decisions,
                cht_best_us=best_s / decisions * 1e6, cht_finish_us=finish_s / decisions * 1e6,
                cht_finish_ops=finish_ops / decisions, cht_decisions=decisions, cht_final_tip=cht.tip())


def active_tree(wl: Workload) -> tuple[RadixTree, float]:
    t = time.perf_counter()
    tree = RadixTree()
    for k in range(wl.W, wl.W + wl.B):
        tree.insert(k, wl.rows[k])
    return tree, time.perf_counter() - t


def bench_lpm(wl: Workload, budget_s: float) -> dict:
    tree, build = active_tree(wl)
    waiting = wl.rows[:wl.W]
    sort_ops = wl.W * math.ceil(math.log2(max(wl.W, 2)))

    def decide():
        ops = tree.ops
        matched = [tree.match_prefix(r) for r in waiting]
        order = sorted(range(len(matched)), key=matched.__getitem__, reverse=True)  # stable: FIFO among ties
        return tree.ops - ops + sort_ops, order[0]

    gc.collect()
    gc.freeze()
    sec, results = timed(decide, 1, 50, budget_s)
    gc.unfreeze()
    return dict(lpm_build_s=build, lpm_us=sec * 1e6, lpm_ops=sum(r[0] for r in results) / len(results),
                lpm_decisions=len(results))


def bench_dfs(wl: Workload, budget_s: float) -> dict:
    cache, _ = active_tree(wl)
    t = time.perf_counter()
    tree = RadixTree()
    waiting = {}
    for k in range(wl.W):
        tree.insert(k, wl.rows[k])
        waiting[k] = wl.rows[k]
    build = time.perf_counter() - t
    arrivals = iter(range(len(wl.rows) - 1, wl.W + wl.B - 1, -1))  # from the end: disjoint from CHT's

    def decide():
        ops = tree.ops + cache.ops
        order = tree.dfs_order()
        for k in order:
            cache.match_prefix(waiting[k])
        tree.remove(order[0])
        del waiting[order[0]]
        new = next(arrivals)
        tree.insert(new, wl.rows[new])
        waiting[new] = wl.rows[new]
        return tree.ops + cache.ops - ops

    gc.collect()
    gc.freeze()
    sec, results = timed(decide, 1, 50, budget_s)
    gc.unfreeze()
    return dict(dfs_build_s=build, dfs_us=sec * 1e6, dfs_ops=sum(results) / len(results), dfs_decisions=len(results))


def run_point(W: int, L: int, args) -> dict:
    decisions = min(args.decisions, 50 * W)
    wl = Workload(W, L, args.groups, args.batch, decisions + 64, args.seed)
    row = dict(W=W, L=L, groups=args.groups, batch=args.batch, gen_s=wl.gen_s, hash_s=wl.hash_s)
    row |= bench_cht(wl, decisions)
    row |= bench_lpm(wl, args.budget_s)
    row |= bench_dfs(wl, args.budget_s)
    row["lpm_over_cht"] = row["lpm_us"] / row["cht_us"]
    row["dfs_over_cht"] = row["dfs_us"] / row["cht_us"]
    del wl
    gc.collect()
    return row


def ratio(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 5))
    lengths = sorted({r["L"] for r in rows})
    styles = ["-", "--", ":", "-."]
    for method, color in (("cht", "tab:green"), ("lpm", "tab:blue"), ("dfs", "tab:red")):
        for L, style in zip(lengths, styles):
            pts = sorted((r["W"], r[f"{method}_us"]) for r in rows if r["L"] == L)
            label = {"cht": "CHT", "lpm": "LPM", "dfs": "DFS-weight"}[method] + f" L={L}"
            ax.plot(*zip(*pts), style, color=color, marker="o", ms=3, label=label)
    ax.set(xscale="log", yscale="log", xlabel="waiting requests W", ylabel="µs per scheduling decision",
           title="Prefix-matching cost per decision")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    save_figure(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_match_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="W in {100, 1000}, L in {1000, 4000}")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decisions", type=int, default=1000, help="CHT decisions per point")
    ap.add_argument("--budget-s", type=float, default=1.0, help="LPM / DFS: time per point (1-50 decisions)")
    ap.add_argument("--mem-gb", type=float, default=8.0, help="skip points estimated above this")
    ap.add_argument("--max-s", type=float, default=60.0, help="skip points estimated to take longer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    Ws = (100, 1000) if args.quick else (100, 1000, 10_000, 100_000)
    Ls = (1000, 4000) if args.quick else (1000, 4000, 8000, 10_000)
    mem_cap = min(args.mem_gb, 0.7 * available_gb())
    print(machine.header("prefix_match_cost", kernels=False))

    head = (f"{'W':>7} {'L':>6} | {'CHT us':>8} {'ops':>8} | {'LPM us':>10} {'ops':>10} | "
            f"{'DFS-w us':>10} {'ops':>10} | {'LPM/CHT':>8} {'DFS/CHT':>8}")
    print(head)
    print("-" * len(head))
    rows, skipped, start = [], [], time.perf_counter()
    for L in Ls:
        for W in Ws:
            gb, sec = estimate(W, L, min(args.decisions, 50 * W) + args.batch + 64, args.budget_s)
            why = (f"~{gb:.1f} GB > {mem_cap:.1f} GB" if gb > mem_cap else
                   f"~{sec:.0f} s > {args.max_s:.0f} s" if sec > args.max_s else None)
            if why:
                skipped.append(dict(W=W, L=L, reason=why))
                print(f"{W:>7} {L:>6} | skipped: {why}", flush=True)
                continue
            r = run_point(W, L, args)
            rows.append(r)
            print(f"{W:>7} {L:>6} | {r['cht_us']:>8.1f} {r['cht_ops']:>8.0f} | {r['lpm_us']:>10.0f} {r['lpm_ops']:>10.0f} | "
                  f"{r['dfs_us']:>10.0f} {r['dfs_ops']:>10.0f} | {ratio(r['lpm_over_cht']):>8} {ratio(r['dfs_over_cht']):>8}",
                  flush=True)

    print(f"\n{'W':>7} {'L':>6} | {'gen s':>6} {'hash s':>6} {'CHT bld s':>9} {'DFS bld s':>9} | "
          f"{'best() us':>9} {'finish us':>9} {'finish ops':>10} | runs CHT/LPM/DFS")
    for r in rows:
        print(f"{r['W']:>7} {r['L']:>6} | {r['gen_s']:>6.2f} {r['hash_s']:>6.2f} {r['cht_build_s']:>9.2f} "
              f"{r['dfs_build_s']:>9.2f} | {r['cht_best_us']:>9.2f} {r['cht_finish_us']:>9.1f} {r['cht_finish_ops']:>10.0f} | "
              f"{r['cht_decisions']}/{r['lpm_decisions']}/{r['dfs_decisions']}")
    goal = next((r for r in rows if r["W"] == 10_000 and r["L"] == 8000), None)
    if goal:
        verdict = "met" if goal["dfs_over_cht"] >= 1000 else "NOT met"
        print(f"\ngoal CHT >= 1000x cheaper than DFS-weight at W=10^4, L=8000: {goal['dfs_over_cht']:.0f}x in time "
              f"({verdict}); {goal['dfs_ops'] / goal['cht_ops']:.0f}x in ops; "
              f"{goal['dfs_us'] / goal['cht_best_us']:.0f}x against best() alone")
    total = time.perf_counter() - start
    print(f"CHT us: best + add_to_batch + insert(arrival); finish: remove_from_batch, not in the decision. "
          f"Block {BS}, {args.groups} groups, batch {args.batch}. {os.cpu_count()} CPUs, {total:.0f} s total.")

    write_json(args.out / "prefix_match_cost.json", dict(block_size=BS, quick=args.quick, cpu=machine.cpu_model(),
                                                         cpus=os.cpu_count(), total_s=total, rows=rows,
                                                         skipped=skipped))
    if rows:
        plot(rows, args.out / "prefix_match_cost.png")


if __name__ == "__main__":
    main()
