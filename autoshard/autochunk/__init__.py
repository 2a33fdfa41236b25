"""AutoChunk: lower the activation-memory peak of inference by running peak regions in chunks.

``autochunk(model, example_inputs, max_memory=...)`` captures the model with ``torch.export``
(an aten-level graph with shapes), estimates the activation memory at every node, and at the
peak looks for a *free dimension*: a dim that every op in a range of nodes computes
independently (the query rows of attention scores, the token dim of an MLP, a batch dim). The
range then runs as a Python ``for`` loop over chunks of that dim, so its big intermediates exist
one chunk at a time. This repeats at the next peak until the estimate fits ``max_memory``.
The result is exact: every op in a loop computes each output element from the same inputs.

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
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..units import format_bytes, parse_bytes
from .codegen import compile_source, generate
from .flow import describe_op
from .memory import PeakMemory, measure_peak_memory
from .regions import Candidate, GraphInfo, Region, candidates, pick, simulate_plan

__all__ = ["AutoChunkError", "ChunkReport", "ChunkedModule", "PeakMemory", "autochunk",
           "measure_peak_memory"]

MAX_REGIONS = 32
#: With ``max_memory=None``, the smallest working set (bytes) a loop iteration may have.
MIN_LOOP_BYTES = 256 * 1024


class AutoChunkError(RuntimeError):
    """The model cannot be captured or run in chunks within the requested memory."""


@dataclass
class LoopInfo:
    """One chunk loop of the plan, for reports."""

    first: str
    last: str
    nodes: int
    dim_size: int
    chunk: int
    iterations: int
    outputs: list[str]


@dataclass
class ChunkReport:
    """What autochunk decided, with estimated activation peaks in bytes."""

    budget: int | None
    estimated_peak_before: int
    estimated_peak_after: int
    lowest_peak: int | None
    loops: list[LoopInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"autochunk: estimated activation peak {format_bytes(self.estimated_peak_before)} -> "
                 f"{format_bytes(self.estimated_peak_after)}"
                 + (f" (budget {format_bytes(self.budget)})" if self.budget is not None else "")]
        for i, lp in enumerate(self.loops):
            lines.append(f"  loop {i}: {lp.nodes} nodes {lp.first}..{lp.last}, dim {lp.dim_size} "
                         f"in chunks of {lp.chunk} ({lp.iterations} iterations)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class _Plan:
    regions: list[Region]
    peak: int
    peak_label: str
    stop: str | None


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _greedy(info: GraphInfo, target: int | None, window: int) -> _Plan:
    """Chunk peak after peak. ``target=None``: every loop at chunk 1, until no loop lowers the
    peak (gives the lowest reachable peak). Otherwise: stop as soon as the peak fits."""
    regions: list[Region] = []
    for _ in range(MAX_REGIONS):
        sim = simulate_plan(info, regions)
        at = sim.argmax
        unit = sim.units[at]
        if target is not None and sim.peak <= target:
            return _Plan(regions, sim.peak, unit.label, None)
        if unit.region is not None:
            r = regions[unit.region]
            if target is not None and _shrink(r, sim.during[at] - unit.transient, target):
                continue
            return _Plan(regions, sim.peak, unit.label,
                         f"the peak is inside chunk loop {unit.region} ({r.describe()}), which "
                         f"cannot be made smaller")
        found, reasons = candidates(info, regions, sim, at, window)
        best = pick(found, target)
        node = unit.node
        where = f"node {node.name} ({describe_op(node)})" if node is not None else unit.label
        if best is None:
            why = "; ".join(reasons[:3]) or "no chunk loop keeps its peak within the budget"
            if not found:
                why = f"no free dim around it ({why})"
            return _Plan(regions, sim.peak, unit.label, f"peak at {where}: {why}")
        if target is None and best.peak_at(1) >= sim.peak:
            return _Plan(regions, sim.peak, unit.label, f"peak at {where}: no chunk loop lowers it")
        best.region.chunk = 1 if target is None else best.largest_chunk(target)
        regions.append(best.region)
    sim = simulate_plan(info, regions)
    return _Plan(regions, sim.peak, sim.units[sim.argmax].label, f"stopped after {MAX_REGIONS} loops")


def _shrink(r: Region, base: int, target: int) -> bool:
    """Lower a loop's chunk so that ``base + chunk * row_bytes <= target``; False if impossible."""
    c = Candidate(r, base).largest_chunk(target)
    if 1 <= c < r.chunk:
        r.chunk = c
        return True
    return False


def _relax(info: GraphInfo, regions: list[Region], target: int) -> int:
    """Give every loop the largest chunk that keeps the whole plan within ``target``."""
    for r in regions:
        lo, hi = r.chunk, r.size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            r.chunk = mid
            if simulate_plan(info, regions).peak <= target:
                lo = mid
            else:
                hi = mid - 1
        r.chunk = lo
    return simulate_plan(info, regions).peak


def _drop_tiny_loops(regions: list[Region]) -> list[Region]:
    """Without a budget, give each loop at least ``MIN_LOOP_BYTES`` of work per iteration and
    drop loops that would then run in one piece (tiny models are left alone)."""
    kept = []
    for r in regions:
        if r.row_bytes > 0:
            r.chunk = max(r.chunk, math.ceil(MIN_LOOP_BYTES / r.row_bytes))
        if r.chunk < r.size:
            kept.append(r)
    return kept


