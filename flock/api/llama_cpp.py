"""llama-server's native API (llama.cpp's tools/server): POST /completion (and /completions), the `content` forms
of /tokenize and /detokenize, /apply-template and GET /props, so a client written for llama-server runs unchanged.

A body's `prompt` is one prompt (a string, token ids, or ids and strings mixed) or several (a list of those,
strings alone included), each completed `n_cmpl` times; one completion answers an object, more a list. Sampling
takes llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; n_predict -1: up to the
context), its penalties over the last `repeat_last_n` tokens of the prompt and output, and its chain: top-k,
top-p, min-p, typical-p, top-n-sigma and XTC on the logits before the temperature (or after it, where `samplers`
puts it first), DRY after the penalties, dynamic temperature; with `mirostat` 1 or 2, llama.cpp's Mirostat chain
instead (the logit biases, the temperature, Mirostat: no penalties or truncations). The slot, cache and progress
knobs are accepted and change nothing (every prompt's prefix is cached anyway); other unknown fields are
ignored, as llama-server ignores them. As there, a null field takes its default, and a field may come under its
OpenAI alias (`max_tokens` for `n_predict`, `n` for `n_cmpl`, `logprobs` for `n_probs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flock.api.logprobs import TokenText
from flock.api.protocol import MAX_CHOICES, APIError, flag, is_int, is_number
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "top_n_sigma": -1.0,
            "xtc_probability": 0.0, "xtc_threshold": 0.1, "repeat_penalty": 1.0, "repeat_last_n": 64,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0,
            "mirostat_eta": 0.1}  # llama-server's (common_params_sampling)
DRY_BREAKERS = ["\n", ":", "\"", "*"]
# samplers Flock does not run: their field and the value that leaves them off
UNSUPPORTED = {"n_indent": 0, "t_max_predict_ms": 0, "lora": [], "multimodal_data": []}
SAMPLER_NAMES = {"dry": "dry", "topk": "top_k", "topp": "top_p", "nucleus": "top_p", "topnsigma": "top_n_sigma",
                 "typp": "typ_p", "typ": "typ_p", "minp": "min_p", "temperature": "temperature", "temp": "temperature",
                 "xtc": "xtc", "infill": "infill", "penalties": "penalties", "adaptivep": "adaptive_p"}
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
TRUNCATIONS = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc")  # llama.cpp's, in its default order
WHOLE_CONTEXT = 1 << 40  # repeat_last_n -1: every token of the prompt and output
ALIASES = {"n_predict": ("max_tokens", "max_completion_tokens"), "n_cmpl": ("n",), "n_probs": ("logprobs",)}


def field_value(body: dict, name: str, default):
    """A field of a body as llama-server reads it: null is absent; absent, its first alias given."""
    for key in (name, *ALIASES.get(name, ())):
        if body.get(key) is not None:
            return body[key]
    return default


@dataclass
class Completion:
    """A parsed /completion body: one engine request per (prompt, completion), prompt-major."""

    single: bool  # one prompt completed once: the answer is an object, not a list
    requests: list[tuple[list[int], SamplingParams]]
    settings: dict  # generation_settings as llama-server reports them
    stream: bool = False
    return_tokens: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False  # probabilities after the sampler chain, not logprobs before it
    response_fields: list[str] = field(default_factory=list)
    prefill_only: bool = False  # n_predict 0: the prompt evaluated, its one token dropped


def parse_completion(body, tokenizer) -> Completion:
    """Check and convert a /completion body; APIError names what is wrong."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in (None, off):
            raise APIError(f"{name} is not supported (leave it at {off!r})", param=name)
    min_keep = field_value(body, "min_keep", 0)
    if not is_int(min_keep) or min_keep > 1:
        raise APIError("min_keep above 1 is not supported (Flock's samplers keep at least one token)", param="min_keep")
    prompts, single = _prompts(body.get("prompt"), tokenizer)
    n = field_value(body, "n_cmpl", 1)
    if not is_int(n) or n < 1 or len(prompts) * n > MAX_CHOICES:
        raise APIError(f"n_cmpl must be an integer >= 1, and n_cmpl times the prompts at most {MAX_CHOICES}",
                       param="n_cmpl")
    params, settings = _sampling_params(body, tokenizer, n)
    n_probs = field_value(body, "n_probs", 0)
    if not is_int(n_probs) or not 0 <= n_probs <= 20:
        raise APIError("n_probs must be an integer in [0, 20]", param="n_probs")
    params.logprobs = n_probs or None
    post_sampling = flag(body, "post_sampling_probs")
    if post_sampling:
        params.logprobs_mode = "processed_logprobs"
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise APIError("response_fields must be a list of field names", param="response_fields")
    requests = [(ids, s) for ids in prompts for s in params.samples()]
    return Completion(single and n == 1, requests, settings, flag(body, "stream"), flag(body, "return_tokens"),
                      n_probs, post_sampling, fields, field_value(body, "n_predict", -1) == 0)


