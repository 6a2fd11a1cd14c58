"""A token-level compressed radix tree, SGLang style: the structure behind its LPM and DFS-weight policies.

Edges hold token runs (numpy views into the inserted sequences, so splitting an edge copies nothing). Every
lookup walks from the root and compares tokens, which is what SGLang pays per waiting request per scheduling
step; here each edge comparison runs in numpy, so the wall time understates SGLang's per-token Python loop,
while `ops` (tokens compared + nodes visited) counts the same work either way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["RadixTree"]


class _Node:
    __slots__ = ("edge", "children", "keys", "count", "parent")

    def __init__(self, edge: np.ndarray, parent: _Node | None):
        self.edge = edge  # tokens on the edge from the parent
        self.children: dict[int, _Node] = {}  # first edge token -> child
        self.keys: dict[Hashable, int] = {}  # keys ending here -> insertion number
        self.count = 0  # keys in the subtree (ref count)
        self.parent = parent


_EMPTY = np.zeros(0, dtype=np.int64)


def _as_array(tokens: Sequence[int]) -> np.ndarray:
    return tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)


class RadixTree:
    """Keyed token sequences in a compressed radix tree; each node counts the keys below it."""

    def __init__(self) -> None:
        self.root = _Node(_EMPTY, None)
        self._ends: dict[Hashable, _Node] = {}
        self._next_seq = 0
        self.ops = 0

    def __len__(self) -> int:
        return len(self._ends)

    def __contains__(self, key) -> bool:
        return key in self._ends

    def insert(self, key, tokens: Sequence[int]) -> None:
        """Add a keyed sequence, splitting at most one edge. O(L) token comparisons + O(depth) nodes."""
        if key in self._ends:
            raise ValueError(f"duplicate key {key!r}")
        tokens = _as_array(tokens)
        node, i = self.root, 0
        node.count += 1
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            self.ops += 1
            if child is None:
                child = _Node(tokens[i:], node)
                node.children[int(tokens[i])] = child
            else:
                k = self._match(child.edge, tokens[i:])
                if k < len(child.edge):
                    child = self._split(child, k)
            child.count += 1
            node, i = child, i + len(child.edge)
        node.keys[key] = self._next_seq
        self._next_seq += 1
        self._ends[key] = node

    def remove(self, key) -> None:
        """Remove a keyed sequence; prune nodes left with no keys below and re-merge a node left with one
        child and no keys of its own. O(depth) nodes (+ one edge concatenation on a merge)."""
        node = self._ends.pop(key)
        del node.keys[key]
        while node is not None:
            node.count -= 1
            parent = node.parent
            self.ops += 1
            if node.count == 0 and parent is not None:
                del parent.children[int(node.edge[0])]
            elif parent is not None and not node.keys and len(node.children) == 1:
                self._merge(node)
            node = parent

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` present in the tree. O(matched tokens) comparisons."""
        tokens = _as_array(tokens)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            self.ops += 1
            if child is None:
                break
            k = self._match(child.edge, tokens[i:])
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def dfs_order(self) -> list:
        """Keys in SGLang's DFS-weight order: a node's own keys first (insertion order), then its children by
        decreasing weight (keys in the subtree), ties by the earliest inserted key below. The weights are
        recomputed, as SGLang does each step for a changing queue. O(N log B): N nodes, B branching."""
        post, stack = [], [self.root]
        while stack:  # parents before children; reversed, children before parents
            node = stack.pop()
            post.append(node)
            stack.extend(node.children.values())
        self.ops += 2 * len(post)
        rank: dict[int, tuple[int, int]] = {}  # id(node) -> (-keys below, first insertion below)
        for node in reversed(post):
            w, first = len(node.keys), min(node.keys.values(), default=1 << 62)
            for child in node.children.values():
                cw, cf = rank[id(child)]
                w, first = w - cw, min(first, cf)
            rank[id(node)] = (-w, first)
        order, stack = [], [self.root]
        while stack:  # push the best-ranked child last so it is popped first
            node = stack.pop()
            order.extend(node.keys)
            stack.extend(sorted(node.children.values(), key=lambda c: rank[id(c)], reverse=True))
        return order

    def _match(self, edge: np.ndarray, tokens: np.ndarray) -> int:
        """Tokens matched along `edge` (a mismatch counts as a compared token)."""
        n = min(len(edge), len(tokens))
        diff = np.flatnonzero(edge[:n] != tokens[:n])
        k = int(diff[0]) if len(diff) else n
        self.ops += min(k + 1, n)
        return k

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut child's edge after k tokens; the new middle node takes child's place. O(1)."""
        parent = child.parent
        mid = _Node(child.edge[:k], parent)
        mid.count = child.count
        parent.children[int(child.edge[0])] = mid
        child.edge, child.parent = child.edge[k:], mid
        mid.children[int(child.edge[0])] = child
        return mid

    def _merge(self, node: _Node) -> None:
        """Fold a key-less node's only child into it, so edges stay maximal. O(edge length)."""
        (child,) = node.children.values()
        node.edge = np.concatenate([node.edge, child.edge])
        node.children = child.children
        node.keys = child.keys
        for grandchild in node.children.values():
            grandchild.parent = node
        for key in node.keys:
            self._ends[key] = node
