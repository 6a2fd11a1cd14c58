from flock.sched.base import Scheduler, StepPlan
from flock.sched.batchllm import BatchLLMScheduler
from flock.sched.fcfs import FCFSScheduler

__all__ = ["Scheduler", "StepPlan", "SCHEDULERS", "make_scheduler"]

SCHEDULERS: dict[str, type[Scheduler]] = {"fcfs": FCFSScheduler, "batchllm": BatchLLMScheduler}


def make_scheduler(name: str, config, kv) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; available: {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](config, kv)
