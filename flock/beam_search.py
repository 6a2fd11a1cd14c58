"""Beam search as vLLM runs it (`LLM.beam_search`, and `use_beam_search` requests): outside the engine, one token
at a time. Each step every live beam is an engine request for one token with its 2 x beam_width most likely next
tokens (the prefix cache holds the beam's KV, so a step computes about one token a beam); the candidates are
ranked by vLLM's score, cumulative logprob / length ** length_penalty (the length counts the prompt, not a final
EOS); a candidate ending in EOS is complete; the best beam_width of the rest go on, for max_tokens steps at most.
The result is the best beam_width of the complete and the live beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from flock.lora import LoRARequest
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from flock.multimodal import ImageInputs


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # of the step requests; their logprobs are the raw logits' (vLLM's default)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the server's: keep the EOS that ended a beam in its token ids
    structured_outputs: None = None  # vLLM's field; beams under a grammar are not supported
    skip_special_tokens: bool = True  # in the beams' text
    watermarking: None = None  # vLLM's field; no watermark here
    cache_salt: str | None = None  # the step requests' (SamplingParams')
    priority: int = 0
    lora_request: LoRARequest | None = None  # the step requests' LoRA adapter
    multi_modal: ImageInputs | None = None  # the prompt's images, which every step request carries

    def validate(self, max_tokens_set: bool = True, max_logprobs: int = MAX_LOGPROBS) -> None:
        """ValueError naming beam_width or max_tokens (`max_tokens_set` False: it is to be set later); a step
        asks for 2 x beam_width alternatives, at most the engine's `max_logprobs` (-1: the vocabulary)."""
        width, most = self.beam_width, max_logprobs // 2 if max_logprobs != -1 else None
        if not isinstance(width, int) or isinstance(width, bool) or width < 1 or most is not None and width > most:
            raise ValueError(f"beam_width (n) must be an integer in [1, {most}] (2 x beam_width alternatives a "
                             f"step, at most max_logprobs {max_logprobs}), got {width!r}")
        if self.structured_outputs is not None or self.watermarking:
            raise ValueError("structured_outputs and watermarking are not supported with beam search")
        if max_tokens_set and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                               or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")

    def fitted(self, prompt_len: int, max_model_len: int) -> BeamSearchParams:
        """These params for a prompt: max_tokens (None: 0, unset) at most what max_model_len leaves after it, as
        vLLM's server caps it (its beams then end with "length")."""
        room = max_model_len - prompt_len
        return replace(self, max_tokens=min(self.max_tokens, room) if self.max_tokens else room)

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width, ignore_eos=True,
                              cache_salt=self.cache_salt, priority=self.priority, lora_request=self.lora_request,
                              multi_modal=self.multi_modal)


@dataclass
class BeamSearchSequence:
    """A beam: the prompt's and its tokens, their cumulative logprob, and (in results) its text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    num_prompt_tokens: int = 0
    finish_reason: str | None = None  # "stop" (EOS) or "length", in results
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class BeamSearch:
    """One prompt's search, stepped by its caller: `requests()` for the engine, then `advance()` with what each
    request's one token's logprobs were."""

    prompt: list[int]
    params: BeamSearchParams
    eos_token_ids: list[int]
    beams: list[BeamSearchSequence] = field(init=False)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0
    arrived: list[TokenLogprobs | None] = field(default_factory=list)  # this step's results so far (`record`)

    def __post_init__(self):
        self.beams = [BeamSearchSequence(list(self.prompt), 0.0, len(self.prompt))]

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def requests(self) -> list[tuple[list[int], SamplingParams]]:
        step = self.params.step_params()
        self.arrived = [None] * len(self.beams)
        return [(b.tokens, step) for b in self.beams]

    def record(self, beam: int, result: TokenLogprobs) -> bool:
        """One request's result, for callers that get them one at a time; True when the step is complete (then
        advanced)."""
        self.arrived[beam] = result
        if None in self.arrived:
            return False
        self.advance(self.arrived)
        return True

    def advance(self, results: list[TokenLogprobs]) -> None:
        """The next beams from the live ones' next-token alternatives (`results[i]`: beam i's)."""
        candidates = []
        for beam, entry in zip(self.beams, results):
            for token, logprob in entry.top:
                new = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob, beam.num_prompt_tokens)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1

    def abort(self) -> None:
        """End the search where it is (the engine aborted its step): the live beams finish as "abort"."""
        for beam in self.beams:
            beam.finish_reason = "abort"
        self.completed += self.beams
        self.beams = []

    def result(self) -> list[BeamSearchSequence]:
        """The best beam_width of the complete and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        return sorted(self.completed + self.beams, key=self.score, reverse=True)[: self.params.beam_width]

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos_token_ids)
        return beam.cum_logprob / length ** self.params.length_penalty
