"""Side-by-side speed of Flock and vLLM (CPU build) on the same token ids, one engine after the other.

    python -m bench.engine_speed --workload shared --vllm-venv V                 # mid, 4 x 16 x (1000 + 100)
    python -m bench.engine_speed --workload unshared                                # mid, 64 x 1100
    python -m bench.engine_speed --workload kv-pressure                             # bench-kv, 1 GiB of KV each
    python -m bench.engine_speed --workload kv-pressure --kv-cache-dtype fp8        # ... both engines' KV in fp8
    python -m bench.engine_speed --workload kv-sweep --kv-fractions 0.25,0.5        # part of the sweep, then
    python -m bench.engine_speed --workload kv-sweep --kv-fractions 1,2 --plot-only # ... the rest; the plot
    python -m bench.engine_speed --model flock/smollm2 --workload shared         # a built-in or any HF folder
    python -m bench.engine_speed --model tiny --groups 2 --per-group 4 --prefix 64 --distinct 16 --gen 4 --skip-vllm

    python -m bench.engine_speed --model flock/smollm2 --workload shared --per-group 64 --prefix 400 --gen 64 \
        --sampling temperature=1.0,top_p=0.95                                    # both engines sampling

Workloads (greedy unless --sampling, ignore_eos, --gen new tokens, prompts shuffled):
  shared      --groups x --per-group prompts: a group prefix (--prefix tokens) + --distinct own tokens;
  unshared    as many prompts of --prefix + --distinct random tokens;
  kv-pressure the flock/bench-kv shape (hidden 512, intermediate 1408, 24 layers, 8 q / 8 KV heads: 48 KiB of
              bf16 KV per token), 16 groups x 8 x (1500 + 100), both engines given 1 GiB of KV (--kv-gib);
  kv-sweep    the kv-pressure batch under KV budgets of --kv-fractions of what it needs at once (every request's
              blocks, full prompt blocks shared by several stored once): fcfs vs batchllm vs vLLM, a plot of wall
              time and computed prompt tokens vs budget (bench/out/engine_speed_kv_sweep.png). Points accumulate
              in bench/out/engine_speed_kv_sweep.json, so the sweep can be run a few budgets at a time.
--model: a shape (tiny, mid, qwen3, phi3, gemma2, gemma3, qwen3moe: the built-in flock/bench-* models), a built-in
name or a Hugging Face folder;
random-weight shapes are saved as bf16 folders first (vLLM loads the same folder).

Flock runs fcfs (prefix caching on, vLLM's policy) and batchllm, with attention "auto" (the fused CPU kernel on
x86, see the printed path) or --attention. vLLM runs with prefix caching in its own virtual environment
(created on first use, see shared/notes/peers.md), one child process per KV budget. Each run prints the CPU
model, the kernel path, the bf16 matmul peak measured in the same run, and per engine: wall s, speed vs vLLM,
saving rate, computed prompt tokens against the block-level bound, steps, requests and tokens per step,
preemptions and decode tokens recomputed after preemption (vLLM: from its metrics where it reports them).
Results: markdown tables and bench/out/engine_speed.json.
"""

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch

from bench.harness import machine, vllm
from bench.harness.offline import (BLOCK, Result, Workload, block_bound_tokens, blocks_needed, hf_folder,
                                   kv_bytes_per_token, run_flock, shared_workload, unshared_workload, warmup_prompts)
from bench.harness.report import OUT, args_dict, fmt, markdown_table, pyplot, save_figure, write_json
from flock.engine.runner import resolve_device
from flock.kv.fp8 import KV_CACHE_DTYPES

MODELS = {"tiny": "flock/bench-tiny", "mid": "flock/bench-mid", "kv": "flock/bench-kv", "qwen3": "flock/bench-qwen3",
          "phi3": "flock/bench-phi3", "gemma2": "flock/bench-gemma2", "gemma3": "flock/bench-gemma3",
          "qwen3moe": "flock/bench-qwen3moe"}
