"""RadixTree against brute force: longest matched prefix, DFS-weight order, pruning on removal."""

import random

import numpy as np
import pytest

from flock.prefix.radix import RadixTree


def random_seqs(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    groups = [tuple(rng.randrange(3) for _ in range(rng.randrange(12))) for _ in range(4)]
    seqs = []
    for _ in range(n):
        if seqs and rng.random() < 0.2:
            seqs.append(rng.choice(seqs))
        else:
            base = rng.choice(groups)
            seqs.append(base[: rng.randrange(len(base) + 1)] + tuple(rng.randrange(3) for _ in range(rng.randrange(6))))
    return seqs


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_dfs(items: list[tuple[int, object, tuple[int, ...]]], depth: int = 0) -> list:
    """items: (insertion number, key, tokens) below a token-level trie node at `depth`."""
    order = [k for _, k, t in items if len(t) == depth]
    groups: dict[int, list] = {}
    for item in items:
        if len(item[2]) > depth:
            groups.setdefault(item[2][depth], []).append(item)
    for g in sorted(groups.values(), key=lambda g: (-len(g), min(i for i, _, _ in g))):
        order += brute_dfs(g, depth + 1)
    return order


def check_shape(tree: RadixTree) -> None:
    """Counts are subtree key counts, no empty nodes, no key-less single-child chains."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        assert node.count == len(node.keys) + sum(c.count for c in node.children.values())
        if node is not tree.root:
            assert node.count > 0 and len(node.edge) > 0
            assert node.keys or len(node.children) >= 2
        for first, child in node.children.items():
            assert int(child.edge[0]) == first and child.parent is node
        stack.extend(node.children.values())


@pytest.mark.parametrize("seed", range(5))
def test_match_and_dfs_order_vs_brute_force(seed):
    rng = random.Random(seed)
    seqs = random_seqs(rng, 60)
    tree = RadixTree()
    live: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # key -> (insertion number, key, tokens)
    for step in range(300):
        if live and rng.random() < 0.4:
            key = rng.choice(list(live))
            tree.remove(key)
            del live[key]
        else:
            tokens = rng.choice(seqs)
            tree.insert(step, np.asarray(tokens, dtype=np.int64) if step % 2 else list(tokens))
            live[step] = (step, step, tokens)
        check_shape(tree)
        assert len(tree) == len(live)
        query = rng.choice(seqs) + tuple(rng.randrange(3) for _ in range(rng.randrange(3)))
        assert tree.match_prefix(query) == max((lcp(query, t) for _, _, t in live.values()), default=0)
        assert tree.dfs_order() == brute_dfs(list(live.values()))
    for key in list(live):
        tree.remove(key)
    assert len(tree) == 0 and not tree.root.children and tree.root.count == 0
    assert tree.match_prefix([0, 1, 2]) == 0 and tree.dfs_order() == []


def test_ops_count_compared_tokens():
    tree = RadixTree()
    tree.insert("a", list(range(100)))
    before = tree.ops
    assert tree.match_prefix(list(range(50)) + [7] * 10) == 50
    assert tree.ops - before == 1 + 51  # one node visited, 50 matches + the mismatch
    with pytest.raises(ValueError):
        tree.insert("a", [1])
    tree.insert("empty", [])
    assert tree.dfs_order() == ["empty", "a"] and len(tree) == 2