def _prompts(prompt, tokenizer) -> tuple[list[list[int]], bool]:
    """The prompts' ids and whether the body gave one: a string, or a list holding a token id is one prompt; a list
    of strings, lists and {"prompt_string"} objects is several."""
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and any(is_int(p) for p in prompt):
        return [_tokens(prompt, tokenizer)], True
    if not isinstance(prompt, list) or not prompt:
        raise APIError("prompt must be a string, a list of token ids (and strings), or a non-empty list of those",
                       param="prompt")
    return [_tokens(p["prompt_string"] if isinstance(p, dict) and "prompt_string" in p else p, tokenizer)
            for p in prompt], False


def _tokens(prompt, tokenizer) -> list[int]:
    """One prompt's ids (a BOS added to a string that comes first)."""
    ids = mixed_tokens(prompt, "prompt", tokenizer, add_special=True)
    if not ids:
        raise APIError("a prompt has no tokens", param="prompt")
    return ids


def mixed_tokens(value, name: str, tokenizer, add_special: bool, parse_special: bool = True) -> list[int]:
    """llama.cpp's tokenize_mixed: a string, or a list of token ids and strings, as ids in order (the special
    tokens added to a string that comes first, where `add_special`; special tokens' text in a string read as
    plain text unless `parse_special`); APIError naming `name` otherwise."""
    parts = [value] if isinstance(value, str) else value
    if not isinstance(parts, list) or not all(isinstance(p, str) or is_int(p) for p in parts):
        raise APIError(f"{name} must be a string, or a list of token ids and strings", param=name)
    vocab = len(tokenizer)
    ids = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special_tokens=add_special and i == 0,
                                    split_special_tokens=not parse_special)
        elif not 0 <= part < vocab:
            raise APIError(f"token id {part} is outside the vocabulary [0, {vocab})", param=name)
        else:
            ids.append(part)
    return ids


