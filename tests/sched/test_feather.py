"""Feather: same tokens as FCFS, homogeneous batches from interleaved traffic, FCFS order without sharing,
bounded waiting under adversarial traffic, and policies that learn from rewards."""

import random

import pytest

from flock import LLM, SamplingParams
from flock.sched.policies import ADD, STOP, BatchState, QLearningPolicy, StaticPolicy, UCBPolicy
from tests.sched.test_batchllm import groups_workload

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
POLICIES = ["static", "ucb", "qlearning"]


def make_llm(scheduler="feather", policy="static", **config):
    return LLM("flock/tiny", dtype="float32", block_size=8, scheduler=scheduler, feather_policy=policy, **config)


def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_count), "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_kv_blocks", [None, 40])
def test_same_tokens_as_fcfs(policy, num_kv_blocks):
    prompts = groups_workload(3, groups=4, per_group=6, prefix=40, distinct=7, singles=4)
    kw = {"num_kv_blocks": num_kv_blocks, "max_num_seqs": 6, "max_num_batched_tokens": 64}
    expected = generate(make_llm("fcfs", **kw), prompts)
    llm = make_llm(policy=policy, **kw)
    assert generate(llm, prompts) == expected
    assert not llm.engine.scheduler.cht.num_active and not llm.engine.scheduler.cht.num_waiting


def run_online(llm, arrivals: list[list[list[int]]], groups: list[int]) -> list[set[int]]:
    """Add arrivals[i] before step i; return the prefix groups of the running batch at every step."""
    engine, group_of, composition = llm.engine, {}, []
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        for p in arrivals[i] if i < len(arrivals) else []:
            group_of[engine.add_request(p, GREEDY).request_id] = groups.pop(0)
        if engine.has_unfinished():
            engine.step()
            composition.append({group_of[r.request_id] for r in engine.scheduler.running})
        i += 1
    return composition


def test_interleaved_groups_run_as_homogeneous_batches():
    rng = random.Random(0)
    heads = [[rng.randrange(100, 8000) for _ in range(64)] for _ in range(4)]
    groups = [i % 4 for i in range(32)]
    prompts = [heads[g] + [rng.randrange(100, 8000) for _ in range(5)] for g in groups]
    mixed = {}
    for name in ("fcfs", "feather"):
        composition = run_online(make_llm(name, max_num_seqs=8), [prompts], list(groups))
        mixed[name] = sum(len(c) for c in composition) / len(composition)
    assert mixed["feather"] < 1.5 < 3.0 < mixed["fcfs"]


def test_parked_requests_are_put_back_or_aborted_cleanly():
    rng = random.Random(3)
    heads = [[rng.randrange(100, 8000) for _ in range(32)] for _ in range(2)]
    llm = make_llm(max_num_seqs=2)
    engine, sched = llm.engine, llm.engine.scheduler
    reqs = [engine.add_request(heads[i % 2] + [rng.randrange(100, 8000) for _ in range(3)], GREEDY) for i in range(6)]
    engine.step()
    for req in reqs[3:5]:
        sched._park(req)
    assert reqs[3] not in sched.cht and reqs[4] not in sched.cht
    engine.abort(reqs[3])
    assert reqs[3] not in sched.parked
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output_token_ids) for r in reqs] == [6, 6, 6, 0, 6, 6]
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and not sched.parked
    assert not sched.cht.num_active and not sched.cht.num_waiting


def record_admissions(llm) -> list[tuple[int, int]]:
    """(request id, admissions it waited) for every admission, in order."""
    sched, log, arrived = llm.engine.scheduler, [], {}
    original_add, original_admit = sched.add, sched.on_admit
    admissions = lambda: len(log)  # noqa: E731

    def add(req):
        arrived.setdefault(req.request_id, admissions())
        original_add(req)

    def on_admit(req):
        log.append((req.request_id, admissions() - arrived[req.request_id]))
        original_admit(req)

    sched.add, sched.on_admit = add, on_admit
    return log


def test_without_sharing_admits_in_fcfs_order():
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 8000) for _ in range(rng.randrange(3, 60))] for _ in range(20)]
    orders = {}
    for name in ("fcfs", "feather"):
        llm = make_llm(name, max_num_seqs=3)
        log = record_admissions(llm)
        generate(llm, prompts)
        orders[name] = [rid for rid, _ in log]
    assert orders["feather"] == orders["fcfs"]


