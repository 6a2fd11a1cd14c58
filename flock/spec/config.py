from dataclasses import dataclass, fields

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for its `ngram` method: up to `num_speculative_tokens` drafts a step, the tokens
    that followed the last earlier occurrence of the context's longest suffix of `prompt_lookup_min` to
    `prompt_lookup_max` tokens."""

    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    method: str = "ngram"

    @classmethod
    def parse(cls, spec: dict) -> "SpeculativeConfig":
        """From vLLM's dict (`method`, or `model: "ngram"` as vLLM's older form); ValueError naming a bad key."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        spec = dict(spec)
        method, model = spec.pop("method", None), spec.pop("model", None)
        method = "ngram" if (method or model) in ("ngram", "[ngram]") else method or model
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported: Flock drafts with 'ngram' (prompt "
                             "lookup); draft models, EAGLE and MTP heads are not run")
        known = {f.name for f in fields(cls)} - {"method"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known | {'method'})}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = lo or hi or DEFAULT_LOOKUP, hi or lo or DEFAULT_LOOKUP
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(k, hi, lo, method)
