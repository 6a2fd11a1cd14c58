"""The pooling APIs' bodies by kind: embeddings, scores and reranks, classifications, and vLLM's generic /pooling
(an embedding or a classification by its `task`, of the prompt or of each of its tokens, each answered as
`data`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from flock.api.classify import ClassifyRequest, parse_classify
from flock.api.embeddings import EmbeddingRequest, parse_embeddings
from flock.api.protocol import APIError
from flock.api.scores import ScoreRequest, parse_scores
from flock.pooling_params import TASKS, ModelTasks

KINDS = ("embedding", "score", "rerank", "classify", "pooling")  # requests whose prompts are pooled


@dataclass
class GenericPoolingRequest:
    """vLLM's /pooling: an embedding or classification body (by `task`; the model's own by default) whose
    vectors come back as each item's `data`."""

    inner: EmbeddingRequest | ClassifyRequest

    @property
    def prompts(self) -> list[list[int]]:
        return self.inner.prompts

    @property
    def params(self):
        return self.inner.params

    def rejected(self, e: ValueError) -> APIError:
        return self.inner.rejected(e)

    def body(self, model: str, vectors: list[list[float]], prompt_tokens: int) -> dict:
        if self.params.task.startswith("token_"):  # a vector of each token, as floats
            data = list(enumerate(vectors))
        else:
            key = "embedding" if isinstance(self.inner, EmbeddingRequest) else "probs"
            data = [(d["index"], d[key]) for d in self.inner.body(model, vectors, prompt_tokens)["data"]]
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "pooling", "data": v} for i, v in data],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


PoolingRequest = EmbeddingRequest | ScoreRequest | ClassifyRequest | GenericPoolingRequest


def pooling_request(kind: str, body, tokenizer, model: ModelTasks) -> PoolingRequest:
    """A body of one of the KINDS, checked (APIError names the bad field)."""
    if kind == "embedding":
        return parse_embeddings(body, tokenizer)
    if kind == "classify":
        return parse_classify(body, tokenizer, model.labels)
    if kind == "pooling":
        return GenericPoolingRequest(_pooled(body, tokenizer, model))
    return parse_scores(kind, body, tokenizer, model)


def _pooled(body, tokenizer, model: ModelTasks) -> EmbeddingRequest | ClassifyRequest:
    task = body.get("task") if isinstance(body, dict) else None
    if task is None:
        task = "token_classify" if model.token_classifier else "classify" if model.num_labels else "embed"
    if task not in TASKS:
        raise APIError(f"task {task!r} is not supported (supported: {', '.join(TASKS)}; plugins are not run)",
                       param="task")
    rest = {k: v for k, v in body.items() if k != "task"}
    inner = parse_embeddings(rest, tokenizer) if task.endswith("embed") else \
        parse_classify(rest, tokenizer, model.labels)
    if task.startswith("token_") and getattr(inner, "encoding", "float") != "float":
        raise APIError("a token task's vectors come as floats (encoding_format float)", param="encoding_format")
    inner.params.task = task
    return inner
