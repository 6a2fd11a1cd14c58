"""Native C kernels, the one place they are built and loaded: CPU features -> ISA path -> gcc build -> load.

Kernels live as C sources in the package (`*/csrc/*.c`). A kernel module declares its library once, as a
`Library`: the source, the gcc flags of every build, the ISA paths it is built for (names of `ISAS`: the CPU
flags a path needs and the gcc flags it adds) and the ctypes signatures of the functions it calls. The library
of a path is compiled on first use by `build` into FLOCK_CACHE_DIR (default ~/.cache/flock)/kernels, named by a
hash of the source, the headers beside it and the flags, so a changed source, header or flag set is rebuilt and
concurrent builders each install a whole library; it is loaded once per process, and `unavailable(path)` says
why it cannot run: the CPU flags the path needs and this CPU lacks, no gcc, or gcc's error. `prebuild` compiles
several builds side by side before their first loads (a fresh machine's engine start, the test suite's).
FLOCK_CPU_ISA forces an attention path lower than the CPU's best (`forced_isa`).
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ISA_ENV = "FLOCK_CPU_ISA"
AMX_REFUSED = "Linux refused AMX tile state (5.16 or later is needed)"  # why an AMX build cannot run


@dataclass(frozen=True)
class Isa:
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo names them
    gcc_flags: tuple[str, ...]


_AVX512 = ("avx512f", "avx512bw", "avx512vl")
_M_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl")
ISAS = {  # every ISA path a kernel is built for
    "amx": Isa((*_AVX512, "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16"),
               (*_M_AVX512, "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mfma")),
    "amxint8": Isa((*_AVX512, "avx512_vnni", "amx_tile", "amx_int8", "fma"),
                   (*_M_AVX512, "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-mfma")),
    "avx512bf16": Isa((*_AVX512, "avx512_bf16", "fma"), (*_M_AVX512, "-mavx512bf16", "-mfma")),
    "avx512dq": Isa((*_AVX512, "avx512dq", "fma"), (*_M_AVX512, "-mavx512dq", "-mfma")),
    "avx512": Isa((*_AVX512, "fma"), (*_M_AVX512, "-mfma")),
    "avx512vnni": Isa((*_AVX512, "avx512_vnni", "fma"), (*_M_AVX512, "-mavx512vnni", "-mfma")),
    "avxvnni": Isa(("avx2", "fma", "avx_vnni"), ("-mavx2", "-mfma", "-mavxvnni")),
    "avx2": Isa(("avx2", "fma"), ("-mavx2", "-mfma")),
    "baseline": Isa((), ()),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_vendor_family() -> tuple[str, int]:
    """/proc/cpuinfo's vendor_id and cpu family ("AuthenticAMD", 26 for Zen 5); ("", 0) where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", 0
    fields = {key.strip(): value.strip() for key, _, value in (ln.partition(":") for ln in text.splitlines()[:16])}
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


@functools.cache
def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return line.partition(":")[2].strip() or "unknown CPU"


def missing_flags(isa: str) -> list[str]:
    """The CPU flags ISA path `isa` needs and this CPU lacks."""
    return [f for f in ISAS[isa].cpu_flags if f not in cpu_flags()]


