"""The prefix planner: tree, BatchLLM's first-level enlargement, groups and saving rates."""

import numpy as np
import pytest

from flock.prefix import build_tree, plan_prefixes
from bench.harness.workloads import industrial, micro_saving_rate, microbench, multilevel, no_sharing

METHODS = ("batchllm", "optimal", "none")


def check_groups(plan, prompts):
    """Every input index in exactly one group; every prompt = prefix + its distinct part; prefixes shared."""
    seen = sorted(i for g in plan.groups for i in g.indices)
    assert seen == list(range(len(prompts)))
    for g in plan.groups:
        assert g.indices == sorted(g.indices) and len(g.distinct_ids) == g.size
        if g.size == 1:
            assert g.prefix_len == 0
        for k, i in enumerate(g.indices):
            assert g.prompt(k) == list(prompts[i])
    assert plan.computed_tokens == sum(g.computed_tokens for g in plan.groups)
    assert plan.logical_tokens == sum(len(p) for p in prompts)


def test_batchllm_reference_example_85_2_percent():
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 8000, 2000).tolist()
    prompts = [prefix + [100 + k] + rng.integers(100, 8000, 199).tolist() for k in range(16)]
    prompts = [prompts[i] for i in rng.permutation(16)]
    for method in METHODS:
        plan = plan_prefixes(prompts, method)
        assert plan.computed_tokens == 2000 + 16 * 200
        assert plan.saving_rate == pytest.approx(1 - (2000 + 16 * 200) / (16 * 2200))
        assert round(plan.saving_rate, 3) == 0.852
        assert plan.saving_rate_bound == plan.saving_rate
        assert plan.num_groups == 1 and plan.groups[0].prefix_len == 2000
        check_groups(plan, prompts)


@pytest.mark.parametrize("p,d,k", [(2000, 200, 16), (2000, 1000, 4), (1000, 1000, 16)])
def test_microbench_shapes_exact(p, d, k):
    prompts = microbench(p, d, k, num_groups=6, scale=0.05, seed=3)
    plan = plan_prefixes(prompts)
    assert plan.num_groups == 6 and plan.sharing_histogram() == {k: 6}
    assert plan.saving_rate == pytest.approx(micro_saving_rate(p, d, k, 0.05))
    assert plan.saving_rate_bound == pytest.approx(plan.saving_rate)
    check_groups(plan, prompts)


def test_design_example_group_of_two_sharing_8_wins():
    # prompts 2..6 (1-based) share 1 token; prompts 4 and 5 share 8 tokens
    prompts = [
        [1, 2, 3, 4],
        [7, 10, 11],
        [7, 20, 21],
        [7, 8, 8, 8, 8, 8, 8, 8, 30, 31],
        [7, 8, 8, 8, 8, 8, 8, 8, 40],
        [7, 50],
    ]
    for method in ("batchllm", "optimal"):
        plan = plan_prefixes(prompts, method)
        check_groups(plan, prompts)
        pair = [g for g in plan.groups if g.indices == [3, 4]]
        assert pair and pair[0].prefix_ids.tolist() == [7, 8, 8, 8, 8, 8, 8, 8]
        rest = [g for g in plan.groups if g.indices == [1, 2, 5]]
        assert rest and rest[0].prefix_ids.tolist() == [7]
        # saving: 8 (the pair sharing 8) + 2 (three sharing 1), not 4 (five sharing 1)
        assert plan.logical_tokens - plan.computed_tokens == 10
    unenlarged = plan_prefixes(prompts, "none")
    assert unenlarged.logical_tokens - unenlarged.computed_tokens == 4


def test_duplicates_prefixes_of_each_other_and_empty_prompts():
    prompts = [[5, 6, 7], [5, 6, 7], [5, 6], [], [5, 6, 7, 8], [], [9], [5, 6, 7]]
    for method in METHODS:
        plan = plan_prefixes(prompts, method)
        check_groups(plan, prompts)
        assert plan.saving_rate_bound >= plan.saving_rate - 1e-12
    plan = plan_prefixes(prompts)
    # all five [5, 6, ...] prompts: one group sharing [5, 6, 7] (4 members) or [5, 6] (5 members)
    assert plan.bound_tokens == 5  # trie: 5, 6, 7, 8 and 9
    assert plan.computed_tokens == plan_prefixes(prompts, "optimal").computed_tokens


def test_empty_batch_and_no_sharing():
    plan = plan_prefixes([])
    assert plan.num_prompts == plan.num_groups == 0 and plan.saving_rate == 0 and plan.saving_rate_bound == 0
    prompts = no_sharing(num_prompts=50, prompt_len=40)
    plan = plan_prefixes(prompts)
    assert plan.num_groups == 50 and plan.saving_rate == 0 and plan.saving_rate_bound == 0
    check_groups(plan, prompts)


def test_numpy_input_and_bad_ids():
    prompts = [np.array(p) for p in microbench(100, 10, 4, num_groups=3, seed=1)]
    plan = plan_prefixes(prompts)
    assert plan.saving_rate == pytest.approx(micro_saving_rate(100, 10, 4))
    with pytest.raises(ValueError):
        plan_prefixes([[1, -2]])
    with pytest.raises(ValueError):
        plan_prefixes([[1]], method="nope")


def test_tree_structure():
    prompts = [[1, 2, 3], [1, 2, 4], [1, 5], [1, 2]]
    tree = build_tree(prompts)
    (a,) = tree.root.children
    assert a.depth == 1 and a.leaves == 4 and tree.label(a).tolist() == [1]
    b = next(c for c in a.children if c.depth == 2)
    assert b.terminals == [3] and len(b.children) == 2 and b.leaves == 3
    assert tree.edge_tokens == 5  # 1, 2, 3, 4, 5


@pytest.mark.parametrize("method", METHODS)
def test_bound_at_least_single_level_and_workloads(method):
    for prompts in (multilevel(scale=0.05, seed=2), industrial(num_prompts=400, scale=0.05, seed=2, header_len=40),
                    industrial(num_prompts=300, scale=0.05, seed=5)):
        plan = plan_prefixes(prompts, method)
        check_groups(plan, prompts)
        assert plan.saving_rate_bound >= plan.saving_rate - 1e-12
        assert 0 <= plan.saving_rate <= 1


def test_multilevel_enlargement_beats_raw_tree():
    prompts = multilevel(scale=0.1)
    raw, alg1, opt = (plan_prefixes(prompts, m) for m in METHODS[::-1])
    assert raw.num_groups == 4 and alg1.num_groups == 32  # documents, not system prompts, become the groups
    assert raw.saving_rate < alg1.saving_rate <= opt.saving_rate <= alg1.saving_rate_bound


def test_summary_helpers():
    plan = plan_prefixes(microbench(40, 10, 4, num_groups=3) + [[7] * 5])
    s = plan.summary()
    assert s["num_prompts"] == 13 and s["num_groups"] == 4 and s["sharing_histogram"] == {"1": 1, "4": 3}
    assert s["prefix_len"]["mean"] == 40 and s["distinct_len"]["count"] == 13
    where = plan.group_of()
    assert all(plan.groups[g].indices[k] == i for i, (g, k) in enumerate(where))
