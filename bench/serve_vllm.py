"""`flock serve` vs `vllm serve`, measured by vLLM's own serving client (`vllm bench serve`), side by side.

    python -m bench.serve_vllm --vllm-venv V                                    # flock/smollm2, 1 run each
    python -m bench.serve_vllm --runs 2 --servers flock --flock-args "--max-num-batched-tokens 4096"

Each server is started fresh for every run (a warm prefix cache from an earlier run would double its numbers),
waited for (/health), measured with the client and stopped. The client runs under vLLM's python, unchanged:
`--backend openai-chat --endpoint /v1/chat/completions --dataset-name prefix_repetition` with NUM_PREFIXES
prefixes of PREFIX_LEN random tokens, each followed by SUFFIX_LEN random tokens, OUTPUT_LEN tokens out
(`--ignore-eos`), NUM_PROMPTS requests sent at once (`--request-rate inf`). Client and server share the CPUs.
vLLM runs as `python -m vllm.entrypoints.openai.api_server --dtype bfloat16 --max-model-len 2048
--enable-prefix-caching` with the environment in shared/notes/peers.md (tcmalloc preloaded if installed).
Results: a markdown table (req/s, TTFT and TPOT mean / p99, ratios to vLLM's mean over its runs) and
bench/out/serve_vllm.json. Needs an existing vLLM venv (shared/notes/peers.md; bench/engine_speed.py
creates one).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

from bench.harness import machine, vllm
from bench.harness.offline import hf_folder
from bench.harness.report import OUT, markdown_table

METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def client_args(url: str, args: argparse.Namespace) -> list[str]:
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", args.model, "--tokenizer", args.model, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", "inf", "--seed", str(args.seed),
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm"]


def run_client(server, args: argparse.Namespace) -> dict:
    """vLLM's client against `server`; its results, plus the CPU seconds of the server (its process tree),
    of the client (start-up included) and the share of the machine that other processes took meanwhile."""
    server0, own0 = machine.tree_cpu_seconds(server.proc.pid), os.times()
    with machine.OthersCPU(server.proc.pid) as others:
        data = vllm.run_serve_client(args.vllm_python, client_args(server.url, args), args.client_timeout)
    data["server_cpu_s"] = machine.tree_cpu_seconds(server.proc.pid) - server0
    data["client_cpu_s"] = sum(os.times()[:4]) - sum(own0[:4])
    data["others_cpu"] = others.fraction
    return data


def measure(name: str, run: int, args: argparse.Namespace) -> dict:
    load, gflops = machine.load_note(args.wait_quiet), machine.matmul_peak()
    t0 = time.perf_counter()
    server = vllm.start_server(name, args)
    ready_s = time.perf_counter() - t0
    try:
        data = run_client(server, args)
        if name == "flock":
            data["server_health"] = httpx.get(f"{server.url}/health", timeout=10).json()
    finally:
        server.stop()
    data |= {"server": name, "run": run, "ready_s": ready_s, "load": load, "matmul_gflops": gflops}
    print(f"{name} run {run}: {data['completed']}/{args.num_prompts} ok, {data['request_throughput']:.2f} req/s, "
          f"TTFT {data['mean_ttft_ms']:.0f} ms, TPOT {data['mean_tpot_ms']:.0f} ms (ready after {ready_s:.0f} s; "
          f"CPU s: server {data['server_cpu_s']:.0f}, client {data['client_cpu_s']:.0f} (start-up included), "
          f"others {data['others_cpu']:.0%} of the machine; before: {load}, bf16 matmul {gflops:.0f} GFLOP/s)",
          flush=True)
    if name == "flock":
        print("  " + engine_note(data), flush=True)
    return data


def engine_note(data: dict) -> str:
    """Where Flock's online time went: its engine's steps against the client's measured duration."""
    h = data["server_health"]
    return (f"engine ({h['attention']} attention): {h['steps']} steps, "
            f"{h['step_tokens'] / max(h['steps'], 1):.0f} tokens per step, model {h['model_seconds']:.1f} s + "
            f"scheduling and outputs {h['busy_seconds'] - h['model_seconds']:.1f} s = busy {h['busy_seconds']:.1f} s "
            f"of the client's {data['duration']:.1f} s")


def table(rows: list[dict], args: argparse.Namespace) -> str:
    vllm_rows = [r for r in rows if r["server"] == "vllm"]
    ref = {m: sum(r[m] for r in vllm_rows) / len(vllm_rows) for m in METRICS} if vllm_rows else None
    head = ["server", "run", "ok", "req/s", "vs vLLM", "TTFT mean / p99 ms", "TPOT mean / p99 ms",
            "TTFT vs vLLM", "TPOT vs vLLM", "ready s", "others' CPU", "bf16 GFLOP/s"]
    ratio = lambda r, m, unit="": f"{r[m] / ref[m]:.2f}{unit}" if ref else "-"
    cells = []
    for r in rows:
        name = f"flock ({r['server_health']['attention']})" if r["server"] == "flock" else "vllm"
        cells.append([name, r["run"], f"{r['completed']}/{args.num_prompts}", f"{r['request_throughput']:.2f}",
                      ratio(r, "request_throughput", "x"), f"{r['mean_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f}",
                      f"{r['mean_tpot_ms']:,.0f} / {r['p99_tpot_ms']:,.0f}", ratio(r, "mean_ttft_ms"),
                      ratio(r, "mean_tpot_ms"), f"{r['ready_s']:.0f}", f"{r['others_cpu']:.0%}",
                      f"{r['matmul_gflops']:.0f}"])
    title = (f"{machine.cpu_model()}, {os.cpu_count()} CPUs; {args.model}; {args.num_prefixes} prefixes x "
             f"({args.prefix_len} + {args.suffix_len}) tokens, {args.output_len} out, {args.num_prompts} prompts "
             f"at once; flock serve {args.flock_args}")
    return title + "\n" + markdown_table(head, cells, align="ll" + "r" * (len(head) - 2))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm.add_server_arguments(ap, "--dtype bfloat16")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--output", type=Path, default=OUT / "serve_vllm.json")
    args = ap.parse_args()
    args.vllm_python = vllm.existing_python(args.vllm_venv.resolve())
    args.model = str(hf_folder(args.model, OUT))

    print(machine.header("serve_vllm"), flush=True)
    rows = [measure(name, run, args) for run in range(1, args.runs + 1) for name in args.servers]
    print(table(rows, args))
    vllm.write_runs(args, rows)
    return 0 if all(r["completed"] == args.num_prompts for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
