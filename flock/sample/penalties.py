"""Penalties, logit biases and min_tokens, with vLLM's semantics, on the rows that ask for them.

In vLLM's order, before temperature, top-k and top-p (and before a greedy row's argmax):
0. allowed_token_ids: every other token goes to -inf; bad_words: a word's last token goes to -inf when the output
   ends with the word's other tokens; a row whose thinking has spent its thinking_token_budget keeps only the
   end-of-thinking token (`forced_token`);
1. min_tokens: the EOS ids and the row's stop_token_ids go to -inf while the output is shorter than min_tokens
   (unless they are all the row has left: a grammar that can only end ends);
2. logit_bias: each listed token's bias is added to its logit;
3. repetition_penalty over the prompt and output tokens: a positive logit is divided by it, a negative one
   multiplied; then frequency and presence over the output tokens only (the OpenAI definition):
   logit -= frequency_penalty * count + presence_penalty * (count > 0). With penalty_last_n, all three count
   the last n tokens of the prompt and output instead (llama.cpp's penalties);
4. llama.cpp's DRY over the last dry_penalty_last_n tokens of the prompt and output (dry.py).

A batch whose rows ask for none of this returns its logits untouched, at the cost of one look at each row's
params; otherwise only the rows that ask are gathered and adjusted, as one set of tensor ops."""

from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Protocol

import torch

from flock.sample.dry import dry_penalties
from flock.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """A row's tokens so far (a Request is one)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def forced_token(self) -> int | None: ...


def adjusts(p: SamplingParams, history: TokenHistory) -> bool:
    """Whether this row's logits change in this step."""
    return (p.has_penalties or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words_token_ids)
            or p.dry or (p.min_tokens > 0 and len(history.output_token_ids) < p.min_tokens)
            or history.forced_token is not None)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
                    eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """The logits with each row's penalties, bias and min_tokens applied: the tensor itself, its adjusted rows
    written in place (half-precision logits are first widened to a float32 copy)."""
    # the common batch asks for nothing: one cheap look at each row's params (no call) settles it
    rows = [i for i, p in enumerate(params) if p.min_tokens or p.logit_bias or p.presence_penalty
            or p.frequency_penalty or p.repetition_penalty != 1.0 or p.allowed_token_ids is not None
            or p.bad_words_token_ids or p.dry_multiplier or p.thinking_token_budget is not None]
    rows = [i for i in rows if adjusts(params[i], histories[i])]
    if not rows:
        return logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = adjust(logits[index], [params[i] for i in rows], [histories[i] for i in rows], eos_token_ids)
    return logits


def adjust(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
           eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """Every row of `logits` adjusted by its own params and tokens, in place; returns it."""
    _allowed(logits, params)
    _forced(logits, histories)
    _bad_words(logits, params, histories)
    _min_tokens(logits, params, histories, set(eos_token_ids))
    _logit_bias(logits, params)
    _penalties(logits, params, histories)
    _dry(logits, params, histories)
    return logits


def _dry(logits: torch.Tensor, params, histories) -> None:
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.dry:
            n = p.dry_penalty_last_n
            window = _last(h, n if n > 0 else len(h.prompt_token_ids) + len(h.output_token_ids))
            ids, penalties = dry_penalties(window, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                           p.dry_breakers or {})
            if len(ids):
                logits[i, _long(ids.tolist(), logits)] -= _values(penalties.tolist(), logits)[:, 0]


def _allowed(logits: torch.Tensor, params) -> None:
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = _long(p.allowed_token_ids, logits)
            kept = logits[i, keep]
            logits[i] = float("-inf")
            logits[i, keep] = kept


def _forced(logits: torch.Tensor, histories) -> None:
    for i, h in enumerate(histories):
        if (token := h.forced_token) is not None:
            logits[i] = float("-inf")
            logits[i, token] = 0.0


def _bad_words(logits: torch.Tensor, params, histories) -> None:
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.bad_words_token_ids:
            out = h.output_token_ids
            for ids in p.bad_words_token_ids:
                before = ids[:-1]
                if len(before) <= len(out) and out[len(out) - len(before):] == before:
                    logits[i, ids[-1]] = float("-inf")


def _min_tokens(logits: torch.Tensor, params, histories, eos_token_ids: set[int]) -> None:
    vocab = logits.shape[-1]
    rows, ids = [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.min_tokens > 0 and len(h.output_token_ids) < p.min_tokens:
            held = [t for t in eos_token_ids.union(p.stop_token_ids) if 0 <= t < vocab]
            rows += [i] * len(held)
            ids += held
    if rows:
        r, t = _long(rows, logits), _long(ids, logits)
        held = logits[r, t]
        logits[r, t] = float("-inf")
        # a row left with no token at all (a grammar that can only end) ends: its grammar wins over min_tokens
        ends = torch.isneginf(logits).all(-1)[r]
        logits[r[ends], t[ends]] = held[ends]


def _logit_bias(logits: torch.Tensor, params) -> None:
    rows, ids, biases = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            biases += p.logit_bias.values()
    if rows:
        bias = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_((_long(rows, logits), _long(ids, logits)), bias, accumulate=True)


def _penalties(logits: torch.Tensor, params, histories) -> None:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    sub = logits[_long(rows, logits)]
    counts = _counts([_counted(params[i], histories[i]) for i in rows], sub)
    repetition = _values([params[i].repetition_penalty for i in rows], sub)
    if bool((repetition != 1.0).any()):
        # the prompt is read only for the rows with a repetition penalty (and no window, which counted it)
        prompts = [histories[i].prompt_token_ids if params[i].repetition_penalty != 1.0
                   and params[i].penalty_last_n is None else [] for i in rows]
        seen = (counts > 0) | (_counts(prompts, sub) > 0)
        factor = torch.where(seen, repetition, 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    frequency = _values([params[i].frequency_penalty for i in rows], sub)
    presence = _values([params[i].presence_penalty for i in rows], sub)
    sub -= frequency * counts + presence * (counts > 0)
    logits[_long(rows, logits)] = sub


def _counted(p: SamplingParams, history: TokenHistory) -> list[int]:
    """The tokens the frequency and presence penalties count: the output, or the last penalty_last_n tokens of
    the prompt and output."""
    return history.output_token_ids if p.penalty_last_n is None else _last(history, p.penalty_last_n)


def _last(history: TokenHistory, n: int) -> list[int]:
    """The last n tokens of the prompt and output."""
    out = history.output_token_ids
    if n <= len(out):
        return out[len(out) - n:]
    prompt = history.prompt_token_ids
    return prompt[max(0, len(prompt) - (n - len(out))):] + out


def _counts(token_lists: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """How often each token id occurs in each list: one (rows, vocab) bincount, in like's dtype."""
    n, vocab = like.shape
    lengths = torch.tensor([len(t) for t in token_lists], device=like.device)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=like.device)
    where = torch.repeat_interleave(torch.arange(n, device=like.device), lengths) * vocab + flat
    counts = torch.zeros(n * vocab, dtype=like.dtype, device=like.device)
    counts.index_add_(0, where, torch.ones_like(where, dtype=like.dtype))
    return counts.view(n, vocab)


def _values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