def _sampling_params(body: dict, tokenizer, n: int) -> tuple[SamplingParams, dict]:
    values = {name: field_value(body, name, default) for name, default in DEFAULTS.items()}
    for name, value in values.items():
        if not is_number(value):
            raise APIError(f"{name} must be a number, got {value!r}", param=name)
    off, temperature_last = _samplers(body.get("samplers"))
    if values["mirostat"]:  # llama.cpp's Mirostat chain: biases, temperature, Mirostat
        off = {"penalties", "dry", *TRUNCATIONS}
    n_predict = field_value(body, "n_predict", -1)
    if not is_int(n_predict) or n_predict < -1:
        raise APIError(f"n_predict must be an integer >= -1, got {n_predict!r}", param="n_predict")
    seed = field_value(body, "seed", -1)
    if not is_int(seed):
        raise APIError(f"seed must be an integer, got {seed!r}", param="seed")
    for name in ("repeat_last_n", "dry_penalty_last_n", "dry_allowed_length", "mirostat"):
        least = 0 if name in ("dry_allowed_length", "mirostat") else -1
        if not is_int(values[name]) or values[name] < least:
            raise APIError(f"{name} must be an integer >= {least}, got {values[name]!r}", param=name)
    last_n = values["repeat_last_n"]
    temperature = values["temperature"]
    kwargs = dict(
        temperature=0.0 if temperature <= 0 else 1.0 if "temperature" in off else temperature,
        top_k=-1 if values["top_k"] <= 0 or "top_k" in off else int(values["top_k"]),
        top_p=1.0 if "top_p" in off else values["top_p"], min_p=0.0 if "min_p" in off else values["min_p"],
        typical_p=1.0 if "typ_p" in off else values["typical_p"],
        top_n_sigma=-1.0 if "top_n_sigma" in off else values["top_n_sigma"],
        xtc_probability=0.0 if "xtc" in off else values["xtc_probability"], xtc_threshold=values["xtc_threshold"],
        temperature_last=temperature_last, dynatemp_range=0.0 if "temperature" in off or values["mirostat"] else values["dynatemp_range"],
        dynatemp_exponent=values["dynatemp_exponent"],
        dry_multiplier=0.0 if "dry" in off else values["dry_multiplier"],
        dry_base=values["dry_base"] if values["dry_base"] >= 1 else DEFAULTS["dry_base"],  # as llama-server
        dry_allowed_length=values["dry_allowed_length"], dry_penalty_last_n=values["dry_penalty_last_n"],
        dry_sequence_breakers=_breakers(field_value(body, "dry_sequence_breakers", DRY_BREAKERS)),
        mirostat=values["mirostat"], mirostat_tau=values["mirostat_tau"], mirostat_eta=values["mirostat_eta"],
        max_tokens=None if n_predict == -1 else max(n_predict, 1), seed=None if seed < 0 else seed, n=n,
        stop=_stop(body.get("stop")), ignore_eos=flag(body, "ignore_eos"),
        logit_bias=_logit_bias(body.get("logit_bias"), tokenizer), structured_outputs=_grammar(body))
    if "penalties" not in off:
        kwargs |= dict(repetition_penalty=values["repeat_penalty"], presence_penalty=values["presence_penalty"],
                       frequency_penalty=values["frequency_penalty"],
                       penalty_last_n=WHOLE_CONTEXT if last_n == -1 else last_n)
    try:
        params = SamplingParams(**kwargs)
        params.validate(len(tokenizer))
    except (TypeError, ValueError) as e:
        raise APIError(str(e)) from None
    settings = {**values, "n_predict": n_predict, "seed": seed, "stop": params.stop, "ignore_eos": params.ignore_eos,
                "n_probs": field_value(body, "n_probs", 0), "stream": flag(body, "stream"), "n_cmpl": n,
                "dry_sequence_breakers": params.dry_sequence_breakers,
                "samplers": [s for s in ("penalties", "dry", *TRUNCATIONS, "temperature") if s not in off]}
    return params, settings


def _samplers(samplers) -> tuple[set[str], bool]:
    """The samplers Flock runs that a `samplers` list (names, or a string of llama.cpp's sampler letters) leaves
    out, and whether the temperature comes after the truncations (as in llama.cpp's default chain); the order of
    the truncations among themselves is llama.cpp's default one."""
    if samplers is None:
        return set(), True
    if isinstance(samplers, str):
        names = [SAMPLER_CHARS.get(c) for c in samplers]
    elif isinstance(samplers, list) and all(isinstance(s, str) for s in samplers):
        names = [SAMPLER_NAMES.get(s.lower().replace("-", "").replace("_", "")) for s in samplers]
    else:
        raise APIError("samplers must be a list of sampler names or a string of sampler letters", param="samplers")
    if None in names:
        raise APIError(f"samplers has an unknown sampler ({samplers!r})", param="samplers")
    truncations = [i for i, name in enumerate(names) if name in TRUNCATIONS]
    last = "temperature" in names and all(i < names.index("temperature") for i in truncations)
    return {"penalties", "dry", "temperature", *TRUNCATIONS} - set(names), last


