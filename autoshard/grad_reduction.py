"""Which gradient all-reduces run after backward in buckets, and which run inline.

One analysis shared by the runtime (:mod:`autoshard.runtime.lower` generates the program from it)
and the step-time model (:func:`autoshard.solver.evaluate.gradient_sync` prices the same), so that what
the model assumes is what the runtime does.

A consumer whose computation is split over mesh axes ``A`` while it reads an operand replicated
over ``A`` gets, in backward, a gradient for that operand that is a partial sum over ``A``: it
needs an all-reduce over ``A``. Run inline, that all-reduce blocks backward. It can instead be left
pending when every path from the operand back to the leaves runs replicated over ``A`` and ends in
parameters: backward is linear in the incoming gradient, so the replicated computation turns a
partial gradient into partial gradients of its inputs, and the parameters' gradients are then
summed over ``A`` by the bucketed all-reduce after backward (as DDP does). Examples: a parameter
read in its stored layout by a batch-sharded matmul (the direct case), and a learned position
embedding looked up replicated and added to batch-sharded token embeddings (a chain).

The rule, a greatest fixed point over the graph: a value ``u`` that carries a gradient is
*deferred* with axes ``A`` when

- every consumer of ``u`` contributes a gradient that is partial over exactly ``A``: it either
  all-reduces ``u``'s gradient over ``A`` itself (the all-reduce then is skipped), or it is a
  deferred value with axes ``A``; a resharded use, the graph output or any other consumer
  contributes a whole gradient and stops the deferral (a consumer whose output carries no
  gradient contributes none);
- and ``u`` is a parameter (its gradient is then bucketed over ``A``), or ``u`` is computed with no
  collective, from operands read as produced, by a node whose specs use none of the axes in ``A``,
  whose every operand that carries a gradient is deferred with ``A``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from torch import fx

from .strategy import BWD

if TYPE_CHECKING:
    from .capture import CapturedGraph
    from .strategy import Strategy

Axes = tuple[int, ...]


@dataclass(frozen=True)
class GradNode:
    """What the analysis needs of one graph node.

    ``kind``: ``"param"`` (a parameter that needs a gradient), ``"leaf"`` (another placeholder),
    ``"op"`` (a call) or ``"output"``. ``operands``: the producing nodes, per operand index.
    ``carries_grad``: its value has a gradient in backward. ``replicated_over``: for an op that runs
    with no collective, reads no operand resharded and has one tensor output, the mesh axes none of
    its specs use (a partial gradient over those passes through it locally); None otherwise.
    ``sync``: per operand, the (live) mesh axes its gradient is all-reduced over; () for none.
    ``resharded``: per operand, whether it is resharded before this node reads it."""

    name: str
    kind: str
    operands: tuple[str, ...] = ()
    carries_grad: bool = False
    replicated_over: frozenset[int] | None = None
    sync: tuple[Axes, ...] = ()
    resharded: tuple[bool, ...] = ()


@dataclass(frozen=True)
class GradReduction:
    """``bucketed``: parameter -> mesh axes of its bucketed gradient all-reduce, in order of first
    use. ``deferred``: the
    (consumer, operand index) pairs whose gradient all-reduce is left to those buckets (not run
    inline)."""

    bucketed: dict[str, Axes] = field(default_factory=dict)
    deferred: frozenset[tuple[str, int]] = frozenset()


def plan_gradient_reduction(nodes: Sequence[GradNode]) -> GradReduction:
    """The bucketed parameters and skipped inline all-reduces of one graph (``nodes`` in
    topological order; see the module docstring)."""
    by_name = {n.name: n for n in nodes}
    uses: dict[str, list[tuple[str, int]]] = {n.name: [] for n in nodes}
    for n in nodes:
        for j, src in enumerate(n.operands):
            if src in uses:
                uses[src].append((n.name, j))
    deferred = {n.name for n in nodes if n.carries_grad and (n.kind == "param" or n.replicated_over is not None)}
    while True:
        axes = _labels(nodes, by_name, uses, deferred)
        kept = {u for u in deferred if axes.get(u) and _resolves(by_name[u], axes, deferred, by_name)}
        if kept == deferred:
            break
        deferred = kept
    # in order of first use (the order the buckets are formed in, identical on every rank)
    bucketed = {src: axes[src] for n in nodes for src in n.operands
                if src in deferred and by_name[src].kind == "param"}
    skipped = frozenset((c, j) for u in deferred for c, j in uses[u] if by_name[c].kind == "op"
                        and j < len(by_name[c].sync) and by_name[c].sync[j])
    return GradReduction(bucketed, skipped)


def _labels(nodes: Sequence[GradNode], by_name: dict[str, GradNode], uses: dict[str, list[tuple[str, int]]],
            deferred: set[str]) -> dict[str, Axes]:
    """Per value carrying a gradient, the axes over which every consumer's contribution is partial
    (absent where some contribution is whole or the axes differ), given the current ``deferred``."""
    axes: dict[str, Axes] = {}
    for n in reversed(nodes):
        if not n.carries_grad or not uses[n.name]:
            continue
        seen = {_contribution(by_name[c], j, axes, deferred) for c, j in uses[n.name]
                if by_name[c].kind != "op" or by_name[c].carries_grad}   # no gradient flows back otherwise
        if len(seen) == 1 and (only := next(iter(seen))):
            axes[n.name] = only
    return axes


def _contribution(consumer: GradNode, j: int, axes: dict[str, Axes], deferred: set[str]) -> Axes:
    """The axes over which ``consumer``'s gradient for its operand ``j`` is partial; () for whole."""
    if consumer.kind != "op" or consumer.resharded[j]:
        return ()
    if consumer.sync[j]:
        return consumer.sync[j]
    if consumer.name in deferred and consumer.name in axes:
        return axes[consumer.name]
    return ()


