"""The input of a batch job: OpenAI Batch lines or plain prompt lines, from JSONL or gzipped JSONL.

A Batch line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions" |
"/v1/responses" | "/v1/messages" | "/v1/embeddings" | "/v1/score" | "/v1/rerank" | "/v1/classify" | "/pooling" |
"/generative_scoring", "body"}` (a /v1/score body with label_token_ids is SGLang's label scoring), or a line of
Anthropic's Message Batches, `{"custom_id", "params"}` (a /v1/messages body).
A plain line is the body itself with `prompt`, `prompt_token_ids` or `messages` (plus any sampling fields);
its custom_id is `line-N` unless it carries one. Bodies are checked later by `flock.api.protocol`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from flock.api.protocol import lone_surrogate

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "response",
        "/v1/messages": "message",
        "/v1/embeddings": "embedding", "/v1/score": "score", "/v1/rerank": "rerank", "/v1/classify": "classify",
        "/generative_scoring": "generative_score", "/pooling": "pooling",
        "/score": "score", "/rerank": "rerank", "/v2/rerank": "rerank", "/classify": "classify"}  # vLLM's too
BATCH_FIELDS = {"custom_id", "method", "url", "body"}


@dataclass
class BatchLine:
    number: int  # 1-based line number in the input
    custom_id: str
    kind: str  # "completion", "chat", "response", "message", one of flock.api.pooling.KINDS, or "generative_score"
    body: dict


class LineError(ValueError):
    """A line that cannot become a request; `custom_id` is None when the line has no readable one."""

    def __init__(self, number: int, message: str, custom_id: str | None = None, code: str = "invalid_request",
                 param: str | None = None):
        super().__init__(message)
        self.number, self.message, self.custom_id, self.code, self.param = number, message, custom_id, code, param


def open_input(path: str) -> BinaryIO:
    """The file, gunzipped on the fly when it starts with the gzip magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_lines(path: str) -> Iterator[BatchLine | LineError]:
    """Every non-blank line, in order, as a BatchLine or the LineError saying why it is not one."""
    with open_input(path) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield parse_line(raw, number)
            except LineError as e:
                yield e


def parse_line(raw: bytes | str, number: int) -> BatchLine:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LineError(number, f"not valid JSON ({e.msg})", code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise LineError(number, f"not valid UTF-8 ({e.reason})", code="invalid_json") from None
    if not isinstance(item, dict):
        raise LineError(number, f"expected a JSON object, got {type(item).__name__}")
    custom_id = item.get("custom_id", f"line-{number}")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(number, f"custom_id must be a non-empty string, got {custom_id!r}", param="custom_id")
    bad = lone_surrogate(custom_id)  # the body's are parse_request's to report; this id could not be written back
    if bad:
        raise LineError(number, f"custom_id {bad}", code="invalid_json", param="custom_id")
    if item.keys() & (BATCH_FIELDS - {"custom_id"}):
        return _batch_line(item, number, custom_id)
    if "params" in item:  # Anthropic's
        if item.keys() - {"custom_id", "params"} or not isinstance(item["params"], dict):
            raise LineError(number, "a Message Batches line is {custom_id, params: a /v1/messages body}", custom_id,
                            param="params")
        return BatchLine(number, custom_id, "message", item["params"])
    return _plain_line(item, number, custom_id)


def _batch_line(item: dict, number: int, custom_id: str) -> BatchLine:
    def fail(message: str, param: str) -> LineError:
        return LineError(number, message, custom_id if "custom_id" in item else None, param=param)

    if "custom_id" not in item:
        raise fail("a Batch line needs a custom_id", "custom_id")
    if item.get("method") != "POST":
        raise fail(f"method must be 'POST', got {item.get('method')!r}", "method")
    kind = URLS.get(item.get("url"))
    if kind is None:
        raise fail(f"url must be one of {list(URLS)}, got {item.get('url')!r}", "url")
    if not isinstance(item.get("body"), dict):
        raise fail("body must be a JSON object", "body")
    return BatchLine(number, custom_id, kind, item["body"])


def _plain_line(item: dict, number: int, custom_id: str) -> BatchLine:
    if "messages" in item and item.keys() & {"prompt", "prompt_token_ids"}:
        raise LineError(number, "a plain line has 'messages' or a prompt ('prompt', 'prompt_token_ids'), not both",
                        custom_id, param="messages")
    body = {k: v for k, v in item.items() if k not in ("custom_id", "prompt_token_ids")}
    if "prompt_token_ids" in item:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise LineError(number, "prompt_token_ids must be a list of integers", custom_id, param="prompt_token_ids")
        body["prompt"] = ids  # token ids win over a text prompt, as in LLM.generate
    elif not item.keys() & {"prompt", "messages"}:
        raise LineError(number, "needs 'prompt', 'prompt_token_ids' or 'messages' (or an OpenAI Batch line)",
                        custom_id)
    return BatchLine(number, custom_id, "chat" if "messages" in item else "completion", body)
