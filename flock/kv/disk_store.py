"""Full KV blocks on disk, a tier below the in-memory prefix cache: a block evicted from memory is read back
instead of computed, and a later run of the same model (the same files, dtype and KV layout: its `fingerprint`)
finds the blocks an earlier one wrote.

A block is one file, named by its chained hash (`flock.kv.hashing`), holding its token ids (the collision guard,
checked on every read), a checksum of its KV and its KV in every layer, as the runner lays it out (a file whose
bytes changed on disk is a miss). Files are written whole (a temporary file renamed into place; one a crash or a
full disk left is deleted) by a background thread, so a crash leaves whole blocks or none; the oldest read or written
ones are deleted beyond `capacity_bytes` (a read touches its file, so the next store of the folder knows too). Several processes may share a folder: a block another one deleted is a
miss.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger("flock")

MAGIC = b"FLOCKKV2"
HEADER_BYTES = len(MAGIC) + 8  # the magic and the KV's checksum, before the token ids
MAX_PENDING_BYTES = 256 << 20  # blocks waiting to be written; more are dropped (a cache may lose entries)
STALE_TMP_SECONDS = 600  # a temporary file this old is no write in progress: a crash's or a full disk's


def fingerprint(identity: dict) -> str:
    """A short name for what a block's KV depends on (model files, dtypes, layout), as a folder name."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


class DiskKVStore:
    def __init__(self, folder: str | Path, capacity_bytes: int, block_size: int, block_bytes: int):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_cache_disk_dir: cannot make the folder {self.folder}: {e}") from None
        self.block_size, self.block_bytes = block_size, block_bytes
        self.file_bytes = HEADER_BYTES + 8 * block_size + block_bytes
        self.capacity = max(capacity_bytes // self.file_bytes, 0)  # in blocks
        self.lock = threading.Lock()
        self.index: OrderedDict[int, None] = OrderedDict((h, None) for h in self._stored())  # oldest first
        self.pending: dict[int, None] = {}
        self.queue: queue.Queue = queue.Queue()
        self.writer: threading.Thread | None = None
        self.blocks_read = self.blocks_written = self.blocks_dropped = 0
        self._trim()

    def _stored(self) -> list[int]:
        """The hashes of the folder's block files, oldest first; other files are left alone, but temporary ones
        no write has touched for a while, which are deleted."""
        blocks = []
        for path in self.folder.iterdir():
            try:
                if path.suffix == ".kv" and len(path.stem) == 16:
                    blocks.append((path.stat().st_mtime_ns, int(path.stem, 16)))
                elif ".tmp" in path.suffix and time.time() - path.stat().st_mtime > STALE_TMP_SECONDS:
                    path.unlink()
            except (OSError, ValueError):  # gone meanwhile, or not a name of ours
                continue
        return [h for _, h in sorted(blocks, key=lambda b: b[0])]

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index or block_hash in self.pending

    def read(self, block_hash: int, tokens: tuple[int, ...]) -> np.ndarray | None:
        """The block's KV bytes, if its file is there, whole, and holds these tokens; else None (and it is
        forgotten). A block still being written is waited for."""
        if block_hash in self.pending:
            self.flush()
        try:
            data = np.fromfile(self._path(block_hash), dtype=np.uint8)
        except OSError:
            data = None
        head = HEADER_BYTES + 8 * self.block_size
        if data is None or len(data) != self.file_bytes or data[: len(MAGIC)].tobytes() != MAGIC \
                or tuple(data[HEADER_BYTES:head].view(np.int64).tolist()) != tokens \
                or data[len(MAGIC) : HEADER_BYTES].tobytes() != xxhash.xxh3_64_digest(data[head:]):
            with self.lock:
                self.index.pop(block_hash, None)
            return None
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
        try:  # its time of use, for the next store of the folder
            os.utime(self._path(block_hash))
        except OSError:
            pass
        self.blocks_read += 1
        return data[head:]

    def write(self, block_hash: int, tokens: tuple[int, ...], payload: np.ndarray) -> None:
        """Keep a block (written in the background; dropped when too many wait)."""
        with self.lock:
            if block_hash in self.index or block_hash in self.pending:
                return
            if len(self.pending) * self.file_bytes >= MAX_PENDING_BYTES:
                self.blocks_dropped += 1
                return
            self.pending[block_hash] = None
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_loop, name="flock-kv-disk", daemon=True)
            self.writer.start()
            atexit.register(self.flush)
        self.queue.put((block_hash, np.asarray(tokens, dtype=np.int64), payload))

    def flush(self) -> None:
        """Wait until every block handed to `write` is on disk."""
        if self.writer is not None:
            self.queue.join()

    def _write_loop(self) -> None:
        while True:
            block_hash, tokens, payload = self.queue.get()
            path = self._path(block_hash)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(MAGIC)
                    f.write(xxhash.xxh3_64_digest(payload))
                    f.write(tokens.tobytes())
                    f.write(payload.tobytes())
                os.replace(tmp, path)
                with self.lock:
                    self.index[block_hash] = None
                self.blocks_written += 1
                self._trim()
            except OSError as e:  # a full disk: said once, the blocks are then lost as the cache's are
                tmp.unlink(missing_ok=True)
                if not self.blocks_dropped:
                    log.warning("warning: KV blocks are not written to %s: %s", self.folder, e)
                self.blocks_dropped += 1
            finally:
                with self.lock:
                    self.pending.pop(block_hash, None)
                self.queue.task_done()

    def _trim(self) -> None:
        """Delete the least recently used blocks beyond the capacity."""
        while True:
            with self.lock:
                if len(self.index) <= self.capacity:
                    return
                block_hash, _ = self.index.popitem(last=False)
            self._path(block_hash).unlink(missing_ok=True)

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}.kv"
