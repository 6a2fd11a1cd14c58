"""The machine a benchmark runs on: its CPU, the kernel paths Flock takes there, its matmul peak and memory
bandwidth, and how busy other processes keep it (the CPUs may be shared, so every figure is printed with it)."""

import os
import resource
import time
from pathlib import Path

import torch

from flock.native import cpu_flags, cpu_model

__all__ = ["cpu_model", "cpu_line", "kernel_paths", "attention_path", "header", "matmul_peak", "arithmetic_peaks",
           "memory_bandwidth", "OthersCPU", "tree_cpu_seconds", "other_cores", "wait_quiet", "load_average",
           "load_note", "peak_rss_gib"]

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
QUIET = 0.15  # share of all CPUs that other processes may use for the machine to count as quiet


# -- CPU and kernel paths --------------------------------------------------------------------------------------
def cpu_line() -> str:
    """CPU model, CPU count, its bf16 instructions, torch version and threads."""
    bf16 = [f for f in BF16_FLAGS if f in cpu_flags()]
    return (f"{cpu_model()} ({os.cpu_count()} CPUs, {', '.join(bf16) or 'no bf16 instructions'}), "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def kernel_paths(dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """The paths a Flock engine of `dtype` takes on this CPU with attention "auto" and ops "auto" (a model
    whose head_dim the kernels take): attention, elementwise ops, GEMMs; each says why not where it falls back."""
    from flock.attention import cpu
    from flock.model import fused_ops, gemm, linear

    dev = torch.device("cpu")
    if (why := cpu.kernel_unavailable()) is None:
        attention = f"cpu kernel, {cpu.chosen_isa()} path"
    else:
        attention = f"torch-cascade ({why})"
    why = fused_ops.unavailable(dtype, dev)
    elementwise = f"fused C kernels ({fused_ops.isa()})" if why is None else f"PyTorch ops ({why})"
    if gemm.unavailable(dtype, dev) is None:
        gemms = f"Flock bf16 GEMM ({gemm.isa()})"
    elif (why := linear.unavailable(dtype, dev)) is None:
        gemms = "oneDNN, prepacked weights"
    else:
        gemms = f"F.linear ({why})"
    return {"attention": attention, "elementwise": elementwise, "gemm": gemms}


def attention_path(attention: str, model: str | Path, dtype: torch.dtype = torch.bfloat16) -> str:
    """The attention backend (and ISA path) an engine of `model` takes for `attention`, and why not the kernel."""
    from flock.attention import cpu, make_backend
    from flock.engine.runner import resolve_device
    from flock.model import resolve_model

    device = resolve_device("auto")
    backend = make_backend(attention, resolve_model(str(model)).config, device, dtype)
    backend = next(iter(getattr(backend, "backends", {None: backend}).values()))  # one per window (Gemma): the first
    if device.type == "cuda":
        return f"{backend.name} on {torch.cuda.get_device_name(device)}"
    if not isinstance(backend, cpu.CpuCascadeBackend):
        return backend.name
    if backend.uses_kernel(torch.device("cpu")):
        return f"cpu kernel, {backend.isa} path"
    return f"torch-cascade (cpu kernel unavailable: {cpu.kernel_unavailable() or 'not for this model shape'})"


def header(name: str, kernels: bool = True, dtype: torch.dtype = torch.bfloat16) -> str:
    """The first line of a benchmark's output: which CPU, and which kernel paths (or none: no model runs)."""
    if not kernels:
        return f"# {name}: {cpu_line()}\n# kernel paths: none (Python and numpy only)"
    paths = "; ".join(f"{k}: {v}" for k, v in kernel_paths(dtype).items())
    return f"# {name}: {cpu_line()}\n# kernel paths ({str(dtype).removeprefix('torch.')}): {paths}"


# -- limits ----------------------------------------------------------------------------------------------------
def matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 2048, repeats: int = 5, max_s: float = 5.0) -> float:
    """GFLOP/s of the best of `repeats` n x n x n matmuls in `dtype` (after two warm-up products). Where one
    product would take over `max_s` seconds (bf16 on a CPU without bf16 instructions: ~0.5 GFLOP/s), the
    products are 512 wide instead: the rate is as telling and the benchmark does not wait minutes for it."""
    from bench.harness.timing import best_time, timed

    small = torch.randn(512, 512).to(dtype)
    timed(lambda: small @ small)
    if timed(lambda: small @ small) * (n / 512) ** 3 > max_s:
        n = 512
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_time(lambda: a @ b, repeats, warmup=2) / 1e9


def arithmetic_peaks(dtypes: dict[str, torch.dtype], repeats: int = 7) -> dict[str, float]:
    """matmul_peak per named dtype, a roofline's arithmetic bound. Half-precision inputs can always be multiplied
    in fp32 (the cpu attention kernel's avx2 and avx512 paths do), so theirs is at least fp32's: on a CPU without
    bf16 instructions torch's bf16 matmul alone (~1 GFLOP/s) would make every kernel look faster than its bound."""
    fp32 = matmul_peak(torch.float32, repeats=repeats)
    return {name: fp32 if dtype == torch.float32 else max(fp32, matmul_peak(dtype, repeats=repeats))
            for name, dtype in dtypes.items()}


def memory_bandwidth(gib: float = 1.0) -> dict:
    """Memory bandwidth with torch's threads: a read (sum) and a copy (read + write) of a tensor larger than
    the last-level cache, best of 7 each. The larger of the two is taken as the limit. The tensor read sits on
    2 MiB pages where Linux gives them (as Flock's weights do): on 4 KiB pages page walks can hold a stream below
    what the memory delivers, and the limit is the memory's (docs/benchmarks.md)."""
    from bench.harness.timing import best_time
    from flock.model import huge_pages

    n = int(gib * 2**30) // 4
    x = huge_pages.empty((n,), torch.float32).normal_()
    y = torch.empty_like(x)
    read = n * 4 / best_time(lambda: x.sum(), 7) / 1e9
    copy = 2 * n * 4 / best_time(lambda: y.copy_(x), 7) / 1e9
    return {"probe_gib": gib, "read_sum_GBps": read, "copy_rw_GBps": copy, "limit_GBps": max(read, copy)}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


# -- load of other processes -----------------------------------------------------------------------------------
def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all but idle and iowait) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process and the children it has reaped."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


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


