from dataclasses import dataclass

import numpy as np
import torch

from flock.sample.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos, stop token or string) or "length"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # the sum of the output tokens' logprobs, when they are asked
    lora_request: object = None  # the LoRA adapter it ran with (vLLM's field)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first), when asked
    # of SamplingParams.prompt_logprob_token_ids: [rows, most ids in a row], row i the logprobs of its ids as
    # predictions of prompt token prompt_logprob_start + i + 1 (-inf in padding), float32
    prompt_token_id_logprobs: np.ndarray | None = None
    lora_request: object = None  # the LoRA adapter it ran with
    # vLLM's fields a decoder-only engine without per-request stats or KV transfer leaves empty
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    metrics: object = None
    kv_transfer_params: dict | None = None


def id_logprobs(entries: list[TokenLogprobs | None], start: int) -> np.ndarray:
    """RequestOutput.prompt_token_id_logprobs from a prompt's entries (each one's `top`: its row's listed ids)."""
    rows = [[lp for _, lp in e.top] for e in entries[start + 1 :]]
    out = np.full((len(rows), max(map(len, rows), default=0)), -np.inf, dtype=np.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """The score of one pair, as vLLM's `LLM.score` returns it."""

    request_id: str
    prompt_token_ids: list[int]  # the pair's: the first text's, then the second's (a cross-encoder's: its prompt)
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """An embedding of one prompt, as vLLM's `LLM.embed` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class PoolingOutput:
    data: torch.Tensor  # an embedding, or a classifier's class probabilities


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled vector, as vLLM's `LLM.encode` returns it."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per class (logits when the request turned the activation off)


@dataclass
class ClassificationRequestOutput:
    """A sequence classifier's answer for one prompt, as vLLM's `LLM.classify` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    num_cached_tokens: int = 0
