from flock.sched.base import Scheduler, StepPlan
from flock.sched.batchllm import BatchLLMScheduler
from flock.sched.fcfs import FCFSScheduler
from flock.sched.feather import FeatherScheduler
from flock.sched.lpm import DFSWeightScheduler, LPMScheduler
from flock.sched.priority import PriorityScheduler

__all__ = ["Scheduler", "StepPlan", "SCHEDULERS", "make_scheduler"]

SCHEDULERS: dict[str, type[Scheduler]] = {
    s.name: s for s in (FCFSScheduler, BatchLLMScheduler, LPMScheduler, DFSWeightScheduler, FeatherScheduler,
                        PriorityScheduler)
}


def make_scheduler(name: str, config, kv) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; available: {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](config, kv)
