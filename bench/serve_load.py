"""Closed-loop load on `flock serve`: C concurrent clients, each sending its next request when the last ends.

    python -m bench.serve_load                                  # flock/tiny, C = 1 4 16 64, 10 s each
    python -m bench.serve_load --concurrency 1 8 --duration 5 --max-tokens 16 --mode whole
    python -m bench.serve_load --model /path/to/hf-folder --server-args "--dtype bfloat16 --num-kv-blocks 8192"

The server runs in a child process (`python -m flock.api.server`, loopback, free port); this process is the
client (httpx, one asyncio loop). Requests are chat completions: one of --systems shared system prompts plus
a distinct question; greedy, ignore_eos, --max-tokens new tokens each, streamed with include_usage (TTFT is
the time to the first content chunk) unless --mode whole. Per concurrency level: requests/s and output
tokens/s over the level's wall time (issuing stops at --duration; in-flight requests finish), latency and
TTFT p50/p99, errors; afterwards /health must show nothing leaked (0 running, 0 waiting, 0 active streams,
KV blocks used back to the baseline). `others CPU` is the share of all CPUs that processes other than this
one and the server took during the level (the machine may be shared).
Results: a table on stdout and bench/out/serve_load.json.
"""

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.harness import machine
from bench.harness.report import OUT, args_dict, markdown_table, write_json
from bench.harness.server_process import ServerProcess

WORDS = ("cache block prefix token batch request stream engine kernel page memory tree hash queue step "
         "decode prefill schedule share group latency budget model layer head query value key").split()


@dataclass
class Level:
    concurrency: int
    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    others_cpu: float = 0.0
    health_after: dict = field(default_factory=dict)
    leak_free: bool = False

    def summary(self) -> dict:
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
        return {"concurrency": self.concurrency, "requests": self.requests, "errors": self.errors,
                "wall_s": self.wall_s, "requests_per_s": self.requests / self.wall_s,
                "output_tokens_per_s": self.output_tokens / self.wall_s,
                "latency_p50_s": pct(self.latencies, 50), "latency_p99_s": pct(self.latencies, 99),
                "ttft_p50_s": pct(self.ttfts, 50), "ttft_p99_s": pct(self.ttfts, 99),
                "others_cpu": self.others_cpu, "leak_free": self.leak_free, "health_after": self.health_after}


def make_prompts(n_systems: int, seed: int) -> tuple[list[str], random.Random]:
    rng = random.Random(seed)
    systems = []
    for i in range(n_systems):
        rules = " ".join(f"Rule {j}: always {' '.join(rng.choices(WORDS, k=8))}." for j in range(12))
        systems.append(f"You are assistant number {i}. Follow these rules. {rules}")
    return systems, rng


def question(rng: random.Random, i: int) -> str:
    return f"Question {i}: how does the {' '.join(rng.choices(WORDS, k=6))} work?"


async def one_request(http: httpx.AsyncClient, body: dict, stream: bool) -> tuple[float, float | None, int]:
    """(latency, time to first content or None, output tokens) of one chat completion."""
    t0 = time.perf_counter()
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0, None, r.json()["usage"]["completion_tokens"]
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True,
                                                                        "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - t0, ttft, tokens


async def run_level(url: str, args, systems: list[str], rng: random.Random, concurrency: int) -> Level:
    level = Level(concurrency)
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client(http: httpx.AsyncClient, deadline: float) -> None:
        while time.perf_counter() < deadline:
            i = next(counter)
            messages = [{"role": "system", "content": systems[i % len(systems)]},
                        {"role": "user", "content": question(rng, i)}]
            body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                latency, ttft, tokens = await one_request(http, body, args.mode == "stream")
            except (httpx.HTTPError, RuntimeError, KeyError) as e:
                level.errors += 1
                print(f"  error: {e!r:.200}", file=sys.stderr)
                continue
            level.requests += 1
            level.output_tokens += tokens
            level.latencies.append(latency)
            if ttft is not None:
                level.ttfts.append(ttft)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, start + args.duration) for _ in range(concurrency)))
        level.wall_s = time.perf_counter() - start
    return level


