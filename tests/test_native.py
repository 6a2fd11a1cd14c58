"""flock.native, the one toolchain of the C kernels: CPU flags -> ISA path -> gcc build (cached by content) ->
load -> why unavailable; and no native code built or loaded anywhere else in the package."""

import ctypes
import re
import shutil
import time
from pathlib import Path

import pytest

import flock
from flock import native
from flock.attention import cpu
from flock.engine import kernels
from flock.engine.kernels import engine_builds
from flock.model import fused_ops, gemm, quant
from flock.native import Library, build

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
KERNELS = {"cpu attention": cpu.KERNEL, "fused ops": fused_ops.KERNEL,
           "bf16 gemm": gemm.KERNEL, "amx gemm": gemm.AMX}
# native code loaded outside flock.native that Flock does not build: the system C library
NOT_FLOCKS = {"flock/engine/heap.py": ['ctypes.CDLL("libc.so.6")']}


def library(tmp_path, monkeypatch, text: str, **kwargs) -> Library:
    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "lib.c").write_text(text)
    kwargs = {"paths": ("avx512bf16", "avx2", "baseline"), "signatures": {}} | kwargs
    return Library(tmp_path / "lib.c", "the test library", **kwargs)


def test_no_native_code_is_built_or_loaded_outside_flock_native():
    root = Path(flock.__file__).parent
    pattern = re.compile(r"""CDLL\(|cdll\.|ctypes\.util|subprocess|["']gcc["']|native\.build\(|import build\b"""
                         r"|cpp_extension")
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root.parent).as_posix()
        if name == "flock/native.py":
            continue
        text = path.read_text()
        for allowed in NOT_FLOCKS.get(name, []):
            text = text.replace(allowed, "")
        found += [f"{name}: {m.group()}" for m in pattern.finditer(text)]
    assert found == []


@needs_gcc
@pytest.mark.parametrize("name, path", [(n, p) for n, k in KERNELS.items() for p in k.paths])
def test_every_path_of_every_kernel_compiles_here_with_its_functions(name, path):
    """gcc compiles AVX-512 and AMX code on any x86 machine: a path this CPU cannot run still must build. Opening
    the library runs none of its code (the sources have no constructors)."""
    kernel = KERNELS[name]
    assert path in native.ISAS and kernel.source.is_file()
    so = ctypes.CDLL(str(kernel.build(path)))
    assert [fn for fn in kernel.signatures if not hasattr(so, fn)] == []


