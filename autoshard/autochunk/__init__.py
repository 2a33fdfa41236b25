"""AutoChunk: lower the activation-memory peak of inference by running peak regions in chunks.

``autochunk(model, example_inputs, max_memory=...)`` captures the model with ``torch.export``
(an aten-level graph with shapes), estimates the activation memory at every node, and at the
peak looks for a *free dimension*: a dim that every op in a range of nodes computes
independently (the query rows of attention scores, the token dim of an MLP, a batch dim). The
range then runs as a Python ``for`` loop over chunks of that dim, so its big intermediates exist
one chunk at a time. This repeats at the next peak until the estimate fits ``max_memory``.
The result is exact: every op in a loop computes each output element from the same inputs.

This module is the entry point (:func:`autochunk`) and states the budget rule; the package's modules
are the steps: :mod:`.flow` and :mod:`.rules` (which dims flow through an op), :mod:`.regions`
(a node range as one loop), :mod:`.memory` (the estimate), :mod:`.search` (which loops),
:mod:`.codegen` and :mod:`.module` (the code and the module that runs it), :mod:`.report` and
:mod:`.measure` (the measured peak, to check the estimate).

Budget rule
    ``max_memory`` (bytes, or a string like ``"64MiB"``) bounds the *estimated activation peak*:
    bytes allocated during the forward above what the caller already holds (parameters,
    buffers and inputs are not counted; the returned outputs are). Each loop gets the largest
    chunk that keeps its own peak within the budget (the fewest iterations). If the budget
    cannot be met, :class:`AutoChunkError` says the lowest peak this planner can reach.

    ``max_memory=None`` means "as low as is cheap": the planner finds the lowest reachable peak
    ``P`` (every loop at chunk length 1) and then uses the budget ``P * (1 + slack)``
    (``slack=0.25`` by default), which lets the loops take chunks many times longer than 1.
    Each loop also keeps at least ``MIN_LOOP_BYTES`` (256 KiB) of work per iteration, so small
    models are not cut into slivers; loops that would then run in one piece are dropped.

Models with no free dimension at their peak: with ``max_memory=None`` (or a budget the model
already meets) the returned module runs the graph without loops and its ``report`` says why
nothing was chunked; with a budget the model exceeds, :class:`AutoChunkError` is raised.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from ..exported import export_program, graph_inputs
from ..units import format_bytes, parse_bytes
from .codegen import generate
from .measure import PeakMemory, measure_peak_memory
from .module import ChunkedModule
from .regions import GraphInfo
from .report import AutoChunkError, ChunkReport, LoopInfo
from .search import MIN_LOOP_BYTES, ChunkPlan, Unreachable, plan_loops, simulate_plan

__all__ = ["AutoChunkError", "ChunkReport", "ChunkedModule", "LoopInfo", "MIN_LOOP_BYTES", "PeakMemory", "autochunk",
           "measure_peak_memory"]


def _budget_error(budget: int, headroom: float, lowest: ChunkPlan) -> AutoChunkError:
    need = int(math.ceil(lowest.peak / (1 - headroom)))
    return AutoChunkError(
        f"cannot bring the estimated activation peak under max_memory={format_bytes(budget)} "
        f"({budget} bytes, {headroom:.0%} kept as headroom): the lowest this planner reaches is "
        f"{format_bytes(lowest.peak)} ({lowest.peak} bytes; {lowest.stop}). Raise max_memory to at "
        f"least {need} bytes, or shrink the inputs.")


def _state_exprs(ep: ExportedProgram) -> tuple[list[fx.Node], dict[fx.Node, str]]:
    """User-input placeholders, and source expressions for parameter/buffer/constant ones."""
    inputs, state = graph_inputs(ep, AutoChunkError, "autochunk",
                                 "autochunk is for inference graphs without state updates (call model.eval() first)")
    where = {InputKind.PARAMETER: "self.model.get_parameter({!r})", InputKind.BUFFER: "self.model.get_buffer({!r})",
             InputKind.CONSTANT_TENSOR: "self.constants[{!r}]"}
    return inputs, {node: where[kind].format(target) for node, kind, target in state}


def _report(info: GraphInfo, plan: ChunkPlan, budget: int | None, lowest: int | None) -> ChunkReport:
    before = simulate_plan(info, []).peak
    after = simulate_plan(info, plan.regions).peak
    loops = [LoopInfo(r.chunked[0].name, r.chunked[-1].name, len(r.dims), r.size, r.chunk, r.iterations,
                      [o.name for o in r.outputs]) for r in plan.regions]
    notes = []
    if not plan.regions:
        notes.append("nothing was chunked: " + (plan.stop or "the model already fits the budget"))
    return ChunkReport(budget, before, after, lowest, loops, notes)


def autochunk(model: nn.Module, example_inputs: tuple, *, max_memory: int | str | None = None,
              example_kwargs: Mapping[str, Any] | None = None, slack: float = 0.25,
              headroom: float = 0.02, window: int = 12, core_aten: bool = False) -> ChunkedModule:
    """Rewrite ``model``'s inference forward so its estimated activation peak fits ``max_memory``.

    Args:
        model: the module (put it in ``eval()`` mode; dropout and batch-norm updates are not chunked).
        example_inputs: positional inputs with the shapes the returned module will be called with.
        max_memory: budget for the estimated activation peak, in bytes or as ``"48MiB"``; None picks
            the lowest peak reachable within ``slack`` (see the module docstring).
        example_kwargs: keyword inputs, if the forward takes any.
        slack: with ``max_memory=None``, how far above the lowest reachable peak the plan may go
            in exchange for longer chunks (0.25 = 25%).
        headroom: fraction of ``max_memory`` kept free for allocations the estimate does not
            model (scalar operands, kernel scratch): the plan targets ``max_memory * (1 - headroom)``.
        window: how many nodes before and after a peak a loop may extend.
        core_aten: plan on the core-ATen decomposition (``addmm``, ``bmm``, ``_softmax``, ...)
            instead of the higher-level export graph (``linear``, ``matmul``, ``softmax``, ...).

    Returns:
        A :class:`ChunkedModule`; its outputs equal ``model``'s, ``.code`` shows the loops and
        ``.report`` the estimated peaks.

    Raises:
        AutoChunkError: the model cannot be captured, or the budget cannot be reached (the
            message gives the lowest reachable peak).
    """
    if model.training:
        raise AutoChunkError("autochunk is for inference: call model.eval() first")
    budget = None if max_memory is None else parse_bytes(max_memory)
    if not 0 <= headroom < 1 or slack < 0:
        raise ValueError(f"need 0 <= headroom < 1 and slack >= 0, got headroom={headroom}, slack={slack}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = dict(example_kwargs or {})
    ep = export_program(model, example_inputs, kwargs, AutoChunkError, no_grad=True, hint=(
        "autochunk needs a model that torch.export.export(model, example_inputs) accepts "
        "(no data-dependent Python control flow)."))
    if core_aten:
        ep = ep.run_decompositions()
    inputs, state = _state_exprs(ep)
    info = GraphInfo(ep.graph)
    target = None if budget is None else int(budget * (1 - headroom))
    try:
        plan, lowest = plan_loops(info, target, slack, window)
    except Unreachable as e:
        assert budget is not None
        raise _budget_error(budget, headroom, e.lowest) from None
    report = _report(info, plan, budget, lowest)
    code, globals_ = generate(info, plan.regions, inputs, state)
    return ChunkedModule(model, ep, code, globals_, report, pytree.tree_leaves((example_inputs, kwargs)))