def _breakers(breakers) -> list[str]:
    if not isinstance(breakers, list) or not breakers or not all(isinstance(b, str) for b in breakers):
        raise APIError("dry_sequence_breakers must be a non-empty array of strings", param="dry_sequence_breakers")
    return breakers


def _stop(stop) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError("stop must be a list of strings", param="stop")
    return [s for s in stops if s]


def _logit_bias(bias, tokenizer) -> dict[int, float] | None:
    """[[token id or string, bias or false], ...] or {"id or string": bias}: a string's every token biased, false
    the token banned (-100, the most Flock's logit_bias takes)."""
    if bias is None or bias == [] or bias == {}:
        return None
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise APIError("logit_bias must be a list of [token, bias] pairs or an object", param="logit_bias")
    out: dict[int, float] = {}
    for token, value in pairs:
        value = -100.0 if value is False else value
        if not is_number(value):
            raise APIError(f"logit_bias values must be numbers or false, got {value!r}", param="logit_bias")
        if is_int(token):
            ids = [token]
        elif isinstance(token, str):  # an object's keys are strings: digits there are a token id
            ids = [int(token)] if isinstance(bias, dict) and token.isdigit() else \
                tokenizer.encode(token, add_special_tokens=False)
        else:
            raise APIError(f"logit_bias tokens must be ids or strings, got {token!r}", param="logit_bias")
        out |= {t: max(-100.0, min(100.0, float(value))) for t in ids}
    return out


def _grammar(body: dict) -> StructuredOutputsParams | None:
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar and schema is not None:
        raise APIError("give grammar or json_schema, not both", param="grammar")
    if grammar:
        if not isinstance(grammar, str):
            raise APIError("grammar must be a GBNF string", param="grammar")
        return StructuredOutputsParams(grammar=grammar)
    if schema is not None:
        if not isinstance(schema, dict):
            raise APIError("json_schema must be a JSON schema object", param="json_schema")
        return StructuredOutputsParams(json=schema)
    return None


def completion_object(req: Completion, index: int, text: str, token_ids: list[int], prompt_ids: list[int],
                      num_cached: int, finish_reason: str | None, stop_reason, logprobs: list[TokenLogprobs] | None,
                      model: str, tokenizer, token_text: TokenText, timings: dict, max_model_len: int) -> dict:
    """One completion's final object (in a stream: its last event, the text already sent); `truncated` when the
    context filled up."""
    truncated = finish_reason == "length" and len(prompt_ids) + len(token_ids) >= max_model_len
    if req.prefill_only:
        text, token_ids, logprobs = "", [], None
    word = stop_reason if isinstance(stop_reason, str) else ""
    stop_type = "limit" if finish_reason == "length" else "word" if word else "eos" if finish_reason else "none"
    obj = {"index": index, "content": "" if req.stream else text,
           "tokens": [] if req.stream or not req.return_tokens else token_ids, "id_slot": 0, "stop": True,
           "model": model, "tokens_predicted": len(token_ids), "tokens_evaluated": len(prompt_ids),
           "generation_settings": req.settings | {"model": model}, "prompt": tokenizer.decode(prompt_ids),
           "has_new_line": "\n" in text, "truncated": truncated, "stop_type": stop_type, "stopping_word": word,
           "tokens_cached": num_cached, "timings": timings}
    if logprobs and not req.stream:
        obj["completion_probabilities"] = probabilities(req, logprobs, token_text)
    return _fields(obj, req.response_fields)


