"""SGLang's native `POST /generate`: its request body -> engine requests, engine outputs -> its response objects,
so a client written for an SGLang server (`{"text": ..., "sampling_params": {...}}`) runs unchanged.

A body is one prompt (`text` a string or `input_ids` a list of ids) or a batch of them, each sampled
`sampling_params.n` times; one prompt with n = 1 answers one object, anything else a list in prompt-major order.
Each object is `{"text", "output_ids", "meta_info"}`; `text` leaves out the stop string or token that ended it
(unless `no_stop_trim`), `output_ids` keep the token. Streamed events carry the text and ids so far.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from flock.api.logprobs import TokenText, finite
from flock.api.protocol import MAX_CHOICES, APIError, flag, given, is_int, is_number
from flock.lora import LoRARequest
from flock.multimodal import ImageInputs
from flock.multimodal.processor import IMAGES_REFUSED, image_prompts
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
GREEDY_BELOW = 1e-6  # a temperature under this samples greedily, as SGLang's
# SGLang's fields for what Flock does not run: refused unless left at their defaults; other unknown fields are
# ignored, as SGLang ignores them
UNSUPPORTED = {"input_embeds", "video_data", "audio_data", "return_hidden_states",
               "custom_logit_processor", "session_params"}
_PLAIN = {"min_new_tokens": "min_tokens", "stop": "stop",
          "stop_token_ids": "stop_token_ids", "top_p": "top_p", "min_p": "min_p", "ignore_eos": "ignore_eos",
          "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
          "repetition_penalty": "repetition_penalty", "skip_special_tokens": "skip_special_tokens",
          "no_stop_trim": "include_stop_str_in_output", "logit_bias": "logit_bias", "sampling_seed": "seed", "n": "n",
          "stream_interval": "stream_interval"}
_GRAMMARS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
# besides: max_new_tokens, temperature, top_k; the last two change nothing here (custom_params only when null)
_ACCEPTED = {"max_new_tokens", "temperature", "top_k", "spaces_between_special_tokens", "custom_params"}


@dataclass
class NativeRequest:
    """A parsed /generate body: one engine request per (prompt, sample), prompt-major."""

    single: bool  # one prompt, one sample: the answer is an object, not a list
    requests: list[tuple[list[int], SamplingParams]]
    rids: list[str]
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # the first prompt position with logprobs; -1: the last one only
    top_logprobs_num: int = 0
    token_ids_logprob: bool = False  # the listed tokens' logprobs at each position, in place of the top ones
    return_text_in_logprobs: bool = False
    prefill_only: list[bool] = field(default_factory=list)  # per request: max_new_tokens 0, its one token dropped


def parse_generate(body, tokenizer, loras: dict[str, LoRARequest] | None = None, max_model_len: int | None = None,
                   priority_scheduling: bool = False) -> NativeRequest:
    """Check and convert a /generate body; APIError names what is wrong. `lora_path` names an adapter of `loras`
    (the server's --lora-modules), for every prompt or one each (null: the base model). `priority` (higher first,
    SGLang's default order) counts only under `priority_scheduling`, else it is ignored as SGLang ignores it;
    `extra_key` keeps a prompt's cached prefix to requests of the same key (Flock's cache_salt)."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    unsupported = sorted(k for k in UNSUPPORTED if body.get(k) not in (None, False, [], {}))
    if unsupported:
        raise APIError(f"{unsupported[0]} is not supported", param=unsupported[0])
    prompts, single = _prompts(body, tokenizer)
    specs = body.get("sampling_params") or {}
    specs = specs if isinstance(specs, list) else [specs] * len(prompts)
    if len(specs) != len(prompts) or not all(isinstance(s, dict) for s in specs):
        raise APIError("sampling_params must be an object, or a list of one per prompt", param="sampling_params")
    params = [_sampling_params(s) for s in specs]
    for p, ids in zip(params, prompts):
        _check_length(len(ids), p.max_tokens, max_model_len)
    for p, key in zip(params, _per_prompt(body.get("extra_key"), len(prompts), "extra_key")):
        p.cache_salt = key or None
    priority = body.get("priority")
    if priority is not None and not is_int(priority):
        raise APIError(f"priority must be an integer, got {priority!r}", param="priority")
    for p in params:
        p.priority = -priority if priority and priority_scheduling else 0
    for p, images in zip(params, _images(body, tokenizer, prompts)):
        p.multi_modal = images
    for p, name in zip(params, _per_prompt(body.get("lora_path"), len(prompts), "lora_path")):
        if name is not None and name not in (loras or {}):
            raise APIError(f"lora_path {name!r} is not a LoRA adapter of this server (its --lora-modules: "
                           f"{sorted(loras or {}) or 'none'})", param="lora_path")
        p.lora_request = None if name is None else loras[name]
    prefill = [s.get("max_new_tokens") == 0 for s in specs]
    n = {p.n for p in params}
    if len(n) > 1:
        raise APIError("sampling_params.n must be the same for every prompt", param="sampling_params")
    logprob = flag(body, "return_logprob")
    start, top = given(body, "logprob_start_len", -1), given(body, "top_logprobs_num", 0)
    if not isinstance(logprob, bool) or not is_int(start) or start < -1 or not is_int(top) or not 0 <= top <= 20:
        raise APIError("return_logprob must be a bool, logprob_start_len an integer >= -1 and top_logprobs_num an "
                       "integer in [0, 20]", param="return_logprob")
    listed = _token_ids_logprob(body.get("token_ids_logprob"), len(prompts), logprob, top)
    for p, ids, wanted in zip(params, prompts, listed):
        if logprob:
            p.logprobs, p.logprob_token_ids = top, wanted
            if start >= len(ids):
                raise APIError(f"logprob_start_len ({start}) must be less than the prompt's {len(ids)} tokens",
                               param="logprob_start_len")
            if 0 <= start < len(ids) - 1 and wanted is None:
                p.prompt_logprobs = top
            elif 0 <= start < len(ids) - 1:
                p.prompt_logprob_token_ids, p.prompt_logprob_start = [wanted] * (len(ids) - 1 - start), start
    if len(prompts) * params[0].n > MAX_CHOICES:
        raise APIError(f"n times the number of prompts must be at most {MAX_CHOICES}", param="sampling_params")
    requests = [(ids, s) for ids, p in zip(prompts, params) for s in p.samples()]
    prefill = [flag for flag, p in zip(prefill, params) for _ in range(p.n)]
    return NativeRequest(single and len(requests) == 1, requests, _rids(body.get("rid"), len(prompts), len(requests)),
                         flag(body, "stream"), logprob, start, top, listed[0] is not None,
                         flag(body, "return_text_in_logprobs"), prefill)


