"""Whole prefix groups onto workers, balanced by the tokens each worker must compute (no Ray here).

The groups are the subtrees of the batch's prefix tree (`flock.prefix.build_tree`, the first step of the
BatchLLM planner): the root's children, each a set of prompts sharing a prefix and everything below it. A
group costs the tokens an engine with a prefix cache computes for it on its own: every edge of its subtree
once (the multi-level count), plus a per-request `extra` (e.g. max_tokens). Groups go largest first onto the
least loaded worker (LPT), so every shared prefix is computed on one worker only. A group is split only when
it alone costs more than a worker's fair share (total / workers), and then along its sub-groups (its node's
children): they are packed into as few pieces as fit a fair share, each piece computing the group's prefix
again; a sub-group that alone exceeds the fair share is split the same way, one level down. Each worker's
engine then plans its share with BatchLLM's first-level enlargement as usual.

Why subtrees rather than the enlarged first level: enlargement lifts a document's questions above the task
instruction they share, so LPT would scatter one task's documents over every worker and each would compute
the instruction again; a subtree keeps them together as long as it fits a worker.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flock.prefix import Node, PrefixTree, TokenTable, build_tree

__all__ = ["Partition", "partition"]

FILL_ROUNDS = 4


@dataclass
class Piece:
    cost: int
    indices: list[int]


@dataclass
class Partition:
    shards: list[list[int]]  # input indices per worker, sorted
    loads: list[int]  # computed tokens (+ extra) per worker, initial loads included
    computed_tokens: int  # over all workers (+ extra): the tree's edge tokens plus the repeated prefixes
    split_groups: int  # groups (and sub-groups) cut into several pieces
    repeated_prefix_tokens: int  # prefix tokens computed again because their group was split

    @property
    def balance(self) -> float:
        """max / mean load: 1.0 is a perfect balance."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def partition(prompts: Sequence[Sequence[int]] | TokenTable | PrefixTree, num_workers: int,
              extra: Sequence[int] | None = None, loads: Sequence[int] | None = None) -> Partition:
    """Assign prompts (by input index) to `num_workers` workers. `extra[i]` is added to prompt i's cost;
    `loads` is work the workers already have (default none)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if loads is not None and len(loads) != num_workers:
        raise ValueError(f"got {len(loads)} initial loads for {num_workers} workers")
    tree = prompts if isinstance(prompts, PrefixTree) else build_tree(prompts)
    n = len(tree.table)
    extra = np.zeros(n, np.int64) if extra is None else np.asarray(extra, np.int64)
    if len(extra) != n:
        raise ValueError(f"got {len(extra)} extra costs for {n} prompts")
    below = _costs(tree, extra)
    start = [int(x) for x in loads] if loads is not None else [0] * num_workers
    total = below[id(tree.root)]
    fair = (total + sum(start)) / num_workers
    whole = [Piece(int(extra[i]), [i]) for i in tree.root.terminals]  # empty prompts
    cut: list[tuple[list[Node], Piece]] = []
    for c in tree.root.children:
        cost = c.depth + below[id(c)]
        if cost <= fair or c.leaves == 1:
            whole.append(Piece(cost, _members(c)))
        else:
            cut += _cut(c, below, extra, fair)
    target = fair
    for _ in range(FILL_ROUNDS):  # the cut prefixes add work: raise the target until the pieces fit
        fill = _Fill(start, target)
        for path, piece in cut:
            fill.place(path, piece)
        if not fill.overflow:
            break
        target += fill.overflow / num_workers
    shards, final = _lpt(whole, fill.loads, fill.shards)
    split = len({id(n) for path, _ in cut for n in path})
    computed = sum(final) - sum(start)
    return Partition(shards, final, computed, split, computed - total)


def _cut(group: Node, below: dict[int, int], extra: np.ndarray, fair: float) -> list[tuple[list[Node], Piece]]:
    """A group above the fair share as pieces in tree order, each with the path of cut nodes above it (a
    piece's cost leaves the path's tokens out). Sub-groups above the fair share are cut too."""
    out: list[tuple[list[Node], Piece]] = []
    todo: list[tuple[list[Node], Node | Piece]] = [([group], group)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, Piece):
            out.append((path, item))
            continue
        parts: list[tuple[list[Node], Node | Piece]] = [(path, Piece(int(extra[i]), [i])) for i in item.terminals]
        for c in item.children:
            own = c.depth - item.depth + below[id(c)]
            cut = item.depth + own > fair and c.leaves > 1
            parts.append((path + [c], c) if cut else (path, Piece(own, _members(c))))
        todo += reversed(parts)
    return out


class _Fill:
    """Fills workers one after the other up to the fair share with the pieces of cut groups, in tree order,
    so that a worker holds a run of siblings and computes the prefixes above them once; once every worker is
    filled, a piece goes where it adds the least."""

    def __init__(self, loads: list[int], fair: float):
        self.loads, self.fair = list(loads), fair
        self.shards: list[list[int]] = [[] for _ in loads]
        self.opened: list[set[int]] = [set() for _ in loads]  # cut nodes whose prefix the worker computes
        self.order = sorted(range(len(loads)), key=self.loads.__getitem__)
        self.at = 0
        self.overflow = 0  # cost placed after every worker was filled

    def place(self, path: list[Node], piece: Piece) -> None:
        while self.at < len(self.order):
            w = self.order[self.at]
            if self.loads[w] + self._cost(w, path, piece) <= self.fair or not self.shards[w]:
                break
            self.at += 1
        else:
            w = min(range(len(self.loads)), key=lambda w: self.loads[w] + self._cost(w, path, piece))
            self.overflow += self._cost(w, path, piece)
        self.loads[w] += self._cost(w, path, piece)
        self.shards[w] += piece.indices
        self.opened[w].update(id(n) for n in path)

    def _cost(self, w: int, path: list[Node], piece: Piece) -> int:
        have = max((n.depth for n in path if id(n) in self.opened[w]), default=0)
        return piece.cost + path[-1].depth - have


def _costs(tree: PrefixTree, extra: np.ndarray) -> dict[int, int]:
    """id(node) -> tokens computed below the node's end (its subtree's edges) plus its prompts' extra."""
    below: dict[int, int] = {}
    for node in reversed(list(tree.nodes())):  # children before parents
        below[id(node)] = int(extra[node.terminals].sum()) + sum(c.depth - node.depth + below[id(c)]
                                                                for c in node.children)
    return below


def _members(node: Node) -> list[int]:
    out, stack = [], [node]
    while stack:
        v = stack.pop()
        out += v.terminals
        stack += v.children
    return out


def _lpt(pieces: list[Piece], loads: list[int], shards: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Largest piece first onto the least loaded bin (ties: the lowest bin number)."""
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    final = list(loads)
    for p in sorted(pieces, key=lambda p: -p.cost):
        load, b = heapq.heappop(heap)
        shards[b] += p.indices
        final[b] = load + p.cost
        heapq.heappush(heap, (final[b], b))
    return [sorted(s) for s in shards], final
