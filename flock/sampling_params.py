import copy
import logging
import math
from dataclasses import dataclass, field, replace

from flock.lora.request import LoRARequest
from flock.multimodal.inputs import ImageInputs

log = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 100.0  # a logit_bias value is clamped to [-100, 100], as OpenAI documents and vLLM does
MIN_TEMPERATURE = 0.01  # vLLM's: a smaller positive temperature is raised to it (its logits would overflow)
MAX_LOGPROBS = 20  # top alternatives per token at most by default (vLLM's max_logprobs)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's
MAX_LOGPROB_TOKEN_IDS = 128  # tokens in logprob_token_ids at most, as vLLM's
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # of StructuredOutputsParams


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression, a choice of
    strings, an EBNF grammar (xgrammar's GBNF dialect), or an xgrammar structural tag (its JSON text: formats such
    as tags around JSON, which tool calls use). JSON has no free whitespace between tokens unless
    `disable_any_whitespace` is False (None: the engine's default, see `--structured-outputs-any-whitespace`),
    so a small model cannot loop on whitespace. An object takes only the properties its schema names unless it
    says otherwise (xgrammar's strict mode, as vLLM runs it: `disable_additional_properties` is accepted and changes
    nothing); `whitespace_pattern` (vLLM's field, which its xgrammar backend ignores) may only be None."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    after: str | None = None  # free text up to and including this string comes first (a reasoning model's thinking)

    @property
    def kind(self) -> str:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {kinds or 'none'}")
        return kinds[0]

    def validate(self) -> None:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object or its text, got {value!r}")
        if kind in ("regex", "grammar", "structural_tag") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, list) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise ValueError(f"structured_outputs.after must be a non-empty string, got {self.after!r}")
        if self.disable_any_whitespace not in (None, True, False):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a boolean, "
                             f"got {self.disable_any_whitespace!r}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(f"structured_outputs.disable_additional_properties must be a boolean, "
                             f"got {self.disable_additional_properties!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported: JSON's whitespace is set by "
                             "disable_any_whitespace")


