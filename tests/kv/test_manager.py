"""KVCacheManager: block tables over the shared pool, prefix caching, all-or-nothing allocation."""

import pytest

from flock.kv.hashing import chained_hashes
from flock.kv.manager import KVCacheManager
from flock.request import Request
from flock.sampling_params import SamplingParams

BS = 4


def make_req(rid: int, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0.0))


def prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` the way the scheduler does (cached prefix, then the rest in one chunk) and mark it computed."""
    cached = kv.cached_prefix(req)
    n = req.num_tokens - len(cached) * kv.block_size
    assert kv.allocate(req, n, cached)
    req.num_computed_tokens = req.num_tokens
    return cached


def assert_pool_consistent(kv: KVCacheManager, live: list[Request]) -> None:
    pool = kv.pool
    for b in range(pool.num_blocks):
        owners = sum(kv.block_table(r).count(b) for r in live)
        assert pool.ref_count[b] == owners, f"block {b}: ref {pool.ref_count[b]}, held by {owners}"
        assert (b in pool.free) == (owners == 0)
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h


def assert_all_free(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(c == 0 for c in pool.ref_count)


def test_blocks_needed_and_capacity():
    kv = KVCacheManager(10, BS, True)
    assert kv.capacity_tokens == 40
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_gives_enough_blocks_and_grows_one_token_at_a_time():
    kv = KVCacheManager(8, BS, True)
    req = make_req(0, list(range(6)))
    assert kv.cached_prefix(req) == []
    assert kv.allocate(req, 6)
    assert len(kv.block_table(req)) == 2
    assert len(set(kv.block_table(req))) == 2
    req.num_computed_tokens = 6
    for step in range(5):  # decode: 6 -> 11 tokens of KV
        req.token_ids.append(100 + step)
        assert kv.allocate(req, 1)
        req.num_computed_tokens += 1
        assert len(kv.block_table(req)) == kv.blocks_needed(req.num_computed_tokens)
    assert len(kv.block_table(req)) == 3
    assert_pool_consistent(kv, [req])
    kv.free(req)
    assert kv.block_table(req) == []
    assert_all_free(kv)


def test_block_hashes_match_chained_hashes():
    kv = KVCacheManager(8, BS, True)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    req = make_req(0, prompt)
    prefill(kv, req)
    assert req.block_hashes(BS, 3) == chained_hashes(prompt, BS)
    assert kv.num_registered[req] == 3
    # the three full blocks are in the index, the partial fourth is not
    for i in range(3):
        assert kv.pool.lookup(req.block_hashes(BS, 3)[i], tuple(prompt[i * BS : (i + 1) * BS])) == kv.block_table(req)[i]
    assert kv.pool.block_hash[kv.block_table(req)[3]] is None


@pytest.mark.parametrize("extra", [1, 3])
def test_second_request_with_same_prompt_gets_cached_prefix(extra):
    kv = KVCacheManager(16, BS, True)
    prompt = list(range(3 * BS + extra))  # 3 full blocks + a partial one
    a, b = make_req(0, prompt), make_req(1, prompt)
    assert prefill(kv, a) == []
    cached = kv.cached_prefix(b)
    assert cached == kv.block_table(a)[:3]
    free_before = kv.pool.num_free
    assert kv.allocate(b, b.num_tokens - 3 * BS, cached)
    assert b.num_computed_tokens == 0 and kv.prefix_tokens(cached) == 3 * BS  # the scheduler counts them
    assert kv.block_table(b)[:3] == kv.block_table(a)[:3]
    assert kv.block_table(b)[3] != kv.block_table(a)[3]
    assert kv.pool.num_free == free_before - 1  # only the partial block is new
    assert all(kv.pool.ref_count[x] == 2 for x in kv.block_table(a)[:3])
    assert_pool_consistent(kv, [a, b])
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_block_aligned_fully_cached_prompt_still_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BS, True)
    prompt = list(range(3 * BS))  # exactly 3 blocks
    a, b = make_req(0, prompt), make_req(1, prompt)
    prefill(kv, a)
    cached = kv.cached_prefix(b)
    assert len(cached) == 2  # never the whole prompt: the last token must be computed to sample
    assert cached == kv.block_table(a)[:2]
    n = b.num_tokens - len(cached) * BS
    assert n == BS
    assert kv.allocate(b, n, cached)
    assert kv.prefix_tokens(cached) == 2 * BS
    assert len(kv.block_table(b)) == 3 and kv.block_table(b)[2] != kv.block_table(a)[2]
    assert_pool_consistent(kv, [a, b])


def test_single_token_and_sub_block_prompts_are_never_cached():
    kv = KVCacheManager(8, BS, True)
    for prompt in ([7], [1, 2, 3], [1, 2, 3, 4]):
        a, b = make_req(0, prompt), make_req(1, prompt)
        prefill(kv, a)
        assert kv.cached_prefix(b) == []
        kv.free(a)


def test_prefix_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(16, BS, True)
    base = list(range(20))
    a = make_req(0, base)
    prefill(kv, a)
    other = base[:9] + [999] + base[10:]  # differs in block 2
    b = make_req(1, other)
    assert kv.cached_prefix(b) == kv.block_table(a)[:2]
    # same block content, different earlier block: no hit at all
    c = make_req(2, [555] + base[1:])
    assert kv.cached_prefix(c) == []


def test_cached_prefix_survives_free_and_revives_free_blocks():
    kv = KVCacheManager(6, BS, True)
    prompt = list(range(3 * BS + 1))
    a = make_req(0, prompt)
    prefill(kv, a)
    table = list(kv.block_table(a))
    kv.free(a)
    assert_all_free(kv)
    b = make_req(1, prompt)
    cached = kv.cached_prefix(b)
    assert cached == table[:3]
    assert kv.allocate(b, 1, cached)
    assert kv.pool.num_free == 6 - 4
    assert all(x not in kv.pool.free for x in kv.block_table(b))
    assert_pool_consistent(kv, [b])


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, BS, True)
    a = make_req(0, list(range(3 * BS)))
    prefill(kv, a)  # 3 of 4 blocks
    b = make_req(1, list(range(100, 100 + 2 * BS)))
    ref_before, free_before = list(kv.pool.ref_count), list(kv.pool.free)
    assert not kv.allocate(b, 2 * BS)
    assert kv.block_table(b) == [] and b.num_computed_tokens == 0
    assert kv.pool.ref_count == ref_before and list(kv.pool.free) == free_before
    # a running request that cannot grow is left untouched too
    kv2 = KVCacheManager(2, BS, True)
    r = make_req(2, list(range(2 * BS)))
    prefill(kv2, r)
    r.token_ids.append(1)
    table = list(kv2.block_table(r))
    assert not kv2.allocate(r, 1)
    assert kv2.block_table(r) == table and r.num_computed_tokens == 2 * BS
    assert kv2.pool.num_free == 0


def test_allocate_failure_with_a_cached_prefix_changes_nothing():
    """The hit blocks sit in the free queue: reviving them costs free blocks too."""
    kv = KVCacheManager(4, BS, True)
    prompt = list(range(3 * BS + 2))
    a = make_req(0, prompt)
    prefill(kv, a)  # all 4 blocks
    kv.free(a)
    filler = make_req(1, [9] * 2)
    assert kv.allocate(filler, 2)  # takes the head of the LRU: a's tail block (the partial one)
    b = make_req(2, prompt)
    cached = kv.cached_prefix(b)
    assert len(cached) == 3
    free_before, ref_before = list(kv.pool.free), list(kv.pool.ref_count)
    assert kv.pool.num_free == 3
    # 3 revived + 1 new > 3 free
    assert not kv.allocate(b, b.num_tokens - 3 * BS, cached)
    assert kv.block_table(b) == [] and b.num_computed_tokens == 0
    assert list(kv.pool.free) == free_before and kv.pool.ref_count == ref_before
    assert kv.cached_prefix(b) == cached  # nothing was evicted
    kv.free(filler)
    assert kv.allocate(b, b.num_tokens - 3 * BS, cached)
    assert kv.num_blocks(b) == 4
    assert_pool_consistent(kv, [b])


def test_prefix_caching_disabled_caches_nothing():
    kv = KVCacheManager(16, BS, False)
    prompt = list(range(3 * BS + 1))
    a, b = make_req(0, prompt), make_req(1, prompt)
    prefill(kv, a)
    assert kv.pool.cached == {}
    assert kv.cached_prefix(b) == []
    prefill(kv, b)
    assert set(kv.block_table(a)).isdisjoint(kv.block_table(b))
    kv.free(a)
    assert kv.cached_prefix(b) == []
    kv.free(b)
    assert kv.pool.cached == {}
    assert_all_free(kv)


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(8, BS, True)
    a = make_req(0, list(range(3 * BS)))
    prefill(kv, a)
    table = list(kv.block_table(a))
    kv.free(a)
    assert list(kv.pool.free)[-3:] == table[::-1]  # prefix block at the tail: evicted last


def test_many_requests_sharing_prefixes_leak_nothing():
    kv = KVCacheManager(32, BS, True)
    base = list(range(1000, 1000 + 4 * BS))
    reqs = []
    for i, cut in enumerate((0, 3, 4, 8, 11, 16, 16)):
        r = make_req(i, base[:cut] + [i] * (2 + i))
        prefill(kv, r)
        for t in range(3):  # a few decode steps
            r.token_ids.append(t)
            assert kv.allocate(r, 1)
            r.num_computed_tokens += 1
        reqs.append(r)
        assert_pool_consistent(kv, reqs)
    assert kv.block_table(reqs[-1])[:4] == kv.block_table(reqs[-2])[:4]
    for r in reqs[::2] + reqs[1::2]:
        kv.free(r)
        assert kv.block_table(r) == [] and r not in kv.num_registered
    assert_all_free(kv)


def test_prefix_ending_inside_a_block_copies_the_start_of_a_cached_block():
    kv = KVCacheManager(16, BS, True)
    shared = list(range(2 * BS + 3))  # two blocks and 3 tokens into the third
    a, b = make_req(0, shared + [100, 101]), make_req(1, shared + [200, 201, 202])
    prefill(kv, a)
    assert kv.cached_prefix(b).tail_tokens == 0  # a's KV exists only once its step has run
    kv.end_step()
    cached = kv.cached_prefix(b)
    assert cached == kv.block_table(a)[:2]
    assert (cached.tail_block, cached.tail_tokens) == (kv.block_table(a)[2], 3)
    assert kv.prefix_tokens(cached) == 2 * BS + 3
    assert kv.allocate(b, 3, cached)
    assert kv.num_blocks(b) == kv.blocks_needed(2 * BS + 3 + 3)
    assert kv.block_table(b)[2] not in kv.block_table(a)
    assert kv.copies[b] == (kv.block_table(a)[2], kv.block_table(b)[2], 3)
    assert_pool_consistent(kv, [a, b])
    kv.free(b)
    assert b not in kv.copies


def test_a_copied_start_leaves_the_last_token_to_compute():
    kv = KVCacheManager(16, BS, True)
    prompt = list(range(2 * BS + 3))
    a, b = make_req(0, prompt), make_req(1, prompt)
    prefill(kv, a)
    kv.end_step()
    cached = kv.cached_prefix(b)
    assert (len(cached), cached.tail_tokens) == (2, 2)
    assert b.num_tokens - kv.prefix_tokens(cached) == 1


def test_blocks_of_a_request_freed_before_its_step_ran_are_not_copied():
    kv = KVCacheManager(16, BS, True)
    shared = list(range(BS + 2))
    a, b = make_req(0, shared + [7]), make_req(1, shared + [8])
    prefill(kv, a)
    kv.free(a)  # preempted while planning: the step never wrote its blocks
    kv.end_step()
    assert kv.cached_prefix(b).tail_tokens == 0


def test_a_reallocated_block_is_no_longer_copied_from():
    kv = KVCacheManager(4, BS, True)
    shared = list(range(BS + 2))
    a, b = make_req(0, shared + [7]), make_req(1, shared + [8])
    prefill(kv, a)
    kv.end_step()
    kv.free(a)
    assert kv.cached_prefix(b).tail_tokens == 2  # a free block keeps its KV until it is taken
    assert kv.allocate(make_req(2, list(range(50, 50 + 4 * BS))), 4 * BS)
    cached = kv.cached_prefix(b)
    assert (cached, cached.tail_block, cached.tail_tokens) == ([], None, 0)


def test_a_waiting_requests_cached_prefix_outlives_older_free_blocks():
    """Under pressure the pool evicts blocks no waiting request reads before the prefix one is waiting for."""
    kv = KVCacheManager(6, BS, True)
    shared = list(range(2 * BS))
    a, other = make_req(0, shared + [99]), make_req(1, list(range(100, 100 + 2 * BS)) + [98])
    prefill(kv, a)
    prefill(kv, other)
    kv.free(a)  # a's blocks are the least recently used
    kv.free(other)
    waiting = make_req(2, shared + [97])
    kv.keep_for([waiting])
    newcomer = make_req(3, list(range(200, 200 + 3 * BS)))
    prefill(kv, newcomer)  # 3 of the 6 blocks: LRU alone would take a's prefix
    assert len(kv.cached_prefix(waiting)) == 2
    kv.keep_for([])
    assert_pool_consistent(kv, [newcomer])
