"""Label scoring over HTTP (flock/label_scores.py): vLLM's /generative_scoring (items' token ids joined to the
query's, each item's probability of the first label as its `score`, labels softmaxed by default) and SGLang's
/v1/score with label_token_ids (texts joined as text, every label's probability per item in `scores`, over the
whole vocabulary by default)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from flock.api.protocol import APIError, check_fields, typed_field
from flock.label_scores import LabelQuery
from flock.sampling_params import SamplingParams

_COMMON = {"model", "query", "items", "label_token_ids", "apply_softmax", "item_first"}
FIELDS = {"vllm": _COMMON | {"add_special_tokens", "cache_salt", "priority", "request_id"},
          "sglang": _COMMON | {"rid"}}


@dataclass
class LabelScoreRequest:
    kind: str  # "vllm" | "sglang"
    scoring: LabelQuery
    prompts: list[list[int]]
    params: SamplingParams
    id: str  # the response's

    @staticmethod
    def rejected(e: ValueError) -> APIError:
        return APIError(str(e), param="items")

    def body(self, model: str, tops: list[list[tuple[int, float]]], prompt_tokens: int) -> dict:
        """The response, from each item's listed label logprobs (TokenLogprobs.top) in order."""
        scores = [self.scoring.probabilities(top) for top in tops]
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(tops),
                 "completion_tokens": len(tops)}
        if self.kind == "sglang":
            return {"scores": scores, "model": model, "usage": usage, "object": "scoring"}
        return {"id": self.id, "object": "list", "created": int(time.time()), "model": model, "usage": usage,
                "data": [{"index": i, "object": "score", "score": s[0]} for i, s in enumerate(scores)]}


def parse_label_scores(kind: str, body, tokenizer, vocab_size: int, max_model_len: int) -> LabelScoreRequest:
    """A /generative_scoring (kind "vllm") or SGLang /v1/score (kind "sglang") body, checked: APIError names the
    bad field, or the item whose prompt leaves no room for the one token."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, FIELDS[kind])
    for name in ("query", "items", "label_token_ids"):
        if body.get(name) is None:
            raise APIError(f"{name} is required", param=name)
    vllm = kind == "vllm"
    scoring = LabelQuery(body["query"], body["items"], body["label_token_ids"],
                         apply_softmax=typed_field(body, "apply_softmax", bool, vllm),
                         item_first=typed_field(body, "item_first", bool, False),
                         add_special_tokens=typed_field(body, "add_special_tokens", bool, True), join_text=not vllm)
    if isinstance(scoring.items, str) and not vllm:  # SGLang takes one text item alone
        scoring.items = [scoring.items]
    try:
        scoring.validate(vocab_size)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None
    prompts = scoring.prompts(tokenizer)
    for i, ids in enumerate(prompts):
        if len(ids) >= max_model_len:
            raise APIError(f"items[{i}]: the query and item are {len(ids)} tokens, and the model takes at most "
                           f"{max_model_len - 1} before the scored token", param="items")
    extra = {"cache_salt": typed_field(body, "cache_salt", str, None), "priority": typed_field(body, "priority", int, 0)}
    given = typed_field(body, "request_id" if vllm else "rid", str, None) or uuid.uuid4().hex
    return LabelScoreRequest(kind, scoring, prompts, scoring.params(**extra),
                             f"generative-scoring-{given}" if vllm else f"score-{given}")
