"""A plan in words: the summary (model, mesh, memory, step time, communication, decisions, solver)
and the per-node table, as plain text or rich tables (:meth:`~autoshard.plans.Plan.explain`).
Repeated blocks with identical decisions are collapsed into one row unless ``full``."""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

from ..specs import ShardSpec
from ..units import format_bytes

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .schema import NodePlan, Plan

__all__ = ["plain_text", "renderable", "summary_lines"]

_SUMMARY_RESHARDS = 10

_TIME_PARTS = ("compute", "comm", "reshard", "grad_sync", "sync_wait", "optimizer", "recompute", "offload")


def _fmt_time(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if abs(seconds) < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _peak_formula(mem: dict[str, float], mp: Any = None) -> str:
    """``params + grads + optimizer [+ gathered parameters] + max(activations, worst rebuild)``, as
    the peak is modeled (gathered parameters: copies read larger than stored, held to backward):
    the activations held at the end of forward, or, if higher, those live when the worst segment
    is rebuilt in backward (only the segments before it still hold theirs); plus the ILP's
    position-free bound when a segment is rebuilt (see :class:`~autoshard.solver.results.MemoryPrediction`)."""
    if mp is None:
        static = " + ".join(f"{k} {format_bytes(mem.get(k, 0.0))}" for k in ("params", "grads", "optimizer"))
        if mem.get("param_copies"):
            static += f" + gathered parameters {format_bytes(mem['param_copies'])}"
        if mem.get("grad_buckets"):
            static += f" + gradient buckets {format_bytes(mem['grad_buckets'])}"
    else:      # mixed precision: name each part with its dtype
        static = (f"{mp.master_dtype} master params {format_bytes(mem.get('params', 0.0))} + "
                  f"{mp.master_dtype} grads {format_bytes(mem.get('grads', 0.0))} + "
                  f"optimizer {format_bytes(mem.get('optimizer', 0.0))} + "
                  f"{mp.param_dtype} working copies {format_bytes(mem.get('param_copies', 0.0))}")
        if mem.get("grad_buckets"):
            static += f" + {mp.reduce_dtype} gradient buckets {format_bytes(mem['grad_buckets'])}"
    held = f"{static} + activations {format_bytes(mem.get('activations', 0.0))}"
    if not mem.get("working_set"):
        return held
    text = (f"{static} + max(activations {format_bytes(mem.get('activations', 0.0))}, at the worst rebuild in "
            f"backward {format_bytes(mem.get('backward_peak', 0.0))})")
    return text + f"; the budget bounds {format_bytes(mem.get('bound', 0.0))} (every segment held while the " \
        f"largest working set, {format_bytes(mem['working_set'])}, is rebuilt)"


_OUTPUTS_TEXT = {"global": "global", "local": "local (tensors of rank >= 1 as each rank's shard)"}


def summary_lines(plan: Plan) -> list[str]:
    budget = "unconstrained" if plan.memory_budget is None else f"{format_bytes(plan.memory_budget)} per device"
    devices = math.prod(plan.mesh_shape)
    mem, t, s = plan.memory, plan.time, plan.solver
    lines = [
        f"autoshard plan for {plan.model_name} (graph fingerprint {plan.fingerprint[:16]}, "
        f"{len(plan.nodes)} nodes)",
        f"mesh {plan.mesh} ({devices} devices), hardware {plan.hardware.get('name', '?')}, "
        f"memory budget {budget}, outputs returned {_OUTPUTS_TEXT[plan.outputs]}"
        + (", batch norm per rank (each device's share of the batch)" if plan.batch_norm == "per_rank" else "")
        + (", mean loss per rank (the mean of each device's share's mean)" if plan.loss == "per_rank" else ""),
        "predicted peak memory per device: " + format_bytes(mem.get("peak", 0.0)) + " = "
        + _peak_formula(mem, plan.mixed_precision),
        "modeled step time: " + _fmt_time(t.get("total", 0.0)) + " = " + " + ".join(
            f"{k} {_fmt_time(t.get(k, 0.0))}" for k in _TIME_PARTS),
        _comm_line(plan),
        _sharding_line(plan),
        _decision_line(plan),
        f"solver: {s.solver} {s.status}"
        + (f" (within {100 * s.gap:.2f}% of the proven bound)" if s.status != "optimal" and s.gap is not None else "")
        + f", objective {_fmt_time(s.objective)}, build {s.build_seconds:.2f} s + "
        f"solve {s.solve_seconds:.2f} s, {s.n_variables} variables, {s.n_constraints} constraints",
    ]
    if s.note:
        lines.append(f"plan picked: {s.note}")
    if plan.mixed_precision is not None:
        lines.append(f"mixed precision: {plan.mixed_precision} (working copies: parameters cast to "
                     f"{plan.mixed_precision.param_dtype} and held by their consumers until backward, gathered "
                     f"ones whole)")
    mode, other = ("training", "eval") if plan.training else ("eval", "training")
    lines.append(f"modes: planned in {mode} mode; " + (
        f"{other} mode planned too ({len(plan.other_mode.nodes)} nodes, parameters laid out alike)"
        if plan.other_mode is not None else f"{other} mode derived when the model is switched (same graph, or "
        f"planned from a captured graph)"))
    if plan.timings:
        lines.append("planning time: " + ", ".join(
            f"{k.removesuffix('_s')} {v:.2f} s" for k, v in plan.timings.items()))
    if plan.fallbacks:
        lines.append(f"replicated without a handler (fallback): {'; '.join(plan.fallbacks)}")
    return lines


def _comm_line(plan: Plan) -> str:
    by_phase: Counter[str] = Counter()
    for c in plan.comm:
        by_phase[c.phase] += c.nbytes
    parts = ", ".join(f"{phase} {format_bytes(n)}" for phase, n in sorted(by_phase.items()))
    total = sum(by_phase.values())
    return (f"communication per step and device: {format_bytes(total)}" + (f" ({parts})" if parts else "")
            + f"; {len(plan.reshards)} reshardings")


class ShardingCounts(NamedTuple):
    """Compute ops with a sharded (or partial) operand or output, of all compute ops; parameters
    stored sharded, of all parameters."""

    split_ops: int
    ops: int
    sharded_params: int
    params: int


def sharding_counts(plan: Plan) -> ShardingCounts:
    """How much of the step ``plan`` runs on shards."""
    def sharded(specs: Iterable[str | None]) -> bool:
        return any(spec is not None and ShardSpec.parse(spec).used_axes() for spec in specs)

    ops = [n for n in plan.nodes.values() if n.kind == "call_function" and n.compute_fwd + n.compute_bwd > 0]
    params = [n for n in plan.nodes.values() if n.kind == "placeholder" and n.memory.get("params", 0)]
    return ShardingCounts(sum(sharded([*n.inputs, *n.outputs]) for n in ops), len(ops),
                          sum(sharded(n.outputs) for n in params), len(params))


def _sharding_line(plan: Plan) -> str:
    c = sharding_counts(plan)
    if c.ops and not c.split_ops:
        return (f"sharding: none - every device runs all {c.ops} compute ops on the whole batch "
                f"(under this profile, communication would cost more than splitting the work saves)")
    return (f"sharding: {c.split_ops} of {c.ops} compute ops run on a shard of their work, "
            f"{c.ops - c.split_ops} replicated; parameters: {c.sharded_params} of {c.params} stored sharded")


def _decision_line(plan: Plan) -> str:
    if not plan.segments:
        return "memory decisions: none (no repeated blocks)"
    by_decision: dict[str, list[str]] = defaultdict(list)
    for seg, d in plan.segments.items():
        by_decision[d].append(seg)
    parts = [f"{d} {len(segs)} ({_ranges(segs)})" for d, segs in sorted(by_decision.items())]
    return "memory decisions per segment: " + ", ".join(parts)


def _split_segment(seg: str) -> tuple[str, int] | None:
    prefix, _, idx = seg.rpartition(".")
    return (prefix, int(idx)) if idx.isdigit() else None


def _ranges(segments: list[str]) -> str:
    """'model.layers.0-3, model.layers.7' for a list of segment names."""
    by_prefix: dict[str, list[int]] = defaultdict(list)
    others = []
    for seg in segments:
        parts = _split_segment(seg)
        if parts is None:
            others.append(seg)
        else:
            by_prefix[parts[0]].append(parts[1])
    out = []
    for prefix, idx in by_prefix.items():
        for lo, hi in _runs(sorted(idx)):
            label = f"{lo}" if lo == hi else f"{lo}-{hi}"
            out.append(f"{prefix}.{label}" if prefix else label)
    return ", ".join(out + others)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


@dataclass
class _Row:
    node: str
    module: str
    op: str
    strategy: str
    comm: str
    memory: str
    group: bool = False


def _short_op(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _node_row(n: NodePlan) -> _Row:
    comm = "-" if not n.collectives else f"{format_bytes(n.comm_bytes)} / {_fmt_time(n.comm_seconds)}"
    held = n.memory["params"] + n.memory["grads"] + n.memory["saved"]
    return _Row(n.name, n.module or (n.fqn or ""), _short_op(n.op), n.strategy, comm,
                format_bytes(held) if held else "-")


def _segment_signature(plan: Plan, seg: str, names: list[str]) -> tuple:
    """What must match for a segment to be shown as 'same as' another: per node its kind, op,
    module (relative to the segment), strategy and specs; and the segment's memory decision."""
    def rel(path: str | None) -> str:
        return (path or "").replace(seg, "<block>", 1)

    nodes = tuple((n.kind, n.op, rel(n.module), rel(n.fqn), n.strategy, tuple(n.inputs), tuple(n.outputs))
                  for n in (plan.nodes[x] for x in names))
    return nodes, plan.segments.get(seg)


def _collapsed_runs(plan: Plan) -> dict[str, tuple[str, str, int]]:
    """For runs of consecutive identical segments (``model.layers.0-31``): the first segment ->
    (label of the others, itself, nodes per segment), each other segment -> ('', first, 0)."""
    members: dict[str, list[str]] = defaultdict(list)
    for n in plan.nodes.values():
        if n.segment is not None:
            members[n.segment].append(n.name)
    by_prefix: dict[str, list[int]] = defaultdict(list)
    for seg in members:
        parts = _split_segment(seg)
        if parts is not None:
            by_prefix[parts[0]].append(parts[1])
    out: dict[str, tuple[str, str, int]] = {}
    for prefix, indices in by_prefix.items():
        def name(i: "int | str", prefix: str = prefix) -> str:
            return f"{prefix}.{i}" if prefix else str(i)

        sigs = {i: _segment_signature(plan, name(i), members[name(i)]) for i in indices}
        for run in _identical_runs(sorted(indices), sigs):
            first = name(run[0])
            rest = name(f"{run[1]}-{run[-1]}" if len(run) > 2 else run[1])
            out[first] = (rest, first, len(members[first]))
            out.update({name(j): ("", first, 0) for j in run[1:]})
    return out


def _identical_runs(indices: list[int], sigs: dict[int, tuple]) -> list[list[int]]:
    """Maximal runs (length >= 2) of consecutive indices with equal signatures."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1 and sigs[i] == sigs[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [r for r in runs if len(r) > 1]


def _rows(plan: Plan, full: bool) -> list[_Row]:
    """The per-node rows; unless ``full``, runs of identical segments become one row after the
    last node of their first segment."""
    runs = {} if full else _collapsed_runs(plan)
    last_of: dict[str, str] = {}
    for n in plan.nodes.values():
        if n.segment is not None:
            last_of[n.segment] = n.name
    rows = []
    for n in plan.nodes.values():
        run = runs.get(n.segment or "")
        if run is not None and run[0] == "":
            continue
        rows.append(_node_row(n))
        if run is not None and last_of[n.segment] == n.name:   # type: ignore[index]
            label, rep, count = run
            rows.append(_Row(label, "", "", f"same as {rep} ({count} nodes each)", "", "", group=True))
    return rows


def _reshard_rows(plan: Plan, full: bool) -> list[list[str]]:
    chosen = plan.reshards if full else sorted(plan.reshards, key=lambda r: -r.cost)[:_SUMMARY_RESHARDS]
    return [[f"{r.src} -> {r.dst}[{r.operand}]", f"{r.src_spec} -> {r.dst_spec}",
             "; ".join(s.text for s in r.fwd) or "-", _fmt_time(r.cost)] for r in chosen]


_NODE_COLUMNS = ("node", "module", "op", "strategy", "comm (bytes / time)", "memory")
_RESHARD_COLUMNS = ("edge", "specs", "forward steps", "cost fwd+bwd")


def _reshard_title(plan: Plan, full: bool) -> str:
    if full or len(plan.reshards) <= _SUMMARY_RESHARDS:
        return f"reshardings ({len(plan.reshards)})"
    return f"reshardings: the {_SUMMARY_RESHARDS} most expensive of {len(plan.reshards)} (full=True lists all)"


def renderable(plan: Plan, full: bool) -> "RenderableType":
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text

    summary = Text("\n".join(summary_lines(plan)))
    nodes = _table(_NODE_COLUMNS, "per-node decisions")
    for r in _rows(plan, full):
        cells = [escape(x) for x in (r.node, r.module, r.op, r.strategy, r.comm, r.memory)]
        nodes.add_row(*cells, style="dim italic" if r.group else None)
    parts: list = [summary, nodes]
    if plan.reshards:
        reshards = _table(_RESHARD_COLUMNS, _reshard_title(plan, full))
        for row in _reshard_rows(plan, full):
            reshards.add_row(*(escape(x) for x in row))
        parts.append(reshards)
    return Group(*parts)


def _table(columns: Iterable[str], title: str) -> Any:
    """A rich table whose cells wrap rather than being cut off with an ellipsis."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, overflow="fold")
    return table


def _plain_table(title: str, header: Iterable[str], rows: list[list[str]]) -> list[str]:
    header = list(header)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [title, line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def plain_text(plan: Plan, full: bool) -> str:
    rows = [[r.node, r.module, r.op, r.strategy, r.comm, r.memory] for r in _rows(plan, full)]
    lines = summary_lines(plan) + [""] + _plain_table("per-node decisions", _NODE_COLUMNS, rows)
    if plan.reshards:
        lines += [""] + _plain_table(_reshard_title(plan, full), _RESHARD_COLUMNS, _reshard_rows(plan, full))
    return "\n".join(lines) + "\n"
