"""Offline-batch speed: Flock's schedulers vs vLLM's CPU build on the `bench.harness.workloads` shapes (BatchLLM §6).

    python -m bench.batch_speed                          # all workloads, default scale (~10 min with vLLM)
    python -m bench.batch_speed --scale 0.05 --prompts 16 --gen 4 --skip-vllm          # a smoke run
    python -m bench.batch_speed --workloads micro-2000-200-s16,nosharing --no-low-kv

Model: the built-in `flock/bench-tiny` shape saved as a bf16 Hugging Face folder (random weights; vLLM loads
the same folder). Workloads: BatchLLM's microbenchmark shapes (prefix/distinct 2000/200, 2000/1000, 1000/1000
at sharing degree 4 and 16), the industrial-like mix, the multi-level (system -> document -> question) mix and
a no-sharing control, every length times --scale, about --prompts prompts each, shuffled; token ids < 8000.
Greedy, ignore_eos, --gen new tokens per prompt.

Conditions per workload:
  Flock FCFS, prefix caching off / on; Flock FCFS on prompts sorted by prefix (token lists sorted
  lexicographically before generate, outputs mapped back; the sort is inside wall s); Flock batchllm;
  vLLM CPU with prefix caching on and off (one vLLM process per condition, all workloads inside it).
  Plus a low-KV run (--low-kv-workloads): num_kv_blocks = --low-kv-fraction of the blocks the batch needs at
  once with every shared block stored once; Flock FCFS (caching on) vs batchllm, computed prefill tokens and
  the tokens recomputed compared with the full-budget run. vLLM is not run that low here: this script sizes its
  CPU KV cache with VLLM_CPU_KVCACHE_SPACE, whole GiB (>= 1 = 262,144 tokens of this model); bench/engine_speed.py's
  KV runs give it exact bytes (kv_cache_memory_bytes).

wall s is end to end around generate (Flock: request checks, planning, scheduling, model, outputs; vLLM the
same around its generate, start-up excluded). total tok/s = (prompt + generated tokens) / wall s.
saving rate = 1 - computed prompt tokens / prompt tokens (vLLM: its cached tokens / prompt tokens).
Results: markdown tables, bench/out/batch_speed.json and the tokens-per-step figure
bench/out/batch_tokens_per_step.png (FCFS caching on vs batchllm: BatchLLM's "valley" figure).
"""

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.harness import machine, vllm
from bench.harness import workloads as fw
from bench.harness.offline import BLOCK, Result, Workload, block_bound_tokens, hf_folder, run_flock, warmup_prompts
from bench.harness.report import OUT, args_dict, markdown_table, pyplot, save_figure, write_json
from flock.prefix import plan_prefixes

MODEL = "flock/bench-tiny"
VLLM_MAX_MODEL_LEN = 2048  # vllm.run_batch's default
MICRO = [(2000, 200), (2000, 1000), (1000, 1000)]
ALL = [f"micro-{p}-{d}-s{k}" for p, d in MICRO for k in (4, 16)] + ["industrial", "multilevel", "nosharing"]


