"""POST /tokenize and /detokenize, as vLLM's server has them: a prompt's token ids, or a chat's as
/v1/chat/completions would send it through the chat template, and token ids back to text."""

from flock.api import protocol
from flock.api.protocol import APIError, chat_token_ids, check_fields

PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
# a chat completion's body whole (counting it is what clients send it here for): what shapes its prompt counts
CHAT_FIELDS = protocol.CHAT_FIELDS | {"return_token_strs"}


def tokenize(body, tokenizer, max_model_len: int) -> dict:
    """vLLM's TokenizeResponse of a {"prompt"} or {"messages"} body: count, max_model_len, tokens, token_strs
    (with return_token_strs, else null)."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    check_fields(body, CHAT_FIELDS if "messages" in body else PROMPT_FIELDS)
    for name in ("add_special_tokens", "return_token_strs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise APIError(f"{name} must be a bool", param=name)
    if "messages" in body:  # the template adds the special tokens (vLLM's add_special_tokens false by default)
        ids = chat_token_ids(body, tokenizer)
    elif isinstance(body.get("prompt"), str):
        ids = tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens") is not False)
    else:
        raise APIError("'prompt' (a string) or 'messages' is required", param="prompt")
    strs = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, tokenizer) -> dict:
    """vLLM's DetokenizeResponse of a {"tokens": [...]} body: {"prompt": their text}."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = len(tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError("'tokens' must be a list of token ids", param="tokens")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"tokens[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}
