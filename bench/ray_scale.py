"""Scale-out on Ray: (1) this machine, one engine vs Ray workers; (2) the partitioner at cluster scale.

    python -m bench.ray_scale local           # (1), a few minutes, on a quiet machine
    python -m bench.ray_scale partition       # (2), no model: ~5 min, ~4 GB of memory

(1) One shared-prefix batch (BatchLLM's 2000/200 shape at --scale, sharing degree 16, --groups groups,
shuffled; --gen tokens each, greedy) through `flock run`'s job: one engine in this process with 2 torch
threads, then on a local Ray (2 CPUs) 1 worker x 2 threads and 2 workers x 1 thread. "start s" builds the
engine(s) (Ray's own start not included); "job s" is the job from its first line read to its last result
written, planning, partitioning and result streaming included. Each condition runs --repeat times, the best
job time is shown.

(2) No model runs. An industrial-like batch (BatchLLM §6: --prompts prompts, group sizes geometric with mean
3, prefixes ~1,570 tokens, own parts ~30), plain and with 8 task instructions of 200 tokens above the
groups, over 8 / 64 / 512 workers, three ways:
  flock      `flock.distributed.partition`: whole prefix groups, balanced by computed tokens;
  ray data   what Ray Data + vLLM does: the dataset in its order, in batches of --batch-size rows, the
             batches dealt round-robin to the replicas;
  random     every row to a random replica.
A worker's computed tokens are those of an engine with an unbounded prefix cache: every distinct prefix of
its prompts once (the best case for vLLM; an LRU cache that evicts computes more). balance = max / mean over
workers (1.00 is ideal); saving = 1 - computed / prompt tokens over all workers; "x one engine" = computed
tokens over those of one engine with the whole batch. Tables: markdown; numbers: bench/out/ray_scale.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np

from bench.harness import machine
from bench.harness.report import OUT, write_json
from bench.harness.workloads import industrial, microbench
from flock.prefix import PrefixTree, build_tree, plan_prefixes

MODEL = "flock/bench-tiny"


# -- (1) this machine ----------------------------------------------------------------------------------------
def local(args) -> list[dict]:
    import ray
    import torch

    from flock.api.batch import JobConfig
    from flock.config import EngineConfig
    from flock.distributed.driver import ClusterConfig, ClusterEngine
    from flock.engine.engine import LLMEngine

    folder = Path(args.tmp)
    folder.mkdir(parents=True, exist_ok=True)
    engine_kw = {"model": MODEL, "scheduler": "batchllm", "kv_cache_memory_bytes": 1 << 30}
    jobs = []
    for r in range(args.repeat):  # other prompts each time: nothing is left in an engine's prefix cache
        prompts = microbench(2000, 200, 16, num_groups=args.groups, scale=args.scale, seed=args.seed + r)
        inp = folder / f"batch{r}.jsonl"
        inp.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": args.gen, "ignore_eos": True}) + "\n"
                               for p in prompts))
        jobs.append(JobConfig(str(inp), str(folder / "out.jsonl"), overwrite=True, quiet=True,
                              sampling={"temperature": 0}, engine=engine_kw))
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    single = LLMEngine(EngineConfig.from_kwargs(**engine_kw))
    print(f"{machine.header('ray_scale local')}\n{MODEL} ({single.runner.dtype}, attention "
          f"{single.runner.backend.name}); {len(prompts)} prompts of {len(prompts[0])} tokens "
          f"({args.groups} groups of 16), {args.gen} generated each\n")
    rows = [measure("one engine, 2 threads (no Ray)", jobs, single, time.perf_counter() - t0)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, cluster in [("Ray: 1 worker x 2 threads", ClusterConfig(1, worker_cpus=2, worker_threads=2)),
                              ("Ray: 2 workers x 1 thread", ClusterConfig(2, worker_cpus=1, worker_threads=1))]:
            t0 = time.perf_counter()
            engine = ClusterEngine(engine_kw, cluster)
            try:
                rows.append(measure(name, jobs, engine, time.perf_counter() - t0))
            finally:
                engine.shutdown()
    finally:
        ray.shutdown()
    base = rows[0]["job_s"]
    print("| condition | start s | job s | total tok/s | saving | vs one engine |")
    print("|---|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['condition']} | {r['start_s']:.1f} | {r['job_s']:.2f} | {r['tok_s']:,.0f} | {r['saving']:.1%} | "
              f"{base / r['job_s']:.2f}x |")
    return rows


def measure(name: str, jobs: list, engine, start_s: float) -> dict:
    """The best of the jobs' times (each job its own prompts) and the statistics of that job."""
    from flock.api.batch import run_job

    best = None
    for job in jobs:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the one-line summary of each job
            assert run_job(job, engine) == 0
        wall = time.perf_counter() - t0
        if best is None or wall < best["job_s"]:
            s = engine.stats.as_dict()
            best = {"condition": name, "start_s": start_s, "job_s": wall, "saving": s["saving_rate"],
                    "tok_s": (s["logical_prefill_tokens"] + s["generated_tokens"]) / wall}
    return best


