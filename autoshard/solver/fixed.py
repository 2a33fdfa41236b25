"""A solution fixed by hand: the plan of an explicit strategy choice, priced like a solved one.

Used to force strategies (tests run every strategy of every node on real ranks this way) and to
turn a hand-written assignment into a :class:`~autoshard.plans.Plan`.
"""
from __future__ import annotations

from typing import Mapping

from .costgraph import CostGraph
from .evaluate import predict
from .results import Solution, SolverOptions


def fixed_solution(cg: CostGraph, strategy_of: Mapping[str, int], options: SolverOptions = SolverOptions(),
                   decisions: Mapping[str, str] | None = None) -> Solution:
    """The solution that runs every graph node with the table strategy ``strategy_of[node]``.

    ``strategy_of`` maps graph node names to indices into the strategy table; nodes left out run
    their all-replicated strategy. Raises ValueError when a merged node cannot take the requested
    combination (build the cost graph with ``merge_followers=False`` to force any combination).
    """
    choice: dict[str, int] = {}
    for node in cg.nodes.values():
        want = {m: strategy_of.get(m, _replicated_index(node.member_strategies[m])) for m in node.members}
        options_ok = [c for c in range(len(node)) if all(int(node.member_index[m][c]) == want[m] for m in node.members)]
        if not options_ok:
            raise ValueError(f"cost-graph node '{node.name}' has no strategy with members at {want}; build the cost "
                             f"graph with merge_followers=False to force it")
        choice[node.name] = options_ok[0]
    decided = dict(decisions or {})
    time, memory = predict(cg, choice, decided, options)
    return Solution(choice=choice, decisions=decided, time=time, memory=memory, status="fixed",
                    objective=time.total, build_seconds=0.0, solve_seconds=0.0, n_variables=0, n_constraints=0,
                    solver="fixed")


def _replicated_index(strategies) -> int:
    for i, s in enumerate(strategies):
        specs = [x for x in (*s.input_specs, *s.output_specs) if x is not None]   # None: taken as produced
        if all(x.is_replicated() for x in specs):
            return i
    raise ValueError(f"no all-replicated strategy among {[s.name for s in strategies]}")
