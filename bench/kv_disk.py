"""The prefix cache's disk tier (`kv_cache_disk_dir`): what reading KV blocks back costs against computing them,
side by side with vLLM, which keeps its prefix cache in memory only.

    python -m bench.kv_disk --vllm-venv V              # flock/smollm2, both sections
    python -m bench.kv_disk --sections next-job --groups 4

Two sections, each a batch of token ids, greedy with ignore_eos, bf16, 16-token blocks:
- next-job: a RAG job run again over the same documents with new questions (GROUPS documents of PREFIX tokens,
  PER_GROUP questions of DISTINCT tokens each, GEN tokens out), each job a fresh engine as `flock run` and
  `vllm run-batch` are: the second job without the tier (every document computed again), and with it after the
  first job wrote its blocks (the documents read from disk); vLLM runs the second job in a fresh process.
- kv-pressure: one job whose documents do not fit the KV cache at once (KV_MIB MiB), shuffled, under fcfs:
  without the tier a document evicted before its next question is computed again, with it (an empty folder at
  start) it is read back; batchllm (which orders the job so that no document comes back) and vLLM with the same
  KV budget beside them.
Reported: wall s (the job only: start-up and a warm-up apart), computed prompt tokens, blocks read from and
written to disk, speed against vLLM, and how many outputs equal the run without the tier. Results: markdown
tables and bench/out/kv_disk.json.
"""

import argparse
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.harness import machine, vllm
from bench.harness.offline import BLOCK, Result, Workload, hf_folder, random_tokens, run_flock, shared_workload, \
    warmup_prompts
from bench.harness.report import OUT, args_dict, markdown_table, write_json


def next_jobs(args: argparse.Namespace) -> tuple[Workload, Workload]:
    """Two jobs over the same documents, each with questions of its own."""
    rng = random.Random(args.seed)
    documents = [random_tokens(rng, args.prefix) for _ in range(args.groups)]

    def job(name: str) -> Workload:
        prompts = [d + random_tokens(rng, args.distinct) for d in documents for _ in range(args.per_group)]
        rng.shuffle(prompts)
        return Workload(name, prompts, args.gen, 0.0)

    return job("first job"), job("second job")


def wait_written(folder: Path, quiet_s: float = 1.0) -> int:
    """Blocks in the tier's folder once the background writes of a finished engine have landed."""
    count, since = -1, time.monotonic()
    while time.monotonic() - since < quiet_s:
        now = sum(1 for _ in folder.rglob("*.kv"))
        if now != count:
            count, since = now, time.monotonic()
        time.sleep(0.1)
    return count


FIRST_JOB = "Flock, first job, writing the tier"  # other prompts than the rows it is shown with


def flock(folder: Path, w: Workload, label: str, args: argparse.Namespace, **kw) -> Result:
    return run_flock(folder, w, label, warmup_prompts(args.seed, args.prefix), attention=args.attention, **kw)


def next_job(folder: Path, python, args: argparse.Namespace, disk: Path) -> list[Result]:
    first, second = next_jobs(args)
    results = [flock(folder, second, "Flock, second job, no disk tier", args, scheduler="batchllm")]
    results.append(flock(folder, first, FIRST_JOB, args, scheduler="batchllm", kv_cache_disk_dir=str(disk)))
    print(f"  blocks on disk after the first job: {wait_written(disk)}", flush=True)
    results.append(flock(folder, second, "Flock, second job, reading the tier", args, scheduler="batchllm",
                         kv_cache_disk_dir=str(disk)))
    if python is not None:
        results += vllm.run_batch(folder, [second], True, python, warmup=warmup_prompts(args.seed, args.prefix),
                                  out=args.out, timeout=args.vllm_timeout)
    return results


def kv_pressure(folder: Path, python, args: argparse.Namespace, disk: Path) -> list[Result]:
    w = shared_workload("kv pressure", random.Random(args.seed), args.groups * 2, args.per_group, args.prefix,
                        args.distinct, args.gen)
    kv = args.kv_mib << 20
    results = [flock(folder, w, "Flock fcfs, no disk tier", args, kv_cache_memory_bytes=kv),
               flock(folder, w, "Flock fcfs, disk tier", args, kv_cache_memory_bytes=kv, kv_cache_disk_dir=str(disk)),
               flock(folder, w, "Flock batchllm, no disk tier", args, scheduler="batchllm", kv_cache_memory_bytes=kv)]
    if python is not None:
        results += vllm.run_batch(folder, [w], True, python, warmup=warmup_prompts(args.seed, args.prefix),
                                  out=args.out, timeout=args.vllm_timeout, kv_bytes=kv)
    return results


def table(results: list[Result], same_as: Result) -> str:
    base = next((r for r in results if r.engine.startswith("vLLM") and not r.error), None)
    cells = []
    for r in results:
        if r.error:
            cells.append([r.engine, "-", "-", "-", "-", r.error])
            continue
        disk = f"{r.extra.get('disk_read_blocks', 0)} / {r.extra.get('disk_saved_blocks', 0)}" \
            if r.engine.startswith("Flock") else "-"
        same = sum(a == b for a, b in zip(r.outputs, same_as.outputs)) \
            if len(r.outputs) == len(same_as.outputs) and r.engine != FIRST_JOB else None
        cells.append([r.engine, f"{r.wall_s:.2f}", f"{r.extra.get('computed_prefill_tokens', 0):,}", disk,
                      f"{base.wall_s / r.wall_s:.2f}x" if base else "-",
                      "-" if same is None else f"{same}/{len(r.outputs)}"])
    head = ["condition", "wall s", "computed prompt tokens", "blocks read / written (disk)", "speed vs vLLM",
            f"outputs as {same_as.engine}'s"]
    return markdown_table(head, cells, align="l" + "r" * (len(head) - 1))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_disk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flock/smollm2", help="a Hugging Face folder or a built-in")
    ap.add_argument("--sections", default="next-job,kv-pressure")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=1500)
    ap.add_argument("--distinct", type=int, default=50)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--kv-mib", type=int, default=128, help="KV cache of the kv-pressure section")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--disk", type=Path, default=None, help="the tier's folder, a subfolder per section, each "
                    "empty at its start (default: a new temporary one, removed after)")
    ap.add_argument("--output", type=Path, default=OUT / "kv_disk.json")
    vllm.add_arguments(ap)
    args = ap.parse_args()
    args.out, args.vllm_venv = args.out.resolve(), args.vllm_venv.resolve()
    python = None if args.skip_vllm else vllm.existing_python(args.vllm_venv)
    folder = hf_folder(args.model, args.out)
    print(machine.header("kv_disk"), flush=True)
    report = {}
    for section in args.sections.split(","):
        disk = args.disk / section if args.disk else Path(tempfile.mkdtemp(prefix="flock-kv-disk-"))
        if disk.exists() and any(disk.iterdir()):
            ap.error(f"--disk: {disk} is not empty (another run's blocks would be read as this one's)")
        print(f"\n## {section}: {folder.name}, {args.groups} documents of {args.prefix} tokens x {args.per_group} "
              f"questions of {args.distinct}, {args.gen} out; {BLOCK}-token blocks; disk tier in {disk}; before: "
              f"{machine.load_note(0)}", flush=True)
        try:
            results = (next_job if section == "next-job" else kv_pressure)(folder, python, args, disk)
        finally:
            if args.disk is None:
                shutil.rmtree(disk, ignore_errors=True)
        print(table(results, results[0]), flush=True)
        report[section] = [asdict(r) | {"outputs": None} for r in results]
    path = write_json(args.output, {"cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(),
                                    "args": args_dict(args), "sections": report}, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
