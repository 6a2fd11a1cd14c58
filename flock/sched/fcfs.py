from flock.sched.base import Scheduler, StepPlan
from flock.request import RequestStatus


class FCFSScheduler(Scheduler):
    """vLLM v1's policy: running requests first (decode or next prefill chunk), then admit waiting requests
    in arrival order while the token budget, `max_num_seqs` and the KV pool allow. When the pool runs out,
    the most recently admitted request is preempted."""

    name = "fcfs"

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self.preempt(victim)
                plan.preempted.append(victim)
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.cached_prefix(req)
            n = min(req.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate(req, n, cached):
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(cached) * self.kv.block_size
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
