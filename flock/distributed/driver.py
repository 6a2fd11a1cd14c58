"""`flock run --workers N`: one batch job over N engines on Ray, sharded by prefix group.

`ClusterEngine` is a `flock.api.job_engine.JobEngine`, as one LLMEngine is, so the batch job reads, checks,
writes and resumes exactly as on one engine, and the driver alone writes the output. At the first step the
requests are partitioned by prefix group (`flock.distributed.partition`) and handed to the workers, Ray
actors owning one LLMEngine each (`flock.distributed.worker`); each step returns the requests finished on any
worker since the last one.

Faults: a worker that dies (its process killed, its node lost, its engine failing) loses only its unfinished
requests: they go to a restarted worker (at most `max_restarts` times per worker), after that to the
survivors, partitioned again by prefix group. A result is written once, when it reaches the driver; the
requests of a dead worker that had not come back run again elsewhere. With every worker dead the job stops
with an EngineError (exit status 2): the results so far are in the output and `--resume` finishes the job.
When the driver dies, Ray ends its workers; `--resume` finishes the job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from flock.api.batch import JobConfig, run_job
from flock.api.job_engine import EngineError, JobEngine
from flock.config import EngineConfig
from flock.distributed.partition import Partition, partition
from flock.distributed.worker import EngineInfo, EngineWorker, Finished, Progress, Work
from flock.engine.engine import check_priority
from flock.engine.stats import RunStats
from flock.pooling_params import PoolingParams
from flock.sampling_params import SamplingParams

log = logging.getLogger("flock")

WAIT_SECONDS = 0.5  # longest a step waits for a worker's report


@dataclass
class ClusterConfig:
    workers: int
    address: str | None = None  # an existing Ray cluster; default: the initialised Ray, else a new local one
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    worker_threads: int | None = None  # torch threads per engine; default: worker_cpus, at least 1
    max_restarts: int = 1  # per worker; after that its requests go to the survivors
    start_timeout: float = 600.0  # seconds for a worker to build its engine
    report_seconds: float = 0.25  # how long a worker steps between two reports

    def validate(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.worker_cpus <= 0 or self.worker_gpus < 0:
            raise ValueError("--worker-cpus must be positive and --worker-gpus not negative")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"--worker-threads must be at least 1, got {self.worker_threads}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-worker-restarts must not be negative, got {self.max_restarts}")

    @property
    def threads(self) -> int:
        return self.worker_threads or max(1, int(self.worker_cpus))


@dataclass
class Submitted:
    request_id: int


@dataclass
class _Slot:
    """A worker position: its current actor, the requests it holds and its call in flight."""

    index: int
    actor: Any = None
    info: EngineInfo | None = None  # of the current actor, once it has started
    keys: set[int] = field(default_factory=set)  # sent to it and not returned
    pending: list[Work] = field(default_factory=list)  # to send with its next call
    call: Any = None  # ObjectRef of its info() or run() in flight
    started: float = 0.0
    stats: RunStats = field(default_factory=RunStats)  # of the current actor
    retired: list[RunStats] = field(default_factory=list)  # of its dead actors
    done: int = 0
    restarts: int = 0
    alive: bool = True

    def all_stats(self) -> list[RunStats]:
        return [self.stats, *self.retired]


class ClusterEngine(JobEngine):
    """N engines on Ray behind the interface of one engine to a batch job."""

    def __init__(self, engine_kwargs: dict, cluster: ClusterConfig):
        cluster.validate()
        self.config = EngineConfig.from_kwargs(**engine_kwargs)  # bad engine options fail here, before Ray
        self.cluster = cluster
        self.started_ray = _connect(cluster.address)
        self.slots = [_Slot(i) for i in range(cluster.workers)]
        try:
            _check_resources(cluster)
            self.remote = ray.remote(EngineWorker).options(num_cpus=cluster.worker_cpus, num_gpus=cluster.worker_gpus,
                                                           max_restarts=0)
            for slot in self.slots:
                self._start(slot)
            self._wait_started()
        except BaseException:
            self.shutdown()
            raise
        self.info: EngineInfo = self.slots[0].info
        self.tokenizer = self.info.tokenizer
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        self.sampling_defaults = self.info.sampling_defaults
        self.tasks = self.info.tasks
        self.eos_token_ids = set(self.info.stop_token_ids)
        self.reset_stats()

    # -- the engine interface of a batch job ----------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        self.info.check_request(prompt_token_ids, params)
        if isinstance(params, SamplingParams):
            check_priority(params, self.config.scheduler)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> Submitted:
        self.check_request(prompt_token_ids, params)
        key = len(self.prompts)
        self.prompts.append(np.asarray(prompt_token_ids, dtype=np.int32))
        self.params.append(params)
        self.undispatched.append(key)
        self.logical_tokens += len(prompt_token_ids)
        return Submitted(key)

    def has_unfinished(self) -> bool:
        return bool(self.undispatched) or any(s.keys for s in self.slots)

    def step(self) -> list[Finished]:
        """The requests finished on any worker since the last step (waits up to WAIT_SECONDS for one)."""
        if self.undispatched:
            keys, self.undispatched = self.undispatched, []
            self._dispatch(keys, [s for s in self.slots if s.alive])
        calls = {s.call: s for s in self.slots if s.call is not None}
        finished: list[Finished] = []
        if calls and ray.wait(list(calls), num_returns=1, timeout=WAIT_SECONDS)[0]:
            for ref in ray.wait(list(calls), num_returns=len(calls), timeout=0)[0]:
                finished += self._collect(calls[ref], ref)
        self._check_starts()
        self._total()
        return finished

    def decode(self, finished: Finished) -> str:
        return finished.text

    def reset_stats(self) -> None:
        """A new job (the engine must be idle): requests, partition and statistics start again."""
        self.prompts: list[np.ndarray] = []
        self.params: list[SamplingParams | PoolingParams] = []
        self.undispatched: list[int] = []
        self.logical_tokens = 0
        self.partition: Partition | None = None  # the job's first, for the summary
        self.stats = RunStats()
        for slot in self.slots:
            slot.stats, slot.retired, slot.done = RunStats(), [], 0
            if slot.alive:
                slot.actor.reset_stats.remote()

    def summary_rows(self) -> list[tuple[str, str]]:
        """The job summary's rows about the workers (`run_job(..., summary_rows=...)`)."""
        alive = sum(s.alive for s in self.slots)
        rows = [("workers", f"{len(self.slots)} Ray actors ({alive} alive), {self.info.threads} torch thread(s) each")]
        if self.partition is not None:
            p = self.partition
            rows.append(("partition (planned)", f"max / mean work {p.balance:.3f} (prompt tokens computed + max_tokens), "
                                                f"{p.split_groups} group(s) cut, {p.repeated_prefix_tokens} prefix "
                                                "tokens repeated"))
        for s in self.slots:
            t = RunStats()
            t.set_total(s.all_stats())
            where = f"pid {s.info.pid} on {s.info.host}" if s.info else "not started"
            notes = (f", restarted {s.restarts}x" if s.restarts else "") + ("" if s.alive else ", dead")
            busy = sum(r.wall_seconds for r in s.all_stats())
            rows.append((f"worker {s.index}", f"{s.done} requests, {t.computed_prefill_tokens} prefill tokens computed "
                                              f"(saving {t.saving_rate:.1%}), {t.generated_tokens} generated, busy "
                                              f"{busy:.1f} s, {where}{notes}"))
        return rows

    def shutdown(self) -> None:
        for slot in self.slots:
            _kill(slot.actor)
        if self.started_ray:
            ray.shutdown()

    # -- workers ----------------------------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        slot.actor = self.remote.remote(self.config, self.cluster.threads, slot.index)
        slot.info, slot.stats, slot.started = None, RunStats(), time.monotonic()
        slot.call = slot.actor.info.remote()

    def _wait_started(self) -> None:
        calls = {s.call: s for s in self.slots}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=self.cluster.start_timeout)
        if len(ready) < len(calls):
            raise EngineError(f"{len(calls) - len(ready)} of {len(calls)} workers did not start within "
                              f"{self.cluster.start_timeout:.0f} s: are there {self.cluster.worker_cpus} CPU(s) "
                              f"and {self.cluster.worker_gpus} GPU(s) free for each?")
        for ref, slot in calls.items():
            try:
                slot.info = ray.get(ref)
            except ray.exceptions.RayError as e:
                raise EngineError(f"worker {slot.index} could not start: {_reason(e)}") from None
            slot.call = None

    def _dispatch(self, keys: list[int], slots: list[_Slot]) -> None:
        """Partition `keys` by prefix group over `slots` and send each its share."""
        outputs = [(p.max_tokens or 0) if isinstance(p, SamplingParams) else 0 for p in (self.params[k] for k in keys)]
        part = partition([self.prompts[k] for k in keys], len(slots), outputs)
        self.partition = self.partition or part
        for slot, shard in zip(slots, part.shards):
            self._send(slot, [keys[i] for i in shard])

    def _send(self, slot: _Slot, keys: list[int]) -> None:
        slot.keys.update(keys)
        slot.pending += [Work(k, self.prompts[k], self.params[k]) for k in keys]
        if slot.call is None and slot.info is not None:
            self._call(slot)

    def _call(self, slot: _Slot) -> None:
        work, slot.pending = slot.pending, []
        slot.call = slot.actor.run.remote(work, self.cluster.report_seconds)

    def _collect(self, slot: _Slot, ref) -> list[Finished]:
        slot.call = None
        try:
            result: EngineInfo | Progress = ray.get(ref)
        except ray.exceptions.RayError as e:  # the actor died, or its engine raised
            self._lose(slot, _reason(e))
            return []
        if isinstance(result, EngineInfo):  # a restarted worker is up
            slot.info = result
            finished = []
        else:
            slot.stats = result.stats
            finished = [f for f in result.finished if f.request_id in slot.keys]  # each result once
            slot.keys.difference_update(f.request_id for f in finished)
            slot.done += len(finished)
        if slot.keys:
            self._call(slot)
        return finished

    def _check_starts(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.alive and slot.info is None and now - slot.started > self.cluster.start_timeout:
                self._lose(slot, f"it did not start within {self.cluster.start_timeout:.0f} s")

    def _lose(self, slot: _Slot, why: str) -> None:
        """The slot's actor is gone: its unfinished requests go to a new actor, else to the survivors."""
        _kill(slot.actor)
        orphans = sorted(slot.keys)
        slot.keys, slot.pending, slot.call = set(), [], None
        slot.retired.append(slot.stats)
        slot.stats = RunStats()
        name = f"worker {slot.index}" + (f" (pid {slot.info.pid} on {slot.info.host})" if slot.info else "")
        if slot.restarts < self.cluster.max_restarts:
            slot.restarts += 1
            log.warning("%s lost: %s; restarting it with its %d unfinished requests", name, why, len(orphans))
            self._start(slot)
            self._send(slot, orphans)
            return
        slot.alive = False
        survivors = [s for s in self.slots if s.alive]
        if not survivors:
            raise EngineError(f"every worker is lost (the last, {name}: {why})")
        log.warning("%s lost: %s; its %d unfinished requests go to the %d other workers", name, why, len(orphans),
                    len(survivors))
        if orphans:
            self._dispatch(orphans, survivors)

    def _total(self) -> None:
        self.stats.set_total(r for s in self.slots for r in s.all_stats())
        self.stats.num_requests = len(self.prompts)  # each request once, however often it ran
        self.stats.logical_prefill_tokens = self.logical_tokens


def run_cluster_job(cfg: JobConfig, cluster: ClusterConfig) -> int:
    """`flock run --workers N`: the job of `cfg` on a ClusterEngine; the same exit statuses as `run_job`."""
    engines: list[ClusterEngine] = []

    def build() -> ClusterEngine:
        engines.append(ClusterEngine(cfg.engine, cluster))
        return engines[-1]

    try:
        return run_job(cfg, build_engine=build, summary_rows=lambda: engines[-1].summary_rows())
    finally:
        for e in engines:
            e.shutdown()


def _connect(address: str | None) -> bool:
    """Connect to Ray unless it is initialised; True when this call did (and shutdown() disconnects)."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return True


def _check_resources(cluster: ClusterConfig) -> None:
    have = ray.cluster_resources()
    for kind, each in (("CPU", cluster.worker_cpus), ("GPU", cluster.worker_gpus)):
        need = cluster.workers * each
        if need > have.get(kind, 0) + 1e-9:
            raise EngineError(f"{cluster.workers} workers x {each:g} {kind}s need {need:g} {kind}s, the Ray cluster has "
                              f"{have.get(kind, 0):g}: use fewer --workers or a fraction of a {kind} each "
                              f"(--worker-{kind.lower()}s)")


def _kill(actor) -> None:
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down
            pass


def _reason(e: Exception) -> str:
    """A Ray error in one line: the exception that ended the task, or why the actor died."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else type(e).__name__
    if isinstance(e, ray.exceptions.ActorDiedError) and "creation task" not in str(e):
        return last.split(". ")[0]  # "The actor is dead because its worker process has died"
    return last
