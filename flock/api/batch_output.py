"""The output and error files of a batch job, in OpenAI Batch format, written so that no work is lost.

Each record is one `os.write` of a whole line as soon as its request finishes, so a killed process loses
nothing it finished; `fsync` runs every `sync_every` records or `sync_seconds`, and on close, which bounds
what a power loss can take (it is recomputed on resume). A crash can still leave a torn last line;
`load_records` cuts it away before a resumed job appends.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("flock")


class CorruptFileError(ValueError):
    pass


def result_record(custom_id: str, request_id: str, body: dict) -> dict:
    return {"id": _batch_request_id(), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_record(custom_id: str | None, line: int, message: str, code: str = "invalid_request",
                 param: str | None = None) -> dict:
    error = {"code": code, "message": f"line {line}: {message}", "param": param, "line": line}
    return {"id": _batch_request_id(), "custom_id": custom_id, "response": None, "error": error}


def _batch_request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def load_records(path: Path) -> list[dict]:
    """The records of an existing output or error file. A tail that is not whole records (a line torn by a
    crash, or garbage a power loss left) is truncated away with a warning; a bad line followed by good ones
    means the file is not ours to repair and raises CorruptFileError."""
    data = path.read_bytes()
    records, pos = [], 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        record = _record(data[pos:end]) if end >= 0 else None
        if record is None and data[pos : (end if end >= 0 else len(data))].strip():
            break
        if record is not None:
            records.append(record)
        pos = end + 1 if end >= 0 else len(data)
    if pos < len(data):
        if any(_record(line) for line in data[pos:].split(b"\n")[1:]):
            line = data.count(b"\n", 0, pos) + 1
            raise CorruptFileError(f"{path}: line {line} is not a batch record, but records follow it; "
                                   "fix or remove the file")
        log.warning("warning: %s ends with an incomplete record (%d bytes, torn by a crash); truncating it",
                    path, len(data) - pos)
        with open(path, "r+b") as f:
            f.truncate(pos)
            os.fsync(f.fileno())
    return records


def drop_records(path: Path, dropped: Callable[[dict], bool]) -> None:
    """Rewrite a records file without those `dropped` says, atomically (a crash leaves the old file or the new)."""
    target = path.resolve()
    kept = [r for r in load_records(target) if not dropped(r)]
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return record if isinstance(record, dict) and "custom_id" in record else None


class JsonlAppender:
    """Appends records to a JSONL file, creating it on the first write (or on `open`)."""

    def __init__(self, path: Path, sync_every: int = 64, sync_seconds: float = 1.0):
        self.path, self.sync_every, self.sync_seconds = path, sync_every, sync_seconds
        self.fd: int | None = None
        self.unsynced = 0
        self.synced_at = time.monotonic()
        self.written = 0

    def open(self) -> None:
        if self.fd is not None:
            return
        created = not self.path.exists()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if created:  # the new directory entry must survive a power loss too
            _fsync_dir(self.path.parent)

    def write(self, record: dict) -> None:
        self.open()
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode())
        while data:
            data = data[os.write(self.fd, data) :]
        self.written += 1
        self.unsynced += 1
        if self.unsynced >= self.sync_every:
            self.sync()

    def tick(self) -> None:
        """Sync if records have waited longer than `sync_seconds`; called from the step loop."""
        if self.unsynced and time.monotonic() - self.synced_at >= self.sync_seconds:
            self.sync()

    def sync(self) -> None:
        if self.fd is not None and self.unsynced:
            os.fsync(self.fd)
        self.unsynced = 0
        self.synced_at = time.monotonic()

    def close(self) -> None:
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
