"""lm-evaluation-harness against `vllm serve` and `flock serve` (float32, the same HF folder): two local tasks
built at run time from text every machine has offline, each task's score on both servers, and how far their
loglikelihoods differ, choice by choice, in the logged samples.

    python -m bench.lm_eval_compare --vllm-venv V --lm-eval-venv E --model /work/models/smollm2-f32
    python -m bench.lm_eval_compare --lm-eval-venv E --servers flock --mc-items 20 --gen-items 8    # a smoke run

Tasks (YAML + JSONL in a temporary folder, `dataset_path: json`, passed with `--include_path`):
- docstring_next (multiple_choice, acc / acc_norm): a few sentences of a standard-library docstring, then its
  true next sentence among 4 (the 3 others from other docstrings);
- zen_complete (generate_until, exact_match): the first half of a Zen of Python line (after the lines before
  it) or of a standard-library function's first docstring line; greedy until a newline.
Each task runs as `lm_eval --model local-completions ... tokenized_requests=True --log_samples` (lm-eval's venv,
--lm-eval-venv, needs `lm-eval[api]` and transformers) against each server started fresh. The bar for the
loglikelihoods: within 0.05 of vLLM's, every choice. Results: bench/out/lm_eval_compare.json.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import float32_servers as servers
from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.stdlib_text import member_docs, module_docs, sentences, zen_lines

BAR = 0.05
MC_TASK, GEN_TASK = "docstring_next", "zen_complete"
MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
"""


# -- the tasks' data -------------------------------------------------------------------------------------------
def mc_items(n: int, rng: random.Random) -> list[dict]:
    """n items: up to 2 sentences of a docstring, its next sentence and 3 from other docstrings, shuffled."""
    docs = [sentences(doc) for _, doc in module_docs() + member_docs()]
    docs = [d for d in docs if d]
    spots = [(i, j) for i, d in enumerate(docs) for j in range(1, len(d))]
    items = []
    for i, j in rng.sample(spots, min(n, len(spots))):
        others = [rng.choice(docs[k]) for k in rng.sample([k for k in range(len(docs)) if k != i], 3)]
        choices = [docs[i][j], *others]
        rng.shuffle(choices)
        items.append({"context": " ".join(docs[i][max(0, j - 2):j]), "choices": choices,
                      "label": choices.index(docs[i][j])})
    return items


