"""POST /v1/embeddings, as OpenAI and vLLM's server answer it for a decoder model (see PoolingParams): `input`
texts or token ids, or, as vLLM takes them, a chat's `messages` through the chat template."""

import base64
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from flock.api.protocol import APIError, chat_token_ids, check_fields, prompt_list, typed_field
from flock.pooling_params import PoolingParams

# vLLM's fields of every pooling request (besides truncate_prompt_tokens): pooling_params takes them
POOLING_FIELDS = {"truncation_side", "priority", "cache_salt", "request_id", "mm_processor_kwargs", "padding"}
FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "add_special_tokens",
          "normalize", "use_activation", "embed_dtype", "endianness", *POOLING_FIELDS}
CHAT_FIELDS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template"}
ENCODINGS = ("float", "base64")
# vLLM's embed_dtype: how base64 writes each value, and the type its bits are read as (numpy has no bfloat16, fp8)
EMBED_DTYPES = {"float32": (torch.float32, torch.float32), "float16": (torch.float16, torch.float16),
                "bfloat16": (torch.bfloat16, torch.int16), "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
                "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}
ENDIANNESS = ("native", "little", "big")


@dataclass
class EmbeddingRequest:
    prompts: list[list[int]]  # the token ids of each input
    params: PoolingParams
    encoding: str  # of the vectors in the response: float or base64
    dtype: str = "float32"  # base64's: vLLM's embed_dtype
    byte_order: str = "native"  # base64's: vLLM's endianness

    @staticmethod
    def rejected(e: ValueError) -> APIError:
        return rejected(e)

    def body(self, model: str, vectors: list[list[float]], prompt_tokens: int) -> dict:
        data = [{"index": i, "object": "embedding", "embedding": self._encoded(v)} for i, v in enumerate(vectors)]
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    def _encoded(self, vector: list[float]) -> list[float] | str:
        """As OpenAI and vLLM send them: the numbers, or base64 of their bytes (float32, or `dtype`, in the
        machine's byte order unless `byte_order` says)."""
        if self.encoding == "float":
            return vector
        kind, bits = EMBED_DTYPES[self.dtype]
        array = torch.tensor(vector, dtype=torch.float32).to(kind).view(bits).numpy()
        if self.byte_order not in ("native", sys.byteorder):
            array = array.byteswap()
        return base64.b64encode(array.tobytes()).decode()


def parse_embeddings(body, tokenizer) -> EmbeddingRequest:
    """A request body, checked (APIError names the bad field)."""
    prompts = pooled_prompts(body, tokenizer, FIELDS)
    dtype = _choice(body, "embed_dtype", tuple(EMBED_DTYPES), "float32")
    return EmbeddingRequest(prompts, _params(body), _choice(body, "encoding_format", ENCODINGS, "float"), dtype,
                            _choice(body, "endianness", ENDIANNESS, "native"))


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
    normalize = typed_field(body, "normalize", bool, None)  # vLLM's older name of use_activation; None: the model's
    return pooling_params(body, dimensions=typed_field(body, "dimensions", int, None),
                          normalize=typed_field(body, "use_activation", bool, normalize))


def pooling_params(body: dict, **given) -> PoolingParams:
    """PoolingParams of a pooling body's fields every kind takes (vLLM's: truncation, priority, cache_salt;
    request_id names nothing a response carries; prompts are never padded) and `given`."""
    if typed_field(body, "padding", str, "do_not_pad") != "do_not_pad":
        raise APIError("padding 'max_length' is not supported (prompts are never padded)", param="padding")
    if typed_field(body, "mm_processor_kwargs", dict, {}):
        raise APIError("mm_processor_kwargs is not supported", param="mm_processor_kwargs")
    typed_field(body, "request_id", str, None)
    return PoolingParams(truncate_prompt_tokens=typed_field(body, "truncate_prompt_tokens", int, None),
                         truncation_side=typed_field(body, "truncation_side", str, None),
                         priority=typed_field(body, "priority", int, 0),
                         cache_salt=typed_field(body, "cache_salt", str, None), **given)


def _choice(body: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    value = typed_field(body, name, str, default)
    if value not in choices:
        raise APIError(f"{name} must be one of {', '.join(choices)}, got {value!r}", param=name)
    return value


def rejected(e: ValueError) -> APIError:
    """The engine's rejection of an input, naming the field its message starts with (else the input)."""
    first = str(e).split(" ", 1)[0]
    return APIError(str(e), param=first if first in FIELDS else "input")

