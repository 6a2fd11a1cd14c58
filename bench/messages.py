"""Anthropic's Messages API online: `flock serve` vs `vllm serve` on /v1/messages, side by side, driven as an agent
client (Claude Code and its kin pointed at a local server) drives it.

    python -m bench.messages --vllm-venv V          # flock/smollm2, 1 fresh server of each
    python -m bench.messages --runs 2 --sessions 8 --turns 4

SESSIONS conversations run at once, each TURNS turns one after another (a turn waits for the previous answer),
through the anthropic client, streamed. Every request carries the same long system prompt (an instruction and
SYSTEM_DOCS reference documents: real text, standard-library documentation) and its session's conversation so far
(the first user turn a document of its own and a question, later turns follow-up questions, the server's own
answers in between), so each turn's prompt extends the one before. Greedy (temperature 0), at most MAX_TOKENS
tokens a turn. Reported: the wall time, turns/s and output tokens/s and their ratio to vLLM's, the mean time to a
turn's first text and per token after it, and how many first-turn answers both servers gave alike (whole, and in
their first FIRST_WORDS words). Both servers
start fresh every run (a small request with another system prompt warms each up); vLLM runs as bench/serve_vllm.py
runs it. Results: a markdown table and bench/out/messages.json.
"""

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import anthropic
import httpx

from bench.harness import machine, vllm
from bench.harness.documents import documents
from bench.harness.offline import hf_folder
from bench.harness.report import OUT, markdown_table

INSTRUCTION = ("You are a careful assistant for a team of Python programmers. Answer from the reference below and "
               "from the files the user shows you; be brief and concrete, and say so when the reference does not "
               "cover a question.\n\nReference:")
FIRST_WORDS = 10  # bf16 roundings part greedy answers sooner or later: how far they agree
QUESTIONS = ("What does this file describe? Answer in two sentences.",
             "Which function or class would I use first, and with which arguments?",
             "What can go wrong when I use it?",
             "Summarize our conversation in one sentence.")


