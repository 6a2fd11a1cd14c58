"""Native C kernels: the CPU's feature flags, and a kernel built with gcc on first use, cached by content.

Kernels live as C sources in the package (`*/csrc/*.c`); `build(source, flags)` compiles one into a shared
library under FLOCK_CACHE_DIR (default ~/.cache/flock)/kernels, named by a hash of the source, the headers
beside it and the flags, so a changed source, header or flag set is rebuilt and concurrent builders each install
a whole library.
"""

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


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
def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return line.partition(":")[2].strip() or "unknown CPU"


def cache_dir() -> Path:
    return Path(os.environ.get("FLOCK_CACHE_DIR", Path.home() / ".cache" / "flock")) / "kernels"


def build(source: Path, flags: list[str]) -> Path:
    """Compile `source` with gcc and `flags` (plus -shared -fPIC) unless a library of it (and of the headers
    beside it) is cached; its path.
    Raises subprocess.CalledProcessError (with gcc's stderr) or OSError (no gcc, no writable cache)."""
    text = b"".join(f.read_bytes() for f in [source, *sorted(source.parent.glob("*.h"))])  # it may include them
    tag = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            built = Path(tmp) / lib.name
            subprocess.run(["gcc", *flags, "-shared", "-fPIC", "-o", str(built), str(source), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(built, lib)
    return lib
