"""The run loop (flock.engine.loop) and the wall clock of RunStats it drives."""

import time

import pytest

from flock.engine.loop import run, run_to_end
from flock.engine.stats import RunStats


class CountdownEngine:
    """A request is a number of steps left; a step takes one from each and returns those that reach 0."""

    def __init__(self, fail_at: int | None = None):
        self.stats = RunStats()
        self.left: dict[str, int] = {}
        self.steps = 0
        self.fail_at = fail_at

    def add_request(self, name: str, steps: int) -> None:
        self.left[name] = steps

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[str]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("step failed")
        self.left = {k: n - 1 for k, n in self.left.items()}
        done = [k for k, n in self.left.items() if n == 0]
        for k in done:
            del self.left[k]
        return done


def test_run_steps_until_idle_and_yields_what_each_step_finished():
    engine = CountdownEngine()
    engine.add_request("a", 1)
    engine.add_request("b", 3)
    assert [s.finished for s in run(engine)] == [["a"], [], ["b"]]
    assert run_to_end(engine) == []  # idle: no step at all
    assert engine.steps == 3


def test_admit_adds_requests_between_steps_and_ends_the_run():
    engine = CountdownEngine()
    arrivals = {0: "a", 3: "b"}  # by call of admit: "b" comes while the engine is idle
    calls = []

    def admit(idle: bool) -> bool:
        if len(calls) in arrivals:
            engine.add_request(arrivals.pop(len(calls)), 1)
        calls.append(idle)
        return bool(arrivals) or engine.has_unfinished()

    assert [s.finished for s in run(engine, admit)] == [["a"], ["b"]]
    assert calls == [True, True, True, True, True]  # idle twice after "a": no step until "b" arrives
    assert engine.steps == 2


def test_a_failed_step_ends_the_run_unless_on_error_takes_it():
    engine = CountdownEngine(fail_at=2)
    engine.add_request("a", 3)
    with pytest.raises(RuntimeError, match="step failed"):
        list(run(engine))
    assert engine.stats.elapsed == engine.stats.wall_seconds > 0  # the clock stopped with the run

    engine = CountdownEngine(fail_at=2)
    engine.add_request("a", 3)
    errors = []
    assert [s.finished for s in run(engine, on_error=errors.append)] == [[], [], [], ["a"]]
    assert [str(e) for e in errors] == ["step failed"]


def test_the_stats_time_every_run_and_sum_the_spans():
    engine = CountdownEngine()
    for run_index in range(2):
        engine.add_request("a", 1)
        for _ in run(engine):
            time.sleep(0.02)
            assert engine.stats.elapsed >= 0.02 * (run_index + 1)  # the open span counts while it runs
        assert engine.stats.wall_seconds == engine.stats.elapsed >= 0.02 * (run_index + 1)
    stats = RunStats()
    stats.start()
    stats.start()  # no-op while a span is open
    time.sleep(0.01)
    stats.stop()
    stats.stop()
    assert 0.01 <= stats.wall_seconds == stats.elapsed < 1
    with pytest.raises(TypeError):
        RunStats(wall_seconds=1.0)  # nobody sets the wall time from outside


def test_the_saving_rate_is_computed_once_for_everyone():
    s = RunStats(logical_prefill_tokens=16 * 2200, computed_prefill_tokens=2000 + 16 * 200)
    assert round(s.saving_rate, 3) == 0.852 and s.as_dict()["saving_rate"] == s.saving_rate
    assert RunStats().saving_rate == 0.0
