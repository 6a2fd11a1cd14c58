"""Label scoring online: `flock serve` vs `vllm serve` on vLLM's /generative_scoring, side by side.

    python -m bench.generative_scoring --vllm-venv V          # flock/smollm2, 1 fresh server of each
    python -m bench.generative_scoring --runs 2 --queries 2 --items 32

A classification job as pipelines send it: QUERIES tasks, each a chat prompt of an instruction and FEW_SHOT
labelled examples (real text: standard-library reference documents) that ends where the next passage goes; each
task's ITEMS passages (one document each, then the question and the assistant turn's start) are scored for the
labels "Yes" and "No", PER_REQUEST items a request, every request sent at once. Both servers get the same token
ids (query and items as id lists, so both join them alike) and are started fresh for every run (a warm prefix
cache would flatter the second); a small request with another query warms each up first. Reported: the wall
time from the first request to the last answer, items/s and its ratio to vLLM's, and how the two servers'
scores agree (largest difference, the same label preferred). vLLM runs as bench/serve_vllm.py runs it.
Results: a markdown table and bench/out/generative_scoring.json.
"""

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx

from bench.harness import machine, vllm
from bench.harness.documents import documents
from bench.harness.offline import hf_folder
from bench.harness.report import OUT, markdown_table
from flock.tokenizer import load_tokenizer

QUESTION = "Does this passage describe how to call a function or class, with its arguments? Answer Yes or No."
LABELS = ("Yes", "No")
HOLE = "\x00"  # where each item goes in the chat


def workload(tokenizer, args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """(query ids, item ids) per task: the query is the chat up to the passage (the system turn with FEW_SHOT
    answered examples, the user turn's start); an item is the passage, the question and the assistant turn's
    start (the model's chat template), so the label is the answer's first token."""
    docs = [text for _, text in documents(seed=args.seed, min_chars=300, max_chars=900)]
    rng = random.Random(args.seed)
    tasks, used = [], 0
    for t in range(args.queries):
        shots = docs[used : used + args.few_shot]
        used += args.few_shot
        examples = "\n\n".join(f"Passage: {d}\n{QUESTION}\n{rng.choice(LABELS)}" for d in shots)
        messages = [{"role": "system", "content": f"Task {t + 1}. You label documentation passages.\n\n{examples}"},
                    {"role": "user", "content": f"Passage: {HOLE}\n{QUESTION}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(HOLE)
        query = tokenizer.encode(before, add_special_tokens=False)
        items = [tokenizer.encode(d + after, add_special_tokens=False) for d in docs[used : used + args.items]]
        used += args.items
        tasks.append((query, items))
    return tasks


def label_ids(tokenizer) -> list[int]:
    return [tokenizer.encode(word, add_special_tokens=False)[0] for word in LABELS]


async def score_all(url: str, tasks, labels: list[int], per_request: int, model: str) -> tuple[float, list]:
    """Every task's items in requests of `per_request`, all sent at once: (seconds, each item's P(Yes) over the
    labels: above 0.5 where Yes is the preferred label; both servers answer with the first label's score)."""
    bodies = [{"model": model, "query": query, "items": items[i : i + per_request], "label_token_ids": labels,
               "apply_softmax": True} for query, items in tasks for i in range(0, len(items), per_request)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(http.post("/generative_scoring", json=b) for b in bodies))
        seconds = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    return seconds, [d["score"] for r in replies for d in r.json()["data"]]


def measure(name: str, run: int, tasks, labels: list[int], args: argparse.Namespace) -> dict:
    load, gflops = machine.load_note(args.wait_quiet), machine.matmul_peak()
    server = vllm.start_server(name, args)
    try:
        warm_query = tasks[0][0][::-1]  # not a prefix of any task's query
        asyncio.run(score_all(server.url, [(warm_query, tasks[0][1][:2])], labels, 2, args.model))
        seconds, yes = asyncio.run(score_all(server.url, tasks, labels, args.per_request, args.model))
        health = httpx.get(f"{server.url}/health", timeout=10).json() if name == "flock" else {}
    finally:
        server.stop()
    items = sum(len(i) for _, i in tasks)
    row = {"server": name, "run": run, "seconds": seconds, "items": items, "items_per_s": items / seconds,
           "yes": yes, "load": load, "matmul_gflops": gflops, "attention": health.get("attention", "")}
    print(f"{name} run {run}: {items} items in {seconds:.2f} s ({items / seconds:.1f} items/s; before: {load}, "
          f"bf16 matmul {gflops:.0f} GFLOP/s)", flush=True)
    return row


def table(rows: list[dict], tasks, args: argparse.Namespace) -> str:
    ref = [r for r in rows if r["server"] == "vllm"]
    base = sum(r["items_per_s"] for r in ref) / len(ref) if ref else None
    cells = []
    for r in rows:
        agree = ""
        if ref and r["server"] != "vllm":
            diffs = [abs(a - b) for a, b in zip(r["yes"], ref[0]["yes"])]
            both = [(a, b) for a, b in zip(r["yes"], ref[0]["yes"])]
            agree = f"{max(diffs):.3f} / {sum(diffs) / len(diffs):.4f}"
            agree += f"; same top label {sum((a > 0.5) == (b > 0.5) for a, b in both) / len(both):.0%}"
        name = f"flock ({r['attention']})" if r["server"] == "flock" else "vllm"
        cells.append([name, r["run"], r["items"], f"{r['seconds']:.2f}", f"{r['items_per_s']:.1f}",
                      f"{r['items_per_s'] / base:.2f}x" if base else "-", agree or "-", f"{r['matmul_gflops']:.0f}"])
    query = sum(len(q) for q, _ in tasks) / len(tasks)
    item = sum(len(i) for _, items in tasks for i in items) / sum(len(items) for _, items in tasks)
    title = (f"{machine.cpu_model()}, {os.cpu_count()} CPUs; {args.model}; {len(tasks)} queries of {query:.0f} "
             f"tokens x {args.items} items of {item:.0f} tokens, {args.per_request} items a request, all at once; "
             f"flock serve {args.flock_args}")
    head = ["server", "run", "items", "seconds", "items/s", "vs vLLM", "P(Yes) diff max / mean vs vLLM",
            "bf16 GFLOP/s"]
    return title + "\n" + markdown_table(head, cells, align="ll" + "r" * (len(head) - 2))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.generative_scoring", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm.add_server_arguments(ap, "--dtype bfloat16 --max-model-len 2048")
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--few-shot", type=int, default=6)
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--per-request", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", type=Path, default=OUT / "generative_scoring.json")
    args = ap.parse_args()
    if "vllm" in args.servers:
        args.vllm_python = vllm.existing_python(args.vllm_venv.resolve())
    args.model = str(hf_folder(args.model, OUT))
    tokenizer = load_tokenizer(args.model)
    tasks, labels = workload(tokenizer, args), label_ids(tokenizer)

    print(machine.header("generative_scoring"), flush=True)
    rows = [measure(name, run, tasks, labels, args) for run in range(1, args.runs + 1) for name in args.servers]
    print(table(rows, tasks, args))
    vllm.write_runs(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
