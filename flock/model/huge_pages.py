"""Weights on transparent 2 MiB pages.

A decode step streams every weight from memory once. On 4 KiB pages that stream needs a TLB entry every 64 cache
lines, more pages than the TLB holds, so page walks stand in its way; on 2 MiB pages it needs one every 32,768.
Linux gives anonymous memory 2 MiB pages where a program asks (`madvise`, what most distributions set transparent
huge pages to), but memory that malloc has already handed out stays on the pages it was first touched on. So these
tensors are carved, 64-byte aligned, from fresh mappings asked for 2 MiB pages before anything touches them: one
per tensor of REGION or more, shared regions of REGION for smaller ones. A region lives as long as a tensor carved
from it. Where the kernel has no transparent huge pages the same memory stays on 4 KiB pages; elsewhere than Linux
these are torch.empty's. (Not the KV caches: fresh 2 MiB pages can fault in slowly, and a step that first writes a
block would wait on them; see docs/kernels.md.)
"""

import math
import mmap
import threading

import torch

PAGE = 2 << 20
REGION = 64 << 20
ALIGN = 64

_lock = threading.Lock()
_shared: list = [None, 0]  # the shared region's bytes (a uint8 tensor) and how many are carved


def _region(size: int) -> torch.Tensor:
    """Fresh bytes, at least `size` from a 2 MiB boundary on, asked for 2 MiB pages."""
    memory = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    try:
        memory.madvise(mmap.MADV_HUGEPAGE, start, (len(memory) - start) // PAGE * PAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as malloc's
        pass
    return raw[start:]


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on 2 MiB pages where the system gives them."""
    size = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or size == 0:
        return torch.empty(shape, dtype=dtype)
    if size >= REGION:
        return _region(size)[:size].view(dtype).view(shape)
    with _lock:
        at = -(-_shared[1] // ALIGN) * ALIGN
        if _shared[0] is None or at + size > REGION:
            _shared[:] = _region(REGION), 0
            at = 0
        _shared[1] = at + size
        return _shared[0][at : at + size].view(dtype).view(shape)
