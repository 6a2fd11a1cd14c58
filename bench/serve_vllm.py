"""`flock serve` vs `vllm serve`, measured by vLLM's own serving client (`vllm bench serve`), side by side.

    python bench/serve_vllm.py --vllm-venv /work/venvs/vllm                     # SmolLM2, 1 run each
    python bench/serve_vllm.py --runs 2 --servers flock --flock-args "--max-num-batched-tokens 4096"

Each server is started fresh for every run (a warm prefix cache from an earlier run would double its numbers),
waited for (/health), measured with the client and stopped. The client runs under vLLM's python, unchanged:
`--backend openai-chat --endpoint /v1/chat/completions --dataset-name prefix_repetition` with NUM_PREFIXES
prefixes of PREFIX_LEN random tokens, each followed by SUFFIX_LEN random tokens, OUTPUT_LEN tokens out
(`--ignore-eos`), NUM_PROMPTS requests sent at once (`--request-rate inf`). Client and server share the CPUs.
vLLM runs as `python -m vllm.entrypoints.openai.api_server --dtype bfloat16 --max-model-len 2048
--enable-prefix-caching` with the environment in shared/notes/peers.md (tcmalloc preloaded if installed).
Results: a markdown table (req/s, TTFT and TPOT mean / p99, ratios to vLLM's mean over its runs) and
bench/out/serve_vllm.json.
"""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent))  # the repo, when flock is not installed
import engine_speed as es  # noqa: E402

from bench.harness.server_process import ServerProcess, free_port  # noqa: E402
from flock.native import cpu_model  # noqa: E402

OUT = BENCH / "out" / "serve_vllm.json"
METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


class VLLMServer:
    """`vllm serve` in its own process group (it spawns an engine-core process); stop() ends the group."""

    def __init__(self, python: Path, model: str, extra: list[str], ready_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
               "--max-model-len", "2048", "--enable-prefix-caching", "--host", "127.0.0.1",
               "--port", str(self.port), *extra]
        env = os.environ | es.VLLM_ENV | ({"LD_PRELOAD": str(es.TCMALLOC)} if es.TCMALLOC.exists() else {})
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_ready(self.url, self.proc, ready_timeout, self.log.name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}, see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready within {timeout} s, see {log}")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and all its descendants (threads, and children it has reaped, included)."""
    total = 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in stat[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += tree_cpu_seconds(int(child))
    except (OSError, IndexError):  # it ended meanwhile
        pass
    return total


def machine_busy_seconds() -> float:
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def matmul_gflops(seconds: float = 1.0) -> float:
    """This machine's bf16 matmul speed right now (2048-wide, torch's threads): its speed drifts between runs."""
    import torch

    a, b = torch.randn(2, 2048, 2048, dtype=torch.bfloat16)
    a @ b
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 2048**3 * n / (time.perf_counter() - t0) / 1e9


def start_server(name: str, args: argparse.Namespace):
    if name == "flock":
        server = ServerProcess("--model", args.model, *shlex.split(args.flock_args), ready_timeout=args.ready_timeout)
        return server.start()
    return VLLMServer(args.vllm_python, args.model, shlex.split(args.vllm_args), args.ready_timeout)


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
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [str(args.vllm_python), str(BENCH / "_vllm_serve_client.py"), result.name,
               *client_args(server.url, args)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        busy0, server0, own0, t0 = machine_busy_seconds(), tree_cpu_seconds(server.proc.pid), os.times(), time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.client_timeout)
        if proc.returncode:
            raise RuntimeError(f"client exited with {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        data = json.loads(Path(result.name).read_text())
    data["server_cpu_s"] = tree_cpu_seconds(server.proc.pid) - server0
    data["client_cpu_s"] = sum(os.times()[:4]) - sum(own0[:4])
    others = machine_busy_seconds() - busy0 - data["server_cpu_s"] - data["client_cpu_s"]
    data["others_cpu"] = max(0.0, others) / ((time.time() - t0) * (os.cpu_count() or 1))
    return data


def measure(name: str, run: int, args: argparse.Namespace) -> dict:
    load, gflops = es.load_note(args.wait_quiet), matmul_gflops()
    t0 = time.perf_counter()
    server = start_server(name, args)
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
    vllm = [r for r in rows if r["server"] == "vllm"]
    ref = {m: sum(r[m] for r in vllm) / len(vllm) for m in METRICS} if vllm else None
    head = ["server", "run", "ok", "req/s", "vs vLLM", "TTFT mean / p99 ms", "TPOT mean / p99 ms",
            "TTFT vs vLLM", "TPOT vs vLLM", "ready s", "others' CPU", "bf16 GFLOP/s"]
    lines = [f"{cpu_model()}, {os.cpu_count()} CPUs; {args.model}; {args.num_prefixes} prefixes x "
             f"({args.prefix_len} + {args.suffix_len}) tokens, {args.output_len} out, {args.num_prompts} prompts "
             f"at once; flock serve {args.flock_args}",
             "| " + " | ".join(head) + " |", "|---|--:" + "|--:" * (len(head) - 2) + "|"]
    ratio = lambda r, m, unit="": f"{r[m] / ref[m]:.2f}{unit}" if ref else "-"
    for r in rows:
        name = f"flock ({r['server_health']['attention']})" if r["server"] == "flock" else "vllm"
        cells = [name, r["run"], f"{r['completed']}/{args.num_prompts}", f"{r['request_throughput']:.2f}",
                 ratio(r, "request_throughput", "x"),
                 f"{r['mean_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f}",
                 f"{r['mean_tpot_ms']:,.0f} / {r['p99_tpot_ms']:,.0f}",
                 ratio(r, "mean_ttft_ms"), ratio(r, "mean_tpot_ms"), f"{r['ready_s']:.0f}",
                 f"{r['others_cpu']:.0%}", f"{r['matmul_gflops']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/work/models/smollm2", help="Hugging Face folder both servers load")
    ap.add_argument("--servers", nargs="+", default=["flock", "vllm"], choices=["flock", "vllm"])
    ap.add_argument("--runs", type=int, default=1, help="fresh servers per kind, alternating")
    ap.add_argument("--flock-args", default="--dtype bfloat16", help="extra `flock serve` options")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` options")
    ap.add_argument("--vllm-venv", type=Path, default=BENCH / "out" / "vllm-venv")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--wait-quiet", type=float, default=0, help="seconds to wait for a quiet machine before each")
    ap.add_argument("--output", type=Path, default=OUT)
    args = ap.parse_args()
    args.vllm_python = args.vllm_venv.resolve() / "bin" / "python"

    rows = [measure(name, run, args) for run in range(1, args.runs + 1) for name in args.servers]
    print(table(rows, args))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output.write_text(json.dumps({"cpu": cpu_model(), "cpus": os.cpu_count(), "args": meta, "runs": rows},
                                      indent=2))
    print(f"wrote {args.output}")
    return 0 if all(r["completed"] == args.num_prompts for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
