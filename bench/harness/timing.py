"""Timers and repeats: the seconds of calls, their best or median, repeats within a time budget."""

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator

__all__ = ["Timer", "timed", "times", "best_time", "median_time", "repeat_within", "gc_paused"]


class Timer:
    """`with Timer() as t: ...` then `t.seconds` (perf_counter)."""

    seconds: float = 0.0

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def timed(fn: Callable) -> float:
    """Seconds of one call of `fn`."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def times(fn: Callable, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn) for _ in range(repeats)]


def best_time(fn: Callable, repeats: int, warmup: int = 1) -> float:
    """The shortest of `repeats` calls after `warmup`: the machine's speed with the least interference."""
    return min(times(fn, repeats, warmup))


def median_time(fn: Callable, repeats: int, warmup: int = 1) -> float:
    """The median of `repeats` calls after `warmup`."""
    return statistics.median(times(fn, repeats, warmup))


def repeat_within(fn: Callable, min_runs: int, max_runs: int, budget_s: float) -> tuple[list[float], list]:
    """One untimed warm-up call, then `fn()` between `min_runs` and `max_runs` times, stopping once `budget_s`
    seconds are spent: (seconds of each call, their results)."""
    fn()
    results, seconds = [], []
    while len(results) < max_runs and (len(results) < min_runs or sum(seconds) < budget_s):
        t = time.perf_counter()
        results.append(fn())
        seconds.append(time.perf_counter() - t)
    return seconds, results


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off inside the block, so a collection does not land in one timing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
