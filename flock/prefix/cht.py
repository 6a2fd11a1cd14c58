"""Feather's Chunked Hash Tree: pick the waiting request whose prompt the running batch already covers best.

A request is the chained hashes of its full token chunks (`flock.kv.hashing.chained_hashes`, chunk = KV
block), computed once by the caller. Because the hashes are chained, equal hashes at chunk j mean equal
prompts up to chunk j, so a hash names a whole prefix and the tree needs no token comparisons at all.

The tree is a compressed trie over chunk hashes. A node is a run of chunks shared by exactly the requests
passing through it: it stores `depth` (chunks from the root to its end) and `src`, the hash tuple of a
request through it; its chunks are src[parent.depth:depth] (any request through a node holds that whole
prefix, so any one's tuple will do, and splitting an edge creates a node with the same `src`: O(1), no
copy). Children are keyed by their first hash. A request ends at the node of depth C (its chunk count;
the root for a request shorter than one chunk). Every node but the root has a request ending at it or at
least two children (unused nodes are removed, single-child ones merged into the child), so the tree has
O(W + B) nodes, B the active requests. "Depth in nodes" (D below) is the number of nodes on a request's
path: the number of distinct branch/end points along its prompt, typically a handful and at most C.

Per node: `count` (active requests passing through), `wait` (waiting requests passing through), `nend`
(requests ending here) and the waiting keys ending here. Counts never increase down a path, so a waiting
request's covered chunks (those some active request holds) are the depth of the deepest node on its path
with count > 0, and its misses are C minus that. Only a node whose count goes 0 -> 1 or 1 -> 0 changes
coverage, and then only for the waiting requests in its subtree, which one walk of that subtree updates
(before an add, resp. after a remove, the subtree holds no other active request, so it has O(A) nodes,
A = waiting requests it holds, plus the moving request's path).

The ranking is a lazy min-heap of (misses, insertion seq, key): a decrease pushes a fresh entry, an increase
leaves the old (now too low) entry, which `best` re-pushes with the current value when it surfaces. The tip
(chunks common to every active request) is the depth of the deepest node through which all of them pass
(count == num_active), kept incrementally.

Costs (D = nodes on the request's path, A = waiting requests whose coverage changes, which is 0 unless
the batch enters or leaves a prefix some waiting request holds): insert O(D + log C + log W); add_to_batch
O(D + A log W); remove_from_batch O(D + A) (+ lazy heap fixes in `best`); discard, shared_depth and
num_waiting_sharing O(D); best amortised O(log W); misses, rank, tip O(1). Nothing loops over a request's chunks.

A request shorter than one chunk has no hashes and ends at the root: it never misses (it fits in any
batch) and, once active, pins the tip at 0. Hashes are assumed distinct within a request (a repeat would
need a chain cycle, i.e. a 64-bit collision). `ops` counts elementary operations: node visits,
binary-search probes, dict/set updates, heap pushes and pops.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

__all__ = ["ChunkedHashTree"]


class _Node:
    __slots__ = ("children", "count", "depth", "nend", "parent", "src", "wait", "waiting")

    def __init__(self, src: tuple[int, ...], depth: int, parent: _Node | None):
        self.src = src  # a hash tuple holding this node's prefix; its chunks are src[parent.depth:depth]
        self.depth = depth
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first hash of the child's run -> child
        self.count = 0  # active requests passing through (ending here or below)
        self.wait = 0  # waiting requests passing through
        self.nend = 0  # requests (waiting or active) ending here
        self.waiting: set = set()  # waiting keys ending here


class ChunkedHashTree:
    """Waiting requests ranked by chunks missing from the active batch's working set; FIFO among ties."""

    def __init__(self) -> None:
        self._root = _Node((), 0, None)
        self._node: dict[Hashable, _Node] = {}  # waiting and active keys -> the node they end at
        self._seq: dict[Hashable, int] = {}  # waiting key -> insertion number (FIFO tie-break, heap validity)
        self._misses: dict[Hashable, int] = {}  # waiting key -> chunks not held by any active request
        self._active: set = set()
        self._ref = None  # one active key: the tip node lies on its path
        self._tip = 0
        self._heap: list[tuple[int, int, Hashable]] = []
        self._next_seq = 0
        self.ops = 0

    @property
    def num_waiting(self) -> int:
        return len(self._seq)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def __contains__(self, key) -> bool:
        """Whether `key` is waiting. O(1)."""
        return key in self._seq

    def insert(self, key, hashes: Sequence[int], rank: int | None = None) -> None:
        """Add a waiting request. O(D + log C + log W): one child lookup and one probe per node on its path
        (its last hash against the node's), a binary search on the one run it leaves midway (split in O(1)),
        and a heap push. Its misses come from the walk (deepest node with count > 0). `rank` orders ties
        (default: after every key inserted so far); pass a key's old `rank(key)` to put it back in place."""
        if key in self._node:
            raise ValueError(f"duplicate key {key!r}")
        hashes = tuple(hashes)
        n = len(hashes)
        node = self._root
        node.wait += 1
        d = covered = 0
        ops = 1
        while d < n:
            child = node.children.get(hashes[d])
            ops += 2
            if child is None:  # nothing else continues this way: a new leaf holds the rest
                child = _Node(hashes, n, node)
                node.children[hashes[d]] = child
                child.wait = 1
                node = child
                ops += 1
                break
            e, src = child.depth, child.src
            hi = min(e, n)
            if hashes[hi - 1] == src[hi - 1]:  # common up to hi (chained hashes): no search
                j = hi
            else:  # largest j in (d, hi) with hashes[j-1] == src[j-1]; position d matches (the child's key)
                lo, hi = d + 1, hi - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    ops += 1
                    if hashes[mid - 1] == src[mid - 1]:
                        lo = mid
                    else:
                        hi = mid - 1
                j = lo
            if j < e:  # leave (or end) midway: split the run at j
                top = _Node(src, j, node)
                top.count, top.wait = child.count, child.wait
                top.children[src[j]] = child
                child.parent = top
                node.children[hashes[d]] = top
                child = top
                ops += 3
            child.wait += 1
            if child.count:
                covered = j
            node, d = child, j
        node.nend += 1
        node.waiting.add(key)
        self._node[key] = node
        if rank is None:
            rank, self._next_seq = self._next_seq, self._next_seq + 1
        self._seq[key] = seq = rank
        self._misses[key] = misses = n - covered
        self.ops += ops + 4
        self._push(misses, seq, key)

    def discard(self, key) -> None:
        """Remove a waiting request; no-op if `key` is not waiting. O(D); its heap entries go stale (dropped
        when they surface or at the next compaction)."""
        if key not in self._seq:
            return
        node = self._node.pop(key)
        del self._seq[key], self._misses[key]
        node.waiting.remove(key)
        node.nend -= 1
        up = node
        while up is not None:
            up.wait -= 1
            up = up.parent
            self.ops += 1
        self.ops += 4
        self._prune(node)

    def best(self):
        """The waiting key with the fewest misses, earliest inserted among ties; None if none waits.
        O(log W) plus O(log W) per stale entry met (each stale entry is met once: amortised O(log W))."""
        heap, seq, misses = self._heap, self._seq, self._misses
        while heap:
            m, s, key = heap[0]
            self.ops += 1
            if seq.get(key) != s:  # discarded or admitted since
                heapq.heappop(heap)
            elif m != misses[key]:  # misses went up since (a decrease pushes a fresh entry): re-rank
                heapq.heapreplace(heap, (misses[key], s, key))
            else:
                return key
            self.ops += 1
        return None

    def rank(self, key) -> int:
        """Tie-break order of a waiting request (its insertion number). O(1)."""
        return self._seq[key]

    def misses(self, key) -> int:
        """Current miss count of a waiting request. O(1)."""
        return self._misses[key]

    def add_to_batch(self, key) -> None:
        """Move a waiting request into the active batch. O(D + A log W): one walk up its path (counts, tip),
        then, if some of its nodes become covered, a walk of the subtree under the topmost of them, which
        holds the A waiting requests that gain covered chunks (each gets one fresh heap entry)."""
        if key not in self._seq:
            raise KeyError(f"{key!r} is not waiting")
        node = self._node[key]
        del self._seq[key], self._misses[key]
        node.waiting.remove(key)
        self._active.add(key)
        n = len(self._active)
        root, up, fresh, tip = self._root, node, None, None
        while up is not root:
            up.wait -= 1
            c = up.count = up.count + 1
            if c == 1:
                fresh = up  # topmost newly covered so far
            if tip is None and c == n:
                tip = up.depth
            up = up.parent
            self.ops += 1
        root.wait -= 1
        root.count += 1
        self.ops += 4
        self._tip = tip if tip is not None else 0
        if n == 1:
            self._ref = key
        if fresh is not None and (fresh.children or fresh.waiting):  # else no waiting request below it
            self._recount(fresh, True)

    def remove_from_batch(self, key) -> None:
        """Drop an active request (finished or preempted). O(D + A): one walk up its path, a walk of the
        subtree under the topmost node it alone covered (the A waiting requests there lose covered chunks;
        their heap entries are fixed lazily by `best`), pruning, and the tip from another active request's
        path."""
        if key not in self._active:
            raise KeyError(f"{key!r} is not active")
        self._active.remove(key)
        node = self._node.pop(key)
        node.nend -= 1
        root, up, gone = self._root, node, None
        while up is not root:
            c = up.count = up.count - 1
            if c == 0:
                gone = up  # topmost node no longer covered so far
            up = up.parent
            self.ops += 1
        root.count -= 1
        self.ops += 3
        if gone is not None and (gone.children or gone.waiting):
            self._recount(gone, False)
        self._prune(node)
        n = len(self._active)
        if n == 0:
            self._ref, self._tip = None, 0
            return
        if self._ref == key:  # the tip node lies on every active request's path
            self._ref = next(iter(self._active))
            self.ops += 1
        up = self._node[self._ref]
        while up.count != n:
            up = up.parent
            self.ops += 1
        self._tip = up.depth

    def tip(self) -> int:
        """Leading chunks common to all active requests; 0 for an empty batch. O(1)."""
        return self._tip

    def shared_depth(self, key) -> int:
        """Chunks of waiting request `key`'s prompt that another request, waiting or active, holds too: the
        depth of the deepest node on its path that another request passes through. O(D)."""
        node = self._node[key]
        while node.wait < 2 and node.count == 0 and node is not self._root:
            node = node.parent
            self.ops += 1
        return node.depth

    def num_waiting_sharing(self, key, depth: int) -> int:
        """Waiting requests other than `key` whose first `depth` chunks equal `key`'s; 0 if depth is 0 or
        exceeds key's chunks. `key` may be waiting or active. O(D): the waiting count of the node holding
        key's chunk depth-1 (exactly the requests through it hold that prefix)."""
        node = self._node[key]
        if depth <= 0 or depth > node.depth:
            return 0
        while node.parent.depth >= depth:
            node = node.parent
            self.ops += 1
        self.ops += 1
        return node.wait - (key in self._seq)

    def _recount(self, top: _Node, gained: bool) -> None:
        """Recompute the misses of the waiting requests ending in `top`'s subtree, after `top`'s count went
        0 -> 1 (gained: push their lowered misses) or 1 -> 0 (lost: the heap is fixed lazily by `best`).
        Covered depth is carried down: a node with count > 0 covers through its depth. O(nodes in the
        subtree + A log W)."""
        misses, seq, push = self._misses, self._seq, self._push
        stack = [(top, top.parent.depth)]
        ops = 0
        while stack:
            node, covered = stack.pop()
            ops += 1
            if node.count:
                covered = node.depth
            if node.waiting:
                m = node.depth - covered
                for k in node.waiting:
                    misses[k] = m
                    if gained:
                        push(m, seq[k], k)
                ops += len(node.waiting)
            if node.children:
                stack.extend([(child, covered) for child in node.children.values()])
        self.ops += ops

    def _prune(self, node: _Node) -> None:
        """Remove `node` and its ancestors once nothing ends at or passes below them, or merge a node that
        nothing ends at into its only child (so every non-root node ends a request or branches). O(D)."""
        root = self._root
        while node is not root and node.nend == 0:
            self.ops += 1
            k = len(node.children)
            if k > 1:
                return
            parent = node.parent
            first = node.src[parent.depth]
            if k == 0:
                del parent.children[first]
                node = parent
                continue
            (child,) = node.children.values()  # all that pass through node go on into child: same counts
            child.parent = parent
            parent.children[first] = child
            self.ops += 2
            return

    def _push(self, misses: int, seq: int, key) -> None:
        """Push a heap entry. O(log W); rebuilds the heap in O(W) when stale entries outnumber live ones,
        so the heap stays O(W) and the rebuild is amortised over the pushes that made it grow."""
        heap = self._heap
        heapq.heappush(heap, (misses, seq, key))
        self.ops += 1
        if len(heap) > 2 * len(self._seq) + 64:
            heap[:] = [(m, self._seq[k], k) for k, m in self._misses.items()]
            heapq.heapify(heap)
            self.ops += len(heap)
