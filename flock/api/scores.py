"""vLLM's score and rerank APIs (`/score`, `/v1/score`; `/rerank`, `/v1/rerank`, `/v2/rerank`, Jina's and
Cohere's shape), as vLLM serves them: for an embedding model (a bi-encoder) each text is embedded alone and a
pair's score is the cosine similarity of its two embeddings; for a sequence classifier of one label (a
cross-encoder, a reranker) each pair is one prompt (`cross_encoder_prompt`) and its score the classifier's.

Score: `text_1` and `text_2` (or `queries` and `documents`/`items`, or `data_1` and `data_2`), each a string or a
list; one text on the left is scored against every text on the right, else they pair up in order. Rerank: a
`query` against `documents` (strings or `{"text": ...}`), the results sorted by relevance, the best `top_n`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from flock.api.embeddings import POOLING_FIELDS, pooling_params
from flock.api.protocol import APIError, check_fields, typed_field
from flock.pooling_params import ModelTasks, PoolingParams, cross_encoder_prompt, pair_scores

_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
_COMMON = {"model", "truncate_prompt_tokens", "user", "chat_template_kwargs", "use_activation", "instruction",
           "max_tokens_per_query", "max_tokens_per_doc", *POOLING_FIELDS}
SCORE_FIELDS = _COMMON | {name for pair in _PAIRS for name in pair}
RERANK_FIELDS = _COMMON | {"query", "documents", "top_n", "return_documents"}


@dataclass
class ScoreRequest:
    kind: str  # "score" | "rerank"
    left: list[str]  # the queries (one for rerank)
    right: list[str]  # the documents
    prompts: list[list[int]]  # token ids: left's, then right's (a cross-encoder's: each pair's)
    params: PoolingParams
    top_n: int = 0  # rerank: how many results (0: all)
    return_documents: bool = True
    cross: bool = False  # a cross-encoder's: one prompt, and one score, per pair

    @staticmethod
    def rejected(e: ValueError) -> APIError:
        """The engine's rejection of a text (which one, the message says)."""
        return APIError(str(e))

    def body(self, model: str, vectors: list[list[float]], prompt_tokens: int) -> dict:
        """The response, from the embeddings of `prompts` in order."""
        scores = self.scores(vectors)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        if self.kind == "score":
            return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    "usage": usage}
        results = sorted(({"index": i, "relevance_score": s}
                          | ({"document": {"text": self.right[i]}} if self.return_documents else {})
                          for i, s in enumerate(scores)), key=lambda r: -r["relevance_score"])
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": usage,
                "results": results[: self.top_n or None]}

    def scores(self, vectors: list[list[float]]) -> list[float]:
        if self.cross:
            return [v[0] for v in vectors]
        return pair_scores(vectors[: len(self.left)], vectors[len(self.left):])


def parse_scores(kind: str, body, tokenizer, model: ModelTasks | None = None) -> ScoreRequest:
    """A /score (kind "score") or /rerank (kind "rerank") body, checked (APIError names the bad field); `model`:
    what the model serves (a classifier scores pairs as a cross-encoder)."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, SCORE_FIELDS if kind == "score" else RERANK_FIELDS)
    if kind == "score":
        names = next((pair for pair in _PAIRS if pair[0] in body and pair[1] in body), None)
        if names is None:
            raise APIError("a score body needs text_1 and text_2 (or queries and documents)", param="text_1")
        left, right = (_texts(body, name) for name in names)
        if len(left) != 1 and len(left) != len(right):
            raise APIError(f"{names[0]} must hold one text or as many as {names[1]} ({len(left)} vs {len(right)})",
                           param=names[0])
        top_n, documents = 0, True
    else:
        left, right = [_text(body.get("query"), "query")], _texts(body, "documents")
        top_n = typed_field(body, "top_n", int, 0)
        if top_n < 0:
            raise APIError(f"top_n must be at least 0, got {top_n}", param="top_n")
        documents = typed_field(body, "return_documents", bool, True)
    left, right = (_cut(body, name, texts, tokenizer) for name, texts in (("max_tokens_per_query", left),
                                                                             ("max_tokens_per_doc", right)))
    params = pooling_params(body)
    kwargs = typed_field(body, "chat_template_kwargs", dict, None)
    if typed_field(body, "instruction", str, None) is not None:  # vLLM's shorthand; the kwargs' own wins
        kwargs = {"instruction": body["instruction"]} | (kwargs or {})
    if kwargs is not None and (model is None or model.score_template is None):
        raise APIError("chat_template_kwargs fills a cross-encoder's score template (serve it with --chat-template)",
                       param="chat_template_kwargs")
    if model is not None and model.num_labels:
        if model.num_labels != 1:
            raise APIError(f"{model.name} classifies into {model.num_labels} classes: scores need a classifier of "
                           "one label (a cross-encoder); use /classify", param="model")
        pairs = zip(left * len(right) if len(left) == 1 else left, right)
        try:
            prompts = [cross_encoder_prompt(tokenizer, a, b, model, kwargs, params.truncate_prompt_tokens)
                       for a, b in pairs]
        except Exception as e:  # the score template's own errors (jinja2's kinds)
            raise APIError(f"the score template failed on this pair: {e}", param="chat_template_kwargs") from None
        params = replace(params, task="classify", use_activation=typed_field(body, "use_activation", bool, True),
                         pair=model.encodes_pairs)
        return ScoreRequest(kind, left, right, prompts, params, top_n, documents, True)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in left + right]
    return ScoreRequest(kind, left, right, prompts, params, top_n, documents)


def _cut(body: dict, name: str, texts: list[str], tokenizer) -> list[str]:
    """The texts cut to their first `body[name]` tokens (vLLM's max_tokens_per_query / _doc; 0: whole), at a
    character boundary of the original text."""
    limit = typed_field(body, name, int, 0)
    if limit < 0:
        raise APIError(f"{name} must be at least 0, got {limit}", param=name)
    return [_first_tokens(t, tokenizer, limit) for t in texts] if limit else texts


def _first_tokens(text: str, tokenizer, limit: int) -> str:
    while True:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        if len(offsets) <= limit:
            return text
        text = text[: min(offsets[limit - 1][1], offsets[limit][0])]


def _texts(body: dict, name: str) -> list[str]:
    value = body.get(name)
    texts = [_text(v, f"{name}[{i}]") for i, v in enumerate(value)] if isinstance(value, list) else \
        [_text(value, name)]
    if not texts:
        raise APIError(f"{name} is empty", param=name)
    return texts


def _text(value, name: str) -> str:
    """A text: a string (an empty chunk of a RAG batch too, as vLLM), or a document's {"text": ...}."""
    if isinstance(value, dict) and set(value) == {"text"}:
        value = value["text"]
    if not isinstance(value, str):
        raise APIError(f"{name} must be a string (or {{'text': string}})", param=name.split("[")[0])
    return value