def adversarial_trace(seed: int):
    """Two requests with a shared head arriving one step apart (so the batch never empties), then a lone
    unrelated request, then a flood sharing the head, two per step (faster than the engine serves them, so
    the batch's group always has members waiting)."""
    rng = random.Random(seed)
    head = [rng.randrange(100, 8000) for _ in range(48)]
    member = lambda: head + [rng.randrange(100, 8000)]  # noqa: E731
    arrivals = [[member()], [member()], [[rng.randrange(100, 8000) for _ in range(40)]]]
    arrivals += [[member(), member()] for _ in range(15)]
    return arrivals, [0, 0, 1] + [0] * 30


@pytest.mark.parametrize("policy", POLICIES)
def test_no_starvation_under_adversarial_traffic(policy):
    """The CHT always prefers the flood (it shares the batch's prefix); only the waiting bound lets the lone
    request in. Without the bound it would wait for the whole flood."""
    waited = {}
    for bound in (6, 10**9):
        llm = make_llm(policy=policy, max_num_seqs=2)
        llm.engine.scheduler.max_wait_rounds = bound
        log = record_admissions(llm)
        arrivals, groups = adversarial_trace(2)
        run_online(llm, arrivals, groups)
        assert len(log) == 33 and not llm.engine.has_unfinished()
        waited[bound] = dict(log)[2]
    assert waited[6] <= 6 + 1
    assert waited[10**9] >= 25


def test_a_popular_prefix_gives_way_after_the_focus_quantum():
    """A steady flood of one group never lets the focus run dry; a small second group (two requests, so it
    is parked, not a loner) gets its turn once the focus has had its quantum of admissions."""
    rng = random.Random(4)
    heads = [[rng.randrange(100, 8000) for _ in range(48)] for _ in range(2)]
    member = lambda g: heads[g] + [rng.randrange(100, 8000)]  # noqa: E731
    waited = {}
    for quantum in (4, 10**9):
        llm = make_llm(max_num_seqs=2)
        sched = llm.engine.scheduler
        sched.focus_quantum, sched.max_wait_rounds = quantum, 10**9
        log = record_admissions(llm)
        arrivals = [[member(0)], [member(0)], [member(1), member(1)]] + [[member(0), member(0)] for _ in range(15)]
        run_online(llm, arrivals, [0, 0, 1, 1] + [0] * 30)
        assert len(log) == 34 and not llm.engine.has_unfinished()
        waited[quantum] = dict(log)[2]
    assert waited[4] <= 4 + 4
    assert waited[10**9] >= 25


def test_static_policy_stops_only_for_a_deep_loss_with_peers_waiting_under_kv_pressure():
    p = StaticPolicy()
    assert p.decide(BatchState(size=100, delta=20, sharing=10)) is STOP
    assert p.decide(BatchState(size=8, delta=20, sharing=10)) is ADD
    assert p.decide(BatchState(size=100, delta=2, sharing=10)) is ADD
    assert p.decide(BatchState(size=100, delta=20, sharing=0)) is ADD
    assert p.decide(BatchState(size=100, delta=20, sharing=10, kv_used=0.2)) is ADD


@pytest.mark.parametrize("cls", [UCBPolicy, QLearningPolicy])
def test_learning_policies_follow_rewards(cls):
    """Start from the safe default, then learn that stopping pays in this state and adding does not."""
    policy = cls(warmup=4)
    state = BatchState(size=100, delta=20, sharing=10)
    calm = BatchState(size=2, delta=1, sharing=0)
    assert policy.decide(state) is STOP and policy.decide(calm) is ADD  # heuristic during warm-up
    for _ in range(300):
        action = policy.decide(calm)
        policy.learn(calm, action, 1.5 if action is STOP else 0.5, calm)
    if isinstance(policy, QLearningPolicy):
        policy.epsilon = 0.0
    assert policy.decide(calm) is STOP


@pytest.mark.parametrize("policy", POLICIES)
def test_a_short_loner_ranked_best_does_not_stop_admission(policy):
    """A prompt under one chunk never misses, so it ranks first; when the oldest waiting request was parked,
    admission stopped there and left the focus group's other members waiting until the batch drained."""
    engine, rng = make_llm(policy=policy).engine, random.Random(0)
    a, b, c = ([rng.randrange(100, 8000) for _ in range(40)] for _ in range(3))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request(a, params)
    engine.step()
    for ids in (c + [1], b + [2], [7, 8, 9], b + [3], c + [4]):
        engine.add_request(ids, params)
    for _ in range(4):
        engine.step()
    assert not engine.scheduler.waiting  # every one fits the pool: all admitted within a few steps
    while engine.has_unfinished():
        engine.step()