def _check_length(num_prompt: int, max_new_tokens: int | None, max_model_len: int | None) -> None:
    """SGLang's limits: the prompt shorter than the context, and with max_new_tokens still inside it."""
    if max_model_len is None:
        return
    if num_prompt >= max_model_len:
        raise APIError(f"The input ({num_prompt} tokens) is longer than the model's context length "
                       f"({max_model_len} tokens).", param="text")
    if max_new_tokens is not None and num_prompt + max_new_tokens >= max_model_len:
        raise APIError(f"Requested token count exceeds the model's maximum context length of {max_model_len} tokens. "
                       f"You requested a total of {num_prompt + max_new_tokens} tokens: {num_prompt} tokens from the "
                       f"input messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                       "tokens in the input messages or the completion to fit within the limit.",
                       param="sampling_params")


def _per_prompt(value, num_prompts: int, name: str) -> list:
    """A field given once for every prompt, or as a list of one per prompt."""
    values = value if isinstance(value, list) else [value] * num_prompts
    if len(values) != num_prompts or not all(v is None or isinstance(v, str) for v in values):
        raise APIError(f"{name} must be a string, or a list of one per prompt", param=name)
    return values


def _token_ids_logprob(value, num_prompts: int, logprob: bool, top: int) -> list[list[int] | None]:
    """SGLang's token_ids_logprob per prompt (one list for all, or one each; None: not asked)."""
    if value is None:
        return [None] * num_prompts
    lists = value if isinstance(value, list) and value and isinstance(value[0], list) else [value] * num_prompts
    if (len(lists) != num_prompts or not all(
            isinstance(ids, list) and ids and all(is_int(t) and t >= 0 for t in ids) for ids in lists)):
        raise APIError("token_ids_logprob must be a non-empty list of token ids, or one per prompt",
                       param="token_ids_logprob")
    if not logprob or top:
        raise APIError("token_ids_logprob needs return_logprob, and takes the place of top_logprobs_num",
                       param="token_ids_logprob")
    return lists




