"""vLLM's priority scheduling (`--scheduling-policy priority`): FCFS among requests of the same priority, a lower
`SamplingParams.priority` value first. Waiting requests are admitted in (priority, arrival) order, and when the KV
pool runs out the running request with the highest (priority, arrival) gives way first, as vLLM's v1 scheduler
preempts."""

from collections.abc import Iterable

from flock.request import Request
from flock.sched.fcfs import FCFSScheduler


def rank(req: Request) -> tuple[int, float, int]:
    return req.params.priority, req.arrival, req.request_id


class PriorityScheduler(FCFSScheduler):
    name = "priority"

    def admission_order(self) -> Iterable[Request]:
        return sorted(self.waiting, key=rank)

    def victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=rank)
