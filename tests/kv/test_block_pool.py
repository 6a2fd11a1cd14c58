"""BlockPool (ref counts, LRU free queue, prefix-cache index) and the chained block hashes."""

import pytest

from flock.kv.block_pool import BlockPool
from flock.kv.hashing import ROOT_HASH, chained_hashes, hash_block


def free_order(pool: BlockPool) -> list[int]:
    """The free queue from head (evicted next) to tail."""
    return list(pool.free)


# --------------------------------------------------------------------------- ref counts


def test_fresh_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_free == 5 and pool.num_used == 0
    assert pool.ref_count == [0] * 5
    assert free_order(pool) == [0, 1, 2, 3, 4]
    assert pool.cached == {}


def test_allocate_takes_blocks_from_the_head_with_one_ref():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert [pool.ref_count[b] for b in blocks] == [1, 1, 1]
    assert pool.num_free == 2 and pool.num_used == 3
    assert free_order(pool) == [3, 4]
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_release_returns_blocks_to_the_tail():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.release(a)
    assert pool.ref_count == [0] * 4
    assert pool.num_free == 4
    assert free_order(pool) == [2, 3, 0, 1]


def test_shared_block_stays_used_until_the_last_ref_goes():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch(b)  # a second request takes the same block
    assert pool.ref_count[b] == 2
    assert pool.num_free == 2
    pool.release([b])
    assert pool.ref_count[b] == 1
    assert b not in pool.free and pool.num_free == 2
    pool.release([b])
    assert pool.ref_count[b] == 0
    assert b in pool.free and pool.num_free == 3


def test_double_release_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError):
        pool.release(blocks)


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.ref_count == [1, 1, 1, 0]
    assert pool.allocate(1) == [3]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


# --------------------------------------------------------------------------- LRU


def test_tail_first_release_evicts_the_prefix_block_last():
    pool = BlockPool(4)
    table = pool.allocate(4)  # one request: blocks 0 (prefix) .. 3 (tail)
    for i, b in enumerate(table):
        pool.register(b, 1000 + i, (i,))
    pool.release(list(reversed(table)))
    assert free_order(pool) == [3, 2, 1, 0]
    # reallocating one block at a time evicts the tail block first, the prefix block last
    evicted = []
    for _ in range(4):
        (b,) = pool.allocate(1)
        evicted.append(b)
        assert pool.lookup(1000 + table.index(b), (table.index(b),)) is None
    assert evicted == [3, 2, 1, 0]


def test_older_frees_are_evicted_before_newer_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.release(b)  # b freed first: least recently used
    pool.release(a)
    assert pool.allocate(2) == b


def test_allocate_evicts_a_cached_free_block_and_drops_its_hash():
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    pool.register(b0, 42, (1, 2))
    pool.release([b0])
    assert pool.lookup(42, (1, 2)) == b0  # still cached while free
    assert pool.cached == {42: b0}
    got = pool.allocate(2)  # needs every block: the cached one is evicted
    assert sorted(got) == [0, 1]
    assert pool.lookup(42, (1, 2)) is None
    assert pool.cached == {}
    assert pool.block_hash[b0] is None and pool.block_tokens[b0] is None


def test_allocate_prefers_uncached_head_order_not_cache_state():
    """With nothing wanted, eviction is plain LRU: the head goes first, cached or not; later cached blocks
    survive."""
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 10 + i, (i,))
    pool.release([blocks[0]])
    pool.release([blocks[1]])
    (got,) = pool.allocate(1)
    assert got == blocks[0]
    assert pool.lookup(10, (0,)) is None
    assert pool.lookup(11, (1,)) == blocks[1]


def cached_pool(n: int) -> tuple[BlockPool, list[int]]:
    """A pool of n blocks, each holding a cached hash 10 + i, all free in order."""
    pool = BlockPool(n)
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.register(b, 10 + i, (i,))
    pool.release(blocks)
    return pool, blocks


def test_allocation_passes_over_blocks_waiting_requests_will_read():
    pool, blocks = cached_pool(4)
    pool.want(lambda: {10: 0, 12: 3})
    assert pool.allocate(2) == [blocks[1], blocks[3]]
    assert pool.lookup(10, (0,)) == blocks[0] and pool.lookup(12, (2,)) == blocks[2]
    assert pool.lookup(11, (1,)) is None and pool.lookup(13, (3,)) is None
    assert free_order(pool) == [blocks[0], blocks[2]]  # kept, still in LRU order


def test_when_only_wanted_blocks_are_free_the_one_read_last_goes_first():
    pool, blocks = cached_pool(3)
    pool.want(lambda: {10: 5, 11: 0, 12: 2})
    assert pool.allocate(2) == [blocks[0], blocks[2]]
    assert pool.lookup(11, (1,)) == blocks[1]


def test_of_blocks_wanted_by_one_request_the_least_recently_freed_go_first():
    """A prefix's blocks are freed tail-first: its leading blocks, which later ones are reached through, go last."""
    pool, blocks = cached_pool(4)
    pool.want(lambda: {10: 1, 11: 1, 12: 1, 13: 0})
    assert pool.allocate(1) == [blocks[0]]
    assert pool.allocate(1) == [blocks[1]]
    pool.release([blocks[1]])  # freed again, no longer cached: taken before any wanted block
    assert pool.allocate(1) == [blocks[1]]
    assert pool.allocate(1) == [blocks[2]]


