"""Where a step's time goes, per model and speed path: GEMM, attention, elementwise ops, the rest.

    python -m bench.step_profile                                  # every section, three models (~6 minutes)
    python -m bench.step_profile --models smollm2 --sections decode,startup

Sections (--sections, comma-separated):
  peak     this CPU's large-matmul peak, measured in the same run: 4096^3 bf16 and fp32 matmuls, plain
           (torch.matmul), with oneDNN-prepacked weights and by Flock's bf16 GEMM; GEMM efficiency is against
           the best one (fp32's where bf16 is slower)
  split    per model and `ops` path (torch: plain PyTorch; packed: prepacked GEMM weights; fused: fused C
           elementwise kernels; auto: both): a prefill-heavy workload (one group of PER_GROUP prompts of PREFIX
           shared + DISTINCT own tokens, 4 new tokens each) and decode-only steps (64 requests), the wall time
           unprofiled and the split of a profiled run (torch.profiler, one labelled range per part)
  batch    per model and `ops` path: wall time of whole batches (bench/engine_speed.py's workloads: GROUPS x
           PER_GROUP prompts of PREFIX shared + DISTINCT own tokens, shuffled, and as many unshared prompts of
           the same length; GEN new tokens; batchllm), unprofiled: what each path gains end to end; with
           --vllm-venv, vLLM's CPU build (prefix caching on) on the same token ids, in the same run
  decode   decode steps of 1, 8 and 64 single-token requests on SmolLM2 (contexts of PREFIX + DISTINCT tokens,
           groups of 16 sharing the prefix): time per step vs the sum of its GEMMs timed alone (the same
           prepacked or plain projections on the same rows, in model order, weights read from memory as in a step)
  startup  LLM(...) in a fresh process, with an empty kernel cache (gcc builds the kernels) and a warm one
Results: markdown tables, and bench/out/step_profile.json. bf16, greedy, ignore_eos.
"""

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.harness import machine, vllm
from bench.harness.offline import hf_folder, shared_workload, unshared_workload, warmup_prompts
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.timing import best_time

MODELS = {"smollm2": "flock/smollm2", "bench-mid": "flock/bench-mid", "bench-tiny": "flock/bench-tiny",
          "bench-gemma3": "flock/bench-gemma3", "bench-qwen3moe": "flock/bench-qwen3moe"}
OPS = ("torch", "packed", "fused", "auto")
PARTS = ("gemm", "attention", "elementwise", "step inputs", "scheduler", "sampling", "embedding")


def measure_peak() -> dict[str, float]:
    """GFLOP/s of 4096^3 products: plain matmul and oneDNN-prepacked linear, bf16 and fp32, and Flock's bf16
    GEMM where it runs."""
    from flock.model import gemm, linear

    n, peaks = 4096, {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        peaks[f"{name} matmul"] = machine.matmul_peak(dtype, n, repeats=3)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        if linear.unavailable(dtype, torch.device("cpu")) is None:
            w = torch.ops.mkldnn._reorder_linear_weight(b, None)
            peaks[f"{name} prepacked"] = 2 * n**3 / best_time(
                lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), 3) / 1e9
        if gemm.unavailable(dtype, torch.device("cpu")) is None:
            pairs = gemm.pack(b)
            peaks[f"{name} flock gemm"] = 2 * n**3 / best_time(lambda: gemm.linear(a, pairs, n), 3) / 1e9
    return peaks