# -- workloads -------------------------------------------------------------------------------------------------
def make_prompts(name: str, scale: float, n: int, seed: int) -> list[list[int]]:
    """About `n` prompts of workload `name` with every length times `scale`."""
    if name.startswith("micro-"):
        _, p, d, k = name.split("-")
        k = int(k[1:])
        return fw.microbench(int(p), int(d), k, num_groups=max(1, n // k), scale=scale, seed=seed)
    if name == "industrial":
        return fw.industrial(num_prompts=n, scale=scale, seed=seed)
    if name == "multilevel":  # 2 system prompts x (n / 16) documents x 8 questions
        return fw.multilevel(num_systems=2, docs_per_system=max(1, n // 16), questions_per_doc=8, scale=scale,
                             seed=seed)
    if name == "nosharing":
        return fw.no_sharing(num_prompts=n, prompt_len=1100, scale=scale, seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(ALL)}")


def block_need(prompts: list[list[int]], gen: int) -> tuple[int, int, int]:
    """KV blocks the whole batch needs at once: (every prompt alone, shared full prompt blocks stored once,
    full prompt blocks shared by two or more prompts)."""
    alone = shared_once = 0
    chains: dict[int, int] = {}
    for p in prompts:
        total, full = math.ceil((len(p) + gen) / BLOCK), len(p) // BLOCK
        alone += total
        shared_once += total - full
        h = 0
        for b in range(full):
            h = hash((h, tuple(p[b * BLOCK:(b + 1) * BLOCK])))
            chains[h] = chains.get(h, 0) + 1
    return alone, shared_once + len(chains), sum(1 for c in chains.values() if c > 1)


def block_bound(prompts: list[list[int]]) -> float:
    """Best saving rate when only whole 16-token blocks are shared (Flock's prefix cache and batchllm) and
    every prompt computes at least its last token."""
    return 1 - block_bound_tokens(prompts) / sum(map(len, prompts))


# -- Flock -----------------------------------------------------------------------------------------------------
def flock_result(folder: Path, w: Workload, label: str, args: argparse.Namespace, **kw) -> Result:
    return run_flock(folder, w, label, warmup_prompts(args.seed, 64), attention=args.attention,
                     max_num_batched_tokens=args.max_batched_tokens, **kw)


FLOCK_CONDITIONS = [  # label, run_flock keywords
    ("Flock FCFS, prefix caching off", dict(caching=False)),
    ("Flock FCFS, prefix caching on", dict(caching=True)),
    ("Flock FCFS sorted by prefix, caching on", dict(caching=True, sort=True)),
    ("Flock batchllm", dict(caching=True, scheduler="batchllm")),
]


# -- report ----------------------------------------------------------------------------------------------------
def vllm_ref(results: list[Result]) -> Result | None:
    return next((r for r in results if r.engine.startswith("vLLM") and r.caching and not r.error), None)


def table(results: list[Result]) -> str:
    head = ["engine / condition", "wall s", "total tok/s", "saving rate", "vs vLLM (caching on)", "steps",
            "preempt.", "others' CPU"]
    ref = vllm_ref(results)
    rows = []
    for r in results:
        name = r.label if r.engine.startswith("vLLM") else r.engine
        if r.error:
            rows.append([name, r.error] + [""] * (len(head) - 2))
            continue
        ratio = f"{ref.wall_s / r.wall_s:.2f}x" if ref else "-"
        saving = "-" if r.saving_rate is None else f"{r.saving_rate:.1%}"
        others = r.extra.get("others_cpu")
        others = f"{others:.0%}" if others is not None and r.wall_s >= 0.5 else "-"
        rows.append([name, f"{r.wall_s:.2f}", f"{r.total_per_s:,.0f}", saving, ratio, r.extra.get("steps", "-"),
                     r.extra.get("preemptions", "-"), others])
    return markdown_table(head, rows)


def agreement(results: list[Result]) -> str:
    """Outputs identical to Flock FCFS's, without and with prefix caching. Random bf16 weights give near-ties,
    so a different computation order (caching, chunking, cascade groups, another engine) may flip a token; a
    sanity check, not a speed figure."""
    lines = []
    for base_name in ("Flock FCFS, prefix caching off", "Flock FCFS, prefix caching on"):
        base = next((r for r in results if not r.error and r.engine == base_name), None)
        if base is None:
            continue
        parts = [f"{r.label if r.engine.startswith('vLLM') else r.engine}: "
                 f"{sum(a == b for a, b in zip(base.outputs, r.outputs))}/{len(base.outputs)}"
                 for r in results if r is not base and not r.error]
        lines.append(f"identical outputs vs {base_name}: " + "; ".join(parts))
    return "\n".join(lines)


def low_kv_table(rows: list[dict]) -> str:
    head = ["workload", "condition", "num_kv_blocks", "wall s", "total tok/s", "saving rate",
            "computed prefill tok", "recomputed vs full budget", "preempt.", "outputs = full budget's"]
    cells = []
    for x in rows:
        if x["error"]:
            cells.append([x["workload"], x["condition"], x["num_kv_blocks"], x["error"]] + [""] * 6)
            continue
        recomputed = "-" if x.get("recomputed") is None else f"{x['recomputed']:+,}"
        cells.append([x["workload"], x["condition"], x["num_kv_blocks"], f"{x['wall_s']:.2f}",
                      f"{x['total_tokens_per_s']:,.0f}", f"{x['saving_rate']:.1%}", f"{x['computed_prefill_tokens']:,}",
                      recomputed, x["preemptions"], x["identical"]])
    return markdown_table(head, cells, align="ll" + "r" * (len(head) - 2))


def plot(series: dict[str, dict[str, list[int]]], path: Path, title: str) -> None:
    fig, axes = pyplot().subplots(len(series), 1, figsize=(10, 3.2 * len(series)), squeeze=False)
    for ax, (name, runs) in zip(axes[:, 0], series.items()):
        for label, steps in runs.items():
            ax.plot(range(1, len(steps) + 1), steps, label=f"{label} ({len(steps)} steps)", lw=1.1,
                    drawstyle="steps-mid")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("tokens in step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.batch_speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(ALL), help=f"comma-separated, from {','.join(ALL)}")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies every prompt length (1 = BatchLLM's)")
    p.add_argument("--prompts", type=int, default=64, help="about this many prompts per workload")
    p.add_argument("--gen", type=int, default=32, help="generated tokens per prompt (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", default="auto", help="Flock attention backend (auto: the CPU's kernel where it runs, "
                   "as the header prints)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--low-kv-workloads", default="micro-2000-200-s16,industrial",
                   help="workloads for the low-KV run (comma-separated, '' for none)")
    p.add_argument("--no-low-kv", action="store_true", help="skip the low-KV run")
    p.add_argument("--low-kv-fraction", type=float, default=0.25,
                   help="num_kv_blocks = this fraction of the blocks the batch needs with sharing")
    p.add_argument("--plot-workload", default="micro-2000-200-s16", help="workload of the tokens-per-step figure")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-off", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vLLM with prefix caching off (one more ~50 s start-up)")
    p.add_argument("--vllm-venv", type=Path, default=vllm.DEFAULT_VENV, help="created if missing")
    p.add_argument("--vllm-timeout", type=float, default=1200, help="seconds per vLLM child process")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.out, args.vllm_venv = args.out.resolve(), args.vllm_venv.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.workloads.split(",") if n]
    low_names = [] if args.no_low_kv else [n for n in args.low_kv_workloads.split(",") if n]
    for n in names + low_names + [args.plot_workload]:
        if n not in ALL:
            p.error(f"unknown workload {n!r}; choose from {', '.join(ALL)}")
    torch.set_num_threads(2)
    t_start = time.perf_counter()

    loads: dict[str, str] = {}

    def check_load(what: str) -> None:
        loads[what] = machine.load_note(args.wait_quiet)
        print(f"# before {what}: {loads[what]}", flush=True)

    print(machine.header("batch_speed"))
    check_load("everything")
    print(f"# model {MODEL} (bf16); "
          f"scale {args.scale}, ~{args.prompts} prompts per workload, {args.gen} generated, greedy, ignore_eos; "
          f"Flock attention {args.attention}, max_num_batched_tokens {args.max_batched_tokens}, block 16",
          flush=True)

    folder = hf_folder(MODEL, args.out)
    python: Path | str | None = None  # the venv's python, or why vLLM is unavailable
    if not args.skip_vllm:
        try:
            python = vllm.vllm_python(args.vllm_venv)
        except (RuntimeError, OSError) as e:
            python = str(e)
            print(f"vLLM unavailable: {e}", flush=True)

    workloads: dict[str, Workload] = {}
    meta: dict[str, dict] = {}
    for n in dict.fromkeys(names + low_names + [args.plot_workload]):
        prompts = make_prompts(n, args.scale, args.prompts, args.seed)
        plan = plan_prefixes(prompts)
        alone, with_sharing, shared_blocks = block_need(prompts, args.gen)
        workloads[n] = Workload(n, prompts, args.gen, plan.saving_rate_bound)
        meta[n] = {"prompts": len(prompts), "prompt_tokens": workloads[n].prompt_tokens,
                   "max_prompt_len": max(map(len, prompts)), "groups": plan.num_groups,
                   "saving_rate_single_level": plan.saving_rate, "saving_rate_bound": plan.saving_rate_bound,
                   "saving_rate_block_bound": block_bound(prompts), "blocks_alone": alone,
                   "blocks_with_sharing": with_sharing, "shared_blocks": shared_blocks}

    # Flock, every workload and condition
    check_load("Flock")
    by_workload: dict[str, list[Result]] = {n: [] for n in names}
    for n in names:
        for label, kw in FLOCK_CONDITIONS:
            r = flock_result(folder, workloads[n], label, args, **kw)
            by_workload[n].append(r)
            print(f"  {n:20s} {label:42s} " + (r.error or f"{r.wall_s:6.2f} s  {r.total_per_s:8,.0f} tok/s  "
                                                f"saving {r.saving_rate:.1%}"), flush=True)

    # low KV budget: FCFS caching on vs batchllm
    low_rows, low_steps = [], {}
    for n in low_names:
        w = workloads[n]
        blocks = max(math.ceil(args.low_kv_fraction * meta[n]["blocks_with_sharing"]),
                     math.ceil((meta[n]["max_prompt_len"] + args.gen) / BLOCK) + 1)
        full = {r.engine: r for r in by_workload.get(n, [])}
        for label, kw in FLOCK_CONDITIONS[1:2] + FLOCK_CONDITIONS[3:]:
            if label not in full:  # the workload is only in the low-KV list: its full-budget run first
                full[label] = flock_result(folder, w, label, args, **kw)
            r = flock_result(folder, w, label, args, num_kv_blocks=blocks, **kw)
            ok, f = not r.error, full[label]
            row = {"workload": n, "condition": label, "num_kv_blocks": blocks, "error": r.error,
                   "blocks_with_sharing": meta[n]["blocks_with_sharing"], "blocks_alone": meta[n]["blocks_alone"]}
            if ok:
                computed, full_computed = r.extra["computed_prefill_tokens"], f.extra.get("computed_prefill_tokens")
                row |= {"wall_s": r.wall_s, "total_tokens_per_s": r.total_per_s, "saving_rate": r.saving_rate,
                        "computed_prefill_tokens": computed, "full_budget_computed_prefill_tokens": full_computed,
                        "recomputed": None if f.error else computed - full_computed,
                        "preemptions": r.extra["preemptions"], "peak_kv_blocks": r.extra["peak_kv_blocks"],
                        "identical": "-" if f.error else
                        f"{sum(a == b for a, b in zip(f.outputs, r.outputs))}/{len(w.prompts)}",
                        "tokens_per_step": r.extra["tokens_per_step"]}
                low_steps.setdefault(n, {})[label] = r.extra["tokens_per_step"]
            low_rows.append(row)
            print(f"  low KV {n:13s} {label:42s} {blocks} blocks: " + (r.error or f"{r.wall_s:6.2f} s  "
                  f"saving {r.saving_rate:.1%}  computed prefill {r.extra['computed_prefill_tokens']:,}"), flush=True)

    # vLLM: one process per caching condition, every workload inside it
    if python is not None:
        fits = [n for n in names if meta[n]["max_prompt_len"] + args.gen <= VLLM_MAX_MODEL_LEN]
        for n in set(names) - set(fits):
            by_workload[n].append(Result(vllm.VLLM_ENGINE, True,
                                         error=f"prompt + gen > max_model_len {VLLM_MAX_MODEL_LEN}"))
        for caching in (True, False) if args.vllm_off else (True,):
            if fits and isinstance(python, Path):
                check_load(f"vLLM (prefix caching {'on' if caching else 'off'})")
            results = vllm.run_batch(folder, [workloads[n] for n in fits], caching, python,
                                     warmup=warmup_prompts(args.seed, 64), out=args.out, timeout=args.vllm_timeout)
            for n, r in zip(fits, results):
                by_workload[n].append(r)

    # report
    report = {"args": args_dict(args), "cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(),
              "model": MODEL, "load": loads, "workloads": {}, "low_kv": low_rows}
    for n in names:
        results, m = by_workload[n], meta[n]
        print(f"\n### {n}: {m['prompts']} prompts, {m['prompt_tokens']:,} prompt tokens (max {m['max_prompt_len']}), "
              f"{m['groups']} groups, {args.gen} generated each; saving rate single-level "
              f"{m['saving_rate_single_level']:.1%}, bound {m['saving_rate_bound']:.1%}, "
              f"whole blocks {m['saving_rate_block_bound']:.1%}\n")
        print(table(results))
        print("\n" + agreement(results))
        starts = {r.label: f"{r.extra['startup_s']:.0f} s" for r in results if "startup_s" in r.extra}
        if starts:
            print(f"vLLM start-up (not in wall s): {starts}; vLLM's CPU build caches whole 128-token blocks "
                  "(its CPU default block_size) and counts only tokens found cached at admission")
        report["workloads"][n] = m | {"results": [asdict(r) | {"label": r.label, "total_tokens_per_s": r.total_per_s}
                                                  for r in results]}
    if low_rows:
        print(f"\n### low KV budget: num_kv_blocks = {args.low_kv_fraction:.0%} of the blocks the batch needs at once "
              f"with shared blocks stored once (the whole batch alone: see JSON)\n")
        print(low_kv_table(low_rows))
        print("\nrecomputed vs full budget = computed prefill tokens here - computed prefill tokens with the default "
              "(ample) KV budget: prefix tokens computed again because they were evicted or preempted")

    if args.plot_workload in by_workload or low_steps:
        series = {}
        runs = {r.engine: r.extra["tokens_per_step"] for r in by_workload.get(args.plot_workload, [])
                if not r.error and r.engine in ("Flock FCFS, prefix caching on", "Flock batchllm")}
        if runs:
            series[f"{args.plot_workload}, default KV budget"] = runs
        for n, runs in low_steps.items():
            series[f"{n}, num_kv_blocks = {args.low_kv_fraction:.0%} of the batch's need"] = runs
        if series:
            path = args.out / "batch_tokens_per_step.png"
            plot(series, path, f"Tokens per step, FCFS (prefix caching on) vs batchllm; {MODEL}, scale "
                               f"{args.scale}, gen {args.gen}, max_num_batched_tokens {args.max_batched_tokens}")
            print(f"\nwrote {path}")
    path = write_json(args.out / "batch_speed.json", report)
    print(f"wrote {path}; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