def partial_object(req: Completion, index: int, text: str, token_ids: list[int], num_predicted: int,
                   num_prompt: int, logprobs: list[TokenLogprobs] | None, token_text: TokenText) -> dict:
    """A streamed event: the new text and its token ids."""
    obj = {"index": index, "content": text, "tokens": token_ids, "stop": False, "id_slot": 0,
           "tokens_predicted": num_predicted, "tokens_evaluated": num_prompt}
    if logprobs:
        obj["completion_probabilities"] = probabilities(req, logprobs, token_text)
    return obj


def probabilities(req: Completion, entries: list[TokenLogprobs], token_text: TokenText) -> list[dict]:
    """llama-server's completion_probabilities: each token with its logprob (or prob) and the top n_probs."""
    key, top = ("prob", "top_probs") if req.post_sampling_probs else ("logprob", "top_logprobs")

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        value = math.exp(logprob) if req.post_sampling_probs else max(logprob, -3.4028234663852886e38)
        return {"id": token_id, "token": text, "bytes": list(token_text.pieces.token_bytes(token_id)), key: value}

    if req.post_sampling_probs and req.requests[0][1].greedy:  # the chain leaves the chosen token alone
        return [item(e.token_id, 0.0) | {top: [item(e.token_id, 0.0)]} for e in entries]
    if req.post_sampling_probs:  # tokens the chain dropped are left out, as llama-server leaves them
        return [item(e.token_id, e.logprob) | {top: [item(t, lp) for t, lp in e.top if lp > -math.inf]}
                for e in entries]
    return [item(e.token_id, e.logprob) | {top: [item(t, lp) for t, lp in e.top]} for e in entries]


def timings(num_cached: int, num_prompt: int, prompt_s: float, num_predicted: int, predicted_s: float) -> dict:
    """llama-server's timings: the prompt's tokens computed (the cached ones not) and the generation's."""
    computed = max(num_prompt - num_cached, 0)
    out = {"cache_n": num_cached}
    for name, n, seconds in (("prompt", computed, prompt_s), ("predicted", num_predicted, predicted_s)):
        out |= {f"{name}_n": n, f"{name}_ms": seconds * 1e3, f"{name}_per_token_ms": seconds * 1e3 / max(n, 1),
                f"{name}_per_second": n / max(seconds, 1e-9)}
    return out


def _fields(obj: dict, fields: list[str]) -> dict:
    """response_fields: only these, "a/b" taken out of a's object under the name b."""
    if not fields:
        return obj
    out = {}
    for name in fields:
        value, found = obj, True
        for part in name.split("/"):
            found = isinstance(value, dict) and part in value
            value = value.get(part) if found else None
            if not found:
                break
        if found:
            out[name.rsplit("/", 1)[-1]] = value
    return out


def tokenize_content(body: dict, tokenizer, token_text: TokenText) -> dict:
    """llama-server's /tokenize: {"tokens": ids}, or with with_pieces [{"id", "piece"}] (a piece that is not whole
    UTF-8 as its bytes)."""
    ids = mixed_tokens(body.get("content"), "content", tokenizer, flag(body, "add_special"),
                       flag(body, "parse_special", default=True))
    if not flag(body, "with_pieces"):
        return {"tokens": ids}
    pieces = []
    for t in ids:
        raw = token_text.pieces.token_bytes(t)
        try:
            pieces.append({"id": t, "piece": raw.decode()})
        except UnicodeDecodeError:
            pieces.append({"id": t, "piece": list(raw)})
    return {"tokens": pieces}


def props(model: str, settings: dict, max_model_len: int, tokenizer, slots: int) -> dict:
    """llama-server's GET /props."""
    return {"default_generation_settings": {"n_ctx": max_model_len, "params": settings}, "total_slots": slots,
            "model_alias": model, "model_path": model, "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "bos_token": tokenizer.bos_token or "", "eos_token": tokenizer.eos_token or "",
            "modalities": {"vision": False, "audio": False}, "build_info": "flock"}

