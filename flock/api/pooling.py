"""The pooling APIs' bodies by kind: embeddings, scores and reranks, classifications."""

from flock.api.classify import ClassifyRequest, parse_classify
from flock.api.embeddings import EmbeddingRequest, parse_embeddings
from flock.api.scores import ScoreRequest, parse_scores
from flock.pooling_params import ModelTasks

KINDS = ("embedding", "score", "rerank", "classify")  # requests whose prompts are pooled, not generated from

PoolingRequest = EmbeddingRequest | ScoreRequest | ClassifyRequest


def pooling_request(kind: str, body, tokenizer, model: ModelTasks) -> PoolingRequest:
    """A body of one of the KINDS, checked (APIError names the bad field)."""
    if kind == "embedding":
        return parse_embeddings(body, tokenizer)
    if kind == "classify":
        return parse_classify(body, tokenizer, model.labels)
    return parse_scores(kind, body, tokenizer, model)
