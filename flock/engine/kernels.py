"""The C kernels a CPU engine loads, compiled side by side while the engine loads its model: a fresh machine's
first engine start runs its compiles beside each other and beside the model's load, not one after another."""

import logging
import threading

from flock import native
from flock.attention import cpu
from flock.model import fused_ops, gemm, quant

log = logging.getLogger("flock")
_compiling: threading.Thread | None = None  # the builds an engine's start began, running beside its model's load


def engine_builds() -> list[tuple[native.Library, str]]:
    """The (library, path) builds a CPU engine loads here: each kernel's best path for this CPU's flags (the
    attention path FLOCK_CPU_ISA forces, if set)."""
    bf16_gemm = gemm.AMX if "amx_bf16" in native.cpu_flags() else gemm.KERNEL
    attention = cpu.forced_isa() or next(iter(cpu.KERNEL.runnable()), None)
    builds = [(cpu.KERNEL, attention)] if attention else []
    return builds + [(lib, lib.runnable()[0]) for lib in (fused_ops.KERNEL, bf16_gemm, quant.KERNEL) if lib.runnable()]


def _uncached() -> list[tuple[native.Library, str]]:
    if todo := native.uncached(engine_builds()):
        log.info("compiling %d C kernels for this CPU (once; kept in %s)", len(todo), native.cache_dir())
    return todo


def start_kernel_builds() -> None:
    """Begin compiling the engine's builds that are not cached yet, in a thread (gcc runs in its own processes)."""
    global _compiling
    if _compiling is None and (todo := _uncached()):
        _compiling = threading.Thread(target=native.prebuild, args=(todo,), name="flock-kernel-builds")
        _compiling.start()


def prebuild_kernels() -> None:
    """The engine's builds compiled, before the model's first load: those begun at the engine's start finished,
    any others (a runner made on its own) compiled now, side by side."""
    global _compiling
    if _compiling is not None:
        _compiling.join()
        _compiling = None
    if todo := _uncached():
        native.prebuild(todo)
