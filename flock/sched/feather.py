"""Feather: prefix-homogeneous continuous batching for online traffic.

Admission takes the Chunked Hash Tree's best candidate: the waiting request with the fewest chunks missing
from the running batch (O(log W) per pick instead of matching every waiting request). When that candidate
would lower the batch's shared-prefix depth, a batching policy decides to add it or to stop admitting and
let the homogeneous batch run. Rules that keep it safe:
- a candidate that shares nothing with the batch starts a new group: the oldest member of the largest
  waiting group (by first chunk, as DFS-weight's heaviest subtree), or the oldest waiting request when no two
  share a first chunk, so traffic without sharing is admitted exactly as FCFS would;
- the oldest request is taken first once it has waited `max_wait_rounds` admissions (no starvation);
- an empty batch always admits;
- admission keeps `reserve_fraction` of the running batch's remaining decode blocks free, so a batch is
  rarely preempted and recomputed (1.0 never preempts but keeps batches small; 0.5 measured best here).
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass

from flock.kv.hashing import chained_hashes
from flock.prefix.cht import ChunkedHashTree
from flock.request import Request, RequestStatus
from flock.sched.base import StepPlan
from flock.sched.fcfs import FCFSScheduler
from flock.sched.policies import BatchState, make_policy
from flock.sched.waiting_groups import WaitingGroups


@dataclass
class Decision:
    state: BatchState
    add: bool
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0


class FeatherScheduler(FCFSScheduler):
    name = "feather"
    max_wait_rounds = 256
    reserve_fraction = 0.5  # share of the batch's remaining decode blocks kept free at admission
    reward_steps = 4  # a decision is rewarded with the decode throughput of the steps that follow it

    def __init__(self, config, kv):
        super().__init__(config, kv)
        self.cht = ChunkedHashTree()
        self.groups = WaitingGroups()
        self.policy = make_policy(config.feather_policy)
        self.admissions = 0
        self.reserved = 0  # decode blocks the running batch still needs, set at each admission round
        self.mark: dict[Request, int] = {}  # admissions counted when the request arrived
        self.open: list[Decision] = []
        self.throughput_avg: float | None = None

    # -- the CHT follows every move between waiting and running ----------------------------------------------
    def add(self, req: Request) -> None:
        super().add(req)
        req.block_hashes = chained_hashes(req.prompt_token_ids, self.kv.block_size)  # the KV manager reuses them
        self.mark[req] = self.admissions
        self._wait(req)

    def on_admit(self, req: Request) -> None:
        self.admissions += 1
        self._timed(self.cht, self.cht.add_to_batch, req)
        self._leave_group(req)

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._timed(self.cht, self.cht.remove_from_batch, req)
        del self.mark[req]

    def preempt(self, req: Request) -> None:
        self._timed(self.cht, self.cht.remove_from_batch, req)
        super().preempt(req)
        self._wait(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self._timed(self.cht, self.cht.remove_from_batch, req)
        else:
            self._timed(self.cht, self.cht.discard, req)
            self._leave_group(req)
        super().abort(req)
        self.mark.pop(req, None)

    # -- admission -------------------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan, budget: int) -> None:
        self.reserved = int(self.reserve_fraction * sum(self._growth(r) for r in self.running))
        super()._admit(plan, budget)

    def try_admit(self, req: Request, budget: int, cached: list[int] | None = None) -> int | None:
        """Admit only if the pool keeps room for the request and the reserved share of the batch's remaining
        decode blocks (known from max_tokens)."""
        if cached is None:
            cached = self.kv.cached_prefix(req)
        need = self.kv.blocks_needed(req.num_prompt_tokens + (req.params.max_tokens or 0)) - len(cached)
        if self.running and need + self.reserved > self.kv.pool.num_free:
            return None
        n = super().try_admit(req, budget, cached)
        if n is not None:
            self.reserved += int(self.reserve_fraction * self._growth(req))
        return n

    def _growth(self, req: Request) -> int:
        """Blocks the request still needs to reach max_tokens (0 when it has no limit)."""
        if req.params.max_tokens is None:
            return 0
        total = req.num_prompt_tokens + req.params.max_tokens
        return max(0, self.kv.blocks_needed(total) - len(req.block_table))

    def admission_order(self) -> Iterable[Request]:
        while self.waiting:
            req = self._candidate()
            if self.running and not self._policy_admits(req):
                return
            yield req

    def _candidate(self) -> Request:
        oldest = self.waiting[0]
        if self.admissions - self.mark[oldest] >= self.max_wait_rounds:
            return oldest
        best = self._timed(self.cht, self.cht.best)
        if self.cht.misses(best) < self._chunks(best):
            return best
        return self._timed(self.cht, self.groups.oldest_of_largest, self._is_waiting) or oldest

    def _wait(self, req: Request) -> None:
        self._timed(self.cht, self.cht.insert, req, tuple(req.block_hashes[: self._chunks(req)]))
        if self._chunks(req):  # a prompt shorter than a chunk shares nothing worth grouping
            self._timed(self.cht, self.groups.add, req.block_hashes[0], req)

    def _leave_group(self, req: Request) -> None:
        if self._chunks(req):
            self._timed(self.cht, self.groups.remove, req.block_hashes[0])

    def _chunks(self, req: Request) -> int:
        return req.num_prompt_tokens // self.kv.block_size

    def _is_waiting(self, req: Request) -> bool:
        return req.status is RequestStatus.WAITING

    def _policy_admits(self, req: Request) -> bool:
        t0 = time.perf_counter()
        depth = self.cht.tip_if_added(req)
        delta = self.cht.tip() - depth
        state = BatchState(len(self.running), delta, self.cht.num_waiting_sharing(req, max(depth, 1)) if delta else 0)
        self.match_seconds += time.perf_counter() - t0
        if delta == 0:
            return True
        add = self.policy.decide(state)
        self.open.append(Decision(state, add))
        return add

    # -- learning from measured speed ------------------------------------------------------------------------
    def observe(self, plan: StepPlan, model_seconds: float) -> None:
        tokens = len(plan.sampling())
        if tokens == 0 or model_seconds <= 0:
            return
        rate = tokens / model_seconds
        self.throughput_avg = rate if self.throughput_avg is None else 0.95 * self.throughput_avg + 0.05 * rate
        for d in self.open:
            d.tokens, d.seconds, d.steps = d.tokens + tokens, d.seconds + model_seconds, d.steps + 1
        while self.open and self.open[0].steps >= self.reward_steps:
            d = self.open.pop(0)
            next_state = self.open[0].state if self.open else None
            self.policy.learn(d.state, d.add, d.tokens / d.seconds / self.throughput_avg, next_state)
