"""The partitioner (no Ray): whole prefix groups per worker, balanced by computed tokens, split only when
a group alone exceeds a worker's fair share, and then along its sub-groups."""

import numpy as np
import pytest

from flock.distributed.partition import partition
from flock.prefix import build_tree
from bench.harness.workloads import industrial


def computed(prompts, shard) -> int:
    """What an engine with a prefix cache computes for a shard: every trie edge of its prompts once."""
    return build_tree([prompts[i] for i in shard]).edge_tokens


def worker_of(part) -> dict[int, int]:
    return {i: w for w, shard in enumerate(part.shards) for i in shard}


def test_groups_stay_whole_and_loads_are_what_workers_compute():
    prompts = industrial(num_prompts=1200, scale=0.1, seed=1)
    tree = build_tree(prompts)
    for workers in (1, 3, 8):
        part = partition(prompts, workers)
        assert sorted(i for s in part.shards for i in s) == list(range(len(prompts)))
        where = worker_of(part)
        for group in tree.root.children:  # each shared prefix lives on one worker
            members = [i for i in range(len(prompts)) if prompts[i][: group.depth] == prompts[group.rep][: group.depth]]
            assert len({where[i] for i in members}) == 1
        assert part.split_groups == 0 and part.repeated_prefix_tokens == 0
        assert part.computed_tokens == tree.edge_tokens == sum(part.loads)
        assert [computed(prompts, s) for s in part.shards] == part.loads
        assert part.balance <= 1.05


def shared_header(docs: int, questions: int, question_len: int = 5, seed: int = 0) -> list[list[int]]:
    """One group: a 40-token header, then `docs` documents of 60 tokens, each asked `questions` questions."""
    rng = np.random.default_rng(seed)
    header = rng.integers(100, 8000, 40).tolist()
    prompts = []
    for d in range(docs):
        doc = [1000 + d] + rng.integers(100, 8000, 59).tolist()
        prompts += [header + doc + [2000 + q] + rng.integers(100, 8000, question_len - 1).tolist() for q in range(questions)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def test_a_group_above_the_fair_share_is_split_along_its_sub_groups():
    prompts = shared_header(docs=12, questions=4)
    tree = build_tree(prompts)
    part = partition(prompts, 4)
    assert part.split_groups == 1
    where = worker_of(part)
    for d in range(12):  # every document (a sub-group) on one worker
        assert len({where[i] for i, p in enumerate(prompts) if p[40] == 1000 + d}) == 1
    holders = sum(1 for s in part.shards if s)
    assert part.repeated_prefix_tokens == (holders - 1) * 40
    assert part.computed_tokens == tree.edge_tokens + part.repeated_prefix_tokens
    assert [computed(prompts, s) for s in part.shards] == part.loads
    assert part.balance <= 1.1


def test_sub_groups_above_the_fair_share_are_split_one_level_down():
    prompts = shared_header(docs=2, questions=40, question_len=20)  # each document above a quarter of the work
    part = partition(prompts, 4)
    assert part.split_groups == 3  # the header's group and both documents
    assert all(part.shards)
    assert [computed(prompts, s) for s in part.shards] == part.loads
    assert part.computed_tokens == build_tree(prompts).edge_tokens + part.repeated_prefix_tokens
    assert 0 < part.repeated_prefix_tokens <= 3 * (40 + 2 * 60)  # a worker beyond the first: header, both documents
    assert part.balance <= 1.1
    # more workers than work: a prefix above the fair share; still every prompt once, loads as computed
    part = partition(prompts, 64)
    assert sorted(i for s in part.shards for i in s) == list(range(80))
    assert [computed(prompts, s) for s in part.shards] == part.loads


def test_extra_costs_and_initial_loads():
    prompts = [[100 + i, 7, 7, 7] for i in range(8)]  # nothing shared: 8 groups of 4 tokens
    part = partition(prompts, 2, extra=[100, 100, 0, 0, 0, 0, 0, 0])
    assert part.loads == [116, 116] and set(part.shards[0]) ^ set(part.shards[1]) == set(range(8))
    assert worker_of(part)[0] != worker_of(part)[1]
    busy = partition(prompts, 2, loads=[24, 0])
    assert busy.loads == [28, 28] and len(busy.shards[0]) == 1 and busy.computed_tokens == 32


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        partition([[1, 2]], 0)
    with pytest.raises(ValueError, match="initial loads"):
        partition([[1, 2]], 2, loads=[0])
    with pytest.raises(ValueError, match="extra costs"):
        partition([[1, 2]], 2, extra=[1, 2])
    assert partition([], 3).shards == [[], [], []]