class Labels:
    """Wraps the model's parts (none nests in another) in labelled profiler ranges when `profiling`, and
    times them with perf_counter (a fraction of a microsecond per call); counts GEMM FLOPs."""

    def __init__(self, llm, profiling: bool = False):
        from flock.model.linear import Linear
        from flock.model.llama import MLP, Attention, RMSNorm

        runner = llm.engine.runner
        self.profiling, self.flops, self.seconds = profiling, 0, dict.fromkeys(PARTS, 0.0)
        backends = getattr(runner.backend, "backends", {None: runner.backend}).values()  # one per window (Gemma)
        self.patches = [(Linear, "forward", "gemm"), (RMSNorm, "forward", "elementwise"),
                        (Attention, "rotated_qkv", "elementwise"), (MLP, "act_and_mul", "elementwise"),
                        *[(b, "forward", "attention") for b in backends],
                        (runner.backend, "build_metadata", "step inputs"),
                        (runner, "_prepare", "step inputs"), (runner.sampler, "sample", "sampling"),
                        (llm.engine.scheduler, "schedule", "scheduler"), (runner.model.embed_tokens, "forward",
                                                                         "embedding")]

    def __enter__(self) -> "Labels":
        self.saved = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in self.patches]
        for obj, attr, part in self.patches:
            setattr(obj, attr, self._wrap(getattr(obj, attr), part, gemm=part == "gemm"))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, old in self.saved:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)

    def _wrap(self, fn, part: str, gemm: bool):
        def labelled(*args, **kwargs):
            if gemm:  # an unbound Linear.forward(self, x)
                layer, x = args
                self.flops += 2 * x.numel() // layer.in_features * layer.in_features * layer.out_features
            t = time.perf_counter()
            with record_function(part) if self.profiling else contextlib.nullcontext():
                out = fn(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - t
            return out
        return labelled


def profiled(llm, run) -> tuple[float, dict[str, float], float | None]:
    """Run `run()` under the profiler with labelled parts: (wall s, seconds per part, GEMM FLOPs). Steps the step
    program runs in one C call add its ops' own times (the profiler sees none of them); their GEMM FLOPs are not
    counted, so the FLOPs are None then."""
    program = llm.engine.runner.model.step_program
    if program is not None:
        program.op_seconds = {}
    with Labels(llm, profiling=True) as labels, profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in PARTS}
    parts, flops = {p: totals.get(p, 0.0) for p in PARTS}, labels.flops
    if program is not None:
        if program.op_seconds:
            add_program_ops(parts, program.op_seconds)
            flops = None
        program.op_seconds = None
    return wall, parts, flops