def forced_isa(choices: Sequence[str]) -> str | None:
    """FLOCK_CPU_ISA, checked against `choices`: the path to force, or None."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if name and name not in choices:
        raise ValueError(f"{ISA_ENV}={name!r} is not an ISA path; choose one of {', '.join(choices)}")
    return name or None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim). Weights that were allocated one by one
    and released as their packed copies are made stay in malloc's heap otherwise (its mmap threshold rises with
    the first large frees), so a model's weights would take twice their size while they are packed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def cache_root() -> Path:
    """FLOCK_CACHE_DIR, default ~/.cache/flock: what Flock builds once and keeps (kernels, GGUF tables)."""
    return Path(os.environ.get("FLOCK_CACHE_DIR", Path.home() / ".cache" / "flock"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


SHARED_HEADERS = Path(__file__).resolve().parent / "csrc"  # headers every kernel source may include


def _library_file(source: Path, flags: list[str]) -> Path:
    headers = [*sorted(source.parent.glob("*.h")), *sorted(SHARED_HEADERS.glob("*.h"))]  # it may include them
    text = b"".join(f.read_bytes() for f in [source, *headers])
    tag = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{tag}.so"


def build(source: Path, flags: list[str]) -> Path:
    """Compile `source` with gcc and `flags` (plus -shared -fPIC) unless a library of it (and of the headers
    beside it and in SHARED_HEADERS) is cached; its path.
    Raises subprocess.CalledProcessError (with gcc's stderr) or OSError (no gcc, no writable cache)."""
    lib = _library_file(source, flags)
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            built = Path(tmp) / lib.name
            command = ["gcc", *flags, f"-I{SHARED_HEADERS}", "-shared", "-fPIC", "-o", str(built), str(source), "-lm"]
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(built, lib)
    return lib


def uncached(builds: Iterable[tuple["Library", str]]) -> list[tuple["Library", str]]:
    """The (library, path) builds of `builds` that are not compiled yet, once each."""
    files = {_library_file(lib.source, lib.gcc_flags(path)): (lib, path) for lib, path in builds}
    return [pair for file, pair in files.items() if not file.exists()]


def prebuild(builds: Iterable[tuple["Library", str]], workers: int | None = None) -> None:
    """Compile the (library, path) builds not cached yet, `workers` gccs at a time (default: one a core), so that
    a fresh machine waits for its kernels' compiles side by side rather than one after another as they load. A
    build that fails is left for its load to report."""
    todo = uncached(builds)
    if not todo:
        return
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        for done in [pool.submit(lib.build, path) for lib, path in todo]:
            with contextlib.suppress(OSError, subprocess.CalledProcessError):
                done.result()


Signature = tuple[list, type | None]  # ctypes argtypes, restype (None: void)
DECLARED: list["Library"] = []  # every Library made, in order: the kernels' modules declare theirs at import


@dataclass(eq=False)
class Library:
    """A C source built per ISA path, loaded on first use. `what` names it in messages ("{path}": the path);
    `ready`, given the loaded library, says why it cannot run after all (None: it can)."""

    source: Path
    what: str
    paths: tuple[str, ...]  # names of ISAS, best first
    signatures: dict[str, Signature]
    flags: tuple[str, ...] = ("-O3", "-fopenmp")
    ready: Callable[[ctypes.CDLL], str | None] | None = None
    _loaded: dict[str, tuple[ctypes.CDLL | None, str | None]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        DECLARED.append(self)

    def gcc_flags(self, path: str) -> list[str]:
        return [*self.flags, *ISAS[path].gcc_flags]

    def runnable(self) -> list[str]:
        """The paths this CPU runs, best first."""
        return [p for p in self.paths if not missing_flags(p)]

    def best(self) -> str | None:
        """The best path this CPU runs whose build loads (an AMX build needs Linux's permission, and checks
        itself), else the least demanding one it runs; None where it runs none."""
        runnable = self.runnable()
        return next((p for p in runnable if self.unavailable(p) is None), runnable[-1] if runnable else None)

    def build(self, path: str) -> Path:
        return build(self.source, self.gcc_flags(path))

    def unavailable(self, path: str | None = None) -> str | None:
        """Why the library cannot run on `path` here (default: the best path this CPU runs, else the least
        demanding), or None when it can."""
        path = path or next(iter(self.runnable()), self.paths[-1])
        if path not in self.paths:
            return f"no ISA path {path!r} here (the paths: {', '.join(self.paths)})"
        if missing := missing_flags(path):
            return f"the {path} path needs {', '.join(missing)}, which this CPU lacks"
        return self._load(path)[1]

    def load(self, path: str) -> ctypes.CDLL:
        """The library of `path`, its functions typed; RuntimeError where it cannot run."""
        if (lib := self._loaded.get(path, (None,))[0]) is not None:
            return lib
        if why := self.unavailable(path):
            raise RuntimeError(why)
        return self._loaded[path][0]

    def clear(self) -> None:
        """Forget the loaded libraries (their builds stay cached): the next use builds or loads again."""
        self._loaded.clear()

    def _load(self, path: str) -> tuple[ctypes.CDLL | None, str | None]:
        if path not in self._loaded:
            self._loaded[path] = self._open(path)
        return self._loaded[path]

    def _open(self, path: str) -> tuple[ctypes.CDLL | None, str | None]:
        try:
            lib = ctypes.CDLL(str(self.build(path)))  # after torch: binds to its libgomp
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:  # no gcc, no writable cache, ...
            detail = getattr(e, "stderr", "") or str(e)
            return None, f"could not build {self.what.format(path=path)}: {detail.strip()[:500]}"
        for name, (argtypes, restype) in self.signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        why = self.ready(lib) if self.ready else None
        return (None, why) if why else (lib, None)
