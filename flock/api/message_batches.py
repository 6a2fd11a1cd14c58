"""Anthropic's Message Batches API on `flock serve` (`/v1/messages/batches`): a batch of Messages requests
(`requests: [{custom_id, params}]`) runs as OpenAI batches do (flock/api/batches.py: each request posted to
/v1/messages in process, many at once), and its results come back as Anthropic's JSONL: `succeeded` with the
Message, `errored` with the error (a request the endpoint refuses), or `canceled`. Kept in memory: a restart
forgets them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field

import httpx

from flock.api.batches import IN_FLIGHT, not_found, post_all
from flock.api.protocol import APIError

_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_REQUESTS = 100_000


def _time(seconds: float | None) -> str | None:
    return None if seconds is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass
class MessageBatch:
    id: str
    custom_ids: list[str]
    created: float = field(default_factory=time.time)
    results: dict[str, dict] = field(default_factory=dict)  # custom_id -> its result, as they come
    canceling: float | None = None
    ended: float | None = None
    task: asyncio.Task | None = None

    def body(self, base_url: str) -> dict:
        """The MessageBatch object (`base_url`: the server's, for results_url)."""
        kinds = [r["type"] for r in self.results.values()]
        counts = {k: kinds.count(k) for k in ("succeeded", "errored", "canceled", "expired")}
        counts["processing"] = len(self.custom_ids) - len(self.results)
        status = "ended" if self.ended else "canceling" if self.canceling else "in_progress"
        return {"id": self.id, "type": "message_batch", "processing_status": status, "request_counts": counts,
                "created_at": _time(self.created), "expires_at": _time(self.created + 24 * 3600),
                "ended_at": _time(self.ended), "cancel_initiated_at": _time(self.canceling), "archived_at": None,
                "results_url": f"{base_url}v1/messages/batches/{self.id}/results" if self.ended else None}


class MessageBatches:
    """Message batches run through the server's own app (`app`: the ASGI app; `headers`: what it asks for)."""

    def __init__(self, app, headers: dict, in_flight: int = IN_FLIGHT):
        self.app, self.headers, self.in_flight = app, headers, in_flight
        self.batches: dict[str, MessageBatch] = {}

    def create(self, body) -> MessageBatch:
        """Check a POST /v1/messages/batches body and start the batch (in the background). A request's params are
        checked by /v1/messages when it runs: a bad one is an errored result, as Anthropic's are."""
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not 0 < len(requests) <= MAX_REQUESTS:
            raise APIError(f"requests must be a list of 1 to {MAX_REQUESTS:,} {{custom_id, params}}", param="requests")
        lines, seen = [], set()
        for i, r in enumerate(requests):
            custom_id = r.get("custom_id") if isinstance(r, dict) else None
            if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id) or custom_id in seen:
                raise APIError(f"requests[{i}].custom_id must be 1 to 64 letters, digits, _ or -, unique in the "
                               f"batch, got {custom_id!r}", param=f"requests[{i}].custom_id")
            if not isinstance(r.get("params"), dict):
                raise APIError(f"requests[{i}].params must be a Messages request body", param=f"requests[{i}].params")
            seen.add(custom_id)
            lines.append((custom_id, r["params"] | {"stream": False}))
        batch = MessageBatch("msgbatch_" + uuid.uuid4().hex, [c for c, _ in lines])
        self.batches[batch.id] = batch
        batch.task = asyncio.create_task(self._run(batch, lines))
        return batch

    def get(self, batch_id: str) -> MessageBatch:
        if batch_id not in self.batches:
            raise not_found("message batch", batch_id, "message_batch_id")
        return self.batches[batch_id]

    def listing(self, base_url: str, after_id: str | None = None, limit: int = 20) -> dict:
        """The batches, the newest first, `limit` after `after_id`."""
        ids = list(self.batches)[::-1]
        start = ids.index(after_id) + 1 if after_id in ids else 0
        page = ids[start : start + limit]
        return {"data": [self.batches[i].body(base_url) for i in page], "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None, "has_more": start + limit < len(ids)}

    def cancel(self, batch_id: str) -> MessageBatch:
        batch = self.get(batch_id)
        if batch.ended is None and batch.canceling is None:
            batch.canceling = time.time()
            batch.task.cancel()
        return batch

    def delete(self, batch_id: str) -> dict:
        if self.get(batch_id).ended is None:
            raise APIError(f"message batch {batch_id!r} is still processing: cancel it first",
                           param="message_batch_id")
        del self.batches[batch_id]
        return {"id": batch_id, "type": "message_batch_deleted"}

    def results(self, batch_id: str) -> bytes:
        """The ended batch's results, a JSON line each."""
        batch = self.get(batch_id)
        if batch.ended is None:
            raise APIError(f"message batch {batch_id!r} has not ended yet", param="message_batch_id")
        return "".join(json.dumps({"custom_id": c, "result": r}, ensure_ascii=False) + "\n"
                       for c, r in batch.results.items()).encode()

    def shutdown(self) -> None:
        for batch in self.batches.values():
            if batch.task is not None:
                batch.task.cancel()

    async def _run(self, batch: MessageBatch, lines: list[tuple[str, dict]]) -> None:
        try:
            await post_all(self.app, self.headers, self.in_flight, "/v1/messages", lines,
                           lambda custom_id, reply: self._result(batch, custom_id, reply))
        except asyncio.CancelledError:
            pass
        finally:
            for custom_id in batch.custom_ids:
                batch.results.setdefault(custom_id, {"type": "canceled"})
            batch.ended = time.time()

    @staticmethod
    def _result(batch: MessageBatch, custom_id: str, reply: httpx.Response) -> None:
        answer = reply.json()
        batch.results[custom_id] = {"type": "succeeded", "message": answer} if reply.status_code == 200 else \
            {"type": "errored", "error": answer}
