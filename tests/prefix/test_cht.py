"""ChunkedHashTree against brute force over the raw token lists, after every operation of random runs."""

import random

import pytest

from flock.kv.hashing import chained_hashes
from flock.prefix.cht import ChunkedHashTree

BS = 4  # chunk (block) size


def make_prompts(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """Heavy sharing over a 3-token alphabet: group prefixes, identical copies, sub-chunk prompts."""
    groups = [tuple(rng.randrange(3) for _ in range(rng.randrange(0, 5 * BS))) for _ in range(4)]
    prompts = []
    for _ in range(n):
        r = rng.random()
        if r < 0.1:
            prompts.append(tuple(rng.randrange(3) for _ in range(rng.randrange(BS))))  # shorter than a chunk
        elif r < 0.3 and prompts:
            prompts.append(rng.choice(prompts))  # identical prompt
        else:
            base = rng.choice(groups)
            base = base[: rng.randrange(len(base) + 1)] if rng.random() < 0.3 else base
            prompts.append(base + tuple(rng.randrange(3) for _ in range(rng.randrange(3 * BS))))
    return prompts


def prefixes(tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tokens[: (j + 1) * BS] for j in range(len(tokens) // BS)]


def common_chunks(seqs: list[tuple[int, ...]]) -> int:
    if not seqs:
        return 0
    n = min(len(s) // BS for s in seqs)
    j = 0
    while j < n and all(s[: (j + 1) * BS] == seqs[0][: (j + 1) * BS] for s in seqs):
        j += 1
    return j


def check(cht: ChunkedHashTree, waiting: dict, active: dict) -> None:
    """`waiting` maps key -> tokens in insertion order; `active` maps key -> tokens."""
    covered = {p for t in active.values() for p in prefixes(t)}
    misses = {k: sum(p not in covered for p in prefixes(t)) for k, t in waiting.items()}
    assert cht.num_waiting == len(waiting) and cht.num_active == len(active)
    for k, m in misses.items():
        assert k in cht and cht.misses(k) == m
    for k in active:
        assert k not in cht
    assert cht.best() == (min(misses, key=misses.get) if waiting else None)  # min() keeps the first: FIFO
    assert cht.tip() == common_chunks(list(active.values()))
    for k, t in waiting.items():
        for depth in range(len(t) // BS + 2):
            want = 0 if depth == 0 or depth > len(t) // BS else sum(
                1 for o, u in waiting.items() if o != k and len(u) >= depth * BS and u[: depth * BS] == t[: depth * BS])
            assert cht.num_waiting_sharing(k, depth) == want
        others = [u for o, u in [*waiting.items(), *active.items()] if o != k]
        assert cht.shared_depth(k) == max((common_chunks([t, u]) for u in others), default=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_brute_force(seed):
    rng = random.Random(seed)
    prompts = make_prompts(rng, 40)
    cht = ChunkedHashTree()
    waiting: dict[int, tuple[int, ...]] = {}
    active: dict[int, tuple[int, ...]] = {}
    next_key = 0
    for _ in range(250):
        r = rng.random()
        if r < 0.35 or not (waiting or active):
            if rng.random() < 0.1 and next_key:  # re-use a key that has left
                key = rng.randrange(next_key)
                if key in waiting or key in active:
                    with pytest.raises(ValueError):
                        cht.insert(key, [])
                    continue
            else:
                key, next_key = next_key, next_key + 1
            tokens = rng.choice(prompts)
            cht.insert(key, chained_hashes(list(tokens), BS))
            waiting[key] = tokens
        elif r < 0.6 and waiting:
            key = cht.best() if rng.random() < 0.6 else rng.choice(list(waiting))
            cht.add_to_batch(key)
            active[key] = waiting.pop(key)
        elif r < 0.85 and active:
            key = rng.choice(list(active))
            cht.remove_from_batch(key)
            del active[key]
        else:
            key = rng.choice(list(waiting)) if waiting and rng.random() < 0.8 else next_key + 1000
            cht.discard(key)
            waiting.pop(key, None)
        check(cht, waiting, active)
    assert cht.ops > 0


def test_heap_stays_bounded_under_churn():
    cht = ChunkedHashTree()
    shared = chained_hashes(list(range(64)), BS)
    waiting = list(range(50))
    for k in waiting:
        cht.insert(k, shared[: 1 + k % len(shared)])
    for step in range(2000):  # every add/remove flips the coverage of up to 16 chunks for all waiting requests
        best = cht.best()
        assert best == min(waiting, key=cht.misses)
        cht.add_to_batch(best)
        waiting.remove(best)
        cht.remove_from_batch(next(iter(cht._active)))
        cht.insert(1000 + step, shared[: 1 + step % len(shared)])
        waiting.append(1000 + step)
        assert len(cht._heap) <= 2 * cht.num_waiting + 64


def test_errors_and_short_prompts():
    cht = ChunkedHashTree()
    cht.insert("short", [])  # shorter than a chunk: no hashes, never misses
    cht.insert("long", chained_hashes(list(range(12)), BS))
    assert cht.misses("short") == 0 and cht.misses("long") == 3 and cht.best() == "short"
    assert cht.shared_depth("long") == 0 and cht.shared_depth("short") == 0
    with pytest.raises(ValueError):
        cht.insert("long", [])
    cht.add_to_batch("long")
    assert cht.tip() == 3 and cht.shared_depth("short") == 0
    with pytest.raises(KeyError):
        cht.add_to_batch("long")
    with pytest.raises(KeyError):
        cht.remove_from_batch("short")
    cht.discard("long")  # active, not waiting: no-op
    assert cht.num_active == 1
    cht.add_to_batch("short")
    assert cht.tip() == 0
    cht.remove_from_batch("short")
    assert cht.tip() == 3
    cht.remove_from_batch("long")
    assert cht.tip() == 0 and cht.best() is None and cht.num_waiting == cht.num_active == 0


def check_tree(cht: ChunkedHashTree) -> None:
    """Structural invariants of the compressed trie: counts are sums, every non-root node ends a request or
    branches (so unused nodes are gone), runs are consistent with the hashes of the requests through them."""
    waiting = set(cht._seq)
    ends: dict[int, list] = {}
    for key, node in cht._node.items():
        ends.setdefault(id(node), []).append(key)
    nodes = 0

    def walk(node):
        nonlocal nodes
        nodes += 1
        mine = ends.get(id(node), [])
        assert node.nend == len(mine) and node.waiting == {k for k in mine if k in waiting}
        count = sum(k in cht._active for k in mine)
        wait = len(node.waiting)
        for first, child in node.children.items():
            assert child.parent is node and child.depth > node.depth and child.src[node.depth] == first
            assert child.src[: node.depth] == node.src[: node.depth]
            c, w = walk(child)
            count, wait = count + c, wait + w
        assert node.count == count and node.wait == wait
        if node is not cht._root:
            assert node.nend > 0 or len(node.children) >= 2
        return count, wait

    walk(cht._root)
    assert nodes <= 2 * len(cht._node) + 1
    assert cht._root.count == cht.num_active and cht._root.wait == cht.num_waiting


def branching_prompts(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """Prompts that are random paths in a deep, bushy token tree: many branch points per prompt, prompts
    that are prefixes of others, ends mid-run and on run boundaries, partial trailing chunks."""
    prompts = [()]
    for _ in range(n):
        base = rng.choice(prompts)
        cut = rng.randrange(len(base) + 1)
        prompts.append(base[:cut] + tuple(rng.randrange(2) for _ in range(rng.randrange(0, 6 * BS))))
    return prompts[1:]


@pytest.mark.parametrize("seed", range(6))
def test_deep_branching_matches_brute_force_and_tree_invariants(seed):
    rng = random.Random(100 + seed)
    prompts = branching_prompts(rng, 30)
    cht = ChunkedHashTree()
    waiting: dict[int, tuple[int, ...]] = {}
    active: dict[int, tuple[int, ...]] = {}
    for step in range(300):
        r = rng.random()
        if r < 0.4 or not (waiting or active):
            tokens = rng.choice(prompts)
            cht.insert(step, chained_hashes(list(tokens), BS))
            waiting[step] = tokens
        elif r < 0.65 and waiting:
            key = cht.best() if rng.random() < 0.5 else rng.choice(list(waiting))
            cht.add_to_batch(key)
            active[key] = waiting.pop(key)
        elif r < 0.9 and active:
            key = rng.choice(list(active))
            cht.remove_from_batch(key)
            del active[key]
        elif waiting:
            key = rng.choice(list(waiting))
            cht.discard(key)
            del waiting[key]
        check(cht, waiting, active)
        check_tree(cht)
    for key in list(waiting):  # everything leaves: only the root remains
        cht.discard(key)
    for key in list(active):
        cht.remove_from_batch(key)
    check_tree(cht)
    assert not cht._root.children and not cht._node and cht.tip() == 0


def steady_ops(chunks: int, groups: int = 4, waiting: int = 200, batch: int = 8, decisions: int = 100) -> float:
    """Mean ops per decision (best + add_to_batch + insert of an arrival + one finish) on the benchmark's
    shape: group prefixes of 80% of the chunks, distinct tails, a batch from group 0."""
    rng = random.Random(chunks)
    prefixes = [tuple(rng.getrandbits(64) for _ in range(chunks * 4 // 5)) for _ in range(groups)]

    def request(g):
        return prefixes[g] + tuple(rng.getrandbits(64) for _ in range(chunks - len(prefixes[g])))

    cht = ChunkedHashTree()
    for k in range(waiting):
        cht.insert(k, request(rng.randrange(groups)))
    running = []
    for k in range(waiting, waiting + batch):
        cht.insert(k, request(0))
        cht.add_to_batch(k)
        running.append(k)
    ops = cht.ops
    for d in range(decisions):
        key = cht.best()
        cht.add_to_batch(key)
        running.append(key)
        cht.insert(10**6 + d, request(rng.randrange(groups)))
        cht.remove_from_batch(running.pop(0))
    return (cht.ops - ops) / decisions


def test_decision_ops_do_not_scale_with_chunks():
    """The flat version did O(C) dict/set operations per decision; the tree's steady-state decision is
    O(depth in nodes + log C + log W), so 100x the chunks adds only a few binary-search probes."""
    short, long = steady_ops(10), steady_ops(1000)
    assert long < 1.5 * short + 20, (short, long)
    assert long < 100  # vs > 4 * 1000 for a per-chunk pass


def test_put_back_with_its_rank_keeps_the_fifo_place():
    cht = ChunkedHashTree()
    for key in "abc":
        cht.insert(key, chained_hashes([1, 2, 3, 4, ord(key)] * 2, BS))
    rank = cht.rank("a")
    cht.discard("a")
    assert cht.best() == "b"
    cht.insert("a", chained_hashes([1, 2, 3, 4, ord("a")] * 2, BS), rank)
    order = []
    while (key := cht.best()) is not None:
        order.append(key)
        cht.add_to_batch(key)
    assert order == ["a", "b", "c"]
