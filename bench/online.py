"""Online serving: schedulers side by side on arrival-time traces replayed in real time through the engine.

    python -m bench.online                                   # 4 workloads x fcfs,batchllm (~8 min)
    python -m bench.online --quick                           # a ~40 s smoke run
    python -m bench.online --workloads groups8 --schedulers fcfs,lpm,feather,feather:ucb --attention torch-cascade,torch
    python -m bench.online --workloads groups8 --num-kv-blocks 600 --load 4   # KV pressure: the 8 prefixes need 512
                                                                              # blocks; 4x capacity keeps it saturated
    python -m bench.online --engine-arg max_num_batched_tokens=1024 --threads 1   # 1 thread: a shared machine
    python -m bench.online --model flock/smollm2 --workloads groups8 --schedulers fcfs,feather --num-requests 200 \
        --probe-requests 64 --num-kv-blocks 600 --load 4 --out bench/out/smollm2   # the real model (~2 min)

Workloads (bench/harness/traces.py): groups8 (the Feather paper's experiment: 8 prefix groups of ~1,024 tokens, ~32-token
suffixes, interleaved), long-prefix (8 groups, prefixes 1K-10K tokens), mixed (half from 4 groups, half
unshared), nosharing; every length times the workload's scale (--scale, else groups8/mixed/nosharing 1.0,
long-prefix 0.25 so the longest prompt fits the model's 4,096 positions). Poisson (or --pattern bursty)
arrivals; greedy, ignore_eos, --max-tokens each.

Rate: by default (--rate auto) each workload's rate is --load (2) x the engine's capacity on it, measured
first: the first --probe-requests of a same-shaped trace (another seed) all at once through fcfs with the first
attention backend and the same KV budget; capacity = requests / wall s. Above capacity the queue builds up
during the whole arrival phase, so scheduling has something to decide (the probe's short run under-rates
the engine a little: its prefixes are computed for fewer requests). The chosen rates are printed. A scheduler
cannot finish faster than the arrivals come, so throughput ratios are capped near --load: compare
throughput at --load 4 (saturated), latency at the default 2.

Each (workload, scheduler, attention) runs a fresh engine (warmed up on unrelated prompts) on the same trace:
add every request whose arrival time has passed, step while there is work, else sleep until the next arrival
(bench.harness.traces.replay). Schedulers are registry names, "NAME:POLICY" passes engine kwarg feather_policy=POLICY;
--engine-arg KEY=VALUE passes any other engine kwarg.

Columns: req/s and out tok/s = finished requests / generated tokens over the wall time (first arrival to last
finish); TTFT = first token - arrival in the trace; TPOT = (finish - first token) / (output tokens - 1);
groups/step = mean distinct prefix groups among the running requests after each step (an unshared request is
its own group); batch = mean running requests; queue max = most arrived requests not running; saving = 1 -
computed / logical prompt tokens; sched % = scheduling time / wall; match % = the scheduler's
prefix-matching time (CHT, cache lookups, radix tree) / model step time. Results: a table per workload,
throughput ratios vs fcfs, bench/out/online.json and bench/out/online_groups.png (groups per step over time, groups8).
"""

import argparse
import gc
import random
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, pyplot, save_figure, write_json
from bench.harness.traces import TRACE_KINDS, ReplayResult, make_trace, replay
from flock import LLM, SamplingParams
from flock.engine.loop import run_to_end
from flock.sched import SCHEDULERS

DEFAULT_SCALE = {"groups8": 1.0, "long-prefix": 0.25, "mixed": 1.0, "nosharing": 1.0}
PLOT_WORKLOAD = "groups8"
SMOOTH_STEPS = 20
FULL = {"workloads": ",".join(TRACE_KINDS), "num_requests": 800, "probe_requests": 200, "time_limit": 300}
QUICK = {"workloads": "groups8,nosharing", "num_requests": 120, "probe_requests": 60, "time_limit": 60,
         "scale": 0.25}


