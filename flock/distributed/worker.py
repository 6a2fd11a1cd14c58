"""One engine of a distributed job: the class a Ray actor runs (Ray itself is not imported here).

The driver hands a worker its requests with `run(work)`, and calls `run()` again as soon as the last call
returns; each call steps the engine for about `seconds` and returns what finished meanwhile, so results
stream back and a dead worker shows up as a failed call.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flock.config import EngineConfig
from flock.engine.engine import LLMEngine, check_prompt, engine_params
from flock.engine.loop import run
from flock.engine.stats import RunStats
from flock.sample.grammar import GrammarCompiler
from flock.sample.logprobs import TokenLogprobs
from flock.pooling_params import ModelTasks, PoolingParams
from flock.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class Work:
    key: int  # the driver's id of the request
    prompt_token_ids: np.ndarray
    params: SamplingParams | PoolingParams


@dataclass
class Finished:
    """A finished request, with the fields of `flock.request.Request` that a batch job writes."""

    request_id: int  # the driver's key
    text: str
    output_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    stop_text: int | str | None = None
    embedding: list[float] | None = None
    error: str | None = None  # the engine refused the request (nothing ran)


@dataclass
class EngineInfo:
    """What the driver needs to check requests exactly as the workers' engines will."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    pid: int
    host: str
    threads: int
    stop_token_ids: list[int] = field(default_factory=list)
    any_whitespace: bool = False  # JSON outputs' default
    tasks: ModelTasks | None = None  # what the model serves
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation config
    max_logprobs: int = MAX_LOGPROBS

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        generates = not isinstance(params, PoolingParams)
        params = engine_params(params, self.tasks, self.max_model_len)
        check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, generates, self.max_logprobs)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        return GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids, self.any_whitespace)


@dataclass
class Progress:
    finished: list[Finished]
    stats: RunStats  # of this worker since it started
    unfinished: int


class EngineWorker:
    def __init__(self, config: EngineConfig, threads: int | None = None, index: int = 0):
        if threads:
            torch.set_num_threads(threads)
        self.engine = LLMEngine(config)
        # unseeded draws of its own: a line's n choices split over two workers must differ
        self.engine.runner.sampler.default_generator.manual_seed(config.seed + index)
        self.keys: dict[int, int] = {}  # engine request id -> driver key
        self.reset_stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()
        self.engine.stats.trace_steps = False

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(e.tokenizer, e.max_model_len, e.vocab_size, os.getpid(), socket.gethostname(),
                          torch.get_num_threads(), sorted(e.eos_token_ids), e.config.structured_outputs_any_whitespace,
                          e.tasks, e.sampling_defaults, e.config.max_logprobs)

    def run(self, work: list[Work] = (), seconds: float = 0.25) -> Progress:
        """Add `work`, then step for about `seconds` (or until nothing is left)."""
        engine = self.engine
        finished = []
        for w in work:
            try:
                req = engine.add_request(w.prompt_token_ids.tolist(), w.params)
            except ValueError as e:  # what the driver's checks cannot see (an adapter, images): this request only
                finished.append(Finished(w.key, "", [], "error", len(w.prompt_token_ids), 0, 0, error=str(e)))
                continue
            self.keys[req.request_id] = w.key
        deadline = time.perf_counter() + seconds
        for step in run(engine, lambda idle: not idle and time.perf_counter() < deadline):
            for req in step.finished:
                finished.append(Finished(self.keys.pop(req.request_id), engine.decode(req), req.output_token_ids,
                                         req.finish_reason, req.num_prompt_tokens, req.num_output_tokens,
                                         req.num_cached_tokens, req.logprobs, req.prompt_logprobs, req.stop_text,
                                         req.embedding))
        return Progress(finished, engine.stats, len(self.keys))
