"""Online traces: token-id requests with arrival times, and a real-time replay through an engine.

``make_trace(kind, ...)`` builds a trace (deterministic per seed; prompts and arrivals come from separate
random streams, so changing the arrival pattern or rate keeps the prompts). Kinds, lengths at ``scale=1``:

- ``groups8``: the Feather paper's experiment: 8 prefix groups, each with its own ~1,024-token prefix, and a
  ~32-token distinct suffix per request; each request's group drawn at random (interleaved arrivals).
- ``long-prefix``: 8 groups whose prefix lengths are drawn in [1,000, 10,000] tokens, ~32-token suffixes.
- ``mixed``: half the requests from 4 shared groups (1,024-token prefixes), half unshared 1,056-token prompts.
- ``nosharing``: every prompt distinct (1,056 tokens).

Sibling parts that should not share start with distinct tokens, so the prefix structure is exactly the
intended one. Arrivals: ``poisson`` (exponential gaps at ``rate`` req/s) or ``bursty`` (gamma gaps with a
coefficient of variation of 3 at the same mean rate: long quiet spells, then bursts).

``replay(engine, trace)`` feeds the trace to an engine in real time and records TTFT / TPOT per request and
the running batch's composition per step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flock.engine.loop import run
from flock.request import Request, RequestStatus
from flock.sampling_params import SamplingParams

__all__ = ["TraceRequest", "TRACE_KINDS", "make_trace", "arrivals", "save_trace", "load_trace", "replay",
           "ReplayResult", "RequestRecord", "StepRecord"]

MIN_TOKEN = 100
BURSTY_CV = 3.0


@dataclass
class TraceRequest:
    arrival_s: float  # seconds after the trace starts
    token_ids: list[int]
    group: int  # prefix group; -1 for an unshared prompt
    max_tokens: int


# -- prompts ---------------------------------------------------------------------------------------------------
class _Tokens:
    def __init__(self, rng: np.random.Generator, vocab_size: int):
        if vocab_size - MIN_TOKEN < 2:
            raise ValueError(f"need at least 2 token ids in [{MIN_TOKEN}, {vocab_size})")
        self.rng, self.lo, self.hi = rng, MIN_TOKEN, vocab_size

    def firsts(self, k: int) -> list[int]:
        """k first tokens, pairwise distinct where the vocabulary allows."""
        span = self.hi - self.lo
        return (self.rng.choice(span, size=k, replace=k > span) + self.lo).tolist()

    def draw(self, n: int, first: int) -> list[int]:
        ids = self.rng.integers(self.lo, self.hi, n).tolist()
        ids[0] = first
        return ids


def _scaled(n: float, scale: float) -> int:
    return max(1, round(n * scale))


Prompts = list[tuple[list[int], int]]  # (token ids, group)


def _grouped(n: int, prefix_lens: list[int], suffix_len: int, t: _Tokens) -> Prompts:
    """n prompts, each a random group's prefix + a suffix whose first token no sibling's suffix has."""
    prefixes = [t.draw(length, f) for length, f in zip(prefix_lens, t.firsts(len(prefix_lens)))]
    groups = t.rng.integers(len(prefixes), size=n).tolist()
    firsts = {g: iter(t.firsts(groups.count(g))) for g in set(groups)}
    return [(prefixes[g] + t.draw(suffix_len, next(firsts[g])), g) for g in groups]


def _unshared(n: int, length: int, t: _Tokens, avoid: set[int] = frozenset()) -> Prompts:
    firsts = [f for f in t.firsts(n + len(avoid)) if f not in avoid][:n]
    return [(t.draw(length, f), -1) for f in firsts]


def _groups8(n: int, scale: float, t: _Tokens) -> Prompts:
    return _grouped(n, [_scaled(1024, scale)] * 8, _scaled(32, scale), t)


def _long_prefix(n: int, scale: float, t: _Tokens) -> Prompts:
    lens = [_scaled(x, scale) for x in t.rng.uniform(1000, 10000, size=8)]
    return _grouped(n, lens, _scaled(32, scale), t)


def _mixed(n: int, scale: float, t: _Tokens) -> Prompts:
    shared = _grouped(n - n // 2, [_scaled(1024, scale)] * 4, _scaled(32, scale), t)
    own = _unshared(n // 2, _scaled(1056, scale), t, avoid={p[0] for p, _ in shared})
    order = t.rng.permutation(n)
    both = shared + own
    return [both[i] for i in order]


def _nosharing(n: int, scale: float, t: _Tokens) -> Prompts:
    return _unshared(n, _scaled(1056, scale), t)


TRACE_KINDS: dict[str, Callable[[int, float, _Tokens], Prompts]] = {
    "groups8": _groups8,
    "long-prefix": _long_prefix,
    "mixed": _mixed,
    "nosharing": _nosharing,
}


# -- arrivals --------------------------------------------------------------------------------------------------
def arrivals(n: int, rate: float, pattern: str, rng: np.random.Generator) -> list[float]:
    """n arrival times starting at 0 with mean rate `rate` req/s."""
    if n < 1 or rate <= 0:
        raise ValueError(f"need n >= 1 requests and a positive rate, got n={n}, rate={rate}")
    if pattern == "poisson":
        gaps = rng.exponential(1 / rate, size=n)
    elif pattern == "bursty":
        shape = 1 / BURSTY_CV**2  # gamma: CV = 1 / sqrt(shape), mean = shape * scale
        gaps = rng.gamma(shape, 1 / (rate * shape), size=n)
    else:
        raise ValueError(f"unknown arrival pattern {pattern!r} (poisson, bursty)")
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def make_trace(kind: str, *, num_requests: int = 800, rate: float = 10.0, pattern: str = "poisson", seed: int = 0,
               scale: float = 1.0, vocab_size: int = 8000, max_tokens: int = 32) -> list[TraceRequest]:
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r} (choose from {', '.join(TRACE_KINDS)})")
    prompt_seed, arrival_seed = np.random.SeedSequence(seed).spawn(2)
    prompts = TRACE_KINDS[kind](num_requests, scale, _Tokens(np.random.default_rng(prompt_seed), vocab_size))
    times = arrivals(num_requests, rate, pattern, np.random.default_rng(arrival_seed))
    return [TraceRequest(a, ids, g, max_tokens) for a, (ids, g) in zip(times, prompts)]


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"arrival_s": r.arrival_s, "group": r.group, "max_tokens": r.max_tokens,
                                 "prompt_token_ids": r.token_ids}) + "\n" for r in trace)


def load_trace(path: str | Path) -> list[TraceRequest]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [TraceRequest(float(x["arrival_s"]), list(x["prompt_token_ids"]), int(x.get("group", -1)),
                         int(x["max_tokens"])) for x in rows]


# -- replay ----------------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    group: int
    arrival_s: float
    ttft_s: float  # first token - arrival in the trace (not the later moment add_request ran)
    tpot_s: float | None  # (finish - first token) / (output tokens - 1); None for a single output token
    output_tokens: int
    preemptions: int


@dataclass
class StepRecord:
    t_s: float  # end of the step, seconds after the start
    batch_size: int  # requests running after the step (a scheduler's prefix-only pseudo-requests excluded)
    distinct_groups: int  # prefix groups among them, each unshared request counting as its own
    tokens: int  # tokens computed in the step
    waiting: int  # arrived requests not running yet


@dataclass
class ReplayResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_s: float
    stats: dict  # engine.stats.as_dict() over the replay, plus the scheduler's match_seconds / match_ops

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "stats": self.stats, "requests": [asdict(r) for r in self.requests],
                "steps": [asdict(s) for s in self.steps]}


def _composition(live: list[Request], group_of: dict[int, int]) -> tuple[int, int]:
    # status, not scheduler.running: not every scheduler keeps that list (batchllm tracks groups instead)
    running = [r for r in live if r.status is RequestStatus.RUNNING]
    groups = {group_of[r.request_id] for r in running}
    singles = sum(1 for r in running if group_of[r.request_id] < 0)
    return len(running), len(groups - {-1}) + singles


def replay(engine, trace: list[TraceRequest], *, time_limit_s: float | None = None) -> ReplayResult:
    """Replay `trace` in real time: add every request whose arrival time has passed, step while there is work,
    otherwise sleep until the next arrival. Greedy, ignore_eos. Resets the engine's stats. With `time_limit_s`,
    requests still unfinished then are aborted and left out of the records."""
    engine.reset_stats()
    engine.scheduler.match_seconds, engine.scheduler.match_ops = 0.0, 0
    group_of: dict[int, int] = {}
    added: list[tuple[Request, TraceRequest]] = []
    live: list[Request] = []
    steps: list[StepRecord] = []
    start = time.monotonic()
    pending = iter(trace)
    upcoming = next(pending, None)

    def admit(idle: bool) -> bool:
        """Add the requests that have arrived; when idle, sleep until the next arrival (or end the replay)."""
        nonlocal upcoming
        now = time.monotonic() - start
        if time_limit_s is not None and now > time_limit_s:
            return False
        while upcoming is not None and upcoming.arrival_s <= now:
            params = SamplingParams(temperature=0, max_tokens=upcoming.max_tokens, ignore_eos=True)
            req = engine.add_request(upcoming.token_ids, params)
            group_of[req.request_id] = upcoming.group
            added.append((req, upcoming))
            live.append(req)
            upcoming = next(pending, None)
        if not engine.has_unfinished():
            if upcoming is None:
                return False
            time.sleep(max(0.0, upcoming.arrival_s - (time.monotonic() - start)))
        return True

    for step in run(engine, admit):
        if step.finished:
            done = {id(r) for r in step.finished}
            live = [r for r in live if id(r) not in done]
        size, distinct = _composition(live, group_of)
        steps.append(StepRecord(time.monotonic() - start, size, distinct, engine.stats.tokens_per_step[-1],
                                len(live) - size))
    for req in live:
        engine.abort(req)
    records = [_record(req, tr, start) for req, tr in added if req.finish_time is not None]
    stats = engine.stats.as_dict() | {"match_seconds": engine.scheduler.match_seconds,
                                      "match_ops": engine.scheduler.match_ops}
    return ReplayResult(records, steps, engine.stats.wall_seconds, stats)


def _record(req: Request, tr: TraceRequest, start: float) -> RequestRecord:
    n = req.num_output_tokens
    tpot = (req.finish_time - req.first_token_time) / (n - 1) if n > 1 else None
    return RequestRecord(tr.group, tr.arrival_s, req.first_token_time - (start + tr.arrival_s), tpot, n,
                         req.num_preemptions)
