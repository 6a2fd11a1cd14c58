import time
from collections import deque
from dataclasses import dataclass, field

from flock.config import EngineConfig
from flock.kv.manager import KVCacheManager
from flock.request import Request, RequestStatus


@dataclass
class StepPlan:
    """What one forward pass computes: each scheduled request advances by its number of new tokens."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def sampling(self) -> list[Request]:
        """Requests whose whole context is computed by this step: each gets a new token."""
        return [req for req, n in self.scheduled if req.samples and req.num_computed_tokens + n == req.num_tokens]

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Decides, each step, which requests advance and by how many tokens. Policies never touch tensors.

    Subclasses implement `schedule`; the bookkeeping around it (queues, finishing, preemption) lives here.
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

    def schedule(self) -> StepPlan:
        raise NotImplementedError

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
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
