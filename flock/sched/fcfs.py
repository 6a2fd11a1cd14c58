from collections.abc import Iterable

from flock.request import Request, RequestStatus
from flock.sched.base import Scheduler, StepPlan


class FCFSScheduler(Scheduler):
    """vLLM v1's policy: running requests first (decode or next prefill chunk), then admit waiting requests
    in arrival order while the token budget, `max_num_seqs` and the KV pool allow. When the pool runs out,
    the most recently admitted request is preempted.

    Online prefix-aware policies (LPM, DFS-weight, Feather) subclass it and change only the admission order.
    """

    name = "fcfs"

    def _schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            n = self.with_drafts(req, req.chunk(start, min(req.num_tokens - start, budget)), budget)
            while not self.allocate(req, n):
                victim = self.victim(self.running)
                at = self.running.index(victim)
                self.running.remove(victim)
                self.preempt(victim)
                plan.preempted.append(victim)
                if at < i:  # planned earlier in this step: its tokens come off the plan (as vLLM's)
                    budget += next(m for r, m in plan.scheduled if r is victim)
                    plan.scheduled = [(r, m) for r, m in plan.scheduled if r is not victim]
                    i -= 1
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                plan.scheduled.append((req, n))
                budget -= n
                i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        order = iter(self.admission_order())
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = next(order, None)
            if req is None:
                break
            n = self.try_admit(req, budget)
            if n is None:
                break
            plan.scheduled.append((req, n))
            budget -= n

    def victim(self, candidates: list[Request]) -> Request:
        """Which of the running `candidates` (in admission order, some perhaps planned in this step already) gives
        way when the KV pool runs out: the most recently admitted."""
        return candidates[-1]

    def admission_order(self) -> Iterable[Request]:
        """Waiting requests in the order they should be admitted; consumed lazily, stops at the first misfit."""
        while self.waiting:
            yield self.waiting[0]

    def try_admit(self, req: Request, budget: int, cached: list[int] | None = None) -> int | None:
        """Move `req` from waiting to running with KV for its first chunk (after its `cached` prefix blocks,
        looked up if not given); the chunk's size, or None if it does not fit in the KV pool (nothing changes
        then)."""
        if cached is None:
            cached = self.kv.cached_prefix(req)
        start = self.kv.prefix_tokens(cached)
        n = req.chunk(start, min(req.num_tokens - start, budget))
        if not self.allocate(req, n, cached):
            return None
        if req.num_preemptions == 0:
            req.num_cached_tokens = self.kv.prefix_tokens(cached)
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.on_admit(req)
        return n

    def on_admit(self, req: Request) -> None:
        """Hook for subclasses that track the running batch."""