def test_a_path_whose_flags_the_cpu_lacks_says_which(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int f(void) { return 1; }\n")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert lib.runnable() == ["avx2", "baseline"]
    why = lib.unavailable("avx512bf16")
    assert why == "the avx512bf16 path needs avx512bw, avx512vl, avx512_bf16, which this CPU lacks"
    with pytest.raises(RuntimeError, match="needs avx512bw"):
        lib.load("avx512bf16")
    assert "'sse9'" in lib.unavailable("sse9")
    monkeypatch.setattr(native, "cpu_flags", lambda: set())
    assert lib.runnable() == ["baseline"]


@needs_gcc
def test_a_source_that_does_not_compile_says_gccs_error(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int f(void) { return undeclared_name; }\n")
    why = lib.unavailable("baseline")
    assert why.startswith("could not build the test library: ") and "undeclared_name" in why
    with pytest.raises(RuntimeError, match="undeclared_name"):
        lib.load("baseline")


def test_no_gcc_is_said(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int f(void) { return 1; }\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc on it
    assert lib.unavailable("baseline").startswith("could not build the test library: ")


@needs_gcc
def test_a_library_is_loaded_once_with_its_signatures(tmp_path, monkeypatch):
    sig = {"add": ([ctypes.c_double, ctypes.c_double], ctypes.c_double)}
    lib = library(tmp_path, monkeypatch, "double add(double a, double b) { return a + b; }\n", signatures=sig)
    assert lib.unavailable("baseline") is None
    loaded = lib.load("baseline")
    assert loaded.add(1.5, 2) == 3.5 and loaded.add.argtypes == sig["add"][0]
    assert lib.load("baseline") is loaded
    lib.clear()
    assert lib.load("baseline") is not loaded


@needs_gcc
def test_a_library_that_is_not_ready_says_why(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int init(void) { return -1; }\n", signatures={"init": ([], ctypes.c_int)},
                  ready=lambda so: None if so.init() == 0 else "init refused")
    assert lib.unavailable("baseline") == "init refused"


@needs_gcc
def test_the_best_path_is_the_best_whose_build_is_ready(tmp_path, monkeypatch):
    """A path whose build refuses (an AMX build without Linux's permission) gives way to the next; where every
    one refuses, the least demanding is named (and says why)."""
    source = "#ifdef __AVX2__\nint init(void) { return REFUSE; }\n#else\nint init(void) { return 0; }\n#endif\n"
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    ready = lambda so: None if so.init() == 0 else "refused"  # noqa: E731
    lib = library(tmp_path, monkeypatch, source.replace("REFUSE", "-1"), signatures={"init": ([], ctypes.c_int)},
                  ready=ready)
    assert lib.runnable() == ["avx2", "baseline"] and lib.best() == "baseline"
    fine = library(tmp_path, monkeypatch, source.replace("REFUSE", "0"), signatures={"init": ([], ctypes.c_int)},
                   ready=ready)
    assert fine.best() == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: set())
    assert library(tmp_path, monkeypatch, "int init(void) { return -1; }\n", signatures={"init": ([], ctypes.c_int)},
                   ready=ready, paths=("avx2",)).best() is None


@needs_gcc
def test_the_build_is_keyed_by_the_paths_flags(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int f(void) { return 1; }\n")
    assert lib.gcc_flags("avx2") == ["-O3", "-fopenmp", "-mavx2", "-mfma"]
    builds = {lib.build(p) for p in lib.paths}
    assert len(builds) == 3 and lib.build("avx2") in builds  # cached


@needs_gcc
def test_prebuild_compiles_the_uncached_builds_side_by_side_and_leaves_failures_to_the_load(tmp_path, monkeypatch):
    lib = library(tmp_path, monkeypatch, "int f(void) { return 1; }\n")
    builds = [(lib, "avx2"), (lib, "baseline"), (lib, "baseline")]
    assert native.uncached(builds) == [(lib, "avx2"), (lib, "baseline")]
    native.prebuild(builds, workers=2)
    assert native.uncached(builds) == [] and lib.build("avx2").exists()
    (tmp_path / "broken").mkdir()
    broken = library(tmp_path / "broken", monkeypatch, "int f(void) { return }\n")
    native.prebuild([(broken, "baseline")])
    assert native.uncached([(broken, "baseline")]) == [(broken, "baseline")]
    assert "could not build the test library" in broken.unavailable("baseline")


def test_the_engine_prebuilds_each_kernels_path_for_this_cpu_or_the_forced_attention_path(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    builds = engine_builds()
    bf16_gemm = gemm.AMX if "amx_bf16" in native.cpu_flags() else gemm.KERNEL
    kernels = [cpu.KERNEL, fused_ops.KERNEL, bf16_gemm, quant.KERNEL]
    assert [lib for lib, _ in builds] == [lib for lib in kernels if lib.runnable()]
    assert all(path == lib.runnable()[0] for lib, path in builds)
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert engine_builds()[0] == (cpu.KERNEL, "avx2")


def test_an_engines_start_compiles_in_the_background_and_its_runner_waits(monkeypatch):
    compiled, todo = [], [(cpu.KERNEL, "avx2")]
    monkeypatch.setattr(native, "uncached", lambda builds: [] if compiled else todo)
    monkeypatch.setattr(native, "prebuild", lambda builds: (time.sleep(0.2), compiled.append(builds)))
    kernels.start_kernel_builds()
    kernels.start_kernel_builds()  # one at a time
    assert compiled == []  # not waited for
    kernels.prebuild_kernels()
    assert compiled == [todo] and kernels._compiling is None
    kernels.prebuild_kernels()  # nothing left to compile
    assert compiled == [todo]


def test_forced_isa_reads_flock_cpu_isa(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    assert native.forced_isa(("avx2",)) is None
    monkeypatch.setenv(native.ISA_ENV, " AVX2 ")
    assert native.forced_isa(("avx512", "avx2")) == "avx2"
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="FLOCK_CPU_ISA='sse9' is not an ISA path; choose one of avx512, avx2"):
        native.forced_isa(("avx512", "avx2"))


@needs_gcc
def test_a_changed_header_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("#define VALUE 1\n")
    (src / "lib.c").write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    first = build(src / "lib.c", ["-O2"])
    assert build(src / "lib.c", ["-O2"]) == first  # cached
    (src / "value.h").write_text("#define VALUE 2\n")
    second = build(src / "lib.c", ["-O2"])
    assert second != first and ctypes.CDLL(str(second)).value() == 2
    assert build(src / "lib.c", ["-O1"]) not in (first, second)
