"""Solver: the cost graph, the ILP over sharding strategies and activation memory, baselines."""
from .costgraph import (FOLLOWER_FAMILIES, CGEdge, CGNode, CostBreakdown, CostGraph, EdgeGroup,
                        StrategyCosts, VariableGroup, block_of, build_cost_graph)

__all__ = [
    "CGEdge", "CGNode", "CostBreakdown", "CostGraph", "EdgeGroup", "FOLLOWER_FAMILIES",
    "StrategyCosts", "VariableGroup", "block_of", "build_cost_graph",
]