def _resolves(node: GradNode, axes: dict[str, Axes], deferred: set[str], by_name: dict[str, GradNode]) -> bool:
    """Whether a partial gradient over ``axes[node]`` at ``node`` ends in parameter buckets."""
    if node.kind == "param":
        return True
    a = axes[node.name]
    if node.replicated_over is None or not set(a) <= node.replicated_over:
        return False
    return all(src in deferred and axes.get(src) == a
               for src in node.operands if src in by_name and by_name[src].carries_grad)


def live(axes: Iterable[int], mesh_shape: Sequence[int]) -> Axes:
    """``axes`` without the mesh axes of size 1 (no collective runs over them), sorted."""
    return tuple(sorted(a for a in set(axes) if mesh_shape[a] > 1))


def grad_nodes(graph: "CapturedGraph", operands_of: Callable[[fx.Node], Sequence[str]],
               strategy_of: Callable[[fx.Node], "Strategy"], resharded: Callable[[str, int], bool],
               mesh_shape: Sequence[int]) -> list[GradNode]:
    """The :class:`GradNode` of every node of ``graph``, from each call's chosen strategy (its
    operand nodes from ``operands_of``) and whether operand ``j`` of a node is resharded."""
    out: list[GradNode] = []
    for node in graph.graph.nodes:
        meta = graph.tensor_meta(node) if node.op in ("placeholder", "call_function") else None
        is_tuple = isinstance(meta, tuple)
        carries = bool(meta is not None and graph.requires_grad(node)
                       and (is_tuple or meta.dtype.is_floating_point))
        if node.op == "placeholder":
            out.append(GradNode(node.name, "param" if node.name in graph.param_fqn else "leaf", carries_grad=carries))
        elif node.op == "call_function":
            operands = tuple(operands_of(node))
            s = strategy_of(node)
            moved = tuple(resharded(node.name, j) for j in range(len(operands)))
            sync = tuple(live((a for c in s.comm if c.phase == BWD and c.kind == "all_reduce"
                               and c.operand == f"in{j}" for a in c.axes), mesh_shape) for j in range(len(operands)))
            used = {a for spec in (*s.input_specs, *s.output_specs) if spec is not None for a in spec.used_axes()}
            local = not s.comm and not any(moved) and not is_tuple
            out.append(GradNode(node.name, "op", operands, carries,
                                frozenset(range(len(mesh_shape))) - used if local else None, sync, moved))
        elif node.op == "output":
            out.append(GradNode(node.name, "output", tuple(a.name for a in node.all_input_nodes)))
    return out
