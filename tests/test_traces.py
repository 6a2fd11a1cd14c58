from itertools import pairwise

import pytest

from flock import LLM
from bench.harness.traces import TRACE_KINDS, load_trace, make_trace, replay, save_trace


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("kind", list(TRACE_KINDS))
def test_deterministic_per_seed(kind):
    a = make_trace(kind, num_requests=40, rate=5, seed=3, scale=0.1)
    assert a == make_trace(kind, num_requests=40, rate=5, seed=3, scale=0.1)
    assert a != make_trace(kind, num_requests=40, rate=5, seed=4, scale=0.1)
    assert all(100 <= t < 8000 for r in a for t in r.token_ids)


def test_pattern_keeps_prompts():
    a = make_trace("mixed", num_requests=30, rate=5, seed=1, scale=0.1)
    b = make_trace("mixed", num_requests=30, rate=50, pattern="bursty", seed=1, scale=0.1)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("kind", list(TRACE_KINDS))
def test_groups_share_exactly_their_prefix(kind):
    trace = make_trace(kind, num_requests=60, rate=5, seed=0, scale=0.1)
    prefix_len: dict[int, int] = {}
    for i, a in enumerate(trace):
        for b in trace[i + 1:]:
            shared = common_prefix(a.token_ids, b.token_ids)
            if a.group < 0 or a.group != b.group:
                assert shared == 0
            else:
                assert 0 < shared < min(len(a.token_ids), len(b.token_ids))
                assert prefix_len.setdefault(a.group, shared) == shared
    if kind == "groups8":
        assert set(prefix_len) == set(range(8)) and set(prefix_len.values()) == {102}  # 1,024 x 0.1
    if kind == "nosharing":
        assert {r.group for r in trace} == {-1}
    if kind == "mixed":
        assert sum(r.group < 0 for r in trace) == 30


@pytest.mark.parametrize("pattern", ["poisson", "bursty"])
def test_arrivals_sorted_at_rate(pattern):
    trace = make_trace("groups8", num_requests=4000, rate=20, pattern=pattern, seed=0, scale=0.01)
    times = [r.arrival_s for r in trace]
    assert times[0] == 0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(20, rel=0.15)


def test_bursty_is_burstier():
    gaps = {}
    for pattern in ("poisson", "bursty"):
        t = [r.arrival_s for r in make_trace("nosharing", num_requests=4000, rate=20, pattern=pattern, seed=0,
                                             scale=0.01)]
        g = [b - a for a, b in pairwise(t[1:])]
        mean = sum(g) / len(g)
        gaps[pattern] = (sum((x - mean) ** 2 for x in g) / len(g)) ** 0.5 / mean
    assert gaps["poisson"] == pytest.approx(1, abs=0.15) and gaps["bursty"] > 2


def test_save_load_round_trip(tmp_path):
    trace = make_trace("long-prefix", num_requests=20, rate=3, pattern="bursty", seed=2, scale=0.05, max_tokens=7)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        make_trace("nope", num_requests=2, rate=1)
    with pytest.raises(ValueError, match="pattern"):
        make_trace("groups8", num_requests=2, rate=1, pattern="nope")


def test_replay_end_to_end():
    engine = LLM("flock/tiny", scheduler="fcfs", attention="torch-cascade", num_kv_blocks=64).engine
    trace = make_trace("groups8", num_requests=8, rate=100, seed=0, scale=0.05, max_tokens=4)
    result = replay(engine, trace)
    assert len(result.requests) == 8 and not engine.has_unfinished()
    assert [r.group for r in result.requests] == [t.group for t in trace]
    for r in result.requests:
        assert r.output_tokens == 4
        assert 0 < r.ttft_s < 5 and 0 < r.tpot_s < 5
    assert result.wall_s >= trace[-1].arrival_s
    assert result.steps and all(1 <= s.distinct_groups <= s.batch_size or s.batch_size == 0 for s in result.steps)
    assert result.stats["generated_tokens"] == 32 and result.stats["saving_rate"] > 0
    assert engine.kv.pool.num_used == 0