# -- engines ---------------------------------------------------------------------------------------------------
def scheduler_kwargs(spec: str) -> dict:
    """"NAME" or "NAME:POLICY" -> engine kwargs."""
    name, _, policy = spec.partition(":")
    return {"scheduler": name} | ({"feather_policy": policy} if policy else {})


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def build_engine(args: argparse.Namespace, spec: str, attention: str):
    kwargs = dict(dtype=args.dtype, attention=attention, max_num_seqs=args.max_num_seqs,
                  num_kv_blocks=args.num_kv_blocks, **scheduler_kwargs(spec)) | args.engine_kwargs
    engine = LLM(args.model, **kwargs).engine
    rng = random.Random(12345)  # unrelated to the traces' tokens: warms the model, shares no block
    for _ in range(4):
        engine.add_request([rng.randrange(100, 8000) for _ in range(64)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    run_to_end(engine)
    return engine


def run(args: argparse.Namespace, trace, spec: str, attention: str) -> tuple[ReplayResult | None, str | None, float]:
    """One replay on a fresh engine; (result, error, others' CPU fraction)."""
    engine = None
    try:
        engine = build_engine(args, spec, attention)
        with machine.OthersCPU() as others:
            result = replay(engine, trace, time_limit_s=args.time_limit)
        return result, None, others.fraction
    except Exception as e:  # noqa: BLE001 - a failing condition is a finding, the others still run
        return None, f"{type(e).__name__}: {e}"[:200], 0.0
    finally:
        del engine
        gc.collect()


def capacity(args: argparse.Namespace, kind: str, scale: float, attention: str) -> float:
    """Requests/s of fcfs on a same-shaped trace whose requests all arrive at once."""
    n = min(args.probe_requests, args.num_requests)
    trace = make_trace(kind, num_requests=n, rate=1e9, seed=args.seed + 1000, scale=scale,
                       max_tokens=args.max_tokens)
    result, error, _ = run(args, trace, "fcfs", attention)
    if error:
        raise RuntimeError(f"capacity probe on {kind} failed: {error}")
    return len(result.requests) / result.wall_s


# -- metrics ---------------------------------------------------------------------------------------------------
def metrics(result: ReplayResult, num_requests: int) -> dict:
    reqs, steps, s = result.requests, [x for x in result.steps if x.batch_size], result.stats
    ttft = [r.ttft_s for r in reqs]
    tpot = [r.tpot_s for r in reqs if r.tpot_s is not None]

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {
        "finished": len(reqs), "requests": num_requests, "wall_s": result.wall_s,
        "requests_per_s": len(reqs) / result.wall_s, "output_tokens_per_s": s["generated_tokens"] / result.wall_s,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "mean_groups_per_step": float(np.mean([x.distinct_groups for x in steps])) if steps else float("nan"),
        "mean_batch": float(np.mean([x.batch_size for x in steps])) if steps else float("nan"),
        "max_queue": max((x.waiting for x in result.steps), default=0),
        "saving_rate": s["saving_rate"], "preemptions": s["preemptions"],
        "schedule_fraction": s["schedule_seconds"] / result.wall_s, "steps": s["steps"],
        "match_fraction": s["match_seconds"] / s["model_seconds"] if s["model_seconds"] else float("nan"),
        "match_ops": s["match_ops"],
        "computed_prefill_tokens": s["computed_prefill_tokens"], "peak_kv_blocks": s["peak_kv_blocks"],
        "num_kv_blocks": s["num_kv_blocks"],
    }


# -- report ----------------------------------------------------------------------------------------------------
def baseline(rows: list[dict], row: dict) -> dict | None:
    return next((r for r in rows if r["scheduler"] == "fcfs" and r["attention"] == row["attention"]
                 and not r["error"]), None)


def table(rows: list[dict]) -> str:
    head = ["scheduler", "attention", "req/s", "vs fcfs", "out tok/s", "TTFT p50 / p99 s", "TPOT p50 / p99 ms",
            "groups/step", "batch", "queue max", "saving", "preempt.", "sched %", "match %", "others' CPU"]
    cells = []
    for r in rows:
        if r["error"]:
            cells.append([r["scheduler"], r["attention"], r["error"]] + [""] * (len(head) - 3))
            continue
        m, base = r["metrics"], baseline(rows, r)
        ratio = f"{m['requests_per_s'] / base['metrics']['requests_per_s']:.2f}x" if base else "-"
        done = "" if m["finished"] == m["requests"] else f" ({m['finished']}/{m['requests']} done)"
        cells.append([
            r["scheduler"], r["attention"], f"{m['requests_per_s']:.1f}{done}", ratio, f"{m['output_tokens_per_s']:,.0f}",
            f"{m['ttft_p50_s']:.2f} / {m['ttft_p99_s']:.2f}", f"{1e3 * m['tpot_p50_s']:.0f} / {1e3 * m['tpot_p99_s']:.0f}",
            f"{m['mean_groups_per_step']:.2f}", f"{m['mean_batch']:.0f}", m["max_queue"], f"{m['saving_rate']:.1%}",
            m["preemptions"], f"{m['schedule_fraction']:.1%}", f"{m['match_fraction']:.2%}", f"{r['others_cpu']:.0%}"])
    return markdown_table(head, cells, align="ll" + "r" * (len(head) - 2))


def ratio_table(by_workload: dict[str, list[dict]]) -> str:
    """Throughput vs fcfs (same attention), workloads side by side."""
    conds = list(dict.fromkeys((r["scheduler"], r["attention"]) for rows in by_workload.values() for r in rows))
    cells = []
    for spec, att in conds:
        row = [spec, att]
        for rows in by_workload.values():
            r = next((x for x in rows if x["scheduler"] == spec and x["attention"] == att), None)
            base = baseline(rows, r) if r and not r["error"] else None
            row.append(f"{r['metrics']['requests_per_s'] / base['metrics']['requests_per_s']:.2f}x" if base else "-")
        cells.append(row)
    return markdown_table(["scheduler", "attention", *by_workload], cells, align="ll" + "r" * len(by_workload))


def moving_average(xs: list[float], n: int) -> np.ndarray:
    """Trailing mean over up to n values (shorter at the start)."""
    c = np.cumsum(np.insert(np.asarray(xs, dtype=float), 0, 0.0))
    i = np.arange(1, len(xs) + 1)
    return (c[i] - c[np.maximum(i - n, 0)]) / np.minimum(i, n)


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(10, 6.4), sharex=True)
    for r in rows:
        if r["error"]:
            continue
        label = f"{r['scheduler']} ({r['attention']})"
        t, groups = r["steps"]["t_s"], r["steps"]["distinct_groups"]
        line, = top.plot(t, groups, lw=0.5, alpha=0.3, drawstyle="steps-post")
        top.plot(t, moving_average(groups, SMOOTH_STEPS), color=line.get_color(), lw=1.4, label=label)
        bottom.plot(t, r["steps"]["waiting"], color=line.get_color(), lw=1.1, label=label, drawstyle="steps-post")
    top.set_ylabel(f"distinct prefix groups in the\nrunning batch (mean of {SMOOTH_STEPS} steps)")
    bottom.set_ylabel("arrived, not running")
    bottom.set_xlabel("seconds since the first arrival")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flock/bench-tiny", help="any model LLM() takes: a built-in (flock/smollm2, "
                   "the real one), a Hugging Face folder or a GGUF file; token ids of the traces are < 8,000")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workloads", help=f"comma-separated, from {','.join(TRACE_KINDS)} (default: all)")
    p.add_argument("--schedulers", default="fcfs,batchllm", help="comma-separated NAME or NAME:POLICY")
    p.add_argument("--attention", default="torch-cascade", help="comma-separated attention backends")
    p.add_argument("--num-requests", type=int, help="requests per workload (default 800)")
    p.add_argument("--rate", default="auto", help="req/s, or auto: --load x the measured capacity")
    p.add_argument("--load", type=float, default=2.0, help="with --rate auto: the rate over the capacity")
    p.add_argument("--probe-requests", type=int, help="requests of the capacity probe (default 200)")
    p.add_argument("--pattern", choices=["poisson", "bursty"], default="poisson")
    p.add_argument("--scale", type=float, default=None, help="prompt length scale (default: per workload)")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV budget (default: the engine's, ample)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="any engine kwarg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, help="seconds per run, then unfinished requests are aborted "
                   "(default 300)")
    p.add_argument("--quick", action="store_true", help="a ~40 s smoke run: groups8 and nosharing, 120 requests "
                   "each, scale 0.25")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 is far steadier while other "
                   "processes are busy: 2 threads then lose up to 20x to OpenMP spinning)")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.workload_list = [w for w in args.workloads.split(",") if w]
    args.scheduler_list = [s for s in args.schedulers.split(",") if s]
    args.attention_list = [a for a in args.attention.split(",") if a]
    for w in args.workload_list:
        if w not in TRACE_KINDS:
            p.error(f"unknown workload {w!r}; choose from {', '.join(TRACE_KINDS)}")
    for s in args.scheduler_list:
        if s.partition(":")[0] not in SCHEDULERS:
            p.error(f"unknown scheduler {s!r}; registered: {', '.join(SCHEDULERS)}")
    args.engine_kwargs = {}
    for kv in args.engine_arg:
        key, sep, value = kv.partition("=")
        if not sep:
            p.error(f"--engine-arg needs KEY=VALUE, got {kv!r}")
        args.engine_kwargs[key] = parse_value(value)
    if args.rate != "auto":
        args.rate = float(args.rate)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load = machine.load_note(args.wait_quiet)
    print(machine.header("online") + f"\n# {load}")
    print(f"# model {args.model} ({args.dtype}); {args.num_requests} requests per workload, {args.pattern} "
          f"arrivals, {args.max_tokens} generated each (greedy, ignore_eos); max_num_seqs {args.max_num_seqs}, "
          f"num_kv_blocks {args.num_kv_blocks or 'engine default'}, engine args {args.engine_kwargs or '-'}",
          flush=True)
    report = {"args": args_dict(args), "cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(), "load": load,
              "workloads": {}}
    by_workload: dict[str, list[dict]] = {}
    for kind in args.workload_list:
        scale = args.scale if args.scale is not None else DEFAULT_SCALE[kind]
        cap = None
        if args.rate == "auto":
            cap = capacity(args, kind, scale, args.attention_list[0])
            rate = args.load * cap
            print(f"\n{kind}: capacity {cap:.1f} req/s (fcfs, {args.attention_list[0]}, all at once) -> rate "
                  f"{rate:.1f} req/s ({args.load}x)", flush=True)
        else:
            rate = args.rate
            print(f"\n{kind}: rate {rate:.1f} req/s", flush=True)
        trace = make_trace(kind, num_requests=args.num_requests, rate=rate, pattern=args.pattern, seed=args.seed,
                           scale=scale, max_tokens=args.max_tokens)
        lens = [len(r.token_ids) for r in trace]
        info = {"scale": scale, "rate": rate, "capacity": cap, "arrival_span_s": trace[-1].arrival_s,
                "prompt_tokens": sum(lens), "mean_prompt_len": float(np.mean(lens)), "max_prompt_len": max(lens),
                "groups": len({r.group for r in trace if r.group >= 0})}
        rows = []
        for spec in args.scheduler_list:
            for attention in args.attention_list:
                result, error, others = run(args, trace, spec, attention)
                row = {"scheduler": spec, "attention": attention, "error": error, "others_cpu": others}
                if result:
                    row["metrics"] = metrics(result, len(trace))
                    row["steps"] = {k: [getattr(s, k) for s in result.steps]
                                    for k in ("t_s", "batch_size", "distinct_groups", "tokens", "waiting")}
                    row["requests"] = {k: [getattr(r, k) for r in result.requests]
                                       for k in ("group", "arrival_s", "ttft_s", "tpot_s", "output_tokens",
                                                 "preemptions")}
                    m = row["metrics"]
                    print(f"  {spec:16s} {attention:14s} {m['requests_per_s']:6.1f} req/s  TTFT p50 "
                          f"{m['ttft_p50_s']:.2f} s  groups/step {m['mean_groups_per_step']:.2f}  "
                          f"saving {m['saving_rate']:.1%}  ({m['finished']}/{m['requests']} done, "
                          f"{m['wall_s']:.1f} s)", flush=True)
                else:
                    print(f"  {spec:16s} {attention:14s} {error}", flush=True)
                rows.append(row)
        by_workload[kind] = rows
        report["workloads"][kind] = info | {"rows": rows}

    for kind, rows in by_workload.items():
        i = report["workloads"][kind]
        print(f"\n### {kind}: {args.num_requests} requests, {i['groups']} groups, mean prompt "
              f"{i['mean_prompt_len']:.0f} tokens (max {i['max_prompt_len']}), scale {i['scale']}, {args.pattern} at "
              f"{i['rate']:.1f} req/s (arrivals over {i['arrival_span_s']:.1f} s)"
              + (f", capacity {i['capacity']:.1f} req/s" if i["capacity"] else "") + "\n")
        print(table(rows))
    if len(args.scheduler_list) > 1:
        print("\n### throughput (req/s) vs fcfs, same attention\n")
        print(ratio_table(by_workload))
    if PLOT_WORKLOAD in by_workload:
        path = args.out / "online_groups.png"
        i = report["workloads"][PLOT_WORKLOAD]
        plot(by_workload[PLOT_WORKLOAD], path, f"{PLOT_WORKLOAD}: {args.num_requests} requests, {args.pattern} at "
             f"{i['rate']:.1f} req/s; {args.model}, num_kv_blocks {args.num_kv_blocks or 'default'}")
        print(f"\nwrote {path}")
    path = write_json(args.out / "online.json", report, indent=None)
    print(f"wrote {path}; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
