"""How parameter offload cuts a captured graph into slices, each a graph module of its own.

Slices are contiguous runs of the graph's nodes, cut before nodes that use parameters (and never
across a tuple value), with their parameter bytes balanced (:func:`balance`).

Parameters used in several slices (tied weights, e.g. GPT-2's ``wte``/``lm_head``): each slice
that uses a parameter loads its own device copy and releases it with the rest of the slice; the
copy's gradient from every slice is accumulated into the one host ``.grad``. Such a parameter is
counted in the bytes of every slice that uses it (the planner balances these per-slice bytes).
Pure functions of parameters (``t(weight)``, dtype casts) are recomputed in every slice that
consumes them, so no value aliasing a parameter copy crosses a slice boundary.
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..exported import graph_inputs
from ..units import format_bytes

__all__ = ["OffloadError", "SlicePlan", "Slicing", "balance", "slice_graph"]


class OffloadError(ValueError):
    """The model cannot be captured or sliced as requested."""


@dataclass
class SlicePlan:
    """One slice: its parameters (host objects, unique), their names and bytes, and its nodes."""

    index: int
    param_names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    nbytes: int
    nodes: list[str] = field(repr=False)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        names = ", ".join(self.param_names[:4]) + (", ..." if len(self.param_names) > 4 else "")
        return (f"{len(self.params)} params, {format_bytes(self.nbytes)}, {len(self.nodes)} nodes "
                f"({self.nodes[0]}..{self.nodes[-1]}): {names}")


def _is_tuple_valued(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def balance(atom_params: list[list[int]], nbytes: dict[int, int], k: int) -> list[int]:
    """Cut atoms (each a list of param ids) into exactly ``k`` contiguous groups, minimising the
    largest group's parameter bytes (union per group). Returns the start atom of each group."""

    def greedy(limit: int) -> list[int] | None:
        starts, cur, cur_b = [0], set(), 0
        for a, ps in enumerate(atom_params):
            new = {p for p in ps if p not in cur}
            add = sum(nbytes[p] for p in new)
            if cur and cur_b + add > limit:
                starts.append(a)
                cur, cur_b = set(), 0
                new = set(ps)
                add = sum(nbytes[p] for p in new)
            if add > limit:
                return None
            cur |= new
            cur_b += add
        return starts

    lo = max(sum(nbytes[p] for p in set(ps)) for ps in atom_params)
    hi = sum(nbytes.values()) * max(1, len(atom_params))  # safe upper bound (tied params)
    while lo < hi:
        mid = (lo + hi) // 2
        s = greedy(mid)
        if s is not None and len(s) <= k:
            hi = mid
        else:
            lo = mid + 1
    starts = greedy(lo)
    assert starts is not None and len(starts) <= k
    # Fewer groups than asked: split the groups with the most atoms (never raises the maximum).
    while len(starts) < k:
        ends = starts[1:] + [len(atom_params)]
        g = max(range(len(starts)), key=lambda i: ends[i] - starts[i])
        assert ends[g] - starts[g] >= 2
        starts.insert(g + 1, (starts[g] + ends[g]) // 2)
    return starts


@dataclass
class Slicing:
    """The slices of a graph: plans, their graph modules and state tensors (on the device), the graph's
    user-input placeholders and its output node."""

    plans: list[SlicePlan]
    modules: list[fx.GraphModule]
    states: list[list[torch.Tensor]]
    user_inputs: list[fx.Node]
    out_node: fx.Node


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Graph constants ``torch.device('cpu')`` (from capturing on CPU) -> ``device``."""
    if device.type == "cpu":
        return

    def fix(a: Any) -> Any:
        if isinstance(a, torch.device) and a.type == "cpu":
            return device
        return a

    for n in graph.nodes:
        if n.op == "call_function":
            n.args = fx.node.map_aggregate(n.args, fix)
            n.kwargs = fx.node.map_aggregate(n.kwargs, fix)


def _ident(name: str) -> str:
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"v_{abs(hash(name))}"


def slice_graph(model: nn.Module, ep: ExportedProgram, num_slices: int, device: torch.device) -> Slicing:
    """Cut ``ep``'s graph into ``num_slices`` slices of balanced parameter bytes, each its own module."""
    graph = ep.graph
    _retarget_devices(graph, device)
    user_inputs, state = graph_inputs(ep, OffloadError, "parameter offload",
                                      "parameter offload does not handle state mutation (e.g. BatchNorm running "
                                      "statistics in train mode): use eval() for such layers or a model without it")
    param_of: dict[fx.Node, nn.Parameter] = {}
    pname: dict[int, str] = {}
    spec_order: dict[int, int] = {}
    state_of: dict[fx.Node, torch.Tensor] = {}
    for node, kind, target in state:
        if kind == InputKind.PARAMETER:
            p = model.get_parameter(target)
            param_of[node] = p
            pname.setdefault(id(p), target)
            spec_order.setdefault(id(p), len(spec_order))
        elif kind == InputKind.BUFFER:
            state_of[node] = model.get_buffer(target)
        else:
            state_of[node] = ep.constants[target]
    by_id = {id(p): p for p in param_of.values()}
    nbytes = {pid: p.numel() * p.element_size() for pid, p in by_id.items()}

    # Pure functions of parameters: recomputed inside each slice that consumes them.
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function":
            ins = n.all_input_nodes
            if ins and all(x in param_of or x in derived for x in ins):
                derived.add(n)
    out_node = next(n for n in graph.nodes if n.op == "output")
    for x in out_node.all_input_nodes:
        if x in derived or x in param_of or x in state_of:
            raise OffloadError(f"graph output {x.name} is a parameter/buffer (or a pure function of one); "
                               "parameter offload only returns computed values")

    def params_behind(x: fx.Node, acc: set[int]) -> set[int]:
        if x in param_of:
            acc.add(id(param_of[x]))
        elif x in derived:
            for y in x.all_input_nodes:
                params_behind(y, acc)
        return acc

    compute = [n for n in graph.nodes if n.op == "call_function" and n not in derived]
    uses = [sorted(set().union(*[params_behind(x, set()) for x in n.all_input_nodes]) if n.all_input_nodes else [])
            for n in compute]
    if not by_id:
        raise OffloadError("the model has no parameters: nothing to offload")
    # Legal cut positions: before a node that uses parameters, with no tuple value crossing.
    pos = {n: k for k, n in enumerate(compute)}
    blocked = [False] * (len(compute) + 1)
    for k, n in enumerate(compute):
        if _is_tuple_valued(n):
            last = max((pos[u] for u in n.users if u in pos), default=k)
            for c in range(k + 1, last + 1):
                blocked[c] = True
    first_user = next(k for k, u in enumerate(uses) if u)
    starts = [0] + [k for k in range(first_user + 1, len(compute)) if uses[k] and not blocked[k]]
    if num_slices > len(starts):
        raise OffloadError(
            f"num_slices={num_slices} is more than the {len(starts)} slice(s) this graph can be cut into: "
            f"it has {sum(1 for u in uses if u)} node(s) that use parameters ({len(by_id)} parameter tensors) "
            f"and slices are cut before such nodes; use num_slices <= {len(starts)}")
    atoms = [list(range(s, e)) for s, e in zip(starts, starts[1:] + [len(compute)])]
    atom_params = [sorted(set().union(*[set(uses[k]) for k in a])) for a in atoms]
    group_starts = balance(atom_params, nbytes, num_slices)
    groups = [sum(atoms[a:b], []) for a, b in zip(group_starts, group_starts[1:] + [len(atoms)])]

    slice_of: dict[fx.Node, int] = {}
    for s, g in enumerate(groups):
        for k in g:
            slice_of[compute[k]] = s

    # Which values each slice reads from outside and must hand on.
    needed_later: dict[fx.Node, int] = {}  # value -> last slice (len = graph output) reading it
    for n in compute:
        for x in n.all_input_nodes:
            if x in slice_of or x in user_inputs:
                needed_later[x] = max(needed_later.get(x, -1), slice_of[n])
    for x in out_node.all_input_nodes:
        needed_later[x] = len(groups)

    plans: list[SlicePlan] = []
    modules: list[fx.GraphModule] = []
    states: list[list[torch.Tensor]] = []
    for s, g in enumerate(groups):
        nodes = [compute[k] for k in g]
        pids = sorted(set().union(*[set(uses[k]) for k in g]),
                      key=lambda pid: (min(k for k in g if pid in uses[k]), spec_order[pid]))
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        pnode: dict[int, fx.Node] = {}
        for pid in pids:
            pnode[pid] = new.placeholder(_ident(pname[pid].replace(".", "_")))
        state_nodes = sorted({x for n in nodes for x in n.all_input_nodes if x in state_of}, key=lambda x: x.name)
        for x in state_nodes:
            env[x] = new.placeholder(x.name)
        inputs = []
        for n in nodes:
            for x in n.all_input_nodes:
                if (x in user_inputs or (x in slice_of and slice_of[x] != s)) and x not in env:
                    inputs.append(x)
                    env[x] = new.placeholder(x.name)
                    env[x].meta = dict(x.meta)

        def value(x: fx.Node) -> fx.Node:
            if x in env:
                return env[x]
            if x in param_of:
                env[x] = pnode[id(param_of[x])]
                return env[x]
            assert x in derived, x
            env[x] = new.node_copy(x, value)
            return env[x]

        for n in nodes:
            env[n] = new.node_copy(n, value)
        outputs = [n for n in nodes if needed_later.get(n, -1) > s]
        new.output(tuple(env[n] for n in outputs))
        gm = fx.GraphModule(nn.Module(), new, class_name=f"Slice{s}")
        params = [by_id[pid] for pid in pids]
        plans.append(SlicePlan(s, [pname[pid] for pid in pids], params, sum(nbytes[pid] for pid in pids),
                               [n.name for n in nodes], [x.name for x in inputs], [n.name for n in outputs]))
        modules.append(gm)
        states.append([state_of[x].to(device) for x in state_nodes])
    return Slicing(plans, modules, states, user_inputs, out_node)
