"""FCFS scheduler, driven step by step without a model.

A fake engine advances `num_computed_tokens`, appends a fake token to each request whose context is complete
and finishes it after its `max_tokens` outputs. It also models the physical KV cache: every scheduled token
writes "the prefix it was computed from" into its slot, and every token a request attends to must read back
exactly its own prefix, so a wrong block table, a bad prefix-cache hit or a write into a shared block fails.
"""

import random

import pytest

from flock.config import EngineConfig
from flock.kv.manager import KVCacheManager
from flock.request import Request, RequestStatus
from flock.sampling_params import SamplingParams
from flock.sched import make_scheduler
from flock.sched.fcfs import FCFSScheduler


def make(num_blocks: int, block_size: int = 4, prefix_caching: bool = True, **config) -> FCFSScheduler:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          **config)
    config.validate()
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    sched = make_scheduler("fcfs", config, kv)
    assert isinstance(sched, FCFSScheduler)
    return sched


def make_req(rid: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), arrival=float(rid))


class Sim:
    def __init__(self, sched: FCFSScheduler):
        self.sched = sched
        self.kv = sched.kv
        self.store: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix that produced it
        self.plans = []
        self.admitted: list[Request] = []  # in admission order (readmissions included)
        self.finished: list[Request] = []
        self.steps = 0

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self):
        sched, kv, bs = self.sched, self.kv, self.kv.block_size
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        plan = sched.schedule()
        self.plans.append(plan)
        self.steps += 1
        cfg = sched.config

        # ---- plan-level invariants
        assert plan, f"nothing planned with {len(sched.waiting)} waiting, {len(sched.running)} running"
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert all(n >= 1 for _, n in plan.scheduled)
        assert len(sched.running) <= cfg.max_num_seqs
        scheduled = [r for r, _ in plan.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert [r for r in scheduled] == [r for r in sched.running if r in scheduled]
        for r in plan.preempted:  # victims: the newest running requests, newest first
            assert r.status is RequestStatus.WAITING and kv.block_table(r) == [] and r.num_computed_tokens == 0
            assert r not in scheduled and r not in sched.running
        assert plan.preempted == running_before[::-1][: len(plan.preempted)]
        if plan.preempted:
            assert list(sched.waiting)[: len(plan.preempted)] == plan.preempted[::-1]
            assert all(r not in waiting_before for r in scheduled)  # no admission in a preempting step
        # admission takes the head of the waiting queue, in order
        newly = [r for r in scheduled if r in waiting_before]
        assert newly == waiting_before[: len(newly)]
        self.admitted += newly
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
        for r in sched.waiting:
            assert r.status is RequestStatus.WAITING and kv.block_table(r) == []

        # ---- KV invariants
        for b in range(kv.pool.num_blocks):
            owners = sum(kv.block_table(r).count(b) for r in sched.running)
            assert kv.pool.ref_count[b] == owners
            assert (b in kv.pool.free) == (owners == 0)
        for r, n in plan.scheduled:
            assert len(kv.block_table(r)) == kv.blocks_needed(r.num_computed_tokens + n)
            assert len(set(kv.block_table(r))) == len(kv.block_table(r))
            assert r.num_computed_tokens + n <= r.num_tokens

        # ---- the "forward pass": all writes, then all reads (as each layer does). A request admitted in the
        # same step may hit blocks another one is computing now; two writes to one slot must then agree.
        written = {}
        for r, n in plan.scheduled:
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                slot = (kv.block_table(r)[p // bs], p % bs)
                value = tuple(r.token_ids[: p + 1])
                assert written.setdefault(slot, value) == value, f"{r} and another request write slot {slot}"
                self.store[slot] = value
        new_tokens = dict((id(r), n) for r, n in plan.scheduled)
        for r in sched.running:  # every live request's KV, not only the scheduled ones: nothing was clobbered
            for p in range(r.num_computed_tokens + new_tokens.get(id(r), 0)):
                got = self.store.get((kv.block_table(r)[p // bs], p % bs))
                assert got == tuple(r.token_ids[: p + 1]), f"{r} reads wrong KV at position {p}"

        # ---- postprocess
        for r, n in plan.scheduled:
            complete = r.num_computed_tokens + n == r.num_tokens
            r.num_computed_tokens += n
            if complete:
                r.token_ids.append(10_000 + 100 * r.request_id + r.num_output_tokens)
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(r)
                    self.finished.append(r)
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert self.steps < max_steps, "no progress"

    def assert_no_leak(self) -> None:
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks
        assert all(c == 0 for c in pool.ref_count)
        assert not self.sched.waiting and not self.sched.running


# --------------------------------------------------------------------------- basic policy


def test_single_request_prefill_then_decode():
    sim = Sim(make(num_blocks=8))
    r = make_req(0, list(range(10)), max_tokens=3)
    sim.add(r)
    plan = sim.step()
    assert plan.scheduled == [(r, 10)] and plan.preempted == []
    assert r.num_output_tokens == 1
    for _ in range(2):
        plan = sim.step()
        assert plan.scheduled == [(r, 1)]
    assert r.is_finished and r.num_output_tokens == 3
    assert not sim.sched.has_unfinished()
    sim.assert_no_leak()


def test_token_budget_is_respected_and_long_prompts_are_chunked():
    sim = Sim(make(num_blocks=64, max_num_batched_tokens=8))
    long = make_req(0, list(range(30)), max_tokens=2)
    short = make_req(1, list(range(100, 105)), max_tokens=2)
    sim.add(long, short)
    plan = sim.step()
    assert plan.scheduled == [(long, 8)]  # the budget is spent on the head of the queue
    assert long.num_computed_tokens == 8 and long.num_output_tokens == 0
    plan = sim.step()
    assert plan.scheduled == [(long, 8)]
    plan = sim.step()
    assert plan.scheduled == [(long, 8)]
    plan = sim.step()  # 6 prompt tokens left: the rest of the budget admits the short request
    assert plan.scheduled == [(long, 6), (short, 2)]
    assert long.num_output_tokens == 1 and short.num_output_tokens == 0
    plan = sim.step()
    assert plan.scheduled == [(long, 1), (short, 3)]
    sim.run()
    assert all(p.num_tokens <= 8 for p in sim.plans)
    assert long.output_token_ids and short.num_output_tokens == 2
    sim.assert_no_leak()


def test_max_num_seqs_limits_the_running_set():
    sim = Sim(make(num_blocks=64, max_num_seqs=2))
    reqs = [make_req(i, [i] * 3, max_tokens=2 + i) for i in range(5)]
    sim.add(*reqs)
    plan = sim.step()
    assert [r for r, _ in plan.scheduled] == reqs[:2]
    assert list(sim.sched.waiting) == reqs[2:]
    sim.step()  # reqs[0] finishes here (2 outputs)
    assert reqs[0].is_finished
    plan = sim.step()
    assert [r for r, _ in plan.scheduled] == [reqs[1], reqs[2]]
    sim.run()
    assert max(len(p.scheduled) for p in sim.plans) <= 2
    assert sim.admitted == reqs  # arrival order
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    sim.assert_no_leak()


def test_waiting_head_blocks_later_requests_when_kv_is_short():
    sim = Sim(make(num_blocks=3, block_size=4))
    a = make_req(0, list(range(8)), max_tokens=2)  # 2 blocks, 9 tokens after its first output
    b = make_req(1, list(range(100, 105)), max_tokens=1)  # 5 tokens: 2 blocks
    c = make_req(2, [5], max_tokens=1)  # 1 block: would fit, but must wait behind b
    sim.add(a, b, c)
    plan = sim.step()
    assert [r for r, _ in plan.scheduled] == [a]
    assert list(sim.sched.waiting) == [b, c]
    sim.run()
    assert sim.admitted == [a, b, c]
    sim.assert_no_leak()


# --------------------------------------------------------------------------- preemption


def test_newest_request_is_preempted_and_requeued_at_the_front():
    sim = Sim(make(num_blocks=4, block_size=4, prefix_caching=False))
    reqs = [make_req(i, [10 * i + j for j in range(4)], max_tokens=6) for i in range(3)]
    late = make_req(3, [99], max_tokens=1)
    sim.add(*reqs, late)
    plan = sim.step()  # 3 x 1 block; late gets the 4th
    assert [r for r, _ in plan.scheduled] == reqs + [late]
    assert late.is_finished  # finished after one token: its block is free again
    assert sim.kv.pool.num_free == 1
    plan = sim.step()  # every request now needs a 2nd block; 1 free: r1 evicts r2 (the newest)
    r0, r1, r2 = reqs
    assert plan.preempted == [r2]
    assert [r for r, _ in plan.scheduled] == [r0, r1]
    assert list(sim.sched.waiting) == [r2]
    assert r2.num_preemptions == 1 and r2.num_computed_tokens == 0 and r2.num_output_tokens == 1
    sim.run()
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sum(len(p.preempted) for p in sim.plans) >= 2
    sim.assert_no_leak()


def test_preempted_requests_go_back_in_arrival_order():
    sim = Sim(make(num_blocks=6, block_size=2, prefix_caching=False))
    reqs = [make_req(i, [i, i], max_tokens=8) for i in range(3)]
    sim.add(*reqs)
    for _ in range(50):
        plan = sim.step()
        if len(plan.preempted) >= 2:
            # several victims in one step: the older one ends up first in the queue
            assert list(sim.sched.waiting)[:2] == sorted(plan.preempted, key=lambda r: r.arrival)
        if not sim.sched.has_unfinished():
            break
    sim.run()
    assert any(p.preempted for p in sim.plans)
    assert all(r.num_output_tokens == 8 for r in reqs)
    sim.assert_no_leak()


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sim = Sim(make(num_blocks=3, block_size=2, prefix_caching=False))
    a = make_req(0, [1, 2, 3], max_tokens=3)  # 2 blocks; 4 tokens after step 1 still fit
    b = make_req(1, [4, 5], max_tokens=3)  # 1 block; 3 tokens after step 1 need a 2nd
    sim.add(a, b)
    plan = sim.step()
    assert [r for r, _ in plan.scheduled] == [a, b]
    assert sim.kv.pool.num_free == 0
    plan = sim.step()
    assert plan.preempted == [b]  # b is the newest: it gives up its own blocks; a is untouched
    assert plan.scheduled == [(a, 1)]
    assert list(sim.sched.waiting) == [b] and sim.sched.running == [a]
    assert b.num_preemptions == 1 and b.token_ids == [4, 5, 10_100]
    sim.run()
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    assert b.output_token_ids[0] == 10_100  # its first output survived the preemption
    sim.assert_no_leak()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tiny_pool_everything_completes_without_leaks(prefix_caching):
    sim = Sim(make(num_blocks=6, block_size=4, prefix_caching=prefix_caching, max_num_batched_tokens=10))
    base = list(range(500, 512))
    reqs = [make_req(i, base[: 4 * (i % 3)] + [i] * (1 + i % 4), max_tokens=5 + i % 3) for i in range(8)]
    sim.add(*reqs)
    sim.run()
    assert any(p.preempted for p in sim.plans)
    assert all(r.is_finished and r.num_output_tokens == r.params.max_tokens for r in reqs)
    sim.assert_no_leak()


# --------------------------------------------------------------------------- prefix caching


def test_prefix_hit_skips_the_cached_blocks():
    sim = Sim(make(num_blocks=32, block_size=4))
    prompt = list(range(12)) + [77]
    a = make_req(0, prompt, max_tokens=3)
    sim.add(a)
    sim.step()
    b = make_req(1, prompt, max_tokens=2)
    sim.add(b)
    plan = sim.step()
    assert plan.scheduled == [(a, 1), (b, 1)]  # 12 tokens from the cache, 1 computed
    assert b.num_cached_tokens == 12
    assert sim.kv.block_table(b)[:3] == sim.kv.block_table(a)[:3]
    sim.run()
    sim.assert_no_leak()


def test_same_step_admissions_share_a_prefix():
    sim = Sim(make(num_blocks=32, block_size=4))
    prompt = list(range(16))
    a, b = make_req(0, prompt, max_tokens=2), make_req(1, prompt, max_tokens=2)
    sim.add(a, b)
    plan = sim.step()
    assert plan.scheduled == [(a, 16), (b, 4)]  # the block-aligned prompt leaves its last block to compute
    assert b.num_cached_tokens == 12
    sim.run()
    sim.assert_no_leak()


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_invariant(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    longest = -(-48 // bs)  # blocks of the longest possible request (24 + 8 prompt, 16 output tokens)
    num_blocks = rng.randrange(longest + 1, 2 * longest + 2)  # tight: preemptions happen
    sim = Sim(make(num_blocks=num_blocks, block_size=bs, prefix_caching=bool(seed % 2 == 0),
                   max_num_batched_tokens=rng.choice([3, 8, 17, 64]), max_num_seqs=rng.choice([1, 3, 8])))
    shared = [rng.randrange(50) for _ in range(24)]
    reqs = []
    for i in range(16):
        prompt = shared[: rng.randrange(0, 25)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        reqs.append(make_req(i, prompt, max_tokens=rng.randrange(1, 17)))
    pending = list(reqs)
    while pending or sim.sched.has_unfinished():  # requests arrive over time
        for _ in range(rng.randrange(0, 4)):
            if pending:
                sim.add(pending.pop(0))
        if sim.sched.has_unfinished():
            sim.step()
        assert sim.steps < 5000
    assert all(r.is_finished and r.num_output_tokens == r.params.max_tokens for r in reqs)
    # first admissions happen in arrival order
    firsts = []
    for r in sim.admitted:
        if r not in firsts:
            firsts.append(r)
    assert firsts == reqs
    sim.assert_no_leak()