@dataclass
class RepetitionDetectionParams:
    """vLLM's: an output that ends with a pattern of `min_pattern_size` (0: 1) to `max_pattern_size` tokens
    repeated `min_count` times in a row stops there, finish_reason "repetition" (max_pattern_size 0: off)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def validate(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
            raise ValueError(f"repetition_detection's fields must be integers, got {self!r}")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise ValueError("repetition_detection needs 0 <= min_pattern_size <= max_pattern_size (both 0: off), "
                             f"got {self.min_pattern_size} and {self.max_pattern_size}")
        if self.max_pattern_size and self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be >= 2, got {self.min_count}")

    def found(self, tokens: list[int]) -> bool:
        """Whether `tokens` end with such a repeated pattern."""
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > len(tokens):
                return False
            tail = tokens[-span:]
            if tail == tail[size:] + tail[-size:]:  # every size-th token repeats: the pattern, min_count times
                return True
        return False


@dataclass
class SamplingParams:
    """How to pick tokens, as in vLLM. temperature 0 is greedy; a seed makes a request reproducible. Penalties,
    logit_bias and min_tokens adjust the logits first, greedy rows included (flock/sample/penalties.py)."""

    n: int = 1  # samples of the prompt (LLM.generate, the API): sample j seeded seed + j, as vLLM's
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely
    # top-k, top-p and min-p on the logits before the temperature, which then scales what they leave (llama.cpp's
    # default chain); False: after it (vLLM's)
    temperature_last: bool = False
    # llama.cpp's other truncations: locally typical sampling (the tokens whose surprise is nearest the entropy, up
    # to this mass; 1: off), top-n-sigma (logits within n standard deviations of the largest; <= 0: off), and XTC
    # (with xtc_probability, every token at least xtc_threshold likely but the least of them dropped)
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # llama.cpp's dynamic temperature: each row's temperature in [temperature - range, temperature + range] by the
    # normalized entropy of its distribution raised to dynatemp_exponent (range 0: off)
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # llama.cpp's DRY: a token extending a sequence repeated within the last dry_penalty_last_n tokens (prompt and
    # output; -1: all) longer than dry_allowed_length loses dry_multiplier * dry_base ** (length - allowed) of its
    # logit; sequences stop at the breakers (flock/sample/dry.py; multiplier 0: off)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", "\"", "*"])
    # llama.cpp's Mirostat (1, or 2 for Mirostat 2.0; 0: off): after the temperature, in place of the truncations,
    # the tokens kept so that each one's surprise tracks mirostat_tau, learning at the rate mirostat_eta
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # vLLM's (offline): False leaves the output text empty, the token ids alone
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token) that ended the output
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    presence_penalty: float = 0.0  # in [-2, 2]: minus this from the logit of every token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: a prompt or output token's logit divided by it (if > 0), else multiplied
    # None: the penalties as vLLM's (repetition over the prompt and output, frequency and presence over the
    # output); n: all three over the last n tokens of the prompt and output, as llama.cpp's penalty_last_n (0: off)
    penalty_last_n: int | None = None
    logit_bias: dict[int, float] | None = None  # token id (or its string) -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (vLLM's): a word's last token is banned after the rest
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as max_model_len - 1)
    truncation_side: str = "left"  # "right": keep the first k instead
    # the logprob of each sampled (prompt) token and this many most likely alternatives, from the raw logits
    # (after a grammar's mask, before penalties and temperature, as vLLM's default); None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # a prompt with these is computed whole: it never reads the prefix cache
    # what this request's logprobs hold, in place of the engine's logprobs_mode (vLLM's values; llama-server's
    # post_sampling_probs asks "processed_logprobs"); None: the engine's
    logprobs_mode: str | None = None
    # vLLM's: the logprobs of exactly these tokens at each output position, in place of the `logprobs` most likely
    # alternatives (scoring labels: "Yes"/"No"); set alone, it asks for logprobs by itself
    logprob_token_ids: list[int] | None = None
    # vLLM's: for each prompt row from prompt_logprob_start (default 0), the logprobs of its own token ids as
    # predictions of the next prompt token (-1: padding, -inf); in RequestOutput.prompt_token_id_logprobs. Prompt
    # position p's row is p - 1 - start: prompt length - 1 - start rows in all
    prompt_logprob_token_ids: list[list[int]] | None = field(default=None, repr=False)
    prompt_logprob_start: int | None = None
    # vLLM's: True computes the whole prompt, never reading the prefix cache (its blocks still enter it for later
    # requests); prompt_logprobs imply it
    skip_reading_prefix_cache: bool | None = None
    stream_interval: int | None = None  # vLLM's: stream every this many tokens (the first and last at once), at least
    # the server's --stream-interval
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the request's prefix-cache blocks are found only by requests with the same salt (tenants that must
    # not learn each other's prompts from cache hits); it changes no output
    cache_salt: str | None = None
    # the LoRA adapter the request runs with (vLLM passes it beside the params: LLM.generate(lora_request=...), the
    # API's model name); its prefix-cache blocks are found only by requests of the same adapter
    lora_request: LoRARequest | None = None
    # the prompt's images as its model's processor made them (from a prompt's multi_modal_data or a chat's image
    # parts, not set by hand); its prefix-cache blocks are found only by requests with the same images
    multi_modal: ImageInputs | None = field(default=None, repr=False)
    priority: int = 0  # vLLM's: with the priority scheduler, lower values go first (others need 0)
    # vLLM's: a reasoning model's thinking (after its <think> token) ends by force after this many tokens (None or
    # -1: no limit; flock/sample/thinking.py)
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None  # (or a dict of its fields)
    # vLLM's fields that change no output here, accepted so that code written for vLLM runs: spaces between
    # special tokens (slow tokenizers' decoding only; Flock's are fast), how outputs stream (LLM returns whole
    # ones, streams send deltas), the flat logprobs container (Flock's list of mappings reads the same), a copy
    # hint, the stop-string buffer, custom logits processors' arguments (Flock runs none)
    spaces_between_special_tokens: bool = True
    output_kind: object = None
    flat_logprobs: bool = False
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    extra_args: dict | None = None
    # vLLM's, accepted at what Flock runs: no watermark, no routing traces, no traced decode tokens
    watermarking: bool | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # the engine's, of bad_words
    dry_breakers: dict | None = field(default=None, repr=False)  # the engine's, of dry_sequence_breakers

    def __post_init__(self):
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %s is below %s, which may overflow the logits; raised to %s (as vLLM)",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's: no seed
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's: the chosen token's and the most likely one's
                setattr(self, name, 1)
        if hasattr(self.prompt_logprob_token_ids, "tolist"):  # vLLM's type: an integer array [rows, ids]
            self.prompt_logprob_token_ids = self.prompt_logprob_token_ids.tolist()
        if isinstance(self.repetition_detection, dict):  # unknown keys stay for validate() to name
            fields = RepetitionDetectionParams.__dataclass_fields__
            if set(self.repetition_detection) <= set(fields):
                self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):  # what does not convert stays as it is, for validate() to name
            self.logit_bias = {_token_id(t) if _converts(t) else t: _clamp_bias(b) if _bias(b) else b
                               for t, b in self.logit_bias.items()}

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's), whose lists and dicts the caller may change."""
        return copy.deepcopy(self)

    def samples(self) -> list["SamplingParams"]:
        """The params of each of the n samples, one engine request each."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + j) for j in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.logprob_token_ids is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt's logits are computed (so it never reads the prefix cache)."""
        return self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None

    @property
    def truncates(self) -> bool:
        """Whether a truncation (top-k aside) leaves out some tokens before the draw."""
        return self.top_p < 1 or self.min_p > 0 or self.typical_p < 1 or self.top_n_sigma > 0 or self.xtc

    @property
    def xtc(self) -> bool:
        """Whether XTC may cut the top tokens (it draws its chance apart from the token's draw)."""
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it (vLLM's: from the left unless truncation_side says)."""
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        k = self.truncate_prompt_tokens
        k = max_model_len - 1 if k == -1 else k
        if k is not None and k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len})")
        if k is None or len(prompt_token_ids) <= k:
            return prompt_token_ids
        return prompt_token_ids[-k:] if self.truncation_side == "left" else prompt_token_ids[:k]

    def _validate_llama_cpp(self) -> None:
        """llama.cpp's dynamic temperature, DRY and Mirostat fields."""
        if not _is_real(self.dynatemp_range) or not 0 <= self.dynatemp_range < math.inf:
            raise ValueError(f"dynatemp_range must be a finite number >= 0, got {self.dynatemp_range!r}")
        if not _is_real(self.dynatemp_exponent) or not math.isfinite(self.dynatemp_exponent):
            raise ValueError(f"dynatemp_exponent must be a finite number, got {self.dynatemp_exponent!r}")
        if not _is_real(self.dry_multiplier) or not 0 <= self.dry_multiplier < math.inf:
            raise ValueError(f"dry_multiplier must be a finite number >= 0, got {self.dry_multiplier!r}")
        if not _is_real(self.dry_base) or not 1 <= self.dry_base < math.inf:
            raise ValueError(f"dry_base must be a finite number >= 1, got {self.dry_base!r}")
        for name, least in (("dry_allowed_length", 0), ("dry_penalty_last_n", -1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.mirostat not in (0, 1, 2) or isinstance(self.mirostat, bool):
            raise ValueError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat!r}")
        for name in ("mirostat_tau", "mirostat_eta"):
            if not _is_real(getattr(self, name)) or not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, list) or not breakers or not all(isinstance(b, str) and b for b in breakers):
            raise ValueError(f"dry_sequence_breakers must be a non-empty list of non-empty strings, got {breakers!r}")

    def tokenize_bad_words(self, tokenizer) -> None:
        """bad_words_token_ids from bad_words, as vLLM's: each word alone and, when that makes other tokens of
        the same count, after a space."""
        out = []
        for word in self.bad_words or []:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        self.bad_words_token_ids = out or None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field (token ids are checked against vocab_size when given)."""
        for name, runs in (("watermarking", (None, False)), ("routed_experts_prompt_start", (0,)),
                           ("trace_decode_token_ids", (None, []))):
            if getattr(self, name) not in runs:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported (Flock runs {name}={runs[0]!r})")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= 2:  # OpenAI's and vLLM's range
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_real(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p!r}")
        if not _is_real(self.top_n_sigma) or not math.isfinite(self.top_n_sigma):
            raise ValueError(f"top_n_sigma must be a finite number (<= 0: off), got {self.top_n_sigma!r}")
        for name in ("xtc_probability", "xtc_threshold"):
            if not _is_real(getattr(self, name)) or not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        self._validate_llama_cpp()
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        last = 2**63 - self.n  # sample j uses seed + j, an int64
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= last):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - n], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        window = self.penalty_last_n
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
            raise ValueError(f"penalty_last_n must be None or an integer >= 0, got {window!r}")
        self._validate_logit_bias(vocab_size)
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(
                _is_token(t, vocab_size) for t in allowed)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids in the vocabulary, got {allowed!r}")
        if not all(_is_token(t, vocab_size) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in the vocabulary, got {self.stop_token_ids!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < -1 or k == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                raise ValueError(f"{name} must be an integer, at least 0 or -1 (the whole vocabulary), got {value!r}")
        if self.logprobs_mode not in (None, *LOGPROBS_MODES):
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        self._validate_logprob_token_ids(vocab_size)
        self._validate_prompt_logprob_token_ids(vocab_size)
        for name in ("detokenize", "skip_reading_prefix_cache"):
            if getattr(self, name) not in ((True, False) if name == "detokenize" else (None, True, False)):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (the text they are found in)")
        interval = self.stream_interval
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
            raise ValueError(f"stream_interval must be a positive integer, got {interval!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, or -1 for no limit, got {budget!r}")
        if self.repetition_detection is not None:
            if not isinstance(self.repetition_detection, RepetitionDetectionParams):
                raise ValueError("repetition_detection must be an object of max_pattern_size, min_pattern_size and "
                                 f"min_count, got {self.repetition_detection!r}")
            self.repetition_detection.validate()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
            self.structured_outputs.validate()

    def _validate_logprob_token_ids(self, vocab_size: int | None) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got {ids!r}")
        outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if outside:
            raise ValueError(f"logprob_token_ids {outside!r} are outside the vocabulary [0, {vocab_size})")

    def _validate_prompt_logprob_token_ids(self, vocab_size: int | None) -> None:
        rows, start = self.prompt_logprob_token_ids, self.prompt_logprob_start
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise ValueError(f"prompt_logprob_start must be an integer >= 0, got {start!r}")
        if rows is None:
            if start is not None:
                raise ValueError("prompt_logprob_start needs prompt_logprob_token_ids")
            return
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprob_token_ids and prompt_logprobs cannot both be set (the listed tokens "
                             "take the alternatives' place)")
        top = vocab_size if vocab_size is not None else math.inf
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) <= MAX_LOGPROB_TOKEN_IDS and all(
                isinstance(t, int) and not isinstance(t, bool) and -1 <= t < top for t in r) for r in rows):
            raise ValueError(f"prompt_logprob_token_ids must be a list of rows of at most {MAX_LOGPROB_TOKEN_IDS} "
                             f"token ids each (-1: padding) in the vocabulary [0, {vocab_size})")

    def prompt_rows_ids(self, prompt_len: int) -> list[list[int] | None] | None:
        """prompt_logprob_token_ids by prompt position (None: no ids); ValueError if the rows do not fit."""
        rows = self.prompt_logprob_token_ids
        if rows is None:
            return None
        start = self.prompt_logprob_start or 0
        if len(rows) != max(prompt_len - 1 - start, 0):
            raise ValueError(f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has "
                             f"{max(prompt_len - 1 - start, 0)} scored rows (prompt length - 1 - prompt_logprob_start)")
        return [None] * (start + 1) + list(rows)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
        bad_ids = [t for t in bias if not _converts(t)] or [t for t in bias if not isinstance(t, int)]
        if bad_ids:
            raise ValueError(f"logit_bias has keys that are not integer token ids: {bad_ids!r}")
        bad_values = {t: b for t, b in bias.items() if not _bias(b)}
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


def _is_token(t, vocab_size: int | None) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size)


def _converts(t) -> bool:
    try:
        _token_id(t)
    except (TypeError, ValueError):
        return False
    return True


def _bias(b) -> bool:
    return _is_real(b) and not math.isnan(b)


def _clamp_bias(b) -> float:
    return min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b)))
