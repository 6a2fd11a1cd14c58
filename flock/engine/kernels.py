"""The C kernels a CPU engine loads, compiled side by side before the model loads them one by one: a fresh
machine's first engine start waits for the slowest compile, not for their sum."""

import logging

from flock import native
from flock.attention import cpu
from flock.model import fused_ops, gemm, quant

log = logging.getLogger("flock")


def engine_builds() -> list[tuple[native.Library, str]]:
    """The (library, path) builds a CPU engine loads here: each kernel's best path for this CPU's flags (the
    attention path FLOCK_CPU_ISA forces, if set)."""
    bf16_gemm = gemm.AMX if "amx_bf16" in native.cpu_flags() else gemm.KERNEL
    attention = cpu.forced_isa() or next(iter(cpu.KERNEL.runnable()), None)
    builds = [(cpu.KERNEL, attention)] if attention else []
    return builds + [(lib, lib.runnable()[0]) for lib in (fused_ops.KERNEL, bf16_gemm, quant.KERNEL) if lib.runnable()]


def prebuild_kernels() -> None:
    """Compile the engine's builds that are not cached yet, side by side."""
    if todo := native.uncached(engine_builds()):
        log.info("compiling %d C kernels for this CPU (once; kept in %s)", len(todo), native.cache_dir())
        native.prebuild(todo)
