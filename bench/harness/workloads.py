"""Synthetic token-id workloads with known prefix structure (BatchLLM's shapes and a few controls).

Every generator returns a list of prompts (lists of token ids in ``[min_token, vocab_size)``) and is
deterministic for a seed. ``scale`` multiplies every length (``scale=0.1`` turns 2000/200 into 200/20) so the
shapes run on a CPU. Sibling parts that should *not* share start with distinct tokens (drawn without
replacement), so the prefix structure is exactly the intended one and saving rates are exact.

From the command line: ``python -m bench.workload KIND -o FILE.jsonl [--scale S] [--seed N]`` writes
``{"prompt_token_ids": [...]}`` lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

__all__ = ["microbench", "industrial", "multilevel", "no_sharing", "micro_saving_rate", "WORKLOADS",
           "make_workload", "write_jsonl"]

MIN_TOKEN = 100
VOCAB_SIZE = 8000


class _Tokens:
    def __init__(self, seed: int, vocab_size: int, min_token: int):
        if vocab_size - min_token < 2:
            raise ValueError(f"need at least 2 token ids in [{min_token}, {vocab_size})")
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = min_token, vocab_size

    def draw(self, n: int, first: int | None = None) -> list[int]:
        ids = self.rng.integers(self.lo, self.hi, max(n, 0)).tolist()
        if first is not None and n > 0:
            ids[0] = first
        return ids

    def firsts(self, k: int) -> list[int]:
        """k first tokens, pairwise distinct where the vocabulary allows."""
        span = self.hi - self.lo
        return (self.rng.choice(span, size=k, replace=k > span) + self.lo).tolist()

    def shuffle(self, items: list) -> list:
        order = self.rng.permutation(len(items))
        return [items[i] for i in order]


def _scaled(n: float, scale: float) -> int:
    """A scaled length: at least 1 token unless the length is 0."""
    return max(1, int(round(n * scale))) if n > 0 else 0


def microbench(prefix_len: int = 2000, distinct_len: int = 200, sharing_degree: int = 16, num_groups: int = 16,
               scale: float = 1.0, seed: int = 0, shuffle: bool = True, vocab_size: int = VOCAB_SIZE,
               min_token: int = MIN_TOKEN) -> list[list[int]]:
    """BatchLLM's microbenchmark: `num_groups` groups of `sharing_degree` prompts, each a common prefix of
    `prefix_len` tokens plus `distinct_len` own tokens; prompts shuffled (BatchLLM: 2000/200, 2000/1000,
    1000/1000 with sharing degree 4 and 16)."""
    t = _Tokens(seed, vocab_size, min_token)
    p, d = _scaled(prefix_len, scale), _scaled(distinct_len, scale)
    prompts = []
    for first in t.firsts(num_groups):
        prefix = t.draw(p, first)
        prompts += [prefix + t.draw(d, f) for f in t.firsts(sharing_degree)]
    return t.shuffle(prompts) if shuffle else prompts


def micro_saving_rate(prefix_len: int, distinct_len: int, sharing_degree: int, scale: float = 1.0) -> float:
    """The exact saving rate of a microbench shape: 1 - (P + k D) / (k (P + D))."""
    p, d, k = _scaled(prefix_len, scale), _scaled(distinct_len, scale), sharing_degree
    return 1 - (p + k * d) / (k * (p + d))


def industrial(num_prompts: int = 8000, prefix_len: int = 1570, distinct_len: int = 30, mean_sharing: float = 3.0,
               num_tasks: int = 8, header_len: int = 0, scale: float = 1.0, seed: int = 0, shuffle: bool = True,
               vocab_size: int = VOCAB_SIZE, min_token: int = MIN_TOKEN, as_arrays: bool = False) -> list:
    """An industrial-like mix (BatchLLM §6): group sizes geometric with mean `mean_sharing` (a third of the
    groups are singletons), shared prefixes ~`prefix_len` (±15 %), distinct parts ~`distinct_len` (±50 %).
    With `header_len > 0` each group belongs to one of `num_tasks` tasks whose prompts all start with the
    task's instruction: sharing above the group level (singletons then join their task's group).
    `as_arrays`: each prompt an int32 numpy array (the same tokens; 100,000 prompts fit in memory)."""
    t = _Tokens(seed, vocab_size, min_token)
    rng = t.rng
    headers = [t.draw(_scaled(header_len, scale), f) for f in t.firsts(num_tasks)] if header_len else []
    group_firsts = t.firsts(min(num_prompts, t.hi - t.lo))  # groups start apart (cycled if the vocab is small)
    prompts: list[list[int]] = []
    while len(prompts) < num_prompts:
        first = group_firsts[len(prompts) % len(group_firsts)]
        size = min(int(rng.geometric(1.0 / mean_sharing)), num_prompts - len(prompts))
        header = headers[int(rng.integers(num_tasks))] if header_len else []
        body = t.draw(_scaled(prefix_len * rng.uniform(0.85, 1.15), scale) - len(header), None if header else first)
        for f in t.firsts(size):
            prompt = header + body + t.draw(_scaled(distinct_len * rng.uniform(0.5, 1.5), scale), f)
            prompts.append(np.array(prompt, dtype=np.int32) if as_arrays else prompt)
    return t.shuffle(prompts) if shuffle else prompts


def multilevel(num_systems: int = 4, docs_per_system: int = 8, questions_per_doc: int = 8, system_len: int = 200,
               doc_len: int = 1000, question_len: int = 50, scale: float = 1.0, seed: int = 0, shuffle: bool = True,
               vocab_size: int = VOCAB_SIZE, min_token: int = MIN_TOKEN) -> list[list[int]]:
    """Three levels: a short system prompt -> a document -> a question (RAG-like)."""
    t = _Tokens(seed, vocab_size, min_token)
    prompts = []
    for fs in t.firsts(num_systems):
        system = t.draw(_scaled(system_len, scale), fs)
        for fd in t.firsts(docs_per_system):
            doc = system + t.draw(_scaled(doc_len, scale), fd)
            prompts += [doc + t.draw(_scaled(question_len, scale), fq) for fq in t.firsts(questions_per_doc)]
    return t.shuffle(prompts) if shuffle else prompts


def no_sharing(num_prompts: int = 256, prompt_len: int = 1100, scale: float = 1.0, seed: int = 0,
               vocab_size: int = VOCAB_SIZE, min_token: int = MIN_TOKEN) -> list[list[int]]:
    """A control: prompts with pairwise distinct first tokens, so nothing is shared. With more prompts than
    token ids, the first two tokens are pairwise distinct instead, so at most one token is shared."""
    t = _Tokens(seed, vocab_size, min_token)
    n, span = _scaled(prompt_len, scale), t.hi - t.lo
    if num_prompts <= span or n < 2:
        return [t.draw(n, f) for f in t.firsts(num_prompts)]
    pairs = t.rng.choice(span * span, size=num_prompts, replace=num_prompts > span * span)  # distinct 2-token starts
    return [[int(q // span) + t.lo, int(q % span) + t.lo] + t.draw(n - 2) for q in pairs]


def _micro(p: int, d: int) -> Callable[..., list[list[int]]]:
    def make(sharing_degree: int = 16, **kw) -> list[list[int]]:
        return microbench(p, d, sharing_degree, **kw)

    make.__doc__ = f"BatchLLM microbenchmark, prefix/distinct {p}/{d}."
    return make


WORKLOADS: dict[str, Callable[..., list[list[int]]]] = {
    "micro-2000-200": _micro(2000, 200),
    "micro-2000-1000": _micro(2000, 1000),
    "micro-1000-1000": _micro(1000, 1000),
    "industrial": industrial,
    "multilevel": multilevel,
    "nosharing": no_sharing,
}


def make_workload(kind: str, **kw) -> list[list[int]]:
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r} (choose from {', '.join(WORKLOADS)})")
    return WORKLOADS[kind](**kw)


def write_jsonl(prompts: list[list[int]], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_token_ids": p}) + "\n")
