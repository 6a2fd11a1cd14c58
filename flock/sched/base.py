import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from flock.config import EngineConfig
from flock.kv.manager import CachedPrefix, KVCacheManager
from flock.request import Request, RequestStatus


@dataclass
class StepPlan:
    """A step's decisions, the one value the runner and the engine read: each scheduled request advances by
    its number of new tokens from `starts` (its computed tokens), over its block table; `kv_copies` are cached
    block starts copied before the step, `kv_loads` blocks read from the disk tier to fill before it, `kv_saves`
    the full blocks it computes that the disk tier keeps once it has run; `samples` marks the requests whose whole context the step computes,
    which get a new token; `drafts` are the speculative tokens each request's new tokens end with (verified by
    the step's samples). The scheduler fills the lists after `scheduled` (`Scheduler.schedule`)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)  # (source block, own block, tokens)
    kv_loads: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (own block, its KV bytes)
    kv_saves: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (own block, hash, tokens)
    samples: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_copied_tokens(self) -> int:
        return sum(n for _, _, n in self.kv_copies)

    def sampling(self) -> list[Request]:
        """The requests that get a new token, in plan order."""
        return [req for (req, _), s in zip(self.scheduled, self.samples) if s]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Decides, each step, which requests advance and by how many tokens. Policies never touch tensors.

    Subclasses implement `_schedule`; the bookkeeping around it (queues, finishing, preemption, the step's
    value) lives here. The scheduler is the one layer that moves a request between states and sets where its
    computation stands before a step; the engine applies the step's results.
    """

    name = "base"

    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # prefix-matching work of prefix-aware admission (counted and timed alike for every policy)
        self.match_ops = 0
        self.match_seconds = 0.0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> StepPlan:
        """Plan the next step: which requests advance by how many tokens, and what the runner reads for them."""
        self.kv.keep_for(list(itertools.islice(self.waiting, self.config.max_num_seqs)))
        plan = self._schedule()
        kv = self.kv
        for req, n in plan.scheduled:
            start = req.num_computed_tokens
            plan.starts.append(start)
            plan.block_tables.append(kv.block_table(req))
            plan.samples.append(not req.prefix_only and start + n >= req.num_tokens)
            plan.drafts.append(req.draft_token_ids[: max(0, start + n - req.num_tokens)])
            copy = kv.take_copy(req)
            if copy is not None:
                plan.kv_copies.append(copy)
            plan.kv_saves += kv.take_saves(req)
        plan.kv_loads = kv.take_loads()
        return plan

    def _schedule(self) -> StepPlan:
        raise NotImplementedError

    def allocate(self, req: Request, num_new_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """KV for `num_new_tokens` more tokens of `req`, after the `cached` prefix it takes, which then counts as
        computed; False, changing nothing, when the pool cannot hold them."""
        if not self.kv.allocate(req, num_new_tokens, cached):
            return False
        if cached is not None:
            req.num_computed_tokens += self.kv.prefix_tokens(cached)
        return True

    def with_drafts(self, req: Request, n: int, budget: int) -> int:
        """`n` new tokens of a running request, and after them its drafts where `n` reaches its last token and the
        budget and the KV pool hold them (their KV allocated then); never preempts for a draft."""
        drafts = min(len(req.draft_token_ids), budget - n)
        if drafts > 0 and req.num_computed_tokens + n == req.num_tokens and self.allocate(req, n + drafts):
            return n + drafts
        return n

    def observe(self, plan: StepPlan, model_seconds: float) -> None:
        """Feedback after the model ran `plan`, for policies that learn from measured speed."""

    def _timed(self, counter, fn, *args):
        """Run fn(*args) as prefix-matching work: add its time, and the `ops` it adds to `counter`."""
        t0, ops0 = time.perf_counter(), counter.ops
        out = fn(*args)
        self.match_seconds += time.perf_counter() - t0
        self.match_ops += counter.ops - ops0
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        self.kv.free(req)

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"

    def preempt(self, req: Request) -> None:
        """Recompute preemption: drop the request's KV and queue it again at the front."""
        self.release(req)
        self.waiting.appendleft(req)

    def release(self, req: Request) -> None:
        """Drop a preempted request's KV: it waits to be computed again from its first token."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
