"""vLLM's classification API (`/classify`, and SGLang's `/v1/classify`) for a sequence classifier: `input` texts
or token ids, or a chat's `messages` through the chat template; each answered with its class probabilities
(logits with `use_activation` false) and its most likely label."""

import time
import uuid
from dataclasses import dataclass

from flock.api import embeddings
from flock.api.protocol import APIError, typed_field
from flock.pooling_params import PoolingParams

FIELDS = {"model", "input", "user", "truncate_prompt_tokens", "add_special_tokens", "use_activation",
          *embeddings.POOLING_FIELDS}


@dataclass
class ClassifyRequest:
    prompts: list[list[int]]
    params: PoolingParams
    labels: tuple[str, ...]  # the model's, by class

    @staticmethod
    def rejected(e: ValueError) -> APIError:
        return embeddings.rejected(e)

    def body(self, model: str, vectors: list[list[float]], prompt_tokens: int) -> dict:
        data = [{"index": i, "label": self.labels[max(range(len(v)), key=v.__getitem__)], "probs": v,
                 "num_classes": len(v)} for i, v in enumerate(vectors)]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                                        "completion_tokens": 0, "prompt_tokens_details": None}}


def parse_classify(body, tokenizer, labels: tuple[str, ...]) -> ClassifyRequest:
    """A request body, checked (APIError names the bad field)."""
    prompts = embeddings.pooled_prompts(body, tokenizer, FIELDS)
    params = embeddings.pooling_params(body, task="classify",
                                       use_activation=typed_field(body, "use_activation", bool, True))
    return ClassifyRequest(prompts, params, labels)
