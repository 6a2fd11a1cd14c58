"""Flock: a prefix-aware LLM inference engine."""

from flock.beam_search import BeamSearchParams
from flock.llm import LLM
from flock.lora import LoRARequest
from flock.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from flock.pooling_params import PoolingParams
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "ClassificationRequestOutput",
           "PoolingRequestOutput", "TokenLogprobs", "LoRARequest", "RepetitionDetectionParams"]
__version__ = "0.1.0"