class OthersCPU:
    """Context manager: CPU time that other processes (and the hypervisor) took while the block ran.
    This process, its reaped children and the process trees of `pids` (a server) are subtracted.
    `.fraction`: of all CPUs; `.cores`: in cores."""

    def __init__(self, *pids: int):
        self.pids, self.fraction, self.cores = pids, 0.0, 0.0

    def __enter__(self) -> "OthersCPU":
        self.start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        (w0, busy0, own0), (w1, busy1, own1) = self.start, self._sample()
        self.cores = max(0.0, busy1 - busy0 - (own1 - own0)) / max(w1 - w0, 1e-9)
        self.fraction = self.cores / (os.cpu_count() or 1)

    def _sample(self) -> tuple[float, float, float]:
        own = own_seconds() + sum(tree_cpu_seconds(p) for p in self.pids)
        return time.perf_counter(), busy_seconds(), own


def other_cores(seconds: float) -> float:
    """Cores that other processes keep busy over the next `seconds` (the load average lags by a minute)."""
    with OthersCPU() as others:
        time.sleep(seconds)
    return others.cores


def wait_quiet(max_s: float, threshold_cores: float, window_s: float = 1.0, pause_s: float = 0.0) -> float:
    """Measure other processes' load over `window_s` windows (`pause_s` apart) until it is below
    `threshold_cores` or `max_s` seconds have passed; returns the last reading, in cores."""
    deadline = time.monotonic() + max_s
    while (cores := other_cores(window_s)) >= threshold_cores and time.monotonic() < deadline:
        time.sleep(pause_s)
    return cores


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load_note(wait_s: float = 0.0) -> str:
    """The machine's load, after waiting up to `wait_s` seconds for it to go quiet (< 15% of all CPUs busy)."""
    cpus = os.cpu_count() or 1
    busy = wait_quiet(wait_s, QUIET * cpus, window_s=1.0, pause_s=4.0) / cpus
    load = os.getloadavg()
    warn = "  WARNING: the machine is busy, figures will be noisy" if busy > QUIET else ""
    return f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {busy:.0%} busy, {cpus} CPUs{warn}"
