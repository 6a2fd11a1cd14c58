"""BatchLLM's global prefix planning: first-level enlargement, prefix-sharing groups and saving rates.

Only the first level of the tree is shared by the group scheduler and the prefix-sharing kernel, so the tree
is restructured to maximise first-level reuse, then every root child becomes a group. Two methods:

- ``"batchllm"``: Algorithm 1 of BatchLLM (§3.2), the authors' greedy bottom-up rule;
- ``"optimal"``: an exact tree DP over first-level plans (each group = a set of prompts sharing the prefix at
  one tree node; a prompt joins the deepest opened node above it). It costs O(sum of node depths in nodes),
  small for real batches, and is what tests measure Algorithm 1 against;
- ``"none"``: the root children of the unmodified tree.

Computed tokens of a single-level plan: ``sum over groups (len(prefix) + sum len(distinct))``; the
multi-level bound computes every trie edge once.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flock.prefix.tree import Node, TokenTable, build_tree

__all__ = ["PrefixGroup", "Plan", "plan_prefixes", "enlarge_first_level", "optimal_first_level", "METHODS"]

METHODS = ("batchllm", "optimal", "none")


@dataclass
class PrefixGroup:
    """A prefix-sharing group. `prefix_ids` / `distinct_ids` are numpy views of the batch's token table;
    `indices[k]` is the input index of the prompt `prefix_ids + distinct_ids[k]`. A group of one has an
    empty prefix. A distinct part can be empty (duplicates, or a prompt that ends where the prefix ends)."""

    prefix_ids: np.ndarray
    distinct_ids: list[np.ndarray]
    indices: list[int]

    @property
    def size(self) -> int:
        return len(self.indices)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    @property
    def computed_tokens(self) -> int:
        return self.prefix_len + sum(len(d) for d in self.distinct_ids)

    def prompt(self, k: int) -> list[int]:
        return self.prefix_ids.tolist() + self.distinct_ids[k].tolist()


@dataclass
class Plan:
    groups: list[PrefixGroup]
    num_prompts: int
    logical_tokens: int
    computed_tokens: int  # single-level plan
    bound_tokens: int  # multi-level: every trie edge once
    plan_seconds: float
    method: str = "batchllm"
    num_tree_nodes: int = 0
    timings: dict = field(default_factory=dict)

    @property
    def saving_rate(self) -> float:
        return 1.0 - self.computed_tokens / self.logical_tokens if self.logical_tokens else 0.0

    @property
    def saving_rate_bound(self) -> float:
        return 1.0 - self.bound_tokens / self.logical_tokens if self.logical_tokens else 0.0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def shared_groups(self) -> list[PrefixGroup]:
        return [g for g in self.groups if g.size > 1]

    def group_of(self) -> list[tuple[int, int]]:
        """For each input index: (group number, position in that group)."""
        where = [(-1, -1)] * self.num_prompts
        for gi, g in enumerate(self.groups):
            for k, i in enumerate(g.indices):
                where[i] = (gi, k)
        return where

    def sharing_histogram(self) -> dict[int, int]:
        """Group size (sharing degree) -> number of groups, sorted by size."""
        return dict(sorted(Counter(g.size for g in self.groups).items()))

    def mean_sharing_degree(self) -> float:
        return self.num_prompts / self.num_groups if self.groups else 0.0

    def prefix_stats(self) -> dict:
        """Length stats of the shared prefixes (groups of two or more)."""
        return _stats([g.prefix_len for g in self.groups if g.size > 1])

    def distinct_stats(self) -> dict:
        return _stats([len(d) for g in self.groups for d in g.distinct_ids])

    def summary(self) -> dict:
        """Everything as plain JSON-able values."""
        return {
            "num_prompts": self.num_prompts,
            "num_groups": self.num_groups,
            "num_shared_groups": len(self.shared_groups),
            "prompts_in_shared_groups": sum(g.size for g in self.shared_groups),
            "mean_sharing_degree": self.mean_sharing_degree(),
            "sharing_histogram": {str(k): v for k, v in self.sharing_histogram().items()},
            "prefix_len": self.prefix_stats(),
            "distinct_len": self.distinct_stats(),
            "logical_tokens": self.logical_tokens,
            "computed_tokens": self.computed_tokens,
            "bound_tokens": self.bound_tokens,
            "saving_rate": self.saving_rate,
            "saving_rate_bound": self.saving_rate_bound,
            "method": self.method,
            "num_tree_nodes": self.num_tree_nodes,
            "plan_seconds": self.plan_seconds,
            "timings": self.timings,
        }


def _stats(values: list[int]) -> dict:
    if not values:
        return {"count": 0, "mean": 0.0, "median": 0.0, "min": 0, "max": 0, "total": 0}
    return {"count": len(values), "mean": statistics.fmean(values), "median": float(statistics.median(values)),
            "min": min(values), "max": max(values), "total": sum(values)}


def _postorder(root: Node) -> list[Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    out.reverse()
    return out


def enlarge_first_level(root: Node) -> None:
    """BatchLLM Algorithm 1, in place: bottom-up, for each non-leaf child C of N and each child G of C,
    gain = (leaves(G) - 1) * len(G) - len(C); if gain > 0, G (with C's label prepended) moves up to N.
    A C left with one child and no terminals absorbs it; one left with nothing is dropped."""
    for n in _postorder(root):  # every node after all of its (original) descendants
        for c in list(n.children):
            if not c.children:
                continue
            len_c = c.depth - n.depth
            for g in list(c.children):
                if (g.leaves - 1) * (g.depth - c.depth) - len_c > 0:
                    c.children.remove(g)
                    c.leaves -= g.leaves
                    g.parent = n
                    n.children.append(g)  # label now runs from n.depth: C's tokens are prepended
            if not c.terminals and len(c.children) == 1:  # merge the only child into C
                (only,) = c.children
                c.depth, c.rep, c.children, c.terminals = only.depth, only.rep, only.children, only.terminals
                for gc in c.children:
                    gc.parent = c
            elif not c.terminals and not c.children:
                n.children.remove(c)


def optimal_first_level(root: Node) -> list[tuple[Node, list[int]]]:
    """The exact best first-level plan: a list of (opened node, input indices of its members).

    A plan opens some nodes; each prompt joins the deepest opened node above it (or none). Saving =
    sum over prompts of depth(its node) - sum over opened nodes of depth. f(v, a) is the best saving in v's
    subtree when the deepest opened proper ancestor of v has depth a; a ranges over v's ancestors' depths."""
    order = _postorder(root)
    # candidate ancestor depths per node (root's is {0}); nodes deeper in nodes than ~depth have more
    anc: dict[int, list[int]] = {id(root): [0]}
    for v in reversed(order):  # parents first
        for c in v.children:
            anc[id(c)] = anc[id(v)] + ([v.depth] if v is not root else [])
    best: dict[int, dict[int, tuple[int, bool]]] = {}
    for v in order:
        vid = id(v)
        nterm = len(v.terminals)
        opened_val = None
        if v is not root and v.leaves > 1:
            opened_val = nterm * v.depth - v.depth + sum(best[id(c)][v.depth][0] for c in v.children)
        table = {}
        for a in anc[vid]:
            closed = nterm * a + sum(best[id(c)][a][0] for c in v.children)
            if opened_val is not None and opened_val > closed:
                table[a] = (opened_val, True)
            else:
                table[a] = (closed, False)
        best[vid] = table
    # reconstruct
    groups: list[tuple[Node, list[int]]] = []
    stack = [(root, 0, None)]  # node, a, index of the group its unassigned prompts join
    while stack:
        v, a, gidx = stack.pop()
        val, is_open = best[id(v)][a]
        if is_open:
            groups.append((v, []))
            gidx, a = len(groups) - 1, v.depth
        if gidx is not None:
            groups[gidx][1].extend(v.terminals)
        else:
            groups.extend((None, [i]) for i in v.terminals)
        stack.extend((c, a, gidx) for c in v.children)
    return groups


def _subtree_terminals(node: Node) -> list[int]:
    out, stack = [], [node]
    while stack:
        v = stack.pop()
        out.extend(v.terminals)
        stack.extend(v.children)
    return out


def plan_prefixes(prompts: Sequence[Sequence[int]] | TokenTable, method: str = "batchllm") -> Plan:
    """Plan the prefix-sharing groups of a batch (lists or numpy arrays of token ids)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    t0 = time.perf_counter()
    table = prompts if isinstance(prompts, TokenTable) else TokenTable(prompts)
    t1 = time.perf_counter()
    tree = build_tree(table)
    t2 = time.perf_counter()
    if method == "optimal":
        chosen = optimal_first_level(tree.root)
    else:
        if method == "batchllm":
            enlarge_first_level(tree.root)
        chosen = [(c, _subtree_terminals(c)) for c in tree.root.children]
        chosen += [(None, [i]) for i in tree.root.terminals]
    t3 = time.perf_counter()
    groups = _make_groups(table, chosen)
    t4 = time.perf_counter()
    plan = Plan(
        groups=groups,
        num_prompts=len(table),
        logical_tokens=table.num_tokens,
        computed_tokens=sum(g.computed_tokens for g in groups),
        bound_tokens=tree.edge_tokens,
        plan_seconds=t4 - t0,
        method=method,
        num_tree_nodes=tree.num_nodes,
        timings={"tokens": t1 - t0, "tree": t2 - t1, "first_level": t3 - t2, "groups": t4 - t3},
    )
    return plan


def _make_groups(table: TokenTable, chosen: list[tuple[Node | None, list[int]]]) -> list[PrefixGroup]:
    """Groups in order of their smallest input index; members in input order; groups of one unshared."""
    flat, offs, lens = table.flat, table.offsets.tolist(), table.lengths.tolist()
    empty = flat[:0]
    groups = []
    for node, members in chosen:
        if not members:
            continue
        members = sorted(members)
        if node is None or len(members) == 1:
            for i in members:
                groups.append(PrefixGroup(empty, [flat[offs[i]:offs[i] + lens[i]]], [i]))
            continue
        d = node.depth
        groups.append(PrefixGroup(flat[offs[members[0]]:offs[members[0]] + d],
                            [flat[offs[i] + d:offs[i] + lens[i]] for i in members], members))
    groups.sort(key=lambda g: g.indices[0])
    return groups
