from dataclasses import dataclass, replace

METHODS = ("ngram", "draft_model")
NGRAM_NAMES = ("ngram", "[ngram]")
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
# each method's own keys beside num_speculative_tokens (vLLM's names)
METHOD_KEYS = {"ngram": {"prompt_lookup_min", "prompt_lookup_max"},
               "draft_model": {"model", "quantization", "draft_tensor_parallel_size", "draft_sample_method"}}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: up to `num_speculative_tokens` drafts a step, from prompt lookup (`ngram`: the
    tokens that followed the last earlier occurrence of the context's longest suffix of `prompt_lookup_min` to
    `prompt_lookup_max` tokens) or from a small model of the same vocabulary (`draft_model`: `model`, a built-in
    name, a Hugging Face folder or a GGUF file, loaded with its own `quantization`). `per_batch_size`: vLLM's
    `num_speculative_tokens_per_batch_size`, inclusive batch-size ranges (start, end, drafts) from 1 up, sorted,
    apart; a batch size past a range takes that range's drafts until the next one starts. `draft_sample_method`
    (a draft model's): "greedy" drafts the argmax, "probabilistic" samples a sampled request's drafts from the
    draft's own distribution, which verification then weighs against the target's (flock/sample/sampler.py)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    method: str = "ngram"
    model: str | None = None
    quantization: str | None = None
    per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    draft_sample_method: str = "greedy"

    def drafts_for(self, batch_size: int) -> int:
        """Drafts a request may get in a step of `batch_size` requests."""
        if self.per_batch_size is None:
            return self.num_speculative_tokens
        k = next((k for start, _, k in reversed(self.per_batch_size) if start <= batch_size), 0)
        return min(k, self.num_speculative_tokens)

    @classmethod
    def parse(cls, spec: dict) -> "SpeculativeConfig":
        """From vLLM's dict (`method`; or only `model`: "ngram" as vLLM's older form, else a draft model's path);
        ValueError naming a bad key."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        spec = dict(spec)
        method, model = spec.pop("method", None), spec.get("model")
        if method is None and model is None:
            raise ValueError("speculative_config has num_speculative_tokens but no method ('ngram', 'draft_model') "
                             "nor model (as vLLM)")
        if method is None:
            method = "ngram" if model in NGRAM_NAMES else "draft_model"
        method = "ngram" if method in NGRAM_NAMES else method
        if method == "ngram":
            spec.pop("model", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported: Flock drafts with 'ngram' "
                             "(prompt lookup) or 'draft_model' (a small model of the same vocabulary); EAGLE and MTP "
                             "heads are not run")
        known = {"num_speculative_tokens", SCHEDULE_KEY} | METHOD_KEYS[method]
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}; known: "
                             f"{sorted(known | {'method'})}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}")
        schedule = _schedule(spec.get(SCHEDULE_KEY))
        if method == "draft_model":
            return replace(cls._draft_model(k, spec), per_batch_size=schedule)
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi if hi is not None else DEFAULT_LOOKUP,
                  hi if hi is not None else lo if lo is not None else DEFAULT_LOOKUP)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(k, hi, lo, method, per_batch_size=schedule)

    @classmethod
    def _draft_model(cls, k: int, spec: dict) -> "SpeculativeConfig":
        model, quantization = spec.get("model"), spec.get("quantization")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config.model must name the draft model (a built-in name, a Hugging Face "
                             f"folder or a GGUF file), got {model!r}")
        if spec.get("draft_tensor_parallel_size") not in (None, 1):
            raise ValueError("speculative_config.draft_tensor_parallel_size must be 1: the draft runs in the engine's "
                             "process")
        if quantization is not None and not isinstance(quantization, str):
            raise ValueError(f"speculative_config.quantization must be a string, got {quantization!r}")
        sample = spec.get("draft_sample_method", "greedy")
        if sample not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}"
                             f", got {sample!r}")
        return cls(k, method="draft_model", model=model, quantization=quantization, draft_sample_method=sample)


def _schedule(entries) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's num_speculative_tokens_per_batch_size, checked as vLLM checks it (ValueError naming what is wrong)."""
    if entries is None:
        return None
    where = f"speculative_config.{SCHEDULE_KEY}"
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where} must be a non-empty list of [range_start, range_end, num_speculative_tokens]")
    schedule = []
    for entry in entries:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"{where}: each entry must be 3 integers [range_start, range_end, "
                             f"num_speculative_tokens], got {entry!r}")
        start, end, k = entry
        if not 0 < start <= end or k < 0:
            raise ValueError(f"{where}: {list(entry)} needs 0 < range_start <= range_end and drafts >= 0")
        schedule.append((start, end, k))
    schedule.sort()
    if schedule[0][0] != 1:
        raise ValueError(f"{where}: the first range must start at batch size 1")
    if any(nxt[0] <= prev[1] for prev, nxt in zip(schedule, schedule[1:])):
        raise ValueError(f"{where}: the ranges overlap")
    return tuple(schedule)
