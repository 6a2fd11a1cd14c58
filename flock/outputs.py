from dataclasses import dataclass

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first), when asked


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
