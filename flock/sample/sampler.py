from collections.abc import Iterable, Sequence
from concurrent.futures import Future
import functools
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from flock.model import fused_ops
from flock.sample.grammar import GrammarMasks
from flock.sample.logprobs import TokenLogprobs, log_softmax, token_logprobs
from flock.sample.penalties import TokenHistory, apply_penalties
from flock.sampling_params import SamplingParams

CHUNK = 256  # vocabulary entries per chunk of the two-level inverse CDF
TOP_P_FIRST = 256  # most likely tokens among which top-p first looks for its cut


def _fused(logits: torch.Tensor) -> bool:
    """Whether the fused kernels take these logits (rows of bf16 or fp32 on a CPU that builds them)."""
    return logits.dim() == 2 and logits.stride(1) == 1 and fused_ops.unavailable(logits.dtype, logits.device) is None


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of every row, in the logits' own dtype (widening bf16 is exact, so it picks the same
    token): by the fused kernel where it runs, 5-10x faster than PyTorch's on a batch of rows here."""
    if _fused(logits):
        return fused_ops.argmax(logits)
    return logits.argmax(dim=-1)


class SamplingRow(TokenHistory, Protocol):
    """What sampling reads of a row: its request's params, generator and grammar, its tokens so far (a Request
    has all but `drafts`, which a step's rows add: flock.spec.DraftRow)."""

    params: SamplingParams
    generator: torch.Generator | None
    grammar: object | None  # an xgrammar matcher
    drafts: list[int]  # speculative tokens before this row, counted in its output (read by the grammar masks)
    grammar_waits: int | None  # Request.grammar_waits: its grammar waits for the thinking, stop tokens stay allowed
    mirostat_mu: float | None  # a Mirostat request's running bound
    # a DraftRow's: the draft this row verifies and the draft model's distribution it was drawn from (None, or no
    # such attribute: the row is sampled as it is)
    proposal: tuple[int, torch.Tensor] | None


@dataclass
class Sampled:
    tokens: torch.Tensor  # one per row
    logprobs: list[TokenLogprobs | None]  # per row: of the rows whose params ask for logprobs
    mirostat_mu: list[float | None]  # per row: a Mirostat row's bound after its draw


