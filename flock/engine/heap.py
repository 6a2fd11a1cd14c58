"""Keep freed memory in glibc's heap when the model runs on the CPU.

A step allocates the same large activations every time (a prefill step's MLP input is tens of MB). glibc hands
blocks above its adaptive mmap threshold back to the OS when they are freed and maps them anew, zero-filled, on
the next step: ~66,000 page faults a second on bench-mid, 2-4% of a run. Fixing the threshold at glibc's
64-bit ceiling and never trimming the heap top keeps them for reuse, as tcmalloc and jemalloc (which vLLM's
CPU build is run with) do. The heap then stays at its peak size, so what loading freed (read-time copies; the
float tensors of a checkpoint quantized at load) is handed back once, before the first step:
`release_freed_memory`. KV caches are not taken from the heap: `zeroed` maps them fresh, to be zero-filled page
by page as steps first write them.
"""

import ctypes
import functools
import math
import mmap

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc ignores larger values on 64-bit


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc so (once per process); False where the C library is not glibc."""
    libc = _libc()
    try:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except AttributeError:  # not glibc (or no libc.so.6: None)
        return False


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor that costs nothing until written, on the CPU: a fresh anonymous mapping, whose pages Linux
    zero-fills as they are first touched (elsewhere, and on other devices, torch.zeros). A KV cache is sized for the
    largest batch but most runs fill a part of it; zeroed whole, 1 GiB of 4 KiB pages takes ~0.3 s at start-up."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
