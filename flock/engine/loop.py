"""The run loop over `engine.step()`, the one every driver of an engine uses: `LLM.generate`, `flock run`, the
server's engine thread, Ray workers and trace replay.

    for step in run(engine):                 # until the engine has nothing left
        write(step.finished)

    for step in run(engine, admit=feed):     # feed(idle) adds requests between steps; False ends the run
        ...

`admit(idle)` runs before every step; `idle` says the engine has nothing to run, so the hook may wait for work
(the server blocks on its queue, trace replay sleeps until the next arrival) or end the run. Without a hook the
run ends when the engine is idle. The engine's `stats` time the run (`RunStats.start` / `stop`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from flock.engine.stats import RunStats


class Steppable(Protocol):
    """What the loop needs of an engine (`LLMEngine`, or `flock.distributed.driver.ClusterEngine`)."""

    stats: RunStats

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Any]: ...


@dataclass
class StepEvent:
    finished: list[Any]  # the requests that finished in the step
    seconds: float  # the step's wall time
    tokens: int = 0  # the tokens it computed (0: it failed)


def run(engine: Steppable, admit: Callable[[bool], bool] | None = None,
        on_error: Callable[[Exception], None] | None = None) -> Iterator[StepEvent]:
    """Step `engine` until `admit` says stop (by default: until it is idle), yielding every step. A step that
    raises ends the run, unless `on_error` takes the exception: the loop then yields the step with nothing
    finished and goes on."""
    stats = engine.stats
    stats.start()
    try:
        while True:
            idle = not engine.has_unfinished()
            if not (admit(idle) if admit is not None else not idle):
                return
            if not engine.has_unfinished():
                continue
            t0, tokens = time.perf_counter(), stats.step_tokens
            try:
                finished = engine.step()
            except Exception as e:
                if on_error is None:
                    raise
                on_error(e)
                finished = []
            yield StepEvent(finished, time.perf_counter() - t0, stats.step_tokens - tokens)
    finally:
        stats.stop()


def run_to_end(engine: Steppable) -> list[Any]:
    """Step until the engine is idle; the requests that finished, in finishing order."""
    return [req for step in run(engine) for req in step.finished]
