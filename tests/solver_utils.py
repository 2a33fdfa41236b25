"""Test helpers for the solver's predictions."""
from autoshard.solver.evaluate import _gather_seconds, gradient_sync, param_gathers


def runtime_change(cg, choice) -> float:
    """What the runtime changes in the collectives the strategies and edges price, so what
    ``predict`` adds to the reference sum besides the scheduled gradient sync: its gradient
    reduction (see evaluate.gradient_sync: + the parameter-gradient all-reduces that run inline,
    - the activation-gradient all-reduces left to the buckets or shared with another consumer of
    their value) and its per-block parameter gathers
    (+ one all-gather and reduce-scatter per group, - the per-edge reshardings they replace)."""
    sync = gradient_sync(cg, choice)
    per_edge, grouped = _gather_seconds(cg, choice, param_gathers(cg, choice))
    return sync.inline - sync.deferred - sync.shared + grouped - per_edge
