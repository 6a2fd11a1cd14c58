"""OpenAI's Files and Batch APIs on `flock serve` (`/v1/files`, `/v1/batches`), as SGLang's server has them: a
pipeline written against OpenAI's Batch API (upload a JSONL file, create a batch, poll it, download its output)
runs unchanged.

A batch's lines are `flock run`'s Batch lines (flock/api/batch_input.py), each posted to the server's own endpoint
in process (the same validation, answers and errors as over HTTP), many at once so that the scheduler sees them
together (prefix-aware, as every request is); a line's answer goes to the output file, a bad line or a request
refused to the error file, each a record in OpenAI's Batch output format. Files and batches are kept in a folder
of their own (`--batch-dir`) and in memory: a restart forgets them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flock.api.batch_input import URLS, LineError, parse_line
from flock.api.batch_output import error_record
from flock.api.protocol import APIError, cursor_page

PURPOSES = ("batch", "batch_output")
COMPLETION_WINDOWS = ("24h",)
IN_FLIGHT = 256  # a batch's lines posted at once
RETRY_WAIT = (0.05, 1.0)  # seconds between a line's tries while the server's waiting queue is full: first, most


def not_found(kind: str, name: str, param: str) -> APIError:
    return APIError(f"no {kind} {name!r}", param=param, status=404, code="not_found")


async def post_all(app, headers: dict, in_flight: int, endpoint: str, lines: list[tuple[str, dict]],
                   on_reply: Callable[[str, httpx.Response], None]) -> None:
    """Post every (custom_id, body) to `endpoint` of the ASGI `app` in process, `in_flight` at a time; each reply
    to `on_reply` as it comes. A line the server's full waiting queue refuses (429) waits and is posted again: a
    batch is a queued job, its lines wait for room rather than fail."""
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flock", headers=headers,
                                 timeout=None) as client:
        async def post(custom_id: str, body: dict) -> None:
            wait = RETRY_WAIT[0]
            async with gate:
                while (reply := await client.post(endpoint, json=body)).status_code == 429:
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, RETRY_WAIT[1])
            on_reply(custom_id, reply)

        await asyncio.gather(*(post(custom_id, body) for custom_id, body in lines))


class FileStore:
    """Uploaded files and batches' outputs: their content in `folder` (None: a temporary folder, made on the first
    file), their objects in memory."""

    def __init__(self, folder: str | Path | None = None):
        self.given = None if folder is None else Path(folder)
        self.files: dict[str, dict] = {}

    @functools.cached_property
    def folder(self) -> Path:
        if self.given is None:
            return Path(tempfile.mkdtemp(prefix="flock-batches-"))
        self.given.mkdir(parents=True, exist_ok=True)
        return self.given

    def create(self, filename: str, data: bytes, purpose: str) -> dict:
        if purpose not in PURPOSES:
            raise APIError(f"purpose must be one of {list(PURPOSES)}, got {purpose!r}", param="purpose")
        file_id = "file-" + uuid.uuid4().hex
        self.path(file_id).write_bytes(data)
        self.files[file_id] = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                               "filename": filename, "purpose": purpose}
        return self.files[file_id]

    def get(self, file_id: str) -> dict:
        if file_id not in self.files:
            raise not_found("file", file_id, "file_id")
        return self.files[file_id]

    def path(self, file_id: str) -> Path:
        return self.folder / file_id

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        del self.files[file_id]
        self.path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def listing(self, purpose: str | None = None, order: str = "desc", limit: int = 10000,
                after: str | None = None) -> dict:
        """The files (of `purpose`), the newest first unless `order` is "asc", `limit` after the one `after` names."""
        data = [f for f in self.files.values() if purpose in (None, f["purpose"])]
        return cursor_page(data if order == "asc" else data[::-1], after, limit)


@dataclass
class Batch:
    body: dict  # the object OpenAI's clients read, but its request counts
    task: asyncio.Task | None = None
    total: int = 0  # its lines, once read
    records: list[dict] = field(default_factory=list)  # answers so far
    errors: list[dict] = field(default_factory=list)  # error records so far

    def object(self) -> dict:
        counts = {"total": self.total, "completed": len(self.records), "failed": len(self.errors)}
        return self.body | {"request_counts": counts}


class BatchService:
    """Batches of lines run through the server's own app (`app`: the ASGI app; `api_key`: what it asks for)."""

    def __init__(self, files: FileStore, app, api_key: str | None = None, in_flight: int = IN_FLIGHT):
        self.files, self.app, self.in_flight = files, app, in_flight
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.batches: dict[str, Batch] = {}

    def create(self, body) -> dict:
        """Check a POST /v1/batches body and start the batch (in the background)."""
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise APIError("input_file_id must be a string", param="input_file_id")
        if self.files.get(file_id)["purpose"] != "batch":
            raise APIError(f"file {file_id!r} is not a batch input (purpose 'batch')", param="input_file_id")
        endpoint = body.get("endpoint")
        if endpoint not in URLS:
            raise APIError(f"endpoint must be one of {list(URLS)}, got {endpoint!r}", param="endpoint")
        if body.get("completion_window", "24h") not in COMPLETION_WINDOWS:
            raise APIError(f"completion_window must be '24h', got {body.get('completion_window')!r}",
                           param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise APIError("metadata must be an object", param="metadata")
        now = int(time.time())
        batch = Batch({"id": "batch_" + uuid.uuid4().hex, "object": "batch", "endpoint": endpoint, "errors": None,
                       "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                       "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                       "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                       "expired_at": None, "cancelling_at": None, "cancelled_at": None, "metadata": metadata})
        self.batches[batch.body["id"]] = batch
        batch.task = asyncio.create_task(self._run(batch))
        return batch.object()

    def get(self, batch_id: str) -> dict:
        if batch_id not in self.batches:
            raise not_found("batch", batch_id, "batch_id")
        return self.batches[batch_id].object()

    def listing(self, after: str | None = None, limit: int = 20) -> dict:
        """The batches, the newest first, `limit` after the one `after` names."""
        return cursor_page([b.object() for b in reversed(self.batches.values())], after, limit)

    def cancel(self, batch_id: str) -> dict:
        """Stop a batch: its lines in flight are aborted; what finished is kept in its files."""
        self.get(batch_id)
        batch = self.batches[batch_id]
        if batch.body["status"] in ("validating", "in_progress"):
            batch.body |= {"status": "cancelling", "cancelling_at": int(time.time())}
            batch.task.cancel()
        return batch.object()

    def shutdown(self) -> None:
        for batch in self.batches.values():
            if batch.task is not None:
                batch.task.cancel()

    async def _run(self, batch: Batch) -> None:
        body = batch.body
        try:
            lines = self._lines(batch)
            body |= {"status": "in_progress", "in_progress_at": int(time.time())}
            batch.total = len(lines) + len(batch.errors)
            await post_all(self.app, self.headers, self.in_flight, body["endpoint"],
                           [(line.custom_id, line.body) for line in lines],
                           lambda custom_id, reply: self._record(batch, custom_id, reply))
            self._finish(batch, "completed")
        except asyncio.CancelledError:
            self._finish(batch, "cancelled")
        except Exception as e:  # noqa: BLE001 - a batch that cannot run says why, the server goes on
            body["errors"] = {"object": "list", "data": [{"code": "internal_error", "message": str(e)}]}
            self._finish(batch, "failed")

    def _lines(self, batch: Batch) -> list:
        """The input's Batch lines for this endpoint; bad ones become error records now."""
        lines, seen = [], set()
        raw = self.files.path(batch.body["input_file_id"]).read_bytes().splitlines()
        for number, text in enumerate(raw, 1):
            if not text.strip():
                continue
            try:
                line = parse_line(text, number)
                if URLS[batch.body["endpoint"]] != line.kind:
                    raise LineError(number, f"this line's url is not the batch's endpoint {batch.body['endpoint']}",
                                    line.custom_id, param="url")
                if line.body.get("stream"):
                    raise LineError(number, "stream is not supported in a batch", line.custom_id, param="stream")
                if line.custom_id in seen:
                    raise LineError(number, f"duplicate custom_id {line.custom_id!r}", line.custom_id,
                                    "duplicate_custom_id", "custom_id")
                seen.add(line.custom_id)
                lines.append(line)
            except LineError as e:
                batch.errors.append(error_record(e.custom_id, e.number, e.message, e.code, e.param))
        return lines

    def _record(self, batch: Batch, custom_id: str, reply: httpx.Response) -> None:
        answer = reply.json()
        request_id = answer.get("id", "") if isinstance(answer, dict) else ""
        record = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
                  "response": {"status_code": reply.status_code, "request_id": request_id, "body": answer},
                  "error": None}
        (batch.records if reply.status_code == 200 else batch.errors).append(record)

    def _finish(self, batch: Batch, status: str) -> None:
        """Write what the batch answered into its output and error files; it ends as `status`."""
        body, now = batch.body, int(time.time())
        body |= {"finalizing_at": now} if status == "completed" else {}
        for records, key in ((batch.records, "output_file_id"), (batch.errors, "error_file_id")):
            if records:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
                name = f"{body['id']}_{key.split('_')[0]}.jsonl"
                body[key] = self.files.create(name, data, "batch_output")["id"]
        body |= {"status": status, f"{status}_at": now}