KV_PRESSURE = dict(groups=16, per_group=8, prefix=1500, distinct=100)
SCHEDULERS = ("fcfs", "batchllm")


def sampling_fields(text: str) -> dict:
    """'temperature=1.0,top_k=50' -> {"temperature": 1.0, "top_k": 50}: the fields both engines sample with."""
    fields = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        fields[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
    return fields


def make_workload(name: str, args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    if name == "shared":
        return shared_workload(name, rng, args.groups, args.per_group, args.prefix, args.distinct, args.gen)
    if name == "unshared":
        return unshared_workload(name, rng, args.groups * args.per_group, args.prefix + args.distinct, args.gen)
    return shared_workload(name, rng, **KV_PRESSURE, gen=args.gen)  # kv-pressure, kv-sweep


def flock_result(folder: Path, w: Workload, scheduler: str, args: argparse.Namespace,
                 kv_bytes: int | None = None) -> Result:
    return run_flock(folder, w, f"Flock {scheduler}", warmup_prompts(args.seed, args.prefix + args.distinct),
                     scheduler=scheduler, attention=args.attention, max_num_batched_tokens=args.max_batched_tokens,
                     kv_cache_memory_bytes=kv_bytes, kv_cache_dtype=args.kv_cache_dtype, sampling=args.sampling)


def vllm_results(folder: Path, w: Workload, python: Path | str, args: argparse.Namespace,
                 kv_bytes: int | None = None) -> list[Result]:
    return vllm.run_batch(folder, [w], True, python, warmup=warmup_prompts(args.seed, args.prefix + args.distinct),
                          out=args.out, timeout=args.vllm_timeout, kv_bytes=kv_bytes, kv_cache_dtype=args.kv_cache_dtype,
                          sampling=args.sampling)


# -- report ----------------------------------------------------------------------------------------------------
def table(results: list[Result], bound_tokens: int) -> str:
    head = ["engine / condition", "wall s", "speed vs vLLM", "total tok/s", "saving rate", "computed prompt tok",
            "steps", "requests / step", "tokens / step", "preemptions", "decode tok recomputed", "others' CPU"]
    ref = next((r for r in results if r.engine.startswith("vLLM") and not r.error), None)
    rows = []
    for r in results:
        if r.error:
            rows.append([r.engine, r.error] + [""] * (len(head) - 2))
            continue
        x = r.extra
        computed = x.get("computed_prefill_tokens")
        rows.append([
            r.engine, f"{r.wall_s:.2f}", f"{ref.wall_s / r.wall_s:.2f}x" if ref else "-", f"{r.total_per_s:,.0f}",
            "-" if r.saving_rate is None else f"{r.saving_rate:.1%}",
            "-" if computed is None else f"{computed:,} ({computed / bound_tokens:.2f}x bound)",
            fmt(x.get("steps")), fmt(x.get("mean_requests_per_step"), ".1f"), fmt(x.get("mean_tokens_per_step"), ",.0f"),
            fmt(x.get("preemptions")), fmt(x.get("recomputed_decode_tokens")),
            f"{x['others_cpu']:.0%}" if "others_cpu" in x else "-"])
    return markdown_table(head, rows)


def agreement(results: list[Result], sampled: bool) -> str:
    """Outputs identical to Flock fcfs's, and the mean number of leading tokens that agree: a sanity check, not a
    speed figure (random bf16 weights give near-ties, so a different computation order may flip a token)."""
    if sampled:
        return "sampled: the engines' tokens are not compared"
    base = next((r for r in results if r.engine == "Flock fcfs" and not r.error), None)
    if base is None:
        return ""

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    parts = []
    for r in results:
        if r is not base and not r.error:
            same = sum(a == b for a, b in zip(base.outputs, r.outputs))
            lead = sum(map(common, base.outputs, r.outputs)) / len(base.outputs)
            parts.append(f"{r.engine}: {same}/{len(base.outputs)} identical, {lead:.1f} leading tokens agree")
    return "vs Flock fcfs: " + "; ".join(parts)


def plot_sweep(points: list[dict], path: Path) -> None:
    fig, (ax, ax2) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    for engine, marker in (("Flock fcfs", "o-"), ("Flock batchllm", "s-"), ("vLLM", "^--")):
        pts = sorted((p for p in points if p["engine"].startswith(engine) and p.get("wall_s")),
                     key=lambda p: p["fraction"])
        if pts:
            xs = [100 * p["fraction"] for p in pts]
            ax.plot(xs, [p["wall_s"] for p in pts], marker, label=engine)
            ax2.plot(xs, [p["computed_prefill_tokens"] / 1e3 for p in pts], marker, label=engine)
    bound = next((p["bound_tokens"] for p in points), None)
    if bound:
        ax2.axhline(bound / 1e3, color="grey", ls=":", label="block-level bound")
    for a, ylabel in ((ax, "wall s"), (ax2, "computed prompt tokens (thousands)")):
        a.set(xscale="log", xlabel="KV budget, % of what the batch needs at once", ylabel=ylabel)
        a.set_xticks([25, 50, 100, 200], ["25%", "50%", "100%", "200%"])
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    fig.suptitle(f"KV-budget sweep: bench-kv model, {KV_PRESSURE['groups']} groups x {KV_PRESSURE['per_group']} x "
                 f"({KV_PRESSURE['prefix']} + {KV_PRESSURE['distinct']}) tokens, bf16, 2 threads", fontsize=10)
    save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------------------
def run_workload(name: str, python: Path | str | None, args: argparse.Namespace) -> dict:
    model = "kv" if name.startswith("kv") else args.model
    folder = hf_folder(MODELS.get(model, model), args.out)
    w = make_workload(name, args)
    bound_tokens = block_bound_tokens(w.prompts)
    need = blocks_needed(w.prompts, w.gen) * BLOCK * kv_bytes_per_token(folder)
    if name == "kv-pressure":
        budgets = [(None, int(args.kv_gib * 2**30))]
    elif name == "kv-sweep":
        budgets = [(f, int(f * need)) for f in args.kv_fractions]
    else:
        budgets = [(None, None)]
    print(f"\n## {name}: {folder.name}, {len(w.prompts)} prompts, {w.prompt_tokens:,} prompt tokens, {w.gen} generated "
          f"each; best saving rate {w.bound:.1%}, block-level bound {bound_tokens:,} computed prompt tokens; "
          f"KV the batch needs at once {need / 2**30:.2f} GiB (bf16); KV cache {args.kv_cache_dtype}; "
          f"sampling {args.sampling or 'greedy'}; Flock attention: "
          f"{machine.attention_path(args.attention, folder)}", flush=True)
    report = []
    for fraction, kv in budgets:
        print(f"[{name}] before Flock{'' if kv is None else f' ({kv / 2**30:.2f} GiB of KV)'}: "
              f"{machine.load_note(args.wait_quiet)}", flush=True)
        results = [flock_result(folder, w, s, args, kv) for s in SCHEDULERS]
        if python is not None:
            print(f"[{name}] before vLLM: {machine.load_note(args.wait_quiet)}", flush=True)
            results += vllm_results(folder, w, python, args, kv)
        where = "" if kv is None else f", KV budget {kv / 2**30:.2f} GiB" + (
            f" ({fraction:.0%} of the need)" if fraction else "")
        print(f"\n### {name}{where}\n\n{table(results, bound_tokens)}\n\nspeed vs vLLM = vLLM's wall s / this wall s "
              f"(> 1: faster); computed prompt tokens vs the block-level bound ({bound_tokens:,})\n"
              f"{agreement(results, bool(args.sampling))}")
        starts = [f"{r.extra['startup_s']:.0f} s" for r in results if "startup_s" in r.extra]
        if starts:
            print(f"vLLM start-up (not in wall s): {starts[0]}")
        report.append({"fraction": fraction, "kv_bytes": kv, "results": [
            asdict(r) | {"outputs": None, "label": r.label, "total_tokens_per_s": r.total_per_s} for r in results]})
    return {"model": str(folder), "prompts": len(w.prompts), "prompt_tokens": w.prompt_tokens, "gen": w.gen,
            "best_saving_rate": w.bound, "bound_tokens": bound_tokens, "need_bytes": need, "runs": report}


def update_sweep(data: dict, args: argparse.Namespace) -> list[dict]:
    """Adds this run's sweep points to OUT/engine_speed_kv_sweep.json; returns all points."""
    path = args.out / "engine_speed_kv_sweep.json"
    points = json.loads(path.read_text()) if path.exists() else []
    for run in data["runs"] if data else []:
        for r in run["results"]:
            if r["error"] is None:
                points = [p for p in points if not (p["engine"] == r["engine"] and p["fraction"] == run["fraction"])]
                points.append({"engine": r["engine"], "fraction": run["fraction"], "kv_bytes": run["kv_bytes"],
                               "wall_s": r["wall_s"], "bound_tokens": data["bound_tokens"],
                               "computed_prefill_tokens": r["extra"].get("computed_prefill_tokens"),
                               "preemptions": r["extra"].get("preemptions")})
    path.write_text(json.dumps(points, indent=1))
    return points


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mid",
                   help="shape (tiny, mid, qwen3, phi3, gemma2, gemma3, qwen3moe), built-in name or HF folder")
    p.add_argument("--workload", default="shared,unshared",
                   help="comma-separated: shared, unshared, kv-pressure, kv-sweep")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=100)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", type=sampling_fields, default={},
                   help="SamplingParams fields both engines sample with, e.g. temperature=1.0,top_p=0.95 (greedy)")
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV budget of both engines under kv-pressure")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="both engines' KV cache elements")
    p.add_argument("--kv-fractions", default="0.25,0.5,1,2", help="kv-sweep budgets, fractions of the need")
    p.add_argument("--plot-only", action="store_true", help="kv-sweep: plot the accumulated points, run nothing")
    p.add_argument("--attention", default="auto", help="Flock's attention backend")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=vllm.DEFAULT_VENV, help="created if missing")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds per vLLM child process")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.out, args.vllm_venv = args.out.resolve(), args.vllm_venv.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.kv_fractions = [float(x) for x in args.kv_fractions.split(",")]
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    sweep_png = args.out / "engine_speed_kv_sweep.png"
    if args.plot_only:
        plot_sweep(update_sweep({}, args), sweep_png)
        print(f"wrote {sweep_png}")
        return
    print(machine.header("engine_speed"))
    if resolve_device("auto").type == "cuda":
        print(f"# Flock runs on cuda ({torch.cuda.get_device_name()}); the kernel paths above are this CPU's")
    print(f"# bf16 matmul peak {machine.matmul_peak():.0f} GFLOP/s (measured now), {machine.load_note()}", flush=True)
    python: Path | str | None = None  # the venv's python, or why vLLM is unavailable
    if not args.skip_vllm:  # install first, so that a slow install does not sit between measurements
        try:
            python = vllm.vllm_python(args.vllm_venv)
        except (RuntimeError, OSError) as e:
            python = str(e)
            print(f"vLLM unavailable: {e}", flush=True)
    report = {"args": args_dict(args), "cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(),
              "workloads": {n: run_workload(n, python, args) for n in args.workload.split(",")}}
    print(f"\nwrote {write_json(args.out / 'engine_speed.json', report, indent=2)}")
    if "kv-sweep" in report["workloads"]:
        plot_sweep(update_sweep(report["workloads"]["kv-sweep"], args), sweep_png)
        print(f"wrote {sweep_png}")


if __name__ == "__main__":
    main()
