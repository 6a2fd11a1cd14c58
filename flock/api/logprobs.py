"""Logprobs in OpenAI's response shapes (and vLLM's `prompt_logprobs`), from the engine's TokenLogprobs."""

from __future__ import annotations

from flock.sample.logprobs import TokenLogprobs


def finite(logprob: float) -> float:
    """A logprob for JSON: a token the grammar or a logit bias ruled out (-inf) as -9999.0, as vLLM gives it."""
    return max(logprob, -9999.0)


class TokenText:
    """Each token id's own text (as vLLM's decoded_token), decoded once per id; with `as_ids`, "token_id:N"
    instead (vLLM's return_tokens_as_token_ids: tokens that do not decode alone stay unambiguous)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def for_request(self, as_ids: bool) -> "TokenText":
        return TokenText(self.tokenizer, as_ids=True) if as_ids else self


def completion_logprobs(text: TokenText, token_ids: list[int], entries: list[TokenLogprobs | None],
                        text_offset: int = 0) -> dict:
    """/v1/completions' `logprobs`: token texts, their logprobs, the top alternatives (the chosen token among
    them, as vLLM gives them) and each token's offset in the text; an entry of None (an echoed prompt's first
    token) has null logprobs."""
    tokens, offsets, logprobs, tops = [], [], [], []
    for token_id, e in zip(token_ids, entries):
        token = text(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        logprobs.append(None if e is None else finite(e.logprob))
        tops.append(None if e is None else {text(t): finite(lp) for t, lp in e.top} | {token: finite(e.logprob)})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(text: TokenText, entries: list[TokenLogprobs]) -> dict:
    """/v1/chat/completions' `logprobs`: {"content": one item per output token}."""
    return {"content": [_chat_item(text(e.token_id), e.logprob)
                        | {"top_logprobs": [_chat_item(text(t), lp) for t, lp in e.top]} for e in entries]}


def _chat_item(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode())}


def prompt_logprobs(text: TokenText, token_ids: list[int], entries: list[TokenLogprobs | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's own token and its top alternatives."""
    out = []
    for token_id, e in zip(token_ids, entries):
        if e is None:
            out.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _) in enumerate(e.top)}
        items = {t: (lp, ranks[t]) for t, lp in e.top} | {token_id: (e.logprob, e.rank)}
        out.append({str(t): {"logprob": finite(lp), "rank": r, "decoded_token": text(t)}
                    for t, (lp, r) in items.items()})
    return out
