"""Global prefix planning for large batches (BatchLLM, DESIGN.md §3.1-3.3)."""

from flock.prefix.planner import METHODS, Group, Plan, enlarge_first_level, optimal_first_level, plan_prefixes
from flock.prefix.tree import Node, PrefixTree, TokenTable, build_tree

__all__ = ["METHODS", "Group", "Plan", "Node", "PrefixTree", "TokenTable", "build_tree", "enlarge_first_level",
           "optimal_first_level", "plan_prefixes"]