def gen_items(n: int, rng: random.Random) -> list[dict]:
    """The Zen of Python's lines cut in half (after the lines before them), then first docstring lines."""
    zen, items = zen_lines(), []
    for i, line in enumerate(zen):
        words = line.split()
        head = " ".join(words[:len(words) // 2])
        prompt = "The Zen of Python, by Tim Peters\n\n" + "".join(f"{x}\n" for x in zen[:i]) + head
        items.append({"prompt": prompt, "answer": line[len(head):].strip()})
    firsts = [(name, doc.splitlines()[0]) for name, doc in member_docs()]
    firsts = [(name, f) for name, f in firsts if 6 <= len(f.split()) <= 14 and f.endswith(".")]
    for name, first in rng.sample(firsts, min(len(firsts), max(0, n - len(items)))):
        words = first.split()
        head = " ".join(words[:len(words) // 2])
        items.append({"prompt": f"{name}: {head}", "answer": first[len(head):].strip()})
    return items[:n]


def write_tasks(folder: Path, args) -> dict[str, int]:
    rng = random.Random(args.seed)
    counts = {}
    for task, yaml, items in ((MC_TASK, MC_YAML, mc_items(args.mc_items, rng)),
                              (GEN_TASK, GEN_YAML, gen_items(args.gen_items, rng))):
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(x) + "\n" for x in items))
        (folder / f"{task}.yaml").write_text(yaml.format(task=task, data=data))
        counts[task] = len(items)
    return counts


# -- running lm-eval -------------------------------------------------------------------------------------------
def run_lm_eval(url: str, task: str, folder: Path, out: Path, args) -> dict:
    """One task through lm-eval against `url`: its metrics and logged samples, or the error it stopped with."""
    model_args = (f"model={servers.NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={args.model},num_concurrent={args.concurrency},tokenized_requests=True,max_retries=1")
    cmd = [str(args.lm_eval_venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
           "--tasks", task, "--include_path", str(folder), "--log_samples", "--output_path", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_DATASETS_OFFLINE": "1",
                                                                          "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.task_timeout)
    wall_s = time.perf_counter() - t0
    results = sorted(out.rglob("results_*.json"))
    log = args.log_dir / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode or not results:
        return {"error": f"lm_eval exited with {proc.returncode}: {why(proc.stdout + proc.stderr)} "
                         f"(log: {log})", "wall_s": wall_s}
    metrics = json.loads(results[-1].read_text())["results"][task]
    samples_file = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1]
    samples = sorted((json.loads(line) for line in samples_file.open()), key=lambda s: s["doc_id"])
    return {"metrics": {k.removesuffix(",none"): v for k, v in metrics.items() if k.endswith(",none")},
            "resps": [s["resps"] for s in samples], "wall_s": wall_s}


def why(log: str) -> str:
    """The line of lm-eval's log that says why it stopped: the server's HTTP error where there is one."""
    if m := re.search(r"Status code: (\d+), Response text: (.{0,300})", log):
        return f"HTTP {m[1]}: {m[2].removesuffix('. Retrying...')}"
    lines = log.strip().splitlines() or [""]
    return next((x for x in lines if re.search(r"Error:|Exception:", x)), lines[-1]).strip()[-300:]


def measure(name: str, folder: Path, args) -> dict:
    t0 = time.perf_counter()
    server = servers.start(name, args)
    ready_s = time.perf_counter() - t0
    try:
        runs = {task: run_lm_eval(server.url, task, folder, folder / f"out-{name}-{task}", args)
                for task in (MC_TASK, GEN_TASK)}
    finally:
        server.stop()
    for task, r in runs.items():
        print(f"{name} {task}: {r.get('metrics') or r['error']} ({r['wall_s']:.0f} s)", flush=True)
    return {"ready_s": ready_s, "tasks": runs}


# -- comparison ------------------------------------------------------------------------------------------------
def score_rows(results: dict) -> tuple[list, list]:
    head = ["task", "metric", *results]
    rows = []
    for task, metrics in ((MC_TASK, ("acc", "acc_norm")), (GEN_TASK, ("exact_match",))):
        for m in metrics:
            cells = []
            for res in results.values():
                r = res["tasks"][task]
                cells.append(r["error"][:80] if "error" in r else f"{r['metrics'][m]:.3f}")
            rows.append([task, m, *cells])
    return head, rows


def loglikelihood_diffs(a: dict, b: dict) -> dict:
    """Per choice |loglikelihood diff| between two servers' logged samples of the multiple-choice task."""
    diffs, same_pick = [], 0
    for ra, rb in zip(a["resps"], b["resps"]):
        la, lb = [float(c[0][0]) for c in ra], [float(c[0][0]) for c in rb]  # lm-eval logs them as strings
        diffs += [abs(x - y) for x, y in zip(la, lb)]
        same_pick += la.index(max(la)) == lb.index(max(lb))
    return {"choices": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "over_bar": sum(d > BAR for d in diffs), "same_pick": same_pick, "items": len(a["resps"])}


def compare(results: dict) -> str:
    if len(results) < 2:
        return "(one server: nothing to compare)"
    (na, ra), (nb, rb) = results.items()
    lines = []
    mc_a, mc_b = ra["tasks"][MC_TASK], rb["tasks"][MC_TASK]
    if "error" in mc_a or "error" in mc_b:
        lines.append(f"{MC_TASK}: no comparison ({mc_a.get('error') or mc_b.get('error')})")
    else:
        d = loglikelihood_diffs(mc_a, mc_b)
        verdict = "PASS" if not d["over_bar"] else "FAIL"
        lines.append(f"{MC_TASK}: {d['choices']} choices, max |loglikelihood diff| {d['max_abs_diff']:.2e}, mean "
                     f"{d['mean_abs_diff']:.2e}, {d['over_bar']} over {BAR} ({verdict}); "
                     f"same pick on {d['same_pick']}/{d['items']} items")
    gen_a, gen_b = ra["tasks"][GEN_TASK], rb["tasks"][GEN_TASK]
    if "error" in gen_a or "error" in gen_b:
        lines.append(f"{GEN_TASK}: no comparison ({gen_a.get('error') or gen_b.get('error')})")
    else:
        same = sum(x == y for x, y in zip(gen_a["resps"], gen_b["resps"]))
        lines.append(f"{GEN_TASK}: identical generations on {same}/{len(gen_a['resps'])} items ({na} vs {nb})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lm_eval_compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_args(ap)
    ap.add_argument("--lm-eval-venv", type=Path, required=True, help="a venv with lm-eval[api] and transformers")
    ap.add_argument("--mc-items", type=int, default=100)
    ap.add_argument("--gen-items", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=2, help="lm-eval's num_concurrent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-timeout", type=float, default=1800)
    ap.add_argument("--output", type=Path, default=OUT / "lm_eval_compare.json")
    args = ap.parse_args()
    servers.resolve(args)
    args.lm_eval_venv = args.lm_eval_venv.resolve()
    args.log_dir = args.output.with_suffix("")  # lm-eval's logs, one per server and task

    print(machine.header("lm_eval_compare", dtype=torch.float32), flush=True)
    with tempfile.TemporaryDirectory(prefix="lm-eval-tasks-") as tmp:
        folder = Path(tmp)
        counts = write_tasks(folder, args)
        print(f"# {args.model}; tasks {counts}", flush=True)
        results = {name: measure(name, folder, args) for name in args.servers}
    path = write_json(args.output, {"cpu": machine.cpu_model(), "kernel_paths": machine.kernel_paths(torch.float32),
                                    "args": args_dict(args), "tasks": counts, "results": results})
    print("\n" + markdown_table(*score_rows(results)))
    print(compare(results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
