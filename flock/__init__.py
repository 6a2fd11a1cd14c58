"""Flock: a prefix-aware LLM inference engine."""

from flock.llm import LLM
from flock.outputs import CompletionOutput, RequestOutput
from flock.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
