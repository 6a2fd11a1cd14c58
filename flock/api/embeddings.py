"""POST /v1/embeddings, as OpenAI and vLLM's server answer it for a decoder model (see PoolingParams): `input`
texts or token ids, or, as vLLM takes them, a chat's `messages` through the chat template."""

import base64
import time
import uuid
from dataclasses import dataclass

import numpy as np

from flock.api.protocol import APIError, chat_token_ids, prompt_list, check_fields, typed_field
from flock.pooling_params import PoolingParams

FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "add_special_tokens",
          "normalize"}
CHAT_FIELDS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template"}
ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    prompts: list[list[int]]  # the token ids of each input
    params: PoolingParams
    encoding: str  # of the vectors in the response: float or base64

    @staticmethod
    def rejected(e: ValueError) -> APIError:
        return rejected(e)

    def body(self, model: str, vectors: list[list[float]], prompt_tokens: int) -> dict:
        data = [{"index": i, "object": "embedding", "embedding": _encoded(v, self.encoding)}
                for i, v in enumerate(vectors)]
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def parse_embeddings(body, tokenizer) -> EmbeddingRequest:
    """A request body, checked (APIError names the bad field)."""
    prompts = pooled_prompts(body, tokenizer, FIELDS)
    return EmbeddingRequest(prompts, _params(body), _encoding(body))


def pooled_prompts(body, tokenizer, fields: set[str]) -> list[list[int]]:
    """The token ids of a pooling body's `input` (texts with special tokens: an embedding model's end-of-text
    token), or of its chat's `messages` through the chat template; APIError names a field not in `fields`."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    chat = "messages" in body
    if chat and "input" in body:
        raise APIError("a body has a chat's messages or an input, not both", param="input")
    check_fields(body, fields | (CHAT_FIELDS if chat else set()))
    if chat:
        return [chat_token_ids({"add_generation_prompt": False} | body, tokenizer)]  # vLLM's default for pooling
    return prompt_list(body, "input", tokenizer)[1]


def _params(body: dict) -> PoolingParams:
    return PoolingParams(dimensions=typed_field(body, "dimensions", int, None),
                         normalize=typed_field(body, "normalize", bool, True),
                         truncate_prompt_tokens=typed_field(body, "truncate_prompt_tokens", int, None))


def _encoding(body: dict) -> str:
    encoding = typed_field(body, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise APIError(f"encoding_format must be one of {', '.join(ENCODINGS)}, got {encoding!r}",
                       param="encoding_format")
    return encoding


def rejected(e: ValueError) -> APIError:
    """The engine's rejection of an input, naming the field its message starts with (else the input)."""
    first = str(e).split(" ", 1)[0]
    return APIError(str(e), param=first if first in FIELDS else "input")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """As OpenAI sends them: the numbers, or base64 of their little-endian float32 bytes."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
