"""Flock: a prefix-aware LLM inference engine."""

from flock.llm import LLM
from flock.outputs import CompletionOutput, RequestOutput
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "TokenLogprobs"]
__version__ = "0.1.0"