async def warm_up(url: str, args, systems: list[str]) -> None:
    """One request per system prompt: the first steps are slow, and a server in use has its prefixes cached."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i, system in enumerate(systems):
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Warm-up {i}"}],
                    "max_tokens": 2, "temperature": 0}
            await one_request(http, body, stream=False)


def wait_drained(url: str, baseline_kv: int, timeout: float = 30.0) -> tuple[dict, bool]:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=10).json()
        ok = h["num_running"] == h["num_waiting"] == h["num_active"] == 0 and h["kv_blocks_used"] == baseline_kv
        if ok or time.monotonic() > deadline:
            return h, ok
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flock/tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of issuing requests per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--systems", type=int, default=4, help="shared system prompts")
    ap.add_argument("--mode", choices=["stream", "whole"], default="stream")
    ap.add_argument("--server-args", default="--num-kv-blocks 4096", help="extra `flock serve` options")
    ap.add_argument("--torch-threads", type=int, help="OMP_NUM_THREADS of the server (default: torch's)")
    ap.add_argument("--url", help="use a running server instead of starting one (no CPU accounting)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=OUT / "serve_load.json")
    args = ap.parse_args()

    print(machine.header("serve_load"), flush=True)
    systems, rng = make_prompts(args.systems, args.seed)
    env = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else None
    server = None if args.url else ServerProcess("--model", args.model, *shlex.split(args.server_args), env=env)
    try:
        url = args.url or server.start().url
        pid = server.proc.pid if server else None
        asyncio.run(warm_up(url, args, systems))
        health = wait_drained(url, 0, timeout=5)[0]
        baseline_kv = health["kv_blocks_used"]
        print(f"# server attention: {health.get('attention', '?')}", flush=True)
        levels = []
        for c in args.concurrency:
            with machine.OthersCPU(*([pid] if pid else [])) as others:
                level = asyncio.run(run_level(url, args, systems, rng, c))
            level.others_cpu = others.fraction
            level.health_after, level.leak_free = wait_drained(url, baseline_kv)
            levels.append(level)
            print(f"  C={c}: {level.requests} requests, {level.errors} errors, leak-free: {level.leak_free}",
                  file=sys.stderr)
        final_health = httpx.get(f"{url}/health", timeout=10).json()
    finally:
        rc = server.stop() if server else None
    summaries = [lv.summary() for lv in levels]
    print(table(summaries, args))
    print(f"prefix saving rate over the run (server-wide): {final_health['saving_rate']:.1%}")
    write_json(args.output, {"args": args_dict(args), "cpu": machine.cpu_model(), "cpus": os.cpu_count(),
                             "kernel_paths": machine.kernel_paths(), "server_exit_code": rc,
                             "final_health": final_health, "levels": summaries}, indent=2)
    print(f"wrote {args.output}")
    return 0 if all(s["leak_free"] and not s["errors"] for s in summaries) else 1


def table(rows: list[dict], args) -> str:
    head = ["C", "requests", "req/s", "out tok/s", "lat p50 ms", "lat p99 ms", "TTFT p50 ms", "TTFT p99 ms",
            "errors", "others CPU", "leak-free"]
    ms = lambda x: "-" if math.isnan(x) else f"{x * 1e3:.0f}"
    cells = [[r["concurrency"], r["requests"], f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.0f}",
              ms(r["latency_p50_s"]), ms(r["latency_p99_s"]), ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]),
              r["errors"], f"{r['others_cpu']:.0%}", "yes" if r["leak_free"] else "NO"] for r in rows]
    return (f"{args.model}, {args.mode}, {args.max_tokens} new tokens, {args.duration:g} s per level, "
            f"{args.systems} shared system prompts\n" + markdown_table(head, cells, align="l" * len(head)))


if __name__ == "__main__":
    sys.exit(main())