def timed(llm, run) -> tuple[float, dict[str, float]]:
    """Run `run()` with the parts timed by perf_counter, no profiler: (wall s, seconds per part)."""
    with Labels(llm) as labels:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    return wall, labels.seconds


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def shared_prompts(args, vocab: int, groups: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [tokens(rng, args.prefix, vocab) for _ in range(groups)]
    prompts = [p + tokens(rng, args.distinct, vocab) for p in prefixes for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


def make_llm(model: str, ops: str, **kw):
    from flock import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", scheduler="batchllm", block_size=16, ops=ops, **kw)
    rng = random.Random(99)
    vocab = llm.engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": tokens(rng, 300, vocab)} for _ in range(4)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # first-call costs
    return llm


def generate(llm, prompts: list[list[int]], gen: int) -> float:
    from flock import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def start_decoding(llm, prompts: list[list[int]]) -> None:
    """Add the prompts and step until every one has its first token (all decode from then on)."""
    from flock import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    engine.step()


def decode_prompts(args, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [tokens(rng, args.prefix, vocab) for _ in range(-(-n // 16))]
    return [prefixes[i // 16] + tokens(rng, args.distinct, vocab) for i in range(n)]


def step_times(llm, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t)
    return times


def split_row(label: str, wall: float, profiled_wall: float, parts: dict[str, float], flops: float | None,
              peak: float) -> str:
    rest = profiled_wall - sum(parts.values())
    cells = [f"{parts[p] / profiled_wall:.1%}" for p in PARTS] + [f"{rest / profiled_wall:.1%}"]
    gflops = flops / parts["gemm"] / 1e9 if flops is not None and parts["gemm"] else None
    rate = "- (step program)" if gflops is None else f"{gflops:,.0f} ({gflops / peak:.0%})"
    return (f"| {label} | {wall:.3f} | {profiled_wall:.3f} | " + " | ".join(cells)
            + f" | {(parts['gemm'] + parts['attention']) / profiled_wall:.1%} | {rate} |")


SPLIT_HEAD = ("| model / workload / ops | wall s | profiled s | " + " | ".join(PARTS) + " | rest | GEMM + attention "
              "| GEMM GFLOP/s (of peak) |\n|---" + "|--:" * (len(PARTS) + 5) + "|")


def section_split(models: dict[str, str], args, peak: float, report: dict) -> None:
    print("\n## Split of a step's time (torch.profiler; % of the profiled wall time)\n")
    print(SPLIT_HEAD)
    for name, model in models.items():
        for ops in args.ops:
            llm = make_llm(model, ops)
            vocab = llm.engine.model_config.vocab_size
            paths = llm.engine.runner.paths | {"attention": llm.engine.runner.backend.name}
            prefill = shared_prompts(args, vocab, 1, seed=1)
            wall = generate(llm, prefill, 4)
            pwall, parts, flops = profiled(llm, lambda: generate(llm, shared_prompts(args, vocab, 1, seed=2), 4))
            print(split_row(f"{name} / prefill-heavy / {ops}", wall, pwall, parts, flops, peak), flush=True)
            report.setdefault(name, {})[f"prefill/{ops}"] = dict(wall=wall, profiled=pwall, parts=parts,
                                                                 flops=flops, paths=paths)
            start_decoding(llm, decode_prompts(args, 64, vocab, seed=3))
            wall = sum(step_times(llm, args.decode_steps))
            pwall, parts, flops = profiled(llm, lambda: step_times(llm, args.decode_steps))
            print(split_row(f"{name} / decode x64 / {ops}", wall, pwall, parts, flops, peak), flush=True)
            report[name][f"decode/{ops}"] = dict(wall=wall, profiled=pwall, parts=parts, flops=flops, paths=paths)
            llm = None  # its caches freed before the next engine loads (the lambdas above close over the name)


def ratio(walls: dict[str, float], a: str, b: str) -> str:
    return f"{walls[a] / walls[b]:.2f}x" if a in walls and b in walls and walls[a] == walls[a] else "-"


def section_batch(models: dict[str, str], args, report: dict) -> None:
    """Whole batches (bench/engine_speed.py's shared and unshared workloads, the same token ids for every
    engine), side by side with vLLM (prefix caching on) when --vllm-venv is given."""
    workloads = [shared_workload("shared", random.Random(args.seed), args.groups, args.per_group, args.prefix,
                                 args.distinct, args.gen),
                 unshared_workload("unshared", random.Random(args.seed), args.groups * args.per_group,
                                   args.prefix + args.distinct, args.gen)]
    python = vllm.existing_python(args.vllm_venv.resolve()) if args.vllm_venv else None  # installs nothing
    print(f"\n## Whole batches: {args.groups} x {args.per_group} prompts of {args.prefix} + {args.distinct} tokens, "
          f"shuffled, {args.gen} new tokens; Flock batchllm (wall s, unprofiled)\n")
    head = ["model", "workload", *(f"ops={o}" for o in args.ops), "vLLM", "torch / auto", "auto vs vLLM"]
    print("| " + " | ".join(head) + " |\n|---|---" + "|--:" * (len(head) - 2) + "|")
    for name, model in models.items():
        folder = hf_folder(model, args.out)
        walls = {w.name: {} for w in workloads}
        for ops in args.ops:
            llm = make_llm(str(folder), ops)
            for w in workloads:
                if w.name == "shared" or ops in ("torch", "auto"):
                    walls[w.name][ops] = generate(llm, w.prompts, args.gen)  # prompts share no block across runs
            llm = None  # its caches freed before the next engine loads (the lambdas above close over the name)
        if python:
            results = vllm.run_batch(folder, workloads, True, python, out=args.out, timeout=1800,
                                     warmup=warmup_prompts(args.seed, args.prefix + args.distinct))
            for w, r in zip(workloads, results):
                walls[w.name]["vLLM"] = r.wall_s
                report.setdefault(name, {})["vllm_startup_s"] = r.extra.get("startup_s")
        for w in workloads:
            t = walls[w.name]
            cells = [f"{t[o]:.2f}" if o in t else "-" for o in (*args.ops, "vLLM")]
            print(f"| {name} | {w.name} | " + " | ".join(cells) + f" | {ratio(t, 'torch', 'auto')} | "
                  f"{ratio(t, 'vLLM', 'auto')} |", flush=True)
        report.setdefault(name, {})["batch"] = walls
    starts = {name: f"{r['vllm_startup_s']:.0f} s" for name, r in report.items()
              if isinstance(r, dict) and r.get("vllm_startup_s")}
    if starts:
        print(f"\nvLLM start-up (not in the wall times): {starts}")


def gemms_alone(model, rows: int, reps: int) -> tuple[float, float, float]:
    """(seconds, FLOPs, weight bytes) of one step's projections on `rows` rows, in model order."""
    from flock.model.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in layers}

    def run():
        for m in layers:
            m(inputs[m.in_features])
    with torch.inference_mode():
        seconds = statistics.median(best_time(run, 1) for _ in range(reps))
    flops = sum(2 * rows * m.in_features * m.out_features for m in layers)
    weight_bytes = sum(m.qweight.nbytes if m.qweight is not None else 2 * m.in_features * m.out_features
                       for m in layers)  # a GGUF's blocks, else bf16
    return seconds, flops, weight_bytes


def add_program_ops(parts: dict[str, float], op_seconds: dict[str, float]) -> None:
    """Adds the step program's op times (timed inside its C call) to the parts the Python wrappers timed."""
    for kind, seconds in op_seconds.items():
        gemm = kind.endswith("GEMM") or kind == "experts"  # a mixture's one call: its GEMMs, routing and sum
        part = "gemm" if gemm else "attention" if kind in ("attention", "KV write") else "elementwise"
        parts[part] += seconds


def section_decode(model: str, args, peak: float, report: dict) -> None:
    print(f"\n## Decode steps on SmolLM2: N single-token requests, contexts of {args.prefix} + {args.distinct} "
          "tokens (groups of 16 share the prefix); median step, parts timed by perf_counter (no profiler; the step "
          "program's ops inside its C call)\n")
    print("| N | ops | ms / step | GEMMs alone ms | step / GEMMs | GEMM GB/s | GEMM GFLOP/s (of peak) | "
          "in the step, ms: GEMM / attention / elementwise / rest |\n|--:|---|--:|--:|--:|--:|--:|---|")
    projections = {}
    for n in (1, 8, 64):
        for ops in args.ops:
            llm = make_llm(model, ops)
            paths = llm.engine.runner.paths  # a GGUF's blocks run on the int8 GEMM where "auto" keeps them
            projections[ops] = paths.get("quantized") or paths.get("gemm", "PyTorch")
            start_decoding(llm, decode_prompts(args, n, llm.engine.model_config.vocab_size, seed=5))
            step = statistics.median(step_times(llm, args.decode_steps))
            gemm_s, flops, weight_bytes = gemms_alone(llm.engine.runner.model, n, args.decode_steps)
            program = llm.engine.runner.model.step_program
            if program is not None:
                program.op_seconds = {}
            wall, parts = timed(llm, lambda: step_times(llm, args.decode_steps))
            main = {p: parts[p] for p in ("gemm", "attention", "elementwise")}
            if program is not None and program.op_seconds:
                add_program_ops(main, program.op_seconds)
                report.setdefault("decode_program_ops", {})[f"{n}/{ops}"] = program.op_seconds
            main["rest"] = wall - sum(main.values())
            split = " / ".join(f"{v / args.decode_steps * 1e3:.2f}" for v in main.values())
            gflops = flops / gemm_s / 1e9
            print(f"| {n} | {ops} | {step * 1e3:.2f} | {gemm_s * 1e3:.2f} | {step / gemm_s:.2f} | "
                  f"{weight_bytes / gemm_s / 1e9:.1f} | {gflops:,.0f} ({gflops / peak:.0%}) | {split} |", flush=True)
            report.setdefault("decode", {})[f"{n}/{ops}"] = dict(step_s=step, gemm_s=gemm_s, flops=flops,
                                                                 weight_bytes=weight_bytes, parts=parts, wall=wall)
            llm = None  # its caches freed before the next engine loads (the lambdas above close over the name)
    for ops, path in projections.items():
        print(f"\nprojections ({ops}): {path}")
    report.setdefault("decode", {})["projections"] = projections


STARTUP_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from flock import LLM
t1 = time.perf_counter()
llm = LLM(sys.argv[1], dtype="bfloat16")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "llm_s": t2 - t1, "paths": llm.engine.runner.paths}))
"""


def section_startup(models: dict[str, str], report: dict) -> None:
    print("\n## Start-up: LLM(model, dtype='bfloat16') in a fresh process (import of torch + flock apart)\n")
    print("| model | kernel cache | import s | LLM(...) s | paths |\n|---|---|--:|--:|---|")
    for name, model in models.items():
        with tempfile.TemporaryDirectory() as cache:
            for state in ("cold", "warm"):
                env = os.environ | {"FLOCK_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, "-c", STARTUP_CHILD, model], env=env, capture_output=True,
                                     text=True, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"| {name} | {state} | {r['import_s']:.2f} | {r['llm_s']:.2f} | "
                      f"{', '.join(f'{k}: {v}' for k, v in r['paths'].items())} |", flush=True)
                report.setdefault(name, {})[f"startup/{state}"] = r


def available(model: str) -> str | None:
    """Why `model` cannot be loaded here (e.g. flock/smollm2 without its wheel), or None."""
    from flock.model import resolve_model

    try:
        resolve_model(model)
    except (OSError, ValueError) as e:
        return str(e)
    return None


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,bench-mid,bench-tiny", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--smollm2", default=MODELS["smollm2"], help="SmolLM2: the built-in or a Hugging Face folder")
    p.add_argument("--sections", default="peak,split,batch,decode,startup")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated paths to compare: {', '.join(OPS)}")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=100)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="workload seed (engine_speed.py's)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--vllm-venv", type=Path, help="run vLLM's CPU build from this venv beside the whole batches")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.ops = args.ops.split(",")
    sections = args.sections.split(",")
    MODELS["smollm2"] = args.smollm2
    models = {m: MODELS[m] for m in args.models.split(",")}
    if "smollm2" in models and (why := available(models["smollm2"])):
        print(f"SmolLM2 ({models.pop('smollm2')}) skipped: {why}")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine.header("step_profile") + f"\n# {machine.load_note()}", flush=True)
    report: dict = {"cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(), "args": args_dict(args)}
    peak = 1.0
    if "peak" in sections or {"split", "decode"} & set(sections):
        report["peak"] = peaks = measure_peak()
        best = max(peaks, key=peaks.get)  # a bf16 model's GEMMs can always run in fp32 (AVX2-only CPUs do)
        peak = peaks[best]
        print("\n## Large-matmul peak (4096^3, GFLOP/s)\n")
        print(markdown_table(list(peaks), [[f"{v:,.0f}" for v in peaks.values()]], align="r" * len(peaks)))
        print(f"\nGEMM efficiency is against {peak:,.0f} ({best})")
    if "split" in sections:
        section_split(models, args, peak, report)
    if "batch" in sections:
        section_batch(models, args, report)
    if "decode" in sections and "smollm2" in models:
        section_decode(models["smollm2"], args, peak, report)
    if "startup" in sections:
        section_startup(models, report)
    print(f"\nwrote {write_json(args.out / 'step_profile.json', report, indent=2)}")


if __name__ == "__main__":
    main()
