"""Feather's batching policies: at an admission point, add the best candidate or stop and let the batch run.

State: batch size, delta (shared-prefix depth in chunks the batch would lose by adding the candidate),
sharing (waiting requests that share the candidate's prefix at the new depth) and the share of the KV pool
in use (a new group's prefix competes for it). Reward: the engine's measured
decode throughput after the decision, divided by its running average (so rewards are near 1 for any model).
Learning policies act like the static heuristic until they have seen `warmup` decisions (the safe default).
"""

import math
import random
from dataclasses import dataclass

ADD, STOP = True, False


@dataclass(frozen=True)
class BatchState:
    size: int
    delta: int
    sharing: int
    kv_used: float = 1.0  # fraction of the KV pool held by running requests

    def context(self) -> tuple[int, int, int, int]:
        """Coarse buckets (powers of two, KV use in quarters), so a table learns from few visits."""
        return (min(self.size.bit_length(), 8), min(self.delta.bit_length(), 7), min(self.sharing.bit_length(), 5),
                min(int(self.kv_used * 4), 3))


class StaticPolicy:
    """Stop only when the batch is already large, the candidate would break a deep shared prefix, the
    candidate has enough waiting peers to form a homogeneous batch of its own later, and the KV pool is
    under pressure (with room to spare, a second group costs compute but takes no memory from the first)."""

    name = "static"

    def __init__(self, min_batch: int = 64, min_delta: int = 8, min_peers: int = 4, min_kv_used: float = 0.5):
        self.min_batch, self.min_delta, self.min_peers, self.min_kv_used = min_batch, min_delta, min_peers, min_kv_used

    def decide(self, s: BatchState) -> bool:
        return not (s.size >= self.min_batch and s.delta >= self.min_delta and s.sharing >= self.min_peers
                    and s.kv_used >= self.min_kv_used)

    def learn(self, s: BatchState, action: bool, reward: float, next_s: BatchState | None) -> None:
        pass


class UCBPolicy(StaticPolicy):
    """Contextual bandit: UCB1 per state bucket over the two actions."""

    name = "ucb"

    def __init__(self, warmup: int = 32, exploration: float = 0.5, seed: int = 0):
        super().__init__()
        self.warmup, self.c = warmup, exploration
        self.count: dict[tuple, list[int]] = {}
        self.total: dict[tuple, list[float]] = {}
        self.seen = 0

    def decide(self, s: BatchState) -> bool:
        if self.seen < self.warmup:
            return super().decide(s)
        n, total = self.count.get(s.context(), [0, 0]), self.total.get(s.context(), [0.0, 0.0])
        for a in (StaticPolicy.decide(self, s), not StaticPolicy.decide(self, s)):
            if n[a] == 0:  # try the safe action first, then the other one once
                return a
        log_n = math.log(n[0] + n[1])
        return max((ADD, STOP), key=lambda a: total[a] / n[a] + self.c * math.sqrt(2 * log_n / n[a]))

    def learn(self, s: BatchState, action: bool, reward: float, next_s: BatchState | None) -> None:
        self.seen += 1
        self.count.setdefault(s.context(), [0, 0])[action] += 1
        self.total.setdefault(s.context(), [0.0, 0.0])[action] += reward


class QLearningPolicy(StaticPolicy):
    """Tabular Q-learning with epsilon-greedy exploration; the static heuristic's action starts with a small
    bonus, so unexplored states act like it."""

    name = "qlearning"

    def __init__(self, warmup: int = 32, alpha: float = 0.2, gamma: float = 0.5, epsilon: float = 0.1,
                 seed: int = 0):
        super().__init__()
        self.warmup, self.alpha, self.gamma, self.epsilon = warmup, alpha, gamma, epsilon
        self.q: dict[tuple, list[float]] = {}
        self.seen = 0
        self.rng = random.Random(seed)

    def _values(self, s: BatchState) -> list[float]:
        if s.context() not in self.q:
            values = [1 / (1 - self.gamma)] * 2  # the value of reward 1 forever
            values[StaticPolicy.decide(self, s)] += 0.01
            self.q[s.context()] = values
        return self.q[s.context()]

    def decide(self, s: BatchState) -> bool:
        if self.seen < self.warmup:
            return super().decide(s)
        if self.rng.random() < self.epsilon / math.sqrt(1 + self.seen / 100):
            return self.rng.random() < 0.5
        q = self._values(s)
        return q[ADD] >= q[STOP]

    def learn(self, s: BatchState, action: bool, reward: float, next_s: BatchState | None) -> None:
        self.seen += 1
        q = self._values(s)
        future = max(self._values(next_s)) if next_s is not None else 1 / (1 - self.gamma)
        q[action] += self.alpha * (reward + self.gamma * future - q[action])


POLICIES = {p.name: p for p in (StaticPolicy, UCBPolicy, QLearningPolicy)}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown feather policy {name!r}; available: {sorted(POLICIES)}")
    return POLICIES[name]()
