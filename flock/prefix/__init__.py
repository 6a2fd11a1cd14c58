"""Global prefix planning for large batches (BatchLLM §3.1-3.3; docs/scheduling.md)."""

from flock.prefix.planner import METHODS, PrefixGroup, Plan, enlarge_first_level, optimal_first_level, plan_prefixes
from flock.prefix.tree import Node, PrefixTree, TokenTable, build_tree

__all__ = ["METHODS", "PrefixGroup", "Plan", "Node", "PrefixTree", "TokenTable", "build_tree", "enlarge_first_level",
           "optimal_first_level", "plan_prefixes"]
