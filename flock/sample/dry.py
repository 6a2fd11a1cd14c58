"""DRY ("don't repeat yourself"), llama.cpp's repetition penalty for sequences: a token that would extend a
sequence already seen in the last `dry_penalty_last_n` tokens (prompt and output), longer than
`dry_allowed_length`, loses dry_multiplier * dry_base ** (length - dry_allowed_length) of its logit. A sequence
breaker (a newline, a colon, a quote, an asterisk by default) ends the sequences that count: the repetition can
reach back no further than the last breaker.

Breakers are strings. As llama.cpp reads them against the vocabulary: a token whose text holds a breaker breaks
on its own, and a token whose text ends with the start of a breaker breaks when the tokens of the breaker's rest
follow it (`breaker_tokens`, once per tokenizer and breaker list)."""

import functools
import math

import numpy as np

MAX_BREAKER_CHARS = 40  # llama.cpp's caps on a breaker and on its rest's tokens
MAX_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: base ** exponent stays finite


@functools.lru_cache(maxsize=8)
def breaker_tokens(tokenizer, breakers: tuple[str, ...]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each token that can start a breaker -> the token sequences that must follow it (() for a token that is a
    breaker by itself)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    heads: dict[int, set[tuple[int, ...]]] = {}
    for breaker in (b[:MAX_BREAKER_CHARS] for b in breakers):
        for token, text in enumerate(texts):
            if breaker in text:
                heads.setdefault(token, set()).add(())
                continue
            for start in (i for i, c in enumerate(text) if c == breaker[0]):
                if breaker.startswith(text[start:]):  # the text ends with the breaker's start
                    rest = breaker[len(text) - start :]
                    tail = tuple(tokenizer.encode(rest, add_special_tokens=False)[:MAX_TAIL_TOKENS])
                    heads.setdefault(token, set()).add(tail)
    return {token: tuple(sorted(tails)) for token, tails in heads.items()}


def dry_penalties(context: list[int], multiplier: float, base: float, allowed: int,
                  heads: dict[int, tuple[tuple[int, ...], ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, penalties) for the tokens that would extend a repeated sequence of `context` (the window)."""
    ctx = np.asarray(context, dtype=np.int64)
    n = len(ctx)
    limit = _repeat_limit(ctx, heads)
    if n <= allowed or limit < allowed:
        return np.empty(0, np.int64), np.empty(0)
    # lengths[j]: how many tokens ending at j equal the context's last ones (its suffix), at most `limit`
    lengths = np.zeros(n - 1, dtype=np.int64)
    alive = np.arange(n - 1)
    for length in range(1, limit + 1):
        at = alive - (length - 1)
        alive = alive[(at >= 0) & (ctx[np.maximum(at, 0)] == ctx[n - length])]
        if not alive.size:
            break
        lengths[alive] = length
    repeats = np.flatnonzero(lengths >= allowed)
    if not repeats.size:
        return np.empty(0, np.int64), np.empty(0)
    # the token after each repeat would extend it: its longest repeat decides
    tokens, longest = ctx[repeats + 1], lengths[repeats]
    order = np.lexsort((longest, tokens))
    last = np.r_[tokens[order][1:] != tokens[order][:-1], True]
    tokens, longest = tokens[order][last], longest[order][last]
    keep = np.array([() not in heads.get(int(t), ()) for t in tokens], dtype=bool)  # breakers go free
    exponent = (longest - allowed)[keep].astype(np.float64)
    if base > 1.000001:
        exponent = np.minimum(exponent, int(FLOAT_MAX_LOG / math.log(base)))
    return tokens[keep], multiplier * base**exponent


def _repeat_limit(ctx: np.ndarray, heads: dict[int, tuple[tuple[int, ...], ...]]) -> int:
    """How far back a repetition may reach: to just after the last breaker (its head and its tail)."""
    n = len(ctx)
    for back in range(n):  # back tokens from the end
        tails = heads.get(int(ctx[n - 1 - back]))
        if tails is None:
            continue
        longest = max((len(t) for t in tails if len(t) <= back and
                       all(ctx[n - back + k] == tok for k, tok in enumerate(t))), default=-1)
        if longest >= 0:
            return back - longest
    return n
