"""SGLang's prefix-aware admission orders, as baselines in the same engine.

- LPM: waiting requests with the longest cached prefix first (FCFS when more than 128 wait, as SGLang does).
  The match runs against the real prefix cache (block-hash lookups), so each decision costs O(W * L / B).
- DFS-weight: a radix tree over the waiting prompts; subtrees holding more requests go first, so requests
  that share a prefix are admitted together. Each decision walks the tree: O(nodes) after O(L) per insert.
"""

import time
from collections.abc import Iterable

from flock.prefix.radix import RadixTree
from flock.request import Request
from flock.sched.fcfs import FCFSScheduler


class LPMScheduler(FCFSScheduler):
    name = "lpm"
    fcfs_above = 128

    def admission_order(self) -> Iterable[Request]:
        if len(self.waiting) > self.fcfs_above:
            return super().admission_order()
        t0 = time.perf_counter()
        matched = []
        for i, req in enumerate(self.waiting):
            cached = self.kv.cached_prefix(req)
            hits = self.kv.prefix_tokens(cached)
            self.match_ops += len(cached) + 1
            matched.append((-hits, i, req))
        matched.sort(key=lambda m: m[:2])
        self.match_seconds += time.perf_counter() - t0
        return [req for _, _, req in matched]


class DFSWeightScheduler(FCFSScheduler):
    name = "dfs-weight"

    def __init__(self, config, kv):
        super().__init__(config, kv)
        self.tree = RadixTree()

    def add(self, req: Request) -> None:
        super().add(req)
        self._timed(self.tree, self.tree.insert, req, req.cache_ids(0, req.num_prompt_tokens))

    def preempt(self, req: Request) -> None:
        super().preempt(req)
        self._timed(self.tree, self.tree.insert, req, req.cache_ids(0, req.num_prompt_tokens))

    def on_admit(self, req: Request) -> None:
        self._timed(self.tree, self.tree.remove, req)

    def abort(self, req: Request) -> None:
        if req in self.waiting:
            self._timed(self.tree, self.tree.remove, req)
        super().abort(req)

    def admission_order(self) -> Iterable[Request]:
        return self._timed(self.tree, self.tree.dfs_order)
