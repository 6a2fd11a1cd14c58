"""BatchLLM's group scheduler: same tokens as FCFS, every shared token computed once, nothing leaked."""

import random

import pytest

from flock import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def groups_workload(seed: int, groups: int, per_group: int, prefix: int, distinct: int, singles: int = 0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        head = [rng.randrange(100, 8000) for _ in range(prefix)]
        prompts += [head + [rng.randrange(100, 8000) for _ in range(distinct)] for _ in range(per_group)]
    prompts += [[rng.randrange(100, 8000) for _ in range(prefix + distinct)] for _ in range(singles)]
    rng.shuffle(prompts)
    return prompts


def run(prompts, **config):
    llm = LLM("flock/tiny", dtype="float32", block_size=8, **config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_count), "KV blocks leaked"
    assert not llm.engine.has_unfinished()
    return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.fixture(scope="module")
def mixed():
    rng = random.Random(5)
    prompts = groups_workload(1, groups=3, per_group=5, prefix=44, distinct=9, singles=3)
    prompts += [p[: rng.randrange(20, len(p))] + [7, 8] for p in prompts[:4]]  # deeper / partial sharing
    prompts.append(list(prompts[0]))  # a duplicate
    rng.shuffle(prompts)
    return prompts, run(prompts, scheduler="fcfs")[0]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [16, 4096])
def test_same_tokens_as_fcfs_in_input_order(mixed, caching, budget):
    prompts, expected = mixed
    got, _ = run(prompts, scheduler="batchllm", enable_prefix_caching=caching, max_num_batched_tokens=budget)
    assert got == expected


def test_saving_reaches_the_bound_on_the_papers_shape():
    # BatchLLM's 2000/200 sharing-degree-16 shape scaled by 1/10: 1 - (200 + 16 * 20) / (16 * 220) = 85.2%
    prompts = groups_workload(2, groups=1, per_group=16, prefix=200, distinct=20)
    for caching in (True, False):
        _, stats = run(prompts, scheduler="batchllm", enable_prefix_caching=caching)
        assert stats["computed_prefill_tokens"] == 200 + 16 * 20
        assert stats["saving_rate"] == pytest.approx(1 - (200 + 16 * 20) / (16 * 220))
        assert round(stats["saving_rate"], 3) == 0.852


def test_small_kv_budget_never_recomputes_a_prefix():
    prompts = groups_workload(3, groups=4, per_group=6, prefix=64, distinct=8, singles=2)
    bound = 4 * 64 + 4 * 6 * 8 + 2 * 72
    _, roomy = run(prompts, scheduler="batchllm")
    assert roomy["computed_prefill_tokens"] == bound
    llm = LLM("flock/tiny", dtype="float32", block_size=8, scheduler="batchllm", num_kv_blocks=16,
              max_num_batched_tokens=64)
    computed = {}  # prefix tokens computed, per pseudo-request prompt
    sched = llm.engine.scheduler
    schedule = sched.schedule

    def spy():
        plan = schedule()
        for req, n in plan.scheduled:
            if req.prefix_only:
                key = tuple(req.prompt_token_ids)
                computed[key] = computed.get(key, 0) + n
        return plan

    sched.schedule = spy
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tight = llm.stats()
    assert tight["preemptions"] > 0 and tight["peak_kv_blocks"] <= 16
    assert len(computed) == 4 and all(n == 64 for n in computed.values())  # each prefix computed once
    _, fcfs = run(prompts, scheduler="fcfs", num_kv_blocks=16, max_num_batched_tokens=64)
    assert fcfs["computed_prefill_tokens"] > bound  # FCFS's LRU cache loses prefixes under this budget


def test_a_group_larger_than_the_kv_cache_still_runs(mixed):
    prompts = groups_workload(4, groups=1, per_group=12, prefix=40, distinct=24)
    expected, _ = run(prompts, scheduler="fcfs")
    # 14 blocks of 8 tokens: the prefix (5 blocks) plus about two members at a time
    got, stats = run(prompts, scheduler="batchllm", num_kv_blocks=14, max_num_batched_tokens=32)
    assert got == expected
    assert stats["peak_kv_blocks"] <= 14


@pytest.mark.parametrize("budget", [32, 2048])
def test_prompt_logprobs_members_are_not_crowded_out_by_a_pinned_prefix(budget):
    """A request with prompt logprobs computes its whole prompt; in a group its pinned prefix left it no room
    in a small KV cache (the scheduler gave the prefix up and pinned it again forever). It runs on its own."""
    prompt = [random.Random(0).randrange(100, 8000) for _ in range(71)]
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=7, ignore_eos=True, prompt_logprobs=1)
    outs = {}
    for scheduler in ("fcfs", "batchllm"):
        engine = LLM("flock/tiny", dtype="float32", scheduler=scheduler, block_size=2, num_kv_blocks=51,
                     max_num_batched_tokens=budget).engine
        requests = [engine.add_request(prompt, sample) for sample in params.samples()]
        for _ in range(200):  # a few dozen steps; a livelock never ends
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished() and engine.kv.pool.num_free == 51, scheduler
        outs[scheduler] = [r.output_token_ids for r in requests], [t.logprob for t in requests[0].prompt_logprobs[1:]]
    assert outs["batchllm"][0] == outs["fcfs"][0]
    assert outs["batchllm"][1] == pytest.approx(outs["fcfs"][1], abs=1e-5)  # float32, other chunks


