"""llama-server's POST /infill: fill-in-the-middle for code editors (llama.vim, llama.vscode), the prompt made as
llama-server makes it, then answered as a /completion (flock/api/llama_cpp.py).

With the model's FIM tokens (found by name in the vocabulary, as llama.cpp finds them) the prompt is the
repo-level pattern: [REPO]myproject, each `input_extra` chunk as [SEP]filename and its text (without a SEP token:
after a snippet marker), [SEP]filename, then [PRE]prefix[SUF]suffix[MID]prompt. The prefix keeps its last 3/4 of
a 2,048-token batch (llama-server's default n_batch), the suffix its first tokens in the quarter left, the extra
chunks their last tokens in what the context leaves beside the batch. A model without the prefix, suffix and
middle tokens is told so, as llama-server tells it."""

from flock.api.llama_cpp import Completion, mixed_tokens, parse_completion
from flock.api.protocol import APIError
from flock.tokenizer import bos_prefix, fim_prompt, fim_tokens

N_BATCH = 2048  # llama-server's default logical batch, which sizes the prefix and suffix kept
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra chunks when the model has no file separator


def parse_infill(body, tokenizer, max_model_len: int) -> Completion:
    """An /infill body as a /completion of the FIM prompt; APIError naming what is wrong."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    fim = fim_tokens(tokenizer)
    missing = [role for role in ("pre", "suf", "mid") if role not in fim]
    if missing:
        names = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        raise APIError("Infill is not supported by this model: " + " ".join(f"{names[r]} token is missing." for r in missing),
                       status=501, type="not_supported_error")
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise APIError(f'"{name}" is required', param=name)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise APIError('"prompt" must be a string', param="prompt")
    ids = infill_prompt(fim, mixed_tokens(body["input_prefix"], "input_prefix", tokenizer, add_special=False),
                        mixed_tokens(body["input_suffix"], "input_suffix", tokenizer, add_special=False),
                        _extra(body.get("input_extra", []), fim, tokenizer),
                        tokenizer.encode(prompt, add_special_tokens=False), bos_prefix(tokenizer), max_model_len)
    return parse_completion(body | {"prompt": ids}, tokenizer)


def infill_prompt(fim: dict[str, int], prefix: list[int], suffix: list[int], extra: list[int], prompt: list[int],
                  bos: list[int], max_model_len: int) -> list[int]:
    """[extra][BOS]? [PRE]prefix prompt [SUF]suffix [MID], each part cut to its share of the batch and context."""
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (N_BATCH // 4)):]
    suffix = suffix[: max(0, N_BATCH // 4 - (2 + len(prompt)))]
    n_extra = min(max(0, max_model_len - N_BATCH + 2), len(extra))  # llama-server's n_predict -1 gives its + 2
    return extra[len(extra) - n_extra:] + fim_prompt(fim, bos, prefix + prompt, suffix)


def _extra(chunks, fim: dict[str, int], tokenizer) -> list[int]:
    if not isinstance(chunks, list):
        raise APIError('"input_extra" must be an array of {"filename": string, "text": string}', param="input_extra")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    out = [fim["rep"], *encode("myproject\n")] if "rep" in fim else []
    for chunk in chunks:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise APIError('extra_context chunk must contain a "text" field with a string value', param="input_extra")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise APIError('extra_context chunk\'s "filename" field must be a string', param="input_extra")
        out += [fim["sep"], *encode(filename + "\n")] if "sep" in fim else encode(SNIPPET)
        out += encode(chunk["text"])
    if "sep" in fim:
        out += [fim["sep"], *encode("filename\n")]
    return out