def _rids(rid, num_prompts: int, num_requests: int) -> list[str]:
    """SGLang's request ids: the body's (a string; a batch's list, or a string with _i added), fresh ones for
    n > 1 samples."""
    if rid is None or num_requests != num_prompts:
        return [uuid.uuid4().hex for _ in range(num_requests)]
    rids = [rid] if num_prompts == 1 and isinstance(rid, str) else \
        [f"{rid}_{i}" for i in range(num_prompts)] if isinstance(rid, str) else rid
    if not isinstance(rids, list) or len(rids) != num_prompts or not all(isinstance(r, str) for r in rids):
        raise APIError("rid must be a string, or a list of one string per prompt", param="rid")
    if len(set(rids)) != len(rids):
        raise APIError("rid has duplicate request ids", param="rid")
    return rids


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError("give either text or input_ids", param="text")
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise APIError("text must be a non-empty string or a non-empty list of them", param="text")
        return [tokenizer.encode(t) for t in texts], isinstance(text, str)
    single = isinstance(ids, list) and bool(ids) and is_int(ids[0])
    batch = [ids] if single else ids
    if not isinstance(batch, list) or not batch or not all(
            isinstance(b, list) and b and all(is_int(t) for t in b) for b in batch):
        raise APIError("input_ids must be a non-empty list of token ids, or a list of them", param="input_ids")
    return batch, single


def _images(body: dict, tokenizer, prompts: list[list[int]]) -> list[ImageInputs | None]:
    """SGLang's image_data: each text prompt's images (a URL, a data: URL or bare base64; a list for several),
    through the model's processor, which also rewrites that prompt's token ids."""
    data = body.get("image_data")
    if data in (None, [], ""):
        return [None] * len(prompts)
    text = body.get("text")
    if text is None:
        raise APIError("image_data needs text prompts (the model's image token marks each image)", param="image_data")
    texts, per_prompt = ([text], [data]) if isinstance(text, str) else (text, data)
    if not isinstance(per_prompt, list) or len(per_prompt) != len(texts):
        raise APIError("image_data must hold one entry (an image or a list) per prompt", param="image_data")
    processor = image_prompts(tokenizer.name_or_path)
    if processor is None:
        raise APIError(IMAGES_REFUSED, param="image_data")
    out = []
    for i, (prompt, images) in enumerate(zip(texts, per_prompt)):
        images = images if isinstance(images, list) else [] if images is None else [images]
        if not images:
            out.append(None)
            continue
        if not all(isinstance(x, str) for x in images):
            raise APIError("image_data entries must be strings (URLs or base64)", param="image_data")
        urls = [x if x.startswith(("data:", "http://", "https://")) else f"data:image;base64,{x}" for x in images]
        try:
            prompts[i], inputs = processor.encode(prompt, urls, allow_files=False)
        except ValueError as e:
            raise APIError(str(e), param="image_data") from None
        out.append(inputs)
    return out


def _sampling_params(spec: dict) -> SamplingParams:
    unknown = sorted(set(spec) - _PLAIN.keys() - _GRAMMARS.keys() - _ACCEPTED)
    if unknown or spec.get("custom_params") is not None:
        raise APIError(f"sampling_params has unknown or unsupported key(s) {unknown or ['custom_params']}",
                       param="sampling_params")
    kwargs = {name: spec[key] for key, name in _PLAIN.items() if spec.get(key) is not None}
    max_new = spec.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)  # null: up to the context length
    if max_new is not None and (not is_int(max_new) or max_new < 0):
        raise APIError(f"sampling_params.max_new_tokens must be at least 0, got {max_new!r}", param="sampling_params")
    kwargs["max_tokens"] = 1 if max_new == 0 else max_new  # 0: prefill only, the one token is dropped
    temperature = spec.get("temperature")
    if temperature is not None:
        kwargs["temperature"] = 0.0 if is_number(temperature) and 0 <= temperature < GREEDY_BELOW else temperature
    top_k = spec.get("top_k")
    if top_k == 0:
        raise APIError("sampling_params.top_k must be -1 (disable) or at least 1, got 0", param="sampling_params")
    kwargs["top_k"] = -1 if top_k is None else top_k
    grammars = {name: spec[key] for key, name in _GRAMMARS.items() if spec.get(key) is not None}
    if len(grammars) > 1:
        raise APIError("only one of regex, json_schema, ebnf or structural_tag can be set", param="sampling_params")
    if grammars:
        (kind, value), = grammars.items()
        if kind == "json" and isinstance(value, str):  # SGLang's is JSON text
            value = _json(value)
        elif kind == "structural_tag" and not isinstance(value, str):
            value = json.dumps(value)
        kwargs["structured_outputs"] = StructuredOutputsParams(**{kind: value})
    try:
        params = SamplingParams(**kwargs)
        params.validate()
    except (TypeError, ValueError) as e:
        raise APIError(f"sampling_params: {e}", param="sampling_params") from None
    return params


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(f"sampling_params.json_schema is not valid JSON: {e}", param="sampling_params") from None


