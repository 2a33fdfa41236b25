"""Train and eval modes: the plan of the graph a model has in its other mode.

``torch.export`` records the mode a model is in: in training, BatchNorm normalises with batch
statistics and updates its running statistics and dropout draws masks; in eval, BatchNorm reads
the running statistics and dropout passes its input through. The two graphs have the same nodes
(names included; eval lacks the running-statistics counter update), with different arguments.

:func:`plan_other_mode` plans the other mode's graph with every node that both graphs have in the
layout the main plan gives it (parameters and buffers above all: the runtime holds one copy of
each, in one layout), and nodes only the other graph has replicated. Nothing is solved: the choice
is fixed by the main plan, priced like a solved one, with every activation kept. The result is a
:class:`~autoshard.plans.Plan` of its own (``training`` says its mode), stored in the main plan's
``other_mode`` by :func:`autoshard.plan` and derived again by :func:`autoshard.parallelize` for plans
that lack it (older files, plans made from a captured graph). Capturing in a mode is
:func:`autoshard.capture.capture_in_mode`; the check that two plans lay parameters out alike,
:func:`autoshard.plans.validation.check_layouts_agree` (both re-exported here).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .capture import capture_in_mode
from .plans.errors import ModeError
from .plans.validation import check_layouts_agree

if TYPE_CHECKING:
    from .capture import CapturedGraph
    from .plans import Plan

__all__ = ["ModeError", "capture_in_mode", "check_layouts_agree", "plan_other_mode"]


def plan_other_mode(plan: "Plan", graph: "CapturedGraph") -> "Plan":
    """The plan of ``graph`` (the model captured in mode ``not plan.training``) with every node the
    main plan has in the main plan's layout; :class:`ModeError` when a parameter, buffer or input
    cannot take that layout there."""
    from .enumerate import enumerate_strategies
    from .plans.build import plan_from_solution
    from .solver.costgraph_build import build_cost_graph
    from .solver.fixed import fixed_solution
    from .solver.ilp import SolverOptions

    mode = "eval" if plan.training else "training"
    table = enumerate_strategies(graph, mesh_shape=tuple(plan.mesh_shape), hardware=plan.hardware_profile(),
                                 fallback="replicate" if plan.fallbacks else "error", outputs=plan.outputs,
                                 batch_norm=plan.batch_norm, loss=plan.loss)
    strategy_of: dict[str, int] = {}
    for ns in table:
        main = plan.nodes.get(ns.node)
        pinned = main is not None and main.kind == "placeholder"
        index = None if main is None else _matching(ns, main.inputs, main.outputs)
        if index is not None:
            strategy_of[ns.node] = index
        elif pinned and graph.node(ns.node).users:
            raise ModeError(f"the {mode}-mode graph of '{plan.model_name}' cannot hold '{main.fqn or ns.node}' "
                            f"as the training plan does ({main.outputs[0]}); the runtime keeps one layout per "
                            f"parameter, so {mode} mode cannot run with this plan. Re-plan with the model in "
                            f"{mode} mode (model.{'eval' if plan.training else 'train'}()) for {mode} use")
    cg = build_cost_graph(table, merge_followers=False, alias_blocks=False, precision=plan.mixed_precision)
    options = SolverOptions(memory_budget=plan.memory_budget,
                            optimizer_bytes_per_param=float(plan.solver_options.get("optimizer_bytes_per_param", 8.0)))
    solution = fixed_solution(cg, strategy_of, options)
    other = plan_from_solution(cg, solution, model_name=plan.model_name, options=options, budget=plan.memory_budget)
    other.training = not plan.training
    check_layouts_agree(plan, other)
    return other


def _matching(ns: Any, inputs: list[str], outputs: list[str | None]) -> int | None:
    """Index of the strategy of ``ns`` with these output specs and (where it fixes them) input specs."""
    for i, s in enumerate(ns.strategies):
        outs = [None if x is None else str(x) for x in s.output_specs]
        ins = [None if x is None else str(x) for x in s.input_specs]
        if outs == list(outputs) and len(ins) == len(inputs) and all(a is None or a == b for a, b in zip(ins, inputs)):
            return i
    return None
