"""Logprobs of chosen tokens: each token's log-probability, its rank and the most likely alternatives, from one
row of logits each (log-softmax in float32, or float64)."""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flock.model import fused_ops


@dataclass
class Logprob:
    """vLLM's: a token's logprob, its rank (1: the most likely; None where unranked) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs(Mapping):
    """The chosen token's logprob and rank (1: the most likely), and the `top` alternatives as (token id,
    logprob), most likely first (`listed`: the tokens logprob_token_ids asked for, in their order). Also vLLM's view
    of them: a mapping of token id to Logprob, the chosen token first, then the alternatives (ranked 1.. unless
    listed), each with its text where `texts` has it (with_texts)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    listed: bool = False
    texts: dict[int, str] | None = field(default=None, repr=False, compare=False)
    _view: tuple | None = field(default=None, repr=False, compare=False)  # (texts, entries) built from them

    def _entries(self) -> dict[int, Logprob]:
        """The mapping, built once (for the texts it was built with: with_texts sets them later)."""
        if self._view is None or self._view[0] is not self.texts:
            text = (self.texts or {}).get
            entries = {self.token_id: Logprob(self.logprob, self.rank, text(self.token_id))}
            for i, (token, logprob) in enumerate(self.top):
                entries.setdefault(token, Logprob(logprob, None if self.listed else i + 1, text(token)))
            self._view = self.texts, entries
        return self._view[1]

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self):
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


def with_texts(entries: list["TokenLogprobs | None"], pieces) -> None:
    """Give each entry of a sequence the text of its tokens after the sequence's tokens before it (vLLM's
    decoded_token; `pieces`: a flock.engine.detokenizer.TokenPieces)."""
    ids = [None if e is None else e.token_id for e in entries]
    for i, entry in enumerate(entries):
        if entry is not None:
            before = [t for t in ids[max(0, i - pieces.context_tokens) : i] if t is not None]
            entry.texts = {t: pieces(t, before) for t in (entry.token_id, *(t for t, _ in entry.top)) if t >= 0}


def log_softmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise, in float32 (float64 logits stay float64); into `out` when given (float32 logits may be `out`
    itself: the same values, overwritten)."""
    return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1, out=out)


def _above(logprobs: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """How many entries of each row exceed its picked one."""
    if logprobs.dim() == 2 and logprobs.stride(1) == 1 and not fused_ops.unavailable(logprobs.dtype, logprobs.device):
        return fused_ops.count_above(logprobs, picked)
    return (logprobs > picked[:, None]).sum(-1)


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int],
                   listed: list[list[int] | None] | None = None) -> list[TokenLogprobs]:
    """One entry per row of `logprobs` (log-softmaxed), for the row's `chosen` token with its `num_top[i]`
    alternatives, or the tokens `listed[i]` in their order where that is not None."""
    chosen = chosen.to(logprobs.device, torch.long)
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    ranks = _above(logprobs, picked) + 1
    top_values, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)
    rows = zip(chosen.tolist(), picked.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), num_top)
    out = [TokenLogprobs(t, p, r, list(zip(ids[:n], values[:n]))) for t, p, r, ids, values, n in rows]
    for entry, row, ids in zip(out, logprobs, listed or []):
        if ids is not None:
            at = torch.tensor(ids, dtype=torch.long, device=row.device)
            values = torch.where(at >= 0, row[at.clamp_min(0)], -torch.inf)  # -1: a padding entry
            entry.top, entry.listed = list(zip(ids, values.tolist())), True
    return out