def output_object(req: NativeRequest, index: int, text: str, output_ids: list[int], num_prompt_tokens: int,
                  num_cached_tokens: int, finish_reason: str | None, stop_reason, prompt_ids: list[int],
                  logprobs: list[TokenLogprobs] | None, prompt_entries: list[TokenLogprobs | None] | None,
                  token_text: TokenText, latency: float | None = None) -> dict:
    """One prompt-sample's {"text", "output_ids", "meta_info"} (so far, while `finish_reason` is None)."""
    if req.prefill_only[index]:
        text, output_ids, logprobs = "", [], [] if logprobs is not None else None
    meta = {"id": req.rids[index], "finish_reason": _finish_reason(req, index, finish_reason, stop_reason,
                                                                   output_ids),
            "prompt_tokens": num_prompt_tokens, "completion_tokens": len(output_ids),
            "cached_tokens": num_cached_tokens, "weight_version": "default"}
    if latency is not None:
        meta["e2e_latency"] = latency
    if req.return_logprob:
        meta |= _logprobs(req, prompt_ids, logprobs or [], prompt_entries, token_text)
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def _finish_reason(req: NativeRequest, index: int, reason: str | None, stop_reason, output_ids: list[int]):
    if reason is None:
        return None
    if reason == "length" or req.prefill_only[index]:  # max_new_tokens reached, or the context filled up
        return {"type": "length", "length": 0 if req.prefill_only[index] else len(output_ids)}
    if reason == "stop":  # a stop string or token, or the EOS / a grammar's end: the last token
        return {"type": "stop", "matched": stop_reason if stop_reason is not None else output_ids[-1]}
    return {"type": "abort", "message": reason, "status_code": None, "err_type": None}


def _logprobs(req: NativeRequest, prompt_ids: list[int], entries: list[TokenLogprobs],
              prompt_entries: list[TokenLogprobs | None] | None, token_text: TokenText) -> dict:
    """SGLang's [logprob, token id, text or null] triples: of the prompt from logprob_start_len (the first
    position's logprob null), of the output, and the top alternatives of each when asked."""
    text = token_text if req.return_text_in_logprobs else (lambda _: None)
    start = len(prompt_ids) - 1 if req.logprob_start_len == -1 else req.logprob_start_len
    known = prompt_entries if prompt_entries is not None else [None] * len(prompt_ids)
    prompt = list(zip(prompt_ids[start:], known[start:]))
    out = {"input_token_logprobs": [[None if i == 0 or e is None else finite(e.logprob), t, text(t)]
                                    for i, (t, e) in enumerate(prompt)],
           "output_token_logprobs": [[finite(e.logprob), e.token_id, text(e.token_id)] for e in entries]}
    if req.top_logprobs_num or req.token_ids_logprob:
        kind = "token_ids" if req.token_ids_logprob else "top"
        out[f"input_{kind}_logprobs"] = [None if i == 0 or e is None else [[finite(lp), t, text(t)] for t, lp in e.top]
                                         for i, (_, e) in enumerate(prompt)]
        out[f"output_{kind}_logprobs"] = [[[finite(lp), t, text(t)] for t, lp in e.top] for e in entries]
    return out


def model_info(model: str, tokenizer_path: str) -> dict:
    """SGLang's GET /get_model_info."""
    return {"model_path": model, "tokenizer_path": tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False}

