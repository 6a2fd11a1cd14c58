"""What a batch job (`flock.api.batch`) asks of its engine. `LLMEngine` is one (one machine);
`flock.distributed.driver.ClusterEngine` is another (N engines on Ray), with rows of its own for the job's
summary."""

from __future__ import annotations

from typing import Any, Protocol

from flock.config import EngineConfig
from flock.engine.stats import RunStats
from flock.pooling_params import ModelTasks, PoolingParams
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine cannot start or go on (e.g. every Ray worker died): the job stops; what is written stays."""


class Submitted(Protocol):
    request_id: int


class FinishedRequest(Protocol):
    """A finished request as the job writes it: `flock.request.Request` has these fields."""

    request_id: int
    finish_reason: str | None
    output_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # per output token, when the params asked
    prompt_logprobs: list[TokenLogprobs | None] | None  # per prompt token, when the params asked
    stop_text: int | str | None  # the stop token or string that ended it (vLLM's stop_reason)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    embedding: list[float] | None  # of a pooling request: its embedding or class probabilities


class JobEngine(Protocol):
    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    vocab_size: int  # the model's (its logits' width)
    sampling_defaults: dict  # the fields a line leaves unset take these (the model's generation config)
    tasks: ModelTasks  # what the model serves
    eos_token_ids: set[int]  # what ends a generation (a beam search's beams)
    stats: RunStats  # of the job since `reset_stats`

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> Submitted: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[FinishedRequest]: ...

    def decode(self, req: FinishedRequest) -> str: ...

    def reset_stats(self) -> None: ...
