"""The pooling APIs' bodies by kind: embeddings, scores and reranks, classifications, and vLLM's generic /pooling
(an embedding or a classification by its `task`, each vector answered as `data`)."""

from __future__ import annotations

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
        inner = self.inner.body(model, vectors, prompt_tokens)
        key = "embedding" if isinstance(self.inner, EmbeddingRequest) else "probs"
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": inner["created"], "model": model,
                "data": [{"index": d["index"], "object": "pooling", "data": d[key]} for d in inner["data"]],
                "usage": inner["usage"]}


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
        task = "classify" if model.num_labels else "embed"
    if task not in TASKS:
        raise APIError(f"task {task!r} is not supported: Flock pools a prompt's last token ({', '.join(TASKS)}); "
                       "token-level tasks (token_embed, token_classify) and plugins are not run", param="task")
    rest = {k: v for k, v in body.items() if k != "task"}
    return parse_embeddings(rest, tokenizer) if task == "embed" else parse_classify(rest, tokenizer, model.labels)
