"""A compact prefix (radix) tree over the token ids of a whole batch, built from sorted prompts.

The prompts are flattened into one numpy array, sorted lexicographically (as big-endian byte strings, so the
sort runs in C with `memcmp`), and the longest common prefix (LCP) of each pair of neighbours in sorted order
is computed with numpy. The sorted order plus the LCP array *is* the compact tree: a single stack pass over
the prompts (O(number of prompts) Python steps, no per-token Python work) creates its nodes.

A node stores only the depth (in tokens) where its edge label ends; the label is
`tokens(rep)[parent.depth:depth]` for any prompt `rep` below it. That keeps relabelling cheap: moving a
node up the tree (BatchLLM's enlargement) prepends the skipped labels automatically.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

__all__ = ["Node", "TokenTable", "PrefixTree", "build_tree"]


class Node:
    """A compact-tree node: its edge label ends at token `depth`; `terminals` are the prompts ending here."""

    __slots__ = ("depth", "rep", "children", "terminals", "leaves", "parent")

    def __init__(self, depth: int, rep: int):
        self.depth = depth  # tokens from the root to the end of this node's label
        self.rep = rep  # a prompt in this subtree (reads the label's tokens)
        self.children: list[Node] = []
        self.terminals: list[int] = []  # input indices of prompts that end exactly here (duplicates allowed)
        self.leaves = 0  # prompts in the subtree, terminals included
        self.parent: Node | None = None

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, leaves={self.leaves}, children={len(self.children)}, terminals={self.terminals})"


class TokenTable:
    """All prompts of a batch in one flat int64 array; `ids(i)` is a zero-copy view of prompt i."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        n = len(prompts)
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=n)
        total = int(lengths.sum())
        if n and all(isinstance(p, np.ndarray) for p in prompts):
            flat = np.concatenate([np.asarray(p).ravel() for p in prompts]).astype(np.int64, copy=False) if total else np.zeros(0, np.int64)
        else:
            flat = np.fromiter(chain.from_iterable(prompts), dtype=np.int64, count=total)
        if total and (flat.min() < 0 or flat.max() >= 2**32):
            raise ValueError("token ids must lie in [0, 2**32)")
        self.flat = flat
        self.lengths = lengths
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        self.num_tokens = total

    def __len__(self) -> int:
        return len(self.lengths)

    def ids(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        o = int(self.offsets[i])
        end = o + int(self.lengths[i]) if stop is None else o + stop
        return self.flat[o + start:end]

    def sort_order(self) -> np.ndarray:
        """Input indices in lexicographic token order (a prompt sorts before its extensions)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        buf = self.flat.astype(">u4").tobytes()  # big-endian: byte order == token order
        offs = (self.offsets * 4).tolist()
        keys = [buf[offs[i]:offs[i + 1]] for i in range(len(self))]
        return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)

    def adjacent_lcp(self, order: np.ndarray) -> np.ndarray:
        """lcp[k] = longest common prefix of prompts order[k-1] and order[k] (lcp[0] = 0)."""
        n = len(order)
        lcp = np.zeros(n, dtype=np.int64)
        flat, offs, lens = self.flat, self.offsets.tolist(), self.lengths.tolist()
        o = order.tolist()
        for k in range(1, n):
            a, b = o[k - 1], o[k]
            m = min(lens[a], lens[b])
            if m == 0:
                continue
            neq = flat[offs[a]:offs[a] + m] != flat[offs[b]:offs[b] + m]
            j = int(neq.argmax())
            lcp[k] = j if neq[j] else m
        return lcp


class PrefixTree:
    """The compact tree of a batch: `root` (depth 0), the token table, and the trie's edge-token count."""

    def __init__(self, table: TokenTable, root: Node, order: np.ndarray, lcp: np.ndarray, num_nodes: int):
        self.table = table
        self.root = root
        self.order = order
        self.lcp = lcp
        self.num_nodes = num_nodes
        # every distinct non-empty prefix once: sum over sorted prompts of (length - lcp with the previous one)
        self.edge_tokens = int((table.lengths[order] - lcp).sum()) if len(order) else 0

    def label(self, node: Node) -> np.ndarray:
        start = node.parent.depth if node.parent is not None else 0
        return self.table.ids(node.rep, start, node.depth)

    def nodes(self):
        """All nodes, parents before children (iterative; the tree can be deep)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)


def build_tree(prompts: Sequence[Sequence[int]] | TokenTable) -> PrefixTree:
    """Build the compact prefix tree of `prompts` (lists or numpy arrays of token ids)."""
    table = prompts if isinstance(prompts, TokenTable) else TokenTable(prompts)
    order = table.sort_order()
    lcp = table.adjacent_lcp(order)
    lengths = table.lengths.tolist()
    root = Node(0, -1)
    stack = [root]
    count = 1

    def attach(child: Node, parent: Node) -> None:
        child.parent = parent
        parent.children.append(child)
        parent.leaves += child.leaves

    for i, l in zip(order.tolist(), lcp.tolist()):
        while stack[-1].depth > l:
            node = stack.pop()
            if stack[-1].depth < l:  # the branching point is inside the popped node's edge: split it
                split = Node(l, node.rep)
                stack.append(split)
                count += 1
            attach(node, stack[-1])
        top = stack[-1]
        if lengths[i] == top.depth:  # the prompt ends here: a duplicate (or the empty prompt at the root)
            top.terminals.append(i)
            top.leaves += 1
            if top.rep < 0:
                top.rep = i
        else:
            node = Node(lengths[i], i)
            node.terminals.append(i)
            node.leaves = 1
            stack.append(node)
            count += 1
    while len(stack) > 1:
        node = stack.pop()
        attach(node, stack[-1])
    return PrefixTree(table, root, order, lcp, count)