def _plan(info: GraphInfo, budget: int | None, slack: float, window: int) -> tuple[_Plan, int | None]:
    """The plan for ``budget`` (None: cheap minimum) and the lowest reachable peak if computed."""
    before = simulate_plan(info, []).peak
    if budget is not None and before <= budget:
        return _Plan([], before, "", None), None
    if budget is not None:
        plan = _greedy(info, budget, window)
        if plan.stop is None:
            return plan, None
    lowest = _greedy(info, None, window)
    if budget is None:
        if not lowest.regions:
            return lowest, lowest.peak
        target = int(math.ceil(lowest.peak * (1 + slack)))
        _relax(info, lowest.regions, max(target, lowest.peak))
        regions = _drop_tiny_loops(lowest.regions)
        peak = simulate_plan(info, regions).peak
        stop = None if regions else f"every chunk loop would work on less than {format_bytes(MIN_LOOP_BYTES)}"
        return _Plan(regions, peak, lowest.peak_label, stop), lowest.peak
    if lowest.peak <= budget:
        peak = _relax(info, lowest.regions, budget)
        return _Plan(lowest.regions, peak, lowest.peak_label, None), lowest.peak
    raise _Unreachable(lowest)


class _Unreachable(Exception):
    def __init__(self, lowest: _Plan) -> None:
        super().__init__(lowest.stop)
        self.lowest = lowest


def _budget_error(budget: int, headroom: float, lowest: _Plan) -> AutoChunkError:
    need = int(math.ceil(lowest.peak / (1 - headroom)))
    return AutoChunkError(
        f"cannot bring the estimated activation peak under max_memory={format_bytes(budget)} "
        f"({budget} bytes, {headroom:.0%} kept as headroom): the lowest this planner reaches is "
        f"{format_bytes(lowest.peak)} ({lowest.peak} bytes; {lowest.stop}). Raise max_memory to at "
        f"least {need} bytes, or shrink the inputs.")


# ---------------------------------------------------------------------------------------------
# Capture and the runnable module
# ---------------------------------------------------------------------------------------------


def _export(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> ExportedProgram:
    try:
        with torch.no_grad():
            return torch.export.export(model, args, dict(kwargs))
    except Exception as e:  # torch.export raises many types
        raise AutoChunkError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {e}. "
            "autochunk needs a model that torch.export.export(model, example_inputs) accepts "
            "(no data-dependent Python control flow).") from e


def _state_exprs(ep: ExportedProgram) -> tuple[list[fx.Node], dict[fx.Node, str]]:
    """User-input placeholders, and source expressions for parameter/buffer/constant ones."""
    ph = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs: list[fx.Node] = []
    state: dict[fx.Node, str] = {}
    for spec in ep.graph_signature.input_specs:
        node = ph[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(node)
        elif spec.kind == InputKind.PARAMETER:
            state[node] = f"self.model.get_parameter({spec.target!r})"
        elif spec.kind == InputKind.BUFFER:
            state[node] = f"self.model.get_buffer({spec.target!r})"
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            state[node] = f"self.constants[{spec.target!r}]"
        else:
            raise AutoChunkError(f"input {spec.arg.name} of kind {spec.kind.name} is not supported; "
                                 "autochunk handles parameters, buffers, tensor constants and user inputs")
    for node in ep.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise AutoChunkError(f"graph node {node.name} is a {node.op} ({node.target}); autochunk handles "
                                 "flat aten graphs (no control-flow or other higher-order ops)")
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise AutoChunkError(
                f"the captured graph writes {spec.kind.name} {spec.target!r}; autochunk is for "
                "inference graphs without state updates (call model.eval() first)")
    return inputs, state


class ChunkedModule(nn.Module):
    """The model's forward as generated Python code with chunk loops (inference only).

    ``code`` holds the source; ``report`` the plan. Parameters and buffers are read from the
    original ``model`` on every call, so they stay shared with it. The code is specialised to the
    shapes of the example inputs; calling with other shapes raises :class:`AutoChunkError`.
    """

    def __init__(self, model: nn.Module, ep: ExportedProgram, code: str, globals_: dict[str, Any],
                 report: ChunkReport, input_shapes: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.constants = dict(ep.constants)
        self.code = code
        self.report = report
        self._in_spec = ep.call_spec.in_spec
        self._out_spec = ep.call_spec.out_spec
        self._input_shapes = input_shapes
        self._fn = compile_source(code, globals_, f"<autochunk:{type(model).__name__}:{id(self)}>")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise AutoChunkError(f"inputs do not have the structure of the example inputs ({self._in_spec})")
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
        if shapes != self._input_shapes:
            raise AutoChunkError(f"input shapes {shapes} differ from the example inputs' {self._input_shapes}; "
                                 "the chunk loops are planned for fixed shapes: call autochunk again")
        with torch.no_grad():
            out = self._fn(self, *flat)
        return pytree.tree_unflatten(list(out), self._out_spec)


def _report(info: GraphInfo, plan: _Plan, budget: int | None, lowest: int | None) -> ChunkReport:
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
    ep = _export(model, example_inputs, kwargs)
    if core_aten:
        ep = ep.run_decompositions()
    inputs, state = _state_exprs(ep)
    info = GraphInfo(ep.graph)
    target = None if budget is None else int(budget * (1 - headroom))
    try:
        plan, lowest = _plan(info, target, slack, window)
    except _Unreachable as e:
        assert budget is not None
        raise _budget_error(budget, headroom, e.lowest) from None
    report = _report(info, plan, budget, lowest)
    code, globals_ = generate(info, plan.regions, inputs, state)
    flat = pytree.tree_leaves((example_inputs, kwargs))
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]
    return ChunkedModule(model, ep, code, globals_, report, shapes)