# -- (2) the partitioner at scale ----------------------------------------------------------------------------
def computed_per_worker(tree: PrefixTree, shards: list[np.ndarray]) -> np.ndarray:
    """Every distinct prefix of each shard's prompts once: sum of lengths minus the longest common prefixes of
    neighbours in sorted order, read off the whole batch's sorted order (the LCP of two prompts is the
    minimum of the neighbour LCPs between them)."""
    rank = np.empty(len(tree.order), dtype=np.int64)
    rank[tree.order] = np.arange(len(tree.order))
    lengths = tree.table.lengths
    out = np.zeros(len(shards), dtype=np.int64)
    for w, shard in enumerate(shards):
        if len(shard):
            q = np.sort(rank[np.asarray(shard)])
            shared = np.minimum.reduceat(tree.lcp[: q[-1] + 1], q[:-1] + 1).sum() if len(q) > 1 else 0
            out[w] = lengths[tree.order[q]].sum() - shared
    return out


def figures(tree: PrefixTree, shards: list[np.ndarray]) -> dict:
    per = computed_per_worker(tree, shards)
    return {"balance": float(per.max() / per.mean()), "computed": int(per.sum()),
            "saving": 1 - per.sum() / tree.table.num_tokens, "vs_one": per.sum() / tree.edge_tokens}


def scale(args) -> list[dict]:
    from flock.distributed.partition import partition

    print(f"{machine.header('ray_scale partition', kernels=False)}\nindustrial-like, {args.prompts:,} prompts; ray data batches of "
          f"{args.batch_size} rows\n")
    rows = []
    rng = np.random.default_rng(args.seed)
    for label, header in (("industrial", 0), ("industrial + 8 task instructions", 200)):
        prompts = industrial(num_prompts=args.prompts, header_len=header, seed=args.seed, as_arrays=True)
        t0 = time.perf_counter()
        tree = build_tree(prompts)
        tree_s = time.perf_counter() - t0
        plan = plan_prefixes(tree.table)  # one engine's BatchLLM plan (first level)
        one = {"saving": 1 - tree.edge_tokens / tree.table.num_tokens, "plan_saving": plan.saving_rate}
        print(f"### {label}: {tree.table.num_tokens / 1e6:.0f}M prompt tokens; one engine saves {one['saving']:.1%} "
              f"(its first-level BatchLLM plan {plan.saving_rate:.1%}); prefix tree {tree_s:.1f} s\n")
        print("| workers | flock: balance | saving | x one engine | groups cut | partition s | ray data: balance | "
              "saving | x one engine | random: balance | saving |")
        print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        n = len(prompts)
        for workers in args.workers:
            t0 = time.perf_counter()
            part = partition(tree, workers)
            part_s = time.perf_counter() - t0
            flock = figures(tree, [np.asarray(s) for s in part.shards])
            batch_of = np.arange(n) // args.batch_size
            ray_data = figures(tree, [np.flatnonzero(batch_of % workers == w) for w in range(workers)])
            pick = rng.integers(workers, size=n)
            random = figures(tree, [np.flatnonzero(pick == w) for w in range(workers)])
            rows.append({"workload": label, "workers": workers, "one_engine": one, "flock": flock,
                         "flock_cut": part.split_groups, "partition_s": part_s, "ray_data": ray_data,
                         "random": random})
            print(f"| {workers} | {flock['balance']:.3f} | {flock['saving']:.1%} | {flock['vs_one']:.3f} | "
                  f"{part.split_groups} | {part_s:.2f} | {ray_data['balance']:.3f} | {ray_data['saving']:.1%} | "
                  f"{ray_data['vs_one']:.2f} | {random['balance']:.3f} | {random['saving']:.1%} |")
        print()
        del prompts, tree, plan
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ray_scale", description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["local", "partition"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", type=int, default=8, help="local: prefix groups of 16 prompts")
    ap.add_argument("--scale", type=float, default=0.25, help="local: lengths x scale (0.25: 500 + 50 tokens)")
    ap.add_argument("--gen", type=int, default=32, help="local: tokens generated per prompt")
    ap.add_argument("--repeat", type=int, default=2, help="local: runs per condition, each on other prompts (best shown)")
    ap.add_argument("--tmp", default="/tmp/flock-ray-scale", help="local: where the batch and outputs go")
    ap.add_argument("--prompts", type=int, default=100_000, help="partition: prompts in the batch")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512], help="partition: worker counts")
    ap.add_argument("--batch-size", type=int, default=64, help="partition: Ray Data's rows per batch")
    ap.add_argument("--output", type=Path, default=OUT / "ray_scale.json", help="the JSON (each part's rows kept)")
    args = ap.parse_args()
    rows = local(args) if args.part == "local" else scale(args)
    path = args.output
    old = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, old | {args.part: {"cpu": machine.cpu_model(), "rows": rows}})


if __name__ == "__main__":
    main()