@pytest.mark.parametrize("caching", [True, False])
def test_a_member_that_cannot_grow_beside_its_pinned_prefix_unpins_it(caching):
    """Two prompts sharing 99 tokens in 8 blocks of 16: the pinned prefix holds 7 (its last one partly), so a
    member of 128 tokens never fits beside it (the scheduler gave the prefix up and pinned it again forever).
    The group runs on without it, and the tokens are FCFS's."""
    rng = random.Random(0)
    shared = [rng.randrange(10, 8000) for _ in range(99)]
    prompts = [shared + [rng.randrange(10, 8000)], shared + [11]]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    outs = {}
    for scheduler in ("fcfs", "batchllm"):
        engine = LLM("flock/tiny", dtype="float32", scheduler=scheduler, block_size=16, num_kv_blocks=8,
                     max_model_len=128, enable_prefix_caching=caching).engine
        requests = [engine.add_request(p, params) for p in prompts]
        for _ in range(300):  # about a hundred steps; a livelock never ends
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished() and engine.kv.pool.num_free == 8, scheduler
        outs[scheduler] = [r.output_token_ids for r in requests]
    assert outs["batchllm"] == outs["fcfs"]


def test_pinned_prefix_is_released_when_the_group_finishes():
    prompts = groups_workload(6, groups=2, per_group=3, prefix=32, distinct=4)
    llm = LLM("flock/tiny", dtype="float32", block_size=8, scheduler="batchllm", enable_prefix_caching=False)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    sched = engine.scheduler
    seen_pinned = False
    while engine.has_unfinished():
        engine.step()
        for g in sched.active:
            if g.prefix is not None and engine.kv.block_table(g.prefix):
                seen_pinned = True
                assert all(engine.kv.pool.ref_count[b] >= 1 for b in engine.kv.block_table(g.prefix))
        held = sum(len(engine.kv.block_table(r)) for r in reqs if not r.is_finished)
        pinned = sum(len(engine.kv.block_table(g.prefix)) for g in sched.active if g.prefix is not None)
        assert engine.kv.pool.num_used == held + pinned - sum(  # shared blocks are counted once
            len(engine.kv.block_table(g.prefix)[: g.prefix_len // 8]) * len([m for m in g.admitted if engine.kv.block_table(m)])
            for g in sched.active if g.prefix is not None)
    assert seen_pinned
    assert engine.kv.pool.num_used == 0 and not sched.active


def test_sharing_below_the_first_level_reaches_the_multi_level_bound():
    # system prompt (16) -> 2 documents (32 each) -> 3 questions each (8): every trie edge computed once
    rng = random.Random(9)
    tokens = lambda n: [rng.randrange(100, 8000) for _ in range(n)]  # noqa: E731
    system = tokens(16)
    prompts = [system + doc + tokens(8) for doc in (tokens(32), tokens(32)) for _ in range(3)]
    rng.shuffle(prompts)
    _, stats = run(prompts, scheduler="batchllm")
    assert stats["computed_prefill_tokens"] == 16 + 2 * 32 + 6 * 8
    assert stats["saving_rate"] == pytest.approx(1 - 128 / 336)


def test_max_num_seqs_caps_the_running_members(mixed):
    """As every scheduler (and vLLM's): at most max_num_seqs members run at once, so a big job's answers come as
    they finish rather than all in its last steps; the tokens are FCFS's."""
    prompts, expected = mixed
    llm = LLM("flock/tiny", dtype="float32", block_size=8, scheduler="batchllm", max_num_seqs=3)
    scheduler, running = llm.engine.scheduler, []
    planned = scheduler._schedule

    def counted():
        plan = planned()
        running.append(sum(len(g.admitted) for g in scheduler.active))
        return plan

    scheduler._schedule = counted
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(running) == 3 and len(running) > len(prompts) // 3 * GREEDY.max_tokens


@pytest.mark.parametrize("shared", [False, True])
def test_a_long_prefill_under_way_is_not_starved_by_arrivals(shared):
    """A steady stream of small requests (one a step) beside a long prompt (or two members of a long shared prefix)
    whose next chunk does not fit under the KV bound: admissions wait for it, as vLLM runs its running requests
    first (it stalled half computed until the stream ended, holding half the pool)."""
    llm = LLM("flock/tiny", dtype="float32", block_size=8, scheduler="batchllm", max_num_seqs=8,
              max_num_batched_tokens=256, num_kv_blocks=60, max_model_len=-1)
    engine, rng = llm.engine, random.Random(0)
    small = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long_ones = []
    for step in range(200):
        engine.add_request([rng.randrange(100, 8000) for _ in range(30)], small)
        if step == 3:
            prefix = [rng.randrange(100, 8000) for _ in range(392 if shared else 400)]
            tails = [[rng.randrange(100, 8000) for _ in range(8)] for _ in range(2)] if shared else [[]]
            long_ones = [engine.add_request(prefix + t, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
                         for t in tails]
        engine.step()
        if long_ones and all(r.is_finished for r in long_ones):
            break
    assert step < 60, f"the long prompt finished only at step {step}"
