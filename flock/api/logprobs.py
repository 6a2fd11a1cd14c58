"""Logprobs in OpenAI's response shapes (and vLLM's `prompt_logprobs`), from the engine's TokenLogprobs."""

from __future__ import annotations

from flock.engine.detokenizer import PIECE_CONTEXT_TOKENS, TokenPieces
from flock.sample.logprobs import TokenLogprobs


def finite(logprob: float) -> float:
    """A logprob for JSON: a token the grammar or a logit bias ruled out (-inf) as -9999.0, as vLLM gives it."""
    return max(logprob, -9999.0)


class TokenText:
    """Each token id's own text after the tokens before it (vLLM's decoded_token, flock.engine.detokenizer's
    TokenPieces); with `as_ids`, "token_id:N" instead (vLLM's return_tokens_as_token_ids: tokens that do not
    decode alone stay unambiguous)."""

    def __init__(self, tokenizer, as_ids: bool = False, pieces: TokenPieces | None = None):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.pieces = pieces or TokenPieces(tokenizer)

    def __call__(self, token_id: int, context: list[int] = ()) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.pieces(token_id, context)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's `bytes`: a piece of a character too, so that a choice's tokens' bytes
        join into its text); with `as_ids`, those of "token_id:N"."""
        return self(token_id).encode() if self.as_ids else self.pieces.token_bytes(token_id)

    def for_request(self, as_ids: bool) -> "TokenText":
        return TokenText(self.tokenizer, True, self.pieces) if as_ids else self


def completion_logprobs(text: TokenText, token_ids: list[int], entries: list[TokenLogprobs | None],
                        text_offset: int = 0, context: list[int] = ()) -> dict:
    """/v1/completions' `logprobs`: token texts, their logprobs, the top alternatives (the chosen token among
    them, as vLLM gives them) and each token's offset in the text; an entry of None (an echoed prompt's first
    token) has null logprobs. `context`: the tokens before token_ids (a stream's earlier ones)."""
    tokens, offsets, logprobs, tops = [], [], [], []
    for i, (token_id, e) in enumerate(zip(token_ids, entries)):
        before = _before(context, token_ids, i)
        token = text(token_id, before)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        logprobs.append(None if e is None else finite(e.logprob))
        tops.append(None if e is None else
                    {text(t, before): finite(lp) for t, lp in e.top} | {token: finite(e.logprob)})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(text: TokenText, entries: list[TokenLogprobs], context: list[int] = ()) -> dict:
    """/v1/chat/completions' `logprobs`: {"content": one item per output token}; `context`: the output tokens
    before the entries' (a stream's earlier ones)."""
    ids = [e.token_id for e in entries]
    items = []
    for i, e in enumerate(entries):
        before = _before(context, ids, i)
        items.append(_chat_item(text, e.token_id, before, e.logprob)
                     | {"top_logprobs": [_chat_item(text, t, before, lp) for t, lp in e.top]})
    return {"content": items}


def _before(context: list[int], ids: list[int], i: int) -> list[int]:
    """The few tokens before ids[i] (context, then ids), that a token's text may complete a character of."""
    return [*context[-PIECE_CONTEXT_TOKENS:], *ids[max(0, i - PIECE_CONTEXT_TOKENS) : i]][-PIECE_CONTEXT_TOKENS:]


def _chat_item(text: TokenText, token_id: int, before: list[int], logprob: float) -> dict:
    return {"token": text(token_id, before), "logprob": finite(logprob), "bytes": list(text.token_bytes(token_id))}


def prompt_logprobs(text: TokenText, token_ids: list[int], entries: list[TokenLogprobs | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's own token and its top alternatives."""
    out = []
    for i, (token_id, e) in enumerate(zip(token_ids, entries)):
        if e is None:
            out.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _) in enumerate(e.top)}
        items = {t: (lp, ranks[t]) for t, lp in e.top} | {token_id: (e.logprob, e.rank)}
        before = _before((), token_ids, i)
        out.append({str(t): {"logprob": finite(lp), "rank": r, "decoded_token": text(t, before)}
                    for t, (lp, r) in items.items()})
    return out
