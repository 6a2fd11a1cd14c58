"""A GGUF file's config, tensor table and converted tokenizer, kept under FLOCK_CACHE_DIR/gguf once parsed.

The `gguf` package's reader builds a numpy view for every string of the vocabulary (seconds for a 49k-token
one, before any weight is read); the config and the tensor table are a few KB. transformers converts the
file's tokenizer again on every load (it reads the metadata, then builds the BPE or SentencePiece model); the
converted one is kept as save_pretrained writes it. An entry is named by a hash of the file's path, size and
mtime, of the versions of `gguf` and `transformers` (whose key mapping makes the config) and of Flock's GGUF
code, so a changed file, package or Flock parses again. The tensors' data are views of one memory map of the
file, as the reader makes them.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from flock import native

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType


@dataclass(frozen=True)
class Tensor:
    """What Flock reads of the gguf reader's ReaderTensor."""

    name: str
    tensor_type: "GGMLQuantizationType"
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray


def _entry(path: str, mtime_ns: int, size: int) -> Path:
    from importlib.metadata import version

    code = b"".join((Path(__file__).parent / f).read_bytes() for f in ("gguf.py", "gguf_table.py"))
    parts = (path, mtime_ns, size, version("gguf"), version("transformers"), hashlib.sha256(code).hexdigest())
    key = "\0".join(map(str, parts))
    return native.cache_root() / "gguf" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def tokenizer_folder(path: Path) -> Path:
    """Where the tokenizer transformers converts from this file is kept (its save_pretrained folder)."""
    stat = path.stat()
    entry = _entry(str(path), stat.st_mtime_ns, stat.st_size)
    return entry.with_name(f"{entry.stem}-tokenizer")


def keep_tokenizer(tokenizer, folder: Path) -> None:
    """Save the converted tokenizer to `folder` (written aside, then renamed; nothing where it cannot be)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(dir=folder.parent, suffix=".tmp"))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(aside)
        os.replace(aside, folder)  # another process may have kept it first: then this copy goes
    except Exception:  # keeping it is optional: whatever save_pretrained or the rename raises, the load goes on
        shutil.rmtree(aside, ignore_errors=True)


def load(path: str, mtime_ns: int, size: int) -> tuple[list[Tensor], dict] | None:
    """(tensors, config) as an earlier parse of this file left them, or None."""
    try:
        table = json.loads(_entry(path, mtime_ns, size).read_text())
    except (OSError, ValueError):
        return None
    from gguf import GGMLQuantizationType

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = [Tensor(name, GGMLQuantizationType(qtype), offset, n_bytes,
                      blob[offset:offset + n_bytes].view(np.dtype(dtype)).reshape(shape))
               for name, qtype, offset, n_bytes, dtype, shape in table["tensors"]]
    return tensors, table["config"]


def save(path: str, mtime_ns: int, size: int, tensors, config: dict) -> None:
    """Keep the parse (a little-endian file's; nothing where the cache cannot be written)."""
    rows = [[t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes), t.data.dtype.str, list(t.data.shape)]
            for t in tensors]
    if any(not dtype.startswith(("<", "|")) for *_, dtype, _ in rows):
        return
    entry = _entry(path, mtime_ns, size)
    try:
        text = json.dumps({"tensors": rows, "config": config})
        if json.loads(text)["config"] != config:  # a tuple or a non-string key would come back changed
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, entry)
    except (OSError, TypeError, ValueError):
        pass
