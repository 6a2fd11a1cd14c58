import math
from dataclasses import dataclass, field

MAX_LOGIT_BIAS = 100.0  # a logit_bias value is clamped to [-100, 100], as OpenAI documents and vLLM does


@dataclass
class SamplingParams:
    """How to pick tokens, as in vLLM. temperature 0 is greedy; a seed makes a request reproducible. Penalties,
    logit_bias and min_tokens adjust the logits first, greedy rows included (flock/sample/penalties.py)."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    presence_penalty: float = 0.0  # in [-2, 2]: minus this from the logit of every token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: a prompt or output token's logit divided by it (if > 0), else multiplied
    logit_bias: dict[int, float] | None = None  # token id (or its string) -> added to its logit, clamped to [-100, 100]

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {_token_id(t): _clamp_bias(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                pass  # validate() names the bad entry

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field (logit_bias ids are checked against vocab_size when given)."""
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
        bad_ids = [t for t in bias if not _converts(t)] or [t for t in bias if not isinstance(t, int)]
        if bad_ids:
            raise ValueError(f"logit_bias has keys that are not integer token ids: {bad_ids!r}")
        bad_values = {t: b for t, b in bias.items() if not _is_real(b) or math.isnan(b)}
        if bad_values:
            raise ValueError(f"logit_bias values must be numbers, got {bad_values!r}")
        if vocab_size is not None:
            outside = [t for t in bias if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(f"logit_bias token ids {outside!r} are outside the vocabulary [0, {vocab_size})")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_id(t) -> int:
    """An int, or a string of one (JSON object keys are strings)."""
    if isinstance(t, bool) or not isinstance(t, (int, str)):
        raise TypeError(t)
    return int(t)


def _converts(t) -> bool:
    try:
        _token_id(t)
    except (TypeError, ValueError):
        return False
    return True


def _clamp_bias(b) -> float:
    if not _is_real(b) or math.isnan(b):
        raise ValueError(b)
    return min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b)))
