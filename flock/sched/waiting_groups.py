"""Waiting requests grouped by their first chunk: which group is largest, and its oldest member."""

import heapq
from collections import deque


class WaitingGroups:
    """Waiting requests per first-chunk hash: counts, a lazy max-heap over them (every change pushes the
    current value; outdated entries are dropped when they surface) and each group's members in arrival
    order (members that left are dropped when they reach the front). Amortised O(log G) per operation."""

    def __init__(self):
        self.count: dict[int, int] = {}
        self.first_seq: dict[int, int] = {}  # tie-break: the group that appeared first
        self.members: dict[int, deque] = {}
        self.heap: list[tuple[int, int, int]] = []  # (-count, first_seq, group)
        self.seq = 0

    def add(self, group: int, req) -> None:
        if group not in self.count:
            self.count[group], self.first_seq[group], self.members[group] = 0, self.seq, deque()
            self.seq += 1
        self.count[group] += 1
        self.members[group].append(req)
        self._push(group)

    def remove(self, group: int) -> None:
        """One member left the waiting queue."""
        self.count[group] -= 1
        if self.count[group]:
            self._push(group)
        else:
            del self.count[group], self.first_seq[group], self.members[group]

    def oldest_of_largest(self, is_waiting, min_size: int = 2):
        """The oldest waiting member of the largest group, or None when no group has `min_size` members."""
        while self.heap:
            neg, first, group = self.heap[0]
            if self.count.get(group) == -neg and self.first_seq[group] == first:
                break
            heapq.heappop(self.heap)
        else:
            return None
        if -self.heap[0][0] < min_size:
            return None
        queue = self.members[self.heap[0][2]]
        while not is_waiting(queue[0]):
            queue.popleft()
        return queue[0]

    def _push(self, group: int) -> None:
        heapq.heappush(self.heap, (-self.count[group], self.first_seq[group], group))
        if len(self.heap) > 4 * len(self.count) + 64:  # drop outdated entries now and then
            self.heap = [(-c, self.first_seq[g], g) for g, c in self.count.items()]
            heapq.heapify(self.heap)
