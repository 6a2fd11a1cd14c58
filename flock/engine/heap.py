"""Keep freed memory in glibc's heap when the model runs on the CPU.

A step allocates the same large activations every time (a prefill step's MLP input is tens of MB). glibc hands
blocks above its adaptive mmap threshold back to the OS when they are freed and maps them anew, zero-filled, on
the next step: ~66,000 page faults a second on bench-mid, 2-4% of a run. Fixing the threshold at glibc's
64-bit ceiling and never trimming the heap top keeps them for reuse, as tcmalloc and jemalloc (which vLLM's
CPU build is run with) do. The heap then stays at its peak size, so what loading freed (read-time copies; the
float tensors of a checkpoint quantized at load) is handed back once, before the first step:
`release_freed_memory`.
"""

import ctypes
import functools

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
