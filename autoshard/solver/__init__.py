"""Solver: the cost graph, the ILP over sharding strategies and activation memory, baselines."""
from .baselines import BaselineResult, baseline_minimum_budget, data_parallel, megatron, solve_baseline, zero3
from .costgraph import (FOLLOWER_FAMILIES, CGEdge, CGNode, CostGraph, EdgeGroup,
                        StrategyCosts, VariableGroup, block_of)
from .costgraph_build import build_cost_graph
from .ilp import InfeasibleBudgetError, Solution, SolverOptions, minimum_budget, solve

__all__ = [
    "BaselineResult", "CGEdge", "CGNode", "CostGraph", "EdgeGroup", "FOLLOWER_FAMILIES",
    "InfeasibleBudgetError", "Solution", "SolverOptions", "StrategyCosts", "VariableGroup",
    "baseline_minimum_budget", "block_of", "build_cost_graph", "data_parallel", "megatron",
    "minimum_budget", "solve", "solve_baseline", "zero3",
]
