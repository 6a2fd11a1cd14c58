"""vLLM's priority scheduling: waiting requests admitted by (priority, arrival), the running request of the highest
(priority, arrival) preempted first when the KV pool runs out; tokens unchanged; other schedulers refuse it."""

import pytest

from flock import LLM, SamplingParams
from flock.engine.loop import run

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


def finish_order(llm: LLM, prompts, priorities) -> list[int]:
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(**GREEDY, priority=q)) for p, q in zip(prompts, priorities)]
    order = [reqs.index(r) for step in run(engine) for r in step.finished]
    return order


def test_waiting_requests_go_by_priority_then_arrival():
    llm = LLM("flock/tiny", scheduler="priority", max_num_seqs=1, num_kv_blocks=64)
    prompts = [[10 + i, 20, 30] for i in range(5)]
    assert finish_order(llm, prompts, [2, 0, 1, 0, -1]) == [4, 1, 3, 2, 0]


def test_the_lowest_priority_gives_way_when_the_pool_runs_out():
    """Both run; decode growth needs more blocks than the pool has: the priority 5 request is preempted, not the
    later-admitted priority 0 one, and both give their tokens alone."""
    llm = LLM("flock/tiny", scheduler="priority", block_size=4, num_kv_blocks=10, max_num_batched_tokens=64)
    prompts = [list(range(100, 112)), list(range(200, 212))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=q) for q in (5, 0)]
    reqs = [llm.engine.add_request(p, s) for p, s in zip(prompts, params)]
    for _ in run(llm.engine):
        pass
    assert reqs[0].num_preemptions > 0 and reqs[1].num_preemptions == 0
    alone = LLM("flock/tiny", num_kv_blocks=64).generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                                          use_tqdm=False)
    assert [r.output_token_ids for r in reqs] == [o.outputs[0].token_ids for o in alone]


def test_the_lowest_priority_gives_way_even_when_planned_first_in_the_step():
    """A priority 10 request runs; a priority 0 one joins; when the pool runs out while the second grows, the first
    gives way though the step had planned it already (its tokens come off the plan, as vLLM's), not the second."""
    engine = LLM("flock/tiny", scheduler="priority", block_size=4, num_kv_blocks=8, max_model_len=32).engine
    low = engine.add_request(list(range(100, 112)), SamplingParams(temperature=0, max_tokens=19, ignore_eos=True,
                                                                   priority=10))
    engine.step()
    high = engine.add_request(list(range(200, 207)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in run(engine):
        pass
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert engine.kv.pool.num_free == 8


def test_other_schedulers_refuse_a_priority():
    llm = LLM("flock/tiny", num_kv_blocks=64)
    with pytest.raises(ValueError, match="priority must be 0 unless the scheduler is 'priority'"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, priority=1), use_tqdm=False)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, priority=0), use_tqdm=False)
