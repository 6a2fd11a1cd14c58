import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from flock.request import Request
from flock.sched.base import StepPlan


@dataclass
class RunStats:
    """Counters of one run. Saving rate (BatchLLM Eq. 2): 1 - computed / logical prefill tokens. The wall time
    is the time between `start()` and `stop()`, summed over the spans (the run loop, `flock.engine.loop`, starts
    and stops it)."""

    num_requests: int = 0
    logical_prefill_tokens: int = 0
    computed_prefill_tokens: int = 0
    cached_prefill_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    copied_prefill_tokens: int = 0  # prompt tokens of a partly shared block taken by copying its KV (admissions)
    disk_read_blocks: int = 0  # KV blocks read from the prefix cache's disk tier instead of computed
    disk_saved_blocks: int = 0  # computed KV blocks handed to it
    computed_decode_tokens: int = 0  # tokens past the prompt, recomputation after preemption included
    generated_tokens: int = 0
    num_drafts: int = 0  # sampled steps of requests that verified drafts (vLLM's spec_decode counters)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    schedule_seconds: float = 0.0
    model_seconds: float = 0.0
    wall_seconds: float = field(default=0.0, init=False)  # of the finished spans; `elapsed` adds the open one
    peak_kv_blocks: int = 0
    num_kv_blocks: int = 0
    step_tokens: int = 0
    step_requests: int = 0
    max_step_tokens: int = 0
    trace_steps: bool = True  # keep tokens_per_step (off in a long-running server)
    tokens_per_step: list[int] = field(default_factory=list)
    _span_start: float | None = field(default=None, init=False, repr=False, compare=False)

    def start(self) -> None:
        """Open a span of wall time (no-op while one is open)."""
        if self._span_start is None:
            self._span_start = time.perf_counter()

    def stop(self) -> None:
        """Close the open span: its seconds join `wall_seconds`."""
        if self._span_start is not None:
            self.wall_seconds += time.perf_counter() - self._span_start
            self._span_start = None

    @property
    def elapsed(self) -> float:
        """Wall seconds so far, the open span included."""
        open_span = time.perf_counter() - self._span_start if self._span_start is not None else 0.0
        return self.wall_seconds + open_span

    @property
    def saving_rate(self) -> float:
        logical = self.logical_prefill_tokens
        return 1 - self.computed_prefill_tokens / logical if logical else 0.0

    def add_request(self, req: Request) -> None:
        self.num_requests += 1
        self.logical_prefill_tokens += req.num_prompt_tokens

    def add_step(self, plan: StepPlan, schedule_s: float, model_s: float, kv_used: int) -> None:
        self.steps += 1
        self.schedule_seconds += schedule_s
        self.model_seconds += model_s
        self.preemptions += len(plan.preempted)
        self.peak_kv_blocks = max(self.peak_kv_blocks, kv_used)
        self.step_tokens += plan.num_tokens
        self.step_requests += len(plan.scheduled)
        self.max_step_tokens = max(self.max_step_tokens, plan.num_tokens)
        if self.trace_steps:
            self.tokens_per_step.append(plan.num_tokens)
        self.copied_prefill_tokens += plan.num_copied_tokens
        self.disk_read_blocks += len(plan.kv_loads)
        for (req, n), start in zip(plan.scheduled, plan.starts):
            prompt = req.num_prompt_tokens
            in_prompt = max(0, min(start + n, prompt) - start)
            self.computed_prefill_tokens += in_prompt
            self.computed_decode_tokens += n - in_prompt

    def add_drafts(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.draft_tokens += drafts
        self.accepted_draft_tokens += accepted

    def set_total(self, parts: Iterable["RunStats"]) -> None:
        """Every counter becomes its sum over `parts` (several engines as one; the largest step: the max).
        The wall time and the step trace stay."""
        parts = list(parts)
        for f in fields(self):
            if f.name not in ("wall_seconds", "_span_start", "trace_steps", "tokens_per_step"):
                values = [getattr(p, f.name) for p in parts]
                setattr(self, f.name, max(values, default=0) if f.name == "max_step_tokens" else sum(values))

    def as_dict(self) -> dict:
        wall = self.wall_seconds or float("nan")
        logical = self.logical_prefill_tokens
        steps = max(self.steps, 1)
        return {
            "num_requests": self.num_requests,
            "logical_prefill_tokens": logical,
            "computed_prefill_tokens": self.computed_prefill_tokens,
            "cached_prefill_tokens": self.cached_prefill_tokens,
            "copied_prefill_tokens": self.copied_prefill_tokens,
            "disk_read_blocks": self.disk_read_blocks,
            "disk_saved_blocks": self.disk_saved_blocks,
            "saving_rate": self.saving_rate,
            "computed_decode_tokens": self.computed_decode_tokens,
            "generated_tokens": self.generated_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "draft_acceptance_rate": self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_acceptance_length": 1 + self.accepted_draft_tokens / self.num_drafts if self.num_drafts else 0.0,
            "steps": self.steps,
            "mean_tokens_per_step": self.step_tokens / steps,
            "mean_requests_per_step": self.step_requests / steps,
            "max_tokens_per_step": self.max_step_tokens,
            "preemptions": self.preemptions,
            "schedule_seconds": self.schedule_seconds,
            "model_seconds": self.model_seconds,
            "wall_seconds": self.wall_seconds,
            "schedule_fraction": self.schedule_seconds / wall,
            "peak_kv_blocks": self.peak_kv_blocks,
            "num_kv_blocks": self.num_kv_blocks,
            "prompt_tokens_per_s": logical / wall,
            "generated_tokens_per_s": self.generated_tokens / wall,
            "total_tokens_per_s": (logical + self.generated_tokens) / wall,
        }
