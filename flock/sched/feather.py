"""Feather: prefix-homogeneous continuous batching for online traffic.

Admission takes the Chunked Hash Tree's best candidate: the waiting request with the fewest chunks missing
from the running batch (O(log W) per pick instead of matching every waiting request). The batch is kept on
one prefix group, its focus: the prefix that the request opening it shares with other requests.
- While focus members wait, a candidate of another group (it shares a prefix with some other request) is
  parked: taken out of the CHT until the focus has no member waiting, then put back in its old place among
  ties. So the batch does not keep feeding every group it once held: under a KV budget each resident group
  costs its whole prefix, and a moderate homogeneous batch beats a larger mixed one.
- Once no focus member waits, or the focus has had `focus_quantum` admissions (a popular prefix with a
  steady stream would otherwise hold the batch for ever), the oldest waiting request opens the next group
  (groups are served oldest first; if it is a focus member, the focus simply renews), and the batching policy decides: add it (the next group starts while the last one finishes) or
  stop and let the batch run. State: batch size, delta (chunks of the focus prefix it does not share: the
  depth the batch's shared prefix would lose), its waiting peers and the share of the KV pool in use.
Rules that keep it safe:
- a request that shares no prefix with any other (a loner) is never parked and opens no group: traffic
  without sharing is admitted exactly as FCFS would;
- the oldest request is admitted first, without the policy, once it has been passed over for
  `max_wait_rounds` admissions or twice the number of requests it found waiting, whichever is more (FCFS
  would admit those first): no starvation, and a burst is not turned back into FCFS order;
- an empty batch always admits;
- admission keeps `reserve_fraction` of the running batch's remaining decode blocks free, so a batch is
  rarely preempted and recomputed (1.0 never preempts but keeps batches small; 0.5 measured best here).
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass

from flock.prefix.cht import ChunkedHashTree
from flock.request import Request
from flock.sched.base import StepPlan
from flock.sched.fcfs import FCFSScheduler
from flock.sched.policies import BatchState, make_policy


@dataclass
class Decision:
    state: BatchState
    add: bool
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0


class FeatherScheduler(FCFSScheduler):
    name = "feather"
    max_wait_rounds = 1024  # admissions a request may always be passed over for
    queue_factor = 2  # ... or this many times the requests waiting when it arrived, if more
    focus_quantum = 256  # admissions after which a focus that never runs dry gives way at the next switch check
    reserve_fraction = 0.5  # share of the batch's remaining decode blocks kept free at admission
    reward_steps = 4  # a decision is rewarded with the decode throughput of the steps that follow it

    def __init__(self, config, kv):
        super().__init__(config, kv)
        self.cht = ChunkedHashTree()
        self.policy = make_policy(config.feather_policy)
        self.admissions = 0
        self.reserved = 0  # decode blocks the running batch still needs, set at each admission round
        self.deadline: dict[Request, int] = {}  # admission count after which the request goes first
        self.focus: tuple[int, ...] | None = None  # chunk hashes of the focus group's prefix
        self.focus_waiting = 0  # its waiting members
        self.focus_since = 0  # admission count when it was set
        self.parked: dict[Request, int] = {}  # other groups' requests kept out of the CHT -> their CHT rank
        self.open: list[Decision] = []
        self.throughput_avg: float | None = None

    # -- the CHT follows every move between waiting and running ----------------------------------------------
    def add(self, req: Request) -> None:
        super().add(req)
        patience = max(self.max_wait_rounds, self.queue_factor * (len(self.waiting) - 1))
        self.deadline[req] = self.admissions + patience
        self._wait(req)

    def on_admit(self, req: Request) -> None:
        self.admissions += 1
        self._timed(self.cht, self.cht.add_to_batch, req)
        self._stop_waiting(req)

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._timed(self.cht, self.cht.remove_from_batch, req)
        del self.deadline[req]

    def preempt(self, req: Request) -> None:
        self._timed(self.cht, self.cht.remove_from_batch, req)
        super().preempt(req)
        self._wait(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self._timed(self.cht, self.cht.remove_from_batch, req)
        else:
            self._timed(self.cht, self.cht.discard, req)
            self._stop_waiting(req)
            self.parked.pop(req, None)
        super().abort(req)
        self.deadline.pop(req, None)

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
        return max(0, self.kv.blocks_needed(total) - self.kv.num_blocks(req))

    def admission_order(self) -> Iterable[Request]:
        while self.waiting:
            switching = (not self.running or self.focus is None or self.focus_waiting == 0
                         or self.admissions - self.focus_since >= self.focus_quantum)
            if switching and self.parked:
                self._unpark()
            oldest = self.waiting[0]
            if self.admissions >= self.deadline[oldest]:  # overdue: goes first
                self._unpark(oldest)
                yield oldest
                continue
            if switching:
                req = oldest
                depth = self._timed(self.cht, self.cht.shared_depth, req)
                if self.running and self.focus is not None and depth and not self._policy_admits(req, depth):
                    return
                self._set_focus(req, depth)
                yield req
                continue
            req = self._candidate()
            if req in self.parked:  # the fallback found nothing better than a parked request
                return
            if not self._in_focus(req) and self._timed(self.cht, self.cht.shared_depth, req):
                self._park(req)  # another group while the focus still has members waiting
                continue
            yield req

    def _candidate(self) -> Request:
        """The CHT's best when the batch covers some of it; else the oldest waiting request, unless that one is
        parked: then the best after all (it fits no worse, and stopping there would leave the focus group's
        waiting members, ranked behind it, out until the batch drains)."""
        best = self._timed(self.cht, self.cht.best)
        if best is not None and (self.cht.misses(best) < self._chunks(best) or self.waiting[0] in self.parked):
            return best
        return self.waiting[0]

    # -- the focus group ---------------------------------------------------------------------------------
    def _set_focus(self, req: Request, depth: int) -> None:
        """Focus on the group of waiting request `req`: the `depth` chunks it shares with other requests (a
        loner, depth 0, keeps the current focus)."""
        if depth:
            self.focus = tuple(self._hashes(req)[:depth])
            self.focus_waiting = self.cht.num_waiting_sharing(req, depth) + 1
            self.focus_since = self.admissions

    def _park(self, req: Request) -> None:
        self.parked[req] = self.cht.rank(req)
        self._timed(self.cht, self.cht.discard, req)

    def _unpark(self, req: Request | None = None) -> None:
        """Put `req` (default: every parked request) back into the CHT, in its old place among ties."""
        for r in [req] if req is not None else list(self.parked):
            if r in self.parked:
                self._timed(self.cht, self.cht.insert, r, self._prompt_hashes(r), self.parked.pop(r))

    def _in_focus(self, req: Request) -> bool:
        d = len(self.focus)
        return self._chunks(req) >= d and self._hashes(req)[d - 1] == self.focus[-1]

    def _focus_depth_lost(self, req: Request) -> int:
        """Chunks of the focus prefix that `req` does not share (chained hashes: binary search)."""
        lo, hi = 0, min(len(self.focus), self._chunks(req))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._hashes(req)[mid - 1] == self.focus[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return len(self.focus) - lo

    def _wait(self, req: Request) -> None:
        self._timed(self.cht, self.cht.insert, req, self._prompt_hashes(req))
        if self.focus is not None and self._in_focus(req):
            self.focus_waiting += 1

    def _stop_waiting(self, req: Request) -> None:
        if self.focus is not None and self._in_focus(req):
            self.focus_waiting -= 1

    def _prompt_hashes(self, req: Request) -> tuple[int, ...]:
        return tuple(self._hashes(req)[: self._chunks(req)])

    def _hashes(self, req: Request) -> list[int]:
        """Chained hashes of the prompt's full chunks (and of any later blocks already hashed)."""
        return req.block_hashes(self.kv.block_size, self._chunks(req))

    def _chunks(self, req: Request) -> int:
        return req.num_prompt_tokens // self.kv.block_size

    def _policy_admits(self, req: Request, depth: int) -> bool:
        t0 = time.perf_counter()
        pool = self.kv.pool
        state = BatchState(len(self.running), self._focus_depth_lost(req), self.cht.num_waiting_sharing(req, depth),
                           pool.num_used / pool.num_blocks)
        self.match_seconds += time.perf_counter() - t0
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