def test_the_wanted_blocks_are_asked_for_once_and_only_when_a_cached_block_is_at_stake():
    calls = []
    pool = BlockPool(4)
    pool.want(lambda: calls.append(1) or {})
    a = pool.allocate(2)  # empty blocks: nothing cached to lose
    assert calls == []
    pool.register(a[0], 10, (0,))
    pool.release(a)
    pool.allocate(2)
    pool.allocate(2)
    assert calls == [1]
    pool.want(None)
    pool.release([0, 1])
    assert pool.allocate(1) == [0]  # plain LRU again


# --------------------------------------------------------------------------- prefix-cache index


def test_lookup_hits_after_register_and_misses_before():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.lookup(7, (1, 2, 3)) is None
    pool.register(b, 7, (1, 2, 3))
    assert pool.lookup(7, (1, 2, 3)) == b
    assert pool.lookup(8, (1, 2, 3)) is None


def test_collision_guard_same_hash_different_tokens_misses():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.register(b, 99, (1, 2, 3, 4))
    assert pool.lookup(99, (1, 2, 3, 5)) is None
    assert pool.lookup(99, (1, 2, 3)) is None
    assert pool.lookup(99, (1, 2, 3, 4)) == b


def test_first_registration_of_a_hash_wins():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    pool.register(b0, 5, (1,))
    pool.register(b1, 5, (1,))  # a duplicate copy of the same content
    assert pool.cached == {5: b0}
    assert pool.block_hash[b1] is None
    pool.register(b0, 6, (2,))  # a block keeps its first hash
    assert pool.block_hash[b0] == 5 and 6 not in pool.cached


def test_touch_of_a_free_cached_block_removes_it_from_the_free_queue():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.register(b, 1, (0,))
    pool.release([b])
    assert b in pool.free and pool.num_free == 3
    hit = pool.lookup(1, (0,))
    pool.touch(hit)
    assert pool.ref_count[b] == 1
    assert b not in pool.free and pool.num_free == 2
    # it cannot be handed out (and evicted) while referenced
    others = pool.allocate(2)
    assert b not in others
    assert pool.lookup(1, (0,)) == b
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_touch_of_a_used_block_only_adds_a_ref():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch(b)
    assert pool.ref_count[b] == 2 and pool.num_free == 1


def test_reset_cache_forgets_every_hash():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i, (i,))
    pool.release(blocks[:2])
    pool.reset_cache()
    assert pool.cached == {}
    assert pool.block_hash == [None] * 3
    assert all(pool.lookup(100 + i, (i,)) is None for i in range(3))
    assert pool.ref_count == [0, 0, 1]


# --------------------------------------------------------------------------- hashing


def test_hash_block_is_deterministic_and_depends_on_parent_and_tokens():
    assert hash_block(ROOT_HASH, [1, 2, 3]) == hash_block(ROOT_HASH, (1, 2, 3))
    assert hash_block(ROOT_HASH, [1, 2, 3]) != hash_block(1, [1, 2, 3])
    assert hash_block(ROOT_HASH, [1, 2, 3]) != hash_block(ROOT_HASH, [1, 2, 4])
    assert hash_block(ROOT_HASH, [1, 2, 3]) != hash_block(ROOT_HASH, [3, 2, 1])


def test_chained_hashes_only_hash_full_blocks():
    assert chained_hashes([], 4) == []
    assert chained_hashes([1, 2, 3], 4) == []
    assert len(chained_hashes(list(range(4)), 4)) == 1
    assert len(chained_hashes(list(range(11)), 4)) == 2
    assert len(chained_hashes(list(range(12)), 4)) == 3
    # the partial tail does not change the full blocks' hashes
    assert chained_hashes(list(range(12)), 4) == chained_hashes(list(range(12)) + [7, 7], 4)


def test_chained_hashes_chain_through_the_parent():
    tokens = list(range(100, 112))
    hs = chained_hashes(tokens, 4)
    parent = ROOT_HASH
    for i, h in enumerate(hs):
        assert h == hash_block(parent, tokens[4 * i : 4 * i + 4])
        parent = h
    # same block content after a different prefix hashes differently
    other = [0, 0, 0, 0] + tokens[4:]
    assert chained_hashes(other, 4)[1] != hs[1]
    # a custom parent shifts the whole chain
    assert chained_hashes(tokens, 4, parent=123) != hs


def test_chained_hashes_equal_for_equal_prefixes_and_differ_after_the_first_difference():
    a = list(range(20))
    b = list(range(9)) + [999] + list(range(10, 20))  # differs in block 2 (tokens 8..11)
    ha, hb = chained_hashes(a, 4), chained_hashes(b, 4)
    assert len(ha) == len(hb) == 5
    assert ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))


def test_tails_keep_the_newest_donors_per_parent_and_pick_the_longest_match():
    from flock.kv.block_pool import TAILS_PER_PARENT

    pool = BlockPool(TAILS_PER_PARENT + 4)
    for b in range(TAILS_PER_PARENT + 2):
        pool.set_tail(b, 9, (1, 2, b))
    assert len(pool.tails[9]) == TAILS_PER_PARENT
    block, n = pool.best_tail(9, (1, 2, 0))
    assert n == 2 and block in pool.tails[9]  # block 0 was dropped: another shares 2 tokens
    assert pool.best_tail(9, (1, 2, 5)) == (5, 3)
    assert pool.best_tail(9, (3,)) == (None, 0)
    assert pool.best_tail(8, (1, 2, 5)) == (None, 0)
    pool.set_tail(5, 9, (1, 2, 5, 6))  # a block listed again (it grew): one entry, the newest
    assert pool.tails[9][5] == (1, 2, 5, 6) and list(pool.tails[9])[-1] == 5
    pool.reset_cache()
    assert pool.tails == {} and pool.tail_parent == {}