class Sampler:
    """Picks one token per row of logits. Greedy rows take the argmax; sampled rows apply temperature,
    top-k and top-p, then draw with the request's own generator, so a seeded request gives the same
    tokens whatever batch it runs in. Penalties, logit_bias and min_tokens come first, on the rows that ask for
    them (penalties.py), so the others keep the fast paths."""

    def __init__(self, seed: int, eos_token_ids: Iterable[int] = (), vocab_size: int = 0,
                 logprobs_mode: str = "raw_logprobs"):
        self.default_generator = torch.Generator().manual_seed(seed)
        self.logprobs_mode = logprobs_mode  # EngineConfig's
        self.eos_token_ids = frozenset(eos_token_ids)  # held back by min_tokens
        self.masks = GrammarMasks(vocab_size)
        self.logprobs: torch.Tensor | None = None  # float32 log-softmax rows, kept across steps (_log_softmax)

    def start_masks(self, rows: Sequence[SamplingRow]) -> Future | None:
        """Start filling the grammar bitmasks of the constrained rows (before the model runs)."""
        stops = sorted(self.eos_token_ids)
        return self.masks.fill([(r.grammar, r.drafts, stops if r.grammar_waits is not None else ())
                                for r in rows if r.grammar is not None])

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], masks: Future | None = None) -> Sampled:
        """A token per row, with logprobs where asked: the grammar masks (`start_masks`) first, the logprobs from
        those logits, then penalties and the draw (`__call__`)."""
        if masks is not None:
            self.masks.apply(logits, [i for i, r in enumerate(rows) if r.grammar is not None], masks)
        asking = [i for i, r in enumerate(rows) if r.params.wants_logprobs]
        params = [r.params for r in rows]
        modes: dict[str, list[int]] = {}  # logprobs mode -> its rows among the asking ones
        for k, i in enumerate(asking):
            modes.setdefault(params[i].logprobs_mode or self.logprobs_mode, []).append(k)
        processed = any(mode.startswith("processed") for mode in modes)
        parts = {mode: self._raw_values(logits, [asking[k] for k in ks], mode)
                 for mode, ks in modes.items() if not mode.startswith("processed")}
        if processed:  # penalties first, so the values see them
            logits = apply_penalties(logits, params, rows, self.eos_token_ids)
        mus = [r.mirostat_mu for r in rows]
        tokens = self(logits, params, [r.generator for r in rows], None if processed else rows, mus,
                      [getattr(r, "proposal", None) for r in rows])
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if asking:
            for mode, ks in modes.items():
                if mode.startswith("processed"):
                    parts[mode] = processed_values(logits[[asking[k] for k in ks]], [params[asking[k]] for k in ks],
                                                   mode)
            values = _gathered(parts, modes, len(asking))
            vocab = logits.shape[-1]
            entries = token_logprobs(values, tokens[asking], [whole(rows[i].params.logprobs, vocab) for i in asking],
                                     [rows[i].params.logprob_token_ids for i in asking])
            for i, entry in zip(asking, entries):
                logprobs[i] = entry
        return Sampled(tokens, logprobs, mus)

    def _raw_values(self, logits: torch.Tensor, rows: list[int], mode: str) -> torch.Tensor:
        """The rows' logprobs (or logits) before penalties and temperature."""
        raw = logits if len(rows) == logits.shape[0] else logits[rows]
        return self._log_softmax(raw) if mode == "raw_logprobs" else raw.float().clone()

    def _log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' log-softmax; of float32 CPU rows into a buffer the next step overwrites (a fresh tensor of a
        few hundred rows would be mapped anew and fault its pages in at every step)."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu":
            return log_softmax(logits)
        if self.logprobs is None or self.logprobs.numel() < logits.numel():
            kept = 0 if self.logprobs is None else self.logprobs.numel()
            self.logprobs = torch.empty(max(logits.numel(), 2 * kept), dtype=torch.float32)
        return log_softmax(logits, self.logprobs[: logits.numel()].view(logits.shape))

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                 histories: Sequence[TokenHistory] | None = None, mirostat_mu: list | None = None,
                 proposals: list | None = None) -> torch.Tensor:
        """One token per row; `histories` (each row's prompt and output tokens, e.g. its Request) are read by the
        rows with penalties, a logit_bias or min_tokens, whose logits are adjusted in place; `mirostat_mu`, the
        Mirostat rows' bounds (None: 2 tau, their start), is updated in place; a sampled row with a proposal
        (SamplingRow.proposal) keeps its draft or replaces it (`_verify`)."""
        if histories is not None:
            logits = apply_penalties(logits, params, histories, self.eos_token_ids)
        sampled = [i for i, p in enumerate(params) if not p.greedy and not p.mirostat]
        verified = [i for i in sampled if proposals is not None and proposals[i] is not None]
        rows = [i for i in sampled if proposals is None or proposals[i] is None]
        if len(rows) == len(params):
            return self._sample(logits, params, generators)
        tokens = greedy(logits)
        if rows:
            tokens[rows] = self._sample(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
        if verified:
            tokens[verified] = self._verify(logits[verified], [params[i] for i in verified],
                                            [generators[i] for i in verified], [proposals[i] for i in verified])
        for i in (i for i, p in enumerate(params) if not p.greedy and p.mirostat):
            p, mu = params[i], mirostat_mu[i] if mirostat_mu is not None else None
            u = self._uniforms([generators[i]])[0]
            tokens[i], mu = _mirostat(logits[i].float(), p, 2 * p.mirostat_tau if mu is None else mu, u.item())
            if mirostat_mu is not None:
                mirostat_mu[i] = mu
        return tokens

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
        """Each row by the path its own params choose (so a seeded row draws alike in any batch): temperature alone
        by the fused kernel (~7x faster than PyTorch), top-k and top-p alone by another (`_nucleus_draw`), the rest,
        and rows those cannot draw (a NaN, no finite logit, a top-k tie), in PyTorch."""
        u = self._uniforms(generators)
        vocab, fused = logits.shape[-1], _fused(logits)
        tokens = torch.full((len(params),), -1, dtype=torch.long)
        for rows, pick in (([i for i, p in enumerate(params) if fused and _plain(p, vocab)], _plain_draw),
                           ([i for i, p in enumerate(params) if fused and _nucleus_only(p, vocab)], _nucleus_draw)):
            if rows:
                every = len(rows) == len(params)
                tokens[rows] = pick(logits if every else logits[rows], params if every else [params[i] for i in rows],
                                    u if every else u[rows])
        rest = (tokens < 0).nonzero()[:, 0].tolist()
        if rest:
            sub, ps, gs = logits[rest], [params[i] for i in rest], [generators[i] for i in rest]
            probs = distribution(sub, ps, self._xtc_rows(ps, gs))
            tokens[rest] = draw(probs, u[rest].to(probs.device))
        return tokens

    def _verify(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                proposals: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Speculative sampling's rejection rule: each row's draft x, drawn from the draft model's distribution q,
        is kept with chance min(1, p(x) / q(x)) under the row's own distribution p; else the token is drawn from
        max(0, p - q), normalized. Either way the token is distributed as p."""
        u = self._uniforms(generators)
        p = distribution(logits, params, self._xtc_rows(params, generators))
        drafts = torch.tensor([x for x, _ in proposals], device=p.device)
        q = torch.zeros_like(p)
        for i, (_, row) in enumerate(proposals):
            q[i, : len(row)] = row  # a draft vocabulary narrower than the target's has nothing past its end
        keep = u.to(p.device) * q.gather(1, drafts[:, None])[:, 0] < p.gather(1, drafts[:, None])[:, 0]
        residual = (p - q).clamp_min(0)
        spent = residual.sum(-1) <= 0  # p and q alike (to rounding): p itself
        residual[spent] = p[spent]
        return torch.where(keep, drafts, draw(residual, self._uniforms(generators).to(p.device)))


    def _xtc_rows(self, params: list[SamplingParams], generators: list) -> list[bool]:
        """The rows whose XTC applies this step: each row with XTC draws its own chance (from its generator, after
        the token's draw; rows without it draw as they would)."""
        rows = [i for i, p in enumerate(params) if p.xtc]
        on = [False] * len(params)
        if rows:
            chance = self._uniforms([generators[i] for i in rows])
            for i, c in zip(rows, chance.tolist()):
                on[i] = c < params[i].xtc_probability
        return on

    def _uniforms(self, generators: list) -> torch.Tensor:
        """One uniform in [0, 1) per row: from the row's own generator (so a seeded request draws the same
        whatever its batch), else from the sampler's."""
        u = torch.empty(len(generators), dtype=torch.float64)
        free = [i for i, g in enumerate(generators) if g is None]
        if free:
            u[free] = torch.rand(len(free), dtype=torch.float64, generator=self.default_generator)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand((), dtype=torch.float64, generator=g)
        return u


def _gathered(parts: dict[str, torch.Tensor], modes: dict[str, list[int]], num_rows: int) -> torch.Tensor:
    """The asking rows' values in their order, from each logprobs mode's rows."""
    if len(parts) == 1:
        return next(iter(parts.values()))
    first = next(iter(parts.values()))
    dtype = functools.reduce(torch.promote_types, (part.dtype for part in parts.values()))
    out = first.new_empty(num_rows, first.shape[-1], dtype=dtype)
    for mode, ks in modes.items():
        out[ks] = parts[mode].to(dtype)
    return out


def whole(count: int | None, vocab: int) -> int:
    """A logprobs count: -1 is the whole vocabulary (None: 0, the chosen token's alone)."""
    return vocab if count == -1 else count or 0


def processed_values(logits: torch.Tensor, params: list[SamplingParams], mode: str) -> torch.Tensor:
    """vLLM's processed logits (or their log-softmax, "processed_logprobs") of rows whose penalties are applied:
    a sampled row's after its temperature and truncations (the tokens they leave out at -inf), a greedy row's as
    they are."""
    logits = logits.float().clone()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        logits[sampled] = truncated_logits(logits[sampled], [params[i] for i in sampled])
    return logits.log_softmax(-1) if mode == "processed_logprobs" else logits


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: the token where each row's cumulative probability first exceeds u
    times its total, found among chunk sums, then inside one chunk (one pass over the probabilities, no
    vocabulary-sized cumsum or noise). A token of probability 0 is never drawn."""
    n, vocab = probs.shape
    chunks = (F.pad(probs, (0, -vocab % CHUNK)) if vocab % CHUNK else probs).view(n, -1, CHUNK)
    mass = chunks.sum(-1).double()
    ends = mass.cumsum(-1)
    target = (u * ends[:, -1])[:, None]
    c = torch.minimum(torch.searchsorted(ends, target, right=True)[:, 0], _last_positive(mass))
    before = torch.where(c > 0, ends.gather(1, (c - 1).clamp_min(0)[:, None])[:, 0], 0.0)
    inside = chunks[torch.arange(n, device=probs.device), c].double()
    k = torch.searchsorted(inside.cumsum(-1), (target[:, 0] - before)[:, None], right=True)[:, 0]
    return c * CHUNK + torch.minimum(k, _last_positive(inside))  # the minimum guards against rounding


def distribution(logits: torch.Tensor, params: list[SamplingParams], xtc_rows: list[bool] | None = None
                 ) -> torch.Tensor:
    """Each row's distribution to draw from, in float32: its temperature and truncations (XTC on `xtc_rows`, the
    rows whose chance came up)."""
    return truncated_logits(logits, params, xtc_rows).softmax(dim=-1)


def truncated_logits(logits: torch.Tensor, params: list[SamplingParams], xtc_rows: list[bool] | None = None
                     ) -> torch.Tensor:
    """Each row's logits in float32 after its temperature and truncations (those left out at -inf)."""
    logits, xtc = logits.float(), xtc_rows or [False] * len(params)
    late = [i for i, p in enumerate(params) if p.temperature_last]
    if not late:
        logits = _truncated(logits, params, xtc)
    else:  # llama.cpp's order on those rows
        early, out = [i for i, p in enumerate(params) if not p.temperature_last], torch.empty_like(logits)
        for rows in (early, late):
            if rows:
                out[rows] = _truncated(logits[rows], [params[i] for i in rows], [xtc[i] for i in rows])
        logits = out
    return logits


def _truncated(logits: torch.Tensor, params: list[SamplingParams], xtc_rows: list[bool]) -> torch.Tensor:
    """The logits after temperature and the truncations: vLLM's order (temperature, min-p, top-k, top-p), or with
    temperature_last (every row's alike) llama.cpp's default chain (top-n-sigma, top-k, typical, top-p, min-p,
    XTC on `xtc_rows`, then temperature); llama.cpp's own truncations keep their places among vLLM's."""
    def xtc(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        return _xtc(x, ps, xtc_rows)

    steps = (_top_n_sigma, _top_k, _typical, _top_p, _min_p, xtc, _tempered) if params[0].temperature_last else \
        (_tempered, _top_n_sigma, _min_p, _top_k, _typical, _top_p, xtc)
    for step in steps:
        logits = step(logits, params)
    return logits


def _mirostat(logits: torch.Tensor, p: SamplingParams, mu: float, u: float, m: int = 100) -> tuple[int, float]:
    """llama.cpp's Mirostat draw from one row of logits after its temperature: version 2 keeps the tokens whose
    surprise (-log2 p) is at most mu (the most likely at least), version 1 the top k that its estimate of the
    distribution's Zipf exponent over the m most likely tokens gives for mu; the token is drawn from those, and mu
    moves by eta times the gap between its surprise there and tau. Returns the token and the new mu."""
    probs, order = (logits / p.temperature).softmax(-1).sort(descending=True)
    if p.mirostat == 2:
        keep = max(1, int((-probs.log2() <= mu).sum()))
    else:
        top = probs[:m].double()
        t = torch.log(torch.arange(2, len(top) + 1, dtype=torch.float64) / torch.arange(1, len(top), dtype=torch.float64))
        s_hat = float((t * torch.log(top[:-1] / top[1:])).sum() / (t * t).sum())
        eps = s_hat - 1
        with np.errstate(all="ignore"):  # a negative base or no estimate: one token, where llama.cpp has NaN
            k = (np.float64(eps) * 2**mu / (1 - np.float64(len(probs)) ** -eps)) ** (1 / s_hat)
        keep = max(int(k), 1) if np.isfinite(k) else 1
    kept = probs[:keep] / probs[:keep].sum()
    index = min(int(torch.searchsorted(kept.double().cumsum(0), torch.tensor([u * float(kept.sum())],
                                                                           dtype=torch.float64), right=True)), keep - 1)
    surprise = -math.log2(float(kept[index]))
    return int(order[index]), mu - p.mirostat_eta * (surprise - p.mirostat_tau)


def _tempered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.temperature == 1.0 and p.dynatemp_range <= 0 for p in params):  # a pass temperature 1 can skip
        return logits
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    dynamic = [i for i, p in enumerate(params) if p.dynatemp_range > 0]
    if dynamic:
        temps[dynamic] = _dynamic_temperatures(logits[dynamic], [params[i] for i in dynamic])
    return logits / temps[:, None]


def _dynamic_temperatures(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """llama.cpp's dynamic temperature of each row: from temperature - range (at least 0) to temperature + range
    by its distribution's entropy over that of as many equally likely tokens (its finite logits), to the power
    dynatemp_exponent; 1 (no scaling) for a row with one token left. Near 0 it keeps only the most likely."""
    low = torch.tensor([max(0.0, p.temperature - p.dynatemp_range) for p in params], dtype=logits.dtype)
    high = torch.tensor([p.temperature + p.dynatemp_range for p in params], dtype=logits.dtype)
    exponent = torch.tensor([p.dynatemp_exponent for p in params], dtype=logits.dtype)
    size = torch.isfinite(logits).sum(-1)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp.where(torch.isfinite(logp), 0.0)).sum(-1)
    normalized = entropy / size.clamp_min(2).to(logits.dtype).log()
    temps = low + (high - low) * normalized.clamp_min(0).pow(exponent)
    return torch.where(size > 1, temps.clamp_min(1e-6), 1.0)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.min_p == 0 for p in params):
        return logits
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    floor = logits.max(dim=-1, keepdim=True).values + min_p.log()[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def _top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's k largest logits and those equal to the k-th (found by a partial sort of the rows with a k)."""
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    rows = [i for i, k in enumerate(top_k) if k < vocab]
    if not rows:
        return logits
    k = torch.tensor([top_k[i] for i in rows], device=logits.device)
    kth = torch.full((len(params), 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    kth[rows] = logits[rows].topk(max(top_k[i] for i in rows), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    return _apply_top_p(logits, top_p) if (top_p < 1).any() else logits


def _top_n_sigma(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """llama.cpp's top-n-sigma: the logits within n standard deviations (of the finite ones) of the largest."""
    if all(p.top_n_sigma <= 0 for p in params):
        return logits
    n = torch.tensor([p.top_n_sigma if p.top_n_sigma > 0 else math.inf for p in params], dtype=logits.dtype)
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp_min(1)
    values = logits.where(finite, 0.0)
    mean = values.sum(-1, keepdim=True) / count
    std = (((values - mean) * finite).square().sum(-1, keepdim=True) / count).sqrt()
    floor = logits.max(-1, keepdim=True).values - n[:, None] * std
    return logits.masked_fill(logits < floor, float("-inf"))


def _typical(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Locally typical sampling (llama.cpp's): the tokens by |surprise - entropy|, kept until their mass passes
    typical_p (the token that passes it kept too)."""
    if all(p.typical_p >= 1 for p in params):
        return logits
    typical = torch.tensor([p.typical_p for p in params], dtype=logits.dtype)
    logp = logits.log_softmax(-1)
    probs = logp.exp()
    entropy = -(probs * logp.where(probs > 0, 0.0)).sum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    order = shifted.sort(-1).indices
    mass = probs.gather(1, order).cumsum(-1)
    # keep up to the first position whose running mass passes typical_p, that one included
    drop_sorted = ((mass - probs.gather(1, order)) > typical[:, None]) & (typical[:, None] < 1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _xtc(logits: torch.Tensor, params: list[SamplingParams], on: list[bool]) -> torch.Tensor:
    """XTC on the rows `on` (their draw chose it): every token at least xtc_threshold likely is dropped but the
    least likely of them, where two or more are."""
    rows = [i for i, o in enumerate(on) if o]
    if not rows:
        return logits
    threshold = torch.tensor([params[i].xtc_threshold for i in rows], dtype=logits.dtype)
    sub = logits[rows]
    probs = sub.softmax(-1)
    above = probs >= threshold[:, None]
    least = probs.masked_fill(~above, math.inf).argmin(-1, keepdim=True)  # the least likely above the threshold
    drop = above & (above.sum(-1, keepdim=True) >= 2)
    drop.scatter_(1, least, False)
    logits = logits.clone()
    logits[rows] = sub.masked_fill(drop, float("-inf"))
    return logits


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Index of the last positive entry of each row."""
    return x.shape[-1] - 1 - (x > 0).flip(-1).int().argmax(-1)


def _plain(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row's only transform is its temperature."""
    return (p.top_k <= 0 or p.top_k >= vocab) and not p.truncates and p.dynatemp_range <= 0


def _plain_draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature alone: the fused kernel draws as `draw` does, from the logits as they are (-1: a row with a NaN
    or no finite logit)."""
    return fused_ops.sample(logits, torch.tensor([p.temperature for p in params], dtype=torch.float32), u)


def _nucleus_only(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row's truncations are top-k and top-p alone, in vLLM's order (at least one of them)."""
    return (not p.temperature_last and p.min_p == 0 and p.typical_p >= 1 and p.top_n_sigma <= 0
            and p.dynatemp_range <= 0 and not p.xtc and (0 < p.top_k < vocab or p.top_p < 1))


def _nucleus_draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """A token per row whose truncations are top-k and top-p alone, by the fused kernel: temperature, top-k, top-p
    and the draw from one pass over the row and a sort of the tokens near a cut. -1 for a row the full path must
    draw: a NaN or no finite maximum, or a tie at its top-k boundary."""
    vocab = logits.shape[-1]
    return fused_ops.nucleus_sample(logits, torch.tensor([p.temperature for p in params]),
                                    torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
                                    torch.tensor([p.top_p for p in params], dtype=torch.float64), u)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rows with top_p < 1 keep their most likely tokens while the mass strictly before each is under top_p
    (the top token always stays). The cut is found among a row's k most likely tokens, a partial sort (a full sort
    of every row cost a large batch most of a step), k quadrupled while some row's k fall short of its top_p."""
    rows = (top_p < 1).nonzero()[:, 0]
    every = len(rows) == len(logits)
    x, p = (logits, top_p) if every else (logits[rows], top_p[rows])
    lse, vocab = x.logsumexp(dim=-1, keepdim=True), x.shape[-1]
    k = min(TOP_P_FIRST, vocab)
    while True:
        values, order = x.topk(k, dim=-1)
        probs = (values - lse).exp()
        before = probs.cumsum(dim=-1) - probs
        if k == vocab or bool((before[:, -1] + probs[:, -1] >= p).all()):
            break
        k = min(4 * k, vocab)
    kept = values.masked_fill(before >= p[:, None], float("-inf"))
    cut = torch.full_like(x, float("-inf")).scatter_(1, order, kept)
    if every:
        return cut
    out = logits.clone()
    out[rows] = cut
    return out