def workload(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The shared system prompt, and each session's first user turn."""
    docs = [f"## {title}\n{text}" for title, text in documents(seed=args.seed, min_chars=500, max_chars=1100)]
    system = INSTRUCTION + "\n\n" + "\n\n".join(docs[: args.system_docs])
    files = docs[args.system_docs : args.system_docs + args.sessions]
    return system, [f"Here is a file:\n\n{d}\n\n{QUESTIONS[0]}" for d in files]


async def session(client, model: str, system: str, first: str, args: argparse.Namespace) -> list[dict]:
    """One conversation's turns, each streamed: its timings, token counts and answer."""
    messages, turns = [], []
    for t in range(args.turns):
        messages.append({"role": "user", "content": first if t == 0 else QUESTIONS[t % len(QUESTIONS)]})
        start, first_text = time.perf_counter(), None
        async with client.messages.stream(model=model, max_tokens=args.max_tokens, system=system, messages=messages,
                                          extra_body={"temperature": 0}) as stream:
            async for text in stream.text_stream:
                first_text = first_text or (time.perf_counter() if text else None)
            message = await stream.get_final_message()
        end = time.perf_counter()
        answer = "".join(b.text for b in message.content if b.type == "text")
        messages.append({"role": "assistant", "content": answer or "..."})
        out = message.usage.output_tokens
        ttft = (first_text or end) - start
        turns.append({"ttft": ttft, "tpot": (end - start - ttft) / max(out - 1, 1), "output_tokens": out,
                      "input_tokens": message.usage.input_tokens, "answer": answer})
    return turns


async def run_sessions(url: str, model: str, system: str, firsts: list[str], args: argparse.Namespace
                       ) -> tuple[float, list[list[dict]]]:
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
        t0 = time.perf_counter()
        sessions = await asyncio.gather(*(session(client, model, system, f, args) for f in firsts))
        return time.perf_counter() - t0, sessions


def measure(name: str, run: int, system: str, firsts: list[str], args: argparse.Namespace) -> dict:
    load, gflops = machine.load_note(args.wait_quiet), machine.matmul_peak()
    server = vllm.start_server(name, args)
    try:
        warm = argparse.Namespace(**vars(args) | {"turns": 1, "max_tokens": 4})
        asyncio.run(run_sessions(server.url, args.model, "Warm up.", firsts[:1], warm))
        seconds, sessions = asyncio.run(run_sessions(server.url, args.model, system, firsts, args))
        health = httpx.get(f"{server.url}/health", timeout=10).json() if name == "flock" else {}
    finally:
        server.stop()
    turns = [t for s in sessions for t in s]
    out = sum(t["output_tokens"] for t in turns)
    row = {"server": name, "run": run, "seconds": seconds, "turns": len(turns), "output_tokens": out,
           "turns_per_s": len(turns) / seconds, "output_per_s": out / seconds,
           "ttft_s": sum(t["ttft"] for t in turns) / len(turns), "tpot_s": sum(t["tpot"] for t in turns) / len(turns),
           "first_answers": [s[0]["answer"] for s in sessions], "sessions": sessions, "load": load,
           "matmul_gflops": gflops, "attention": health.get("attention", "")}
    print(f"{name} run {run}: {len(turns)} turns, {out} tokens out in {seconds:.2f} s (before: {load}, bf16 matmul "
          f"{gflops:.0f} GFLOP/s)", flush=True)
    return row


def table(rows: list[dict], system: str, args: argparse.Namespace) -> str:
    ref = [r for r in rows if r["server"] == "vllm"]
    base = sum(r["turns_per_s"] for r in ref) / len(ref) if ref else None
    cells = []
    for r in rows:
        same = "-"
        if ref and r["server"] != "vllm":
            pairs = list(zip(r["first_answers"], ref[0]["first_answers"]))
            words = sum(a.split()[:FIRST_WORDS] == b.split()[:FIRST_WORDS] for a, b in pairs)
            same = f"{sum(a == b for a, b in pairs)} / {words} of {len(pairs)}"
        name = f"flock ({r['attention']})" if r["server"] == "flock" else "vllm"
        cells.append([name, r["run"], r["turns"], r["output_tokens"], f"{r['seconds']:.2f}", f"{r['turns_per_s']:.2f}",
                      f"{r['output_per_s']:.1f}", f"{r['turns_per_s'] / base:.2f}x" if base else "-",
                      f"{r['ttft_s']:.2f}", f"{r['tpot_s'] * 1e3:.0f}", same, f"{r['matmul_gflops']:.0f}"])
    title = (f"{machine.cpu_model()}, {os.cpu_count()} CPUs; {args.model}; {args.sessions} sessions x {args.turns} "
             f"turns at once, a system prompt of {len(system)} characters, at most {args.max_tokens} tokens a turn, "
             f"greedy; flock serve {args.flock_args}")
    head = ["server", "run", "turns", "tokens out", "seconds", "turns/s", "tokens/s", "vs vLLM", "TTFT s",
            "TPOT ms", f"first answers as vLLM's: whole / first {FIRST_WORDS} words", "bf16 GFLOP/s"]
    return title + "\n" + markdown_table(head, cells, align="ll" + "r" * (len(head) - 2))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.messages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm.add_server_arguments(ap, "--dtype bfloat16 --max-model-len 4096", "--max-model-len 4096")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-docs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", type=Path, default=OUT / "messages.json")
    args = ap.parse_args()
    if "vllm" in args.servers:
        args.vllm_python = vllm.existing_python(args.vllm_venv.resolve())
    args.model = str(hf_folder(args.model, OUT))
    system, firsts = workload(args)

    print(machine.header("messages"), flush=True)
    rows = [measure(name, run, system, firsts, args) for run in range(1, args.runs + 1) for name in args.servers]
    print(table(rows, system, args))
    vllm.write_runs(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
