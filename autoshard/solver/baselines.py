"""Baselines: hand-written parallelism plans, priced by the same cost model as autoshard's plans.

A baseline is a *restriction* of the cost graph: for some CGNodes (parameter and user-input
placeholders) only the strategies whose output spec is the one the hand plan prescribes are
allowed (an ``allowed`` mask, CGNode name -> strategy indices). :func:`solve_baseline` hands that
mask to the same ILP with every segment's memory decision fixed to ``keep`` (no recompute, no
offload: these are plain parallelism baselines). Every other node stays free, so each baseline
is the *best plan within its family* under the same cost model: an apples-to-apples comparison,
and one that flatters the baselines rather than the solver.

Families (``mesh_shape`` is 2D; axes of size 1 never shard):

- :func:`data_parallel`: every parameter replicated; every user input sharded on its batch dim
  (dim 0) over all mesh axes of size > 1 (``S01`` on a 2D mesh, ``S1`` on ``(1, n)``); every
  other node reads its operands as produced (no resharding), so the batch sharding carries
  through the graph: DDP's program.
- :func:`megatron`: Megatron-LM tensor parallelism on ``tp_axis`` (default 1, the fast
  intra-node axis) with data parallelism on the other axis. Column-parallel linears shard their
  output features, row-parallel ones their input features (bias replicated), token embeddings
  are vocab-parallel, the LM head is column-parallel on the vocabulary (with tied weights, GPT-2,
  one placeholder: dim 0 either way); position/token-type tables, norms and everything else are
  replicated, as in Megatron-LM. User inputs are batch-sharded over the data-parallel axis.
  Ops read their operands as produced where they can (resharding on edges is penalised, as for
  data parallelism): the tensor-parallel weights are used in their stored layout, never
  all-gathered, and the activations move only where a column/row pair needs it.
- :func:`zero3`: ZeRO-3 / FSDP: every parameter sharded over all devices (``S01`` on dim 0 when
  it divides, else the largest dim that divides, else replicated); inputs batch-sharded over
  all axes; every other edge reads its operand as produced, so the computation is data parallel
  and the parameters are gathered before use (per block, :mod:`autoshard.param_gather`).
- :func:`replicated`: no parallelism: every node runs its all-replicated strategy, every rank the
  whole step on the whole batch, with no collective (the single-device program on every rank).

Column vs row (Megatron). Known module names decide first (:data:`COLUMN_NAMES`,
:data:`ROW_NAMES`, matched as a suffix of the module path). For any other linear, the
*alternation rule*: take the parameter-consuming matmuls (``linear``/``addmm``/``mm``) of one
repeated block (``model.layers.3``; everything outside blocks is one group) in graph order,
split them into maximal runs that read the same activation tensor (q/k/v read the same normed
hidden state, as do gate/up), and alternate: runs 0, 2, 4, ... are column-parallel, runs 1, 3,
... row-parallel. On GPT-2, Llama and BERT this reproduces the name table (a test checks it).

Cost-model caveats (quoted in the benchmark notes):

- ZeRO-3's parameters are gathered per block by the runtime: one all-gather before the block's
  first use, one reduce-scatter of their gradients (:mod:`autoshard.param_gather`);
  :func:`predict` and the plan's communication price exactly that. The ILP prices each gathered
  edge's bandwidth and one latency per block (:mod:`autoshard.solver.param_edges`), with the
  consumer's gradient all-reduce still counted as bucketed (a small over-count). The gathered
  parameters are kept from forward to backward (no re-gather in backward, unlike FSDP's default
  ``reshard_after_forward=True``) and counted as memory (``param_copies``).
- "Free" nodes may pick any layout the cost model prices: a baseline is the best member of its
  family, not one particular implementation of it.

Fallbacks are never silent: when a prescribed spec does not divide a tensor (e.g. GPT-2's
50257-token vocabulary over 2 devices) the node falls back to replicated (inputs: to the
largest subset of the axes that divides) and a note says so.
"""
from __future__ import annotations

import dataclasses
import re
from itertools import combinations
from typing import Callable, Iterable, NamedTuple, Sequence

import torch
import torch.fx as fx

from ..decisions import Decision
from ..specs import ShardSpec
from ..strategy import Strategy
from .costgraph import CGNode, CostGraph
from .tp_roles import COLUMN, is_embedding_weight, is_token_embedding, linear_roles, matmul_slot
from .ilp import InfeasibleBudgetError, Reshard, SolverOptions, Solution, minimum_budget, solve
from .memory_model import static_floor

__all__ = [
    "ARBITRATED", "BASELINES", "DATA_PARALLEL_MARGIN", "BaselineResult", "best_by_step_model", "Restriction", "baseline_minimum_budget",
    "data_parallel", "input_nodes", "megatron", "parameter_nodes", "replicated", "restriction",
    "solve_baseline", "zero3",
]

aten = torch.ops.aten

class Restriction(NamedTuple):
    """A baseline as a restriction: CGNode name -> allowed strategy indices, notes on every
    place where the hand plan could not be followed (or was followed in a non-obvious way), and
    whether edges may reshard (see :func:`~autoshard.solver.ilp.solve`)."""

    allowed: dict[str, list[int]]
    notes: list[str]
    reshard: Reshard = True


class BaselineResult(NamedTuple):
    """The best plan of a baseline family, the notes of its restriction, and the restriction."""

    solution: Solution
    notes: list[str]
    allowed: dict[str, list[int]]


# -- small helpers ---------------------------------------------------------------------------------

def _axes(mesh_shape: Sequence[int], exclude: Iterable[int] = ()) -> tuple[int, ...]:
    """Mesh axes of size > 1, minus ``exclude``, outer first."""
    skip = set(exclude)
    return tuple(a for a, n in enumerate(mesh_shape) if n > 1 and a not in skip)


def _spec(ndim: int, dim: int | None = None, axes: Sequence[int] = ()) -> ShardSpec:
    """``ndim``-rank spec sharding ``dim`` over ``axes`` (replicated when ``dim`` is None or no axes)."""
    spec = ShardSpec.replicate(ndim)
    return spec if dim is None or not axes else spec.with_dim(dim, tuple(sorted(axes)))


def _indices(node: CGNode, spec: ShardSpec) -> list[int]:
    """Strategies of a (placeholder) CGNode whose output spec is ``spec``."""
    return [c for c, s in enumerate(node.strategies) if s.output_specs and s.output_specs[0] == spec]


def _pattern(fqn: str) -> str:
    """``transformer.h.3.attn.c_attn.bias`` -> ``transformer.h.*.attn.c_attn.bias`` (for notes)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


class _Notes:
    """Notes grouped by message over repeated blocks: one line per distinct message, with a count."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, message: str) -> None:
        self._counts[message] = self._counts.get(message, 0) + 1

    def lines(self) -> list[str]:
        return [m if n == 1 else f"{m} (x{n})" for m, n in self._counts.items()]


class _Plan:
    """Accumulates the restriction of one baseline."""

    def __init__(self, cg: CostGraph, family: str) -> None:
        self.cg = cg
        self.family = family
        self.mesh_shape = cg.mesh.shape
        self.allowed: dict[str, list[int]] = {}
        self.notes = _Notes()

    def name(self, node: CGNode) -> str:
        member = node.members[0]
        g = self.cg.graph
        return _pattern(g.param_fqn.get(member) or g.user_input_specs.get(member, member))

    def require(self, node: CGNode, spec: ShardSpec, why: str = "") -> bool:
        """Allow only ``spec`` on ``node``; if no strategy has it, fall back to replicated and
        note it. Returns whether the prescribed spec was available."""
        idx = _indices(node, spec)
        if idx:
            self.allowed[node.name] = idx
            return True
        rep = ShardSpec.replicate(spec.ndim)
        self.allowed[node.name] = _indices(node, rep)
        self.notes.add(f"{self.family}: {self.name(node)} {self._shape(node)} cannot take {spec}"
                       f"{' (' + why + ')' if why else ''} on mesh {self.cg.mesh}: replicated instead")
        return False

    def batch_shard(self, node: CGNode, axes: Sequence[int]) -> None:
        """Shard a user input's dim 0 over ``axes``; when that does not divide, over the largest
        subset of ``axes`` that does (noted), else replicated (noted)."""
        meta = self.cg.graph.tensor_meta(node.members[0])
        if meta is None or isinstance(meta, tuple) or meta.ndim == 0 or not axes:
            return
        subsets = [s for k in range(len(axes), 0, -1) for s in combinations(axes, k)]
        subsets.sort(key=lambda s: -_size(s, self.mesh_shape))
        for subset in subsets:
            idx = _indices(node, _spec(meta.ndim, 0, subset))
            if idx:
                self.allowed[node.name] = idx
                if tuple(subset) != tuple(axes):
                    self.notes.add(f"{self.family}: input {self.name(node)} {meta.shape}: batch "
                                   f"{meta.shape[0]} does not divide over axes {tuple(axes)}; "
                                   f"sharded over {subset} only")
                return
        self.allowed[node.name] = _indices(node, _spec(meta.ndim))
        self.notes.add(f"{self.family}: input {self.name(node)} {meta.shape}: batch {meta.shape[0]} divides "
                       f"over no mesh axis of {self.cg.mesh}: replicated instead")

    def restriction(self) -> Restriction:
        return Restriction(self.allowed, self.notes.lines())

    def _shape(self, node: CGNode) -> tuple[int, ...]:
        meta = self.cg.graph.tensor_meta(node.members[0])
        return tuple(meta.shape) if meta is not None and not isinstance(meta, tuple) else ()


def _size(axes: Sequence[int], mesh_shape: Sequence[int]) -> int:
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


def _placeholders(cg: CostGraph, predicate: Callable[[str], bool]) -> list[CGNode]:
    return [n for n in cg.nodes.values() if n.kind == "placeholder" and predicate(n.members[0])]


def parameter_nodes(cg: CostGraph) -> list[CGNode]:
    """CGNodes of the parameter placeholders (tied weights appear once)."""
    return _placeholders(cg, cg.graph.is_param)


def input_nodes(cg: CostGraph) -> list[CGNode]:
    """CGNodes of the tensor user inputs."""
    return _placeholders(cg, cg.graph.is_user_input)


def _meta_ndim(cg: CostGraph, node: CGNode) -> int:
    return cg.graph.tensor_meta(node.members[0]).ndim  # type: ignore[union-attr]


# -- data parallel -----------------------------------------------------------------------------------

def data_parallel(cg: CostGraph) -> Restriction:
    """The program DDP runs: parameters replicated, inputs batch-sharded over every mesh axis of
    size > 1, and every op reading its operands in the layout their producer gives them (no
    resharding anywhere but into the graph's outputs), so the batch sharding carries through the
    whole graph and the only collectives are the gradient all-reduces (bucketed by the runtime)
    and what an op needs to give a global value (a batch-sharded loss's token count)."""
    plan = _Plan(cg, "data_parallel")
    for node in parameter_nodes(cg):
        plan.require(node, _spec(_meta_ndim(cg, node)))
    for node in input_nodes(cg):
        plan.batch_shard(node, _axes(cg.mesh.shape))
    _without_internal_resharding(plan)
    return plan.restriction()._replace(reshard=False)


def replicated(cg: CostGraph) -> Restriction:
    """No parallelism: every rank runs the whole step on the whole batch (what the module does on one
    device). Every node takes a strategy whose specs are all replicated, so nothing is sharded and no
    collective runs (gradients are whole on every rank); a node with no such strategy stays free
    (noted). Where ranks share a machine's cores, or a model is too small for its collectives to pay,
    this can be the fastest plan there is."""
    plan = _Plan(cg, "replicated")
    for node in cg.nodes.values():
        idx = [c for c in range(len(node)) if all(_all_replicated(node.member_strategy(m, c)) for m in node.members)]
        if idx:
            plan.allowed[node.name] = idx
        else:
            plan.notes.add(f"replicated: node {node.name} has no all-replicated strategy: left to the solver")
    return plan.restriction()


def _all_replicated(strategy: Strategy) -> bool:
    return all(spec.is_replicated() for spec in (*strategy.input_specs, *strategy.output_specs) if spec is not None)


def _without_internal_resharding(plan: _Plan) -> None:
    """Restrict every free node that merges followers to strategies that move nothing between its
    members (the edges between nodes are held by the ILP's ``reshard=False`` rows)."""
    for node in plan.cg.nodes.values():
        if node.name in plan.allowed or len(node.members) == 1:
            continue
        c = node.costs
        still = [s for s in range(len(node)) if c.reshard_fwd[s] == 0 and c.reshard_bwd[s] == 0]
        if not still:
            plan.notes.add(f"{plan.family}: {plan.name(node)} moves data between its merged members in every "
                           "strategy; left free")
        elif len(still) < len(node):
            plan.allowed[node.name] = still


# -- ZeRO-3 ------------------------------------------------------------------------------------------

def zero3(cg: CostGraph) -> Restriction:
    """FSDP's program: every parameter sharded over all devices (dim 0, else the largest dim that
    divides, else replicated, noted) and gathered before use; inputs batch-sharded over every mesh
    axis of size > 1; every other edge reads its operand as produced (as for data parallelism), so
    the computation is batch-sharded throughout and the runtime gathers each block's parameters
    in one all-gather and reduce-scatters their gradients in one collective
    (:mod:`autoshard.param_gather`)."""
    plan = _Plan(cg, "zero3")
    axes = _axes(cg.mesh.shape)
    params = parameter_nodes(cg)
    for node in params:
        _zero3_param(plan, node, axes)
    for node in input_nodes(cg):
        plan.batch_shard(node, axes)
    _without_internal_resharding(plan)
    return plan.restriction()._replace(reshard=frozenset(node.name for node in params))


def _zero3_param(plan: _Plan, node: CGNode, axes: tuple[int, ...]) -> None:
    meta = plan.cg.graph.tensor_meta(node.members[0])
    if not axes:
        plan.require(node, _spec(meta.ndim))
        return
    if meta.ndim == 0:
        plan.require(node, _spec(0))
        plan.notes.add(f"zero3: {plan.name(node)} is a scalar: replicated")
        return
    dims = [0] + sorted(range(1, meta.ndim), key=lambda d: -meta.shape[d])
    for d in dims:
        idx = _indices(node, _spec(meta.ndim, d, axes))
        if idx:
            plan.allowed[node.name] = idx
            if d != 0:
                plan.notes.add(f"zero3: {plan.name(node)} {meta.shape}: dim 0 does not divide over "
                               f"{_size(axes, plan.mesh_shape)} devices; sharded on dim {d}")
            return
    plan.require(node, _spec(meta.ndim, 0, axes), "no dim divides")


# -- Megatron ----------------------------------------------------------------------------------------

def _megatron_spec(graph, p: fx.Node, ndim: int, roles: dict[str, str], tp: int) -> tuple[ShardSpec, str]:
    """The Megatron layout of parameter ``p`` and a short reason."""
    if is_embedding_weight(p):
        if is_token_embedding(graph, p):
            return _spec(ndim, 0, (tp,)), "vocab-parallel embedding"
        return _spec(ndim), "replicated"
    for user in p.users:
        slot = matmul_slot(user, p)
        if slot is None or user.name not in roles:
            continue
        role = roles[user.name]
        # linear weights are [out, in]; addmm/mm (GPT-2 Conv1D) weights are [in, out]
        out_dim, in_dim = (0, 1) if user.target is aten.linear.default else (1, 0)
        if slot == "bias":
            return (_spec(ndim, 0, (tp,)) if role == COLUMN else _spec(ndim)), f"{role}-parallel bias"
        return _spec(ndim, out_dim if role == COLUMN else in_dim, (tp,)), f"{role}-parallel weight"
    return _spec(ndim), "replicated"


def megatron(cg: CostGraph, tp_axis: int = 1, use_names: bool = True) -> Restriction:
    """Megatron-LM: tensor parallel over ``tp_axis``, data parallel over the other axis.

    Resharding is penalised (``reshard=False``): with it free, the ILP gathered the sharded weights
    before use (22 ``S1R -> RR`` gathers per step on a 4-layer Llama), which is not Megatron and
    ran 1.35x slower than DTensor's tensor parallelism."""
    if tp_axis not in (0, 1):
        raise ValueError(f"tp_axis must be 0 or 1 (a mesh axis), got {tp_axis}")
    plan = _Plan(cg, "megatron")
    mesh_shape = cg.mesh.shape
    if mesh_shape[tp_axis] == 1:
        plan.notes.add(f"megatron: tp axis {tp_axis} has size 1 on mesh {cg.mesh}: plain data parallel")
    roles = linear_roles(cg, use_names)
    for node in parameter_nodes(cg):
        p = cg.graph.node(node.members[0])
        ndim = _meta_ndim(cg, node)
        spec, why = _megatron_spec(cg.graph, p, ndim, roles, tp_axis) if mesh_shape[tp_axis] > 1 else (_spec(ndim), "")
        plan.require(node, spec, why)
    for node in input_nodes(cg):
        plan.batch_shard(node, _axes(mesh_shape, exclude=(tp_axis,)))
    return plan.restriction()._replace(reshard=False)


# -- solving -----------------------------------------------------------------------------------------

BASELINES: dict[str, Callable[..., Restriction]] = {
    "data_parallel": data_parallel,
    "megatron": megatron,
    "zero3": zero3,
    "replicated": replicated,
}
"""Baseline name -> the function building its restriction."""


def restriction(cg: CostGraph, name: str, **kwargs) -> Restriction:
    """The restriction of baseline ``name`` (keyword arguments go to its function)."""
    try:
        build = BASELINES[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; baselines: {', '.join(BASELINES)}") from None
    return build(cg, **kwargs)


def _keep(options: SolverOptions) -> SolverOptions:
    return dataclasses.replace(options, fixed_decision=Decision.KEEP)


def solve_baseline(cg: CostGraph, name: str, options: SolverOptions = SolverOptions(),
                   name_minimum: bool = True, **kwargs) -> BaselineResult:
    """The best plan of baseline family ``name`` under ``options`` (memory decisions fixed to
    ``keep``). Raises :class:`~autoshard.errors.InfeasibleBudgetError` when no plan of the
    family fits the budget, naming the smallest budget that does unless ``name_minimum=False``
    (see also :func:`baseline_minimum_budget`)."""
    r = restriction(cg, name, **kwargs)
    return BaselineResult(solve(cg, _keep(options), allowed=r.allowed, reshard=r.reshard, name_minimum=name_minimum),
                          r.notes, r.allowed)


ARBITRATED: tuple[str, ...] = ("data_parallel", "zero3", "replicated")
"""The baseline families :func:`best_by_step_model` solves to check the ILP's plan against: those
whose step the ILP prices linearly where the runtime does something else (data parallelism: every
gradient bucketed and overlapped with backward; ZeRO-3: per-block gathers and reduce-scatters), and
the plan with no collective at all (replicated), which a plan that shards only part of the graph
can miss by the ILP's approximations: it prices an activation gradient's all-reduce that the runtime
defers into the parameters' buckets (:mod:`autoshard.grad_reduction`) inline, and no collective's
wait for drifted ranks (:mod:`.sync_wait`). mlp-256 at batch 8 on 4 gloo ranks: the ILP's plan
(the first layer replicated, the rest sharded) objective 21.1 ms, :func:`~.ilp.predict` 23.1 ms;
the replicated plan 22.2 ms both ways, measured 17.6 ms against 25.8.
Megatron is left out: what sets it apart, its tensor-parallel collectives, runs inline and the ILP
prices it exactly as :func:`~.ilp.predict` does, and its restricted ILP (resharding penalised) was
the slowest of the three parallel families (about 3 s of a 8 s Llama-7B plan). Over 36 model x profile x mesh x budget
cases (GPT-2, Llama, BERT, MLP, CNN; cpu-gloo and the H100 profiles) it never modeled faster than
the ILP's plan where it fit the budget (1.01x to 39x slower)."""


DATA_PARALLEL_MARGIN = 0.05
"""How much faster (a fraction of its step) the ILP's plan must be modeled than the data-parallel plan
for :func:`best_by_step_model` to take it over that one, where no other arbitrated family (ZeRO-3,
replicated) is modeled faster than data parallelism (gpt2-mini on 2x4 under ``h100-nvlink``: data
parallelism is modeled slower than one device, and the ILP's plan is kept). Plans the model separates by a few percent
are within its error, and a plan that mixes axes carries costs it does not price (on 4 gloo ranks
sharing 2 cores, all-reduces that alternate between the mesh axes took up to 29% longer than the
profile's price on one axis, 12% in a synthetic probe, and compute on shards of odd shapes runs slower
than its curves); the data-parallel plan is the program torch DDP runs. cnn-28 at batch 8, 32 x 32
images, on 4 gloo ranks: the ILP's plan (the first conv's channels over axis 0, the batch over axis 1)
was modeled 3.0% and 1.5% faster than data parallelism under two measured profiles and measured 1.11x
and 1.15x slower head to head (1.08x in a third hour). Over every other model of the
fidelity runs, every plan picked over data parallelism was modeled at least 15% faster than it."""


def best_by_step_model(cg: CostGraph, solution: Solution, options: SolverOptions = SolverOptions(),
                       prefer_data_parallel_within: float = DATA_PARALLEL_MARGIN) -> Solution:
    """``solution`` (the ILP's), or the best plan of a family of :data:`ARBITRATED` where
    :func:`~.ilp.predict` (the exact step schedule) models that one faster. The ILP prices some of the step
    linearly (gradient sync as bucket rates; a parameter that reaches an op resharded, or whose uses need
    different gradient reductions, as if bucketed, where the runtime all-reduces it inline),
    so on models where plans differ by a few collectives the exact model arbitrates. Then the
    data-parallel plan, where it fits and no other family's is modeled faster, unless the best is
    modeled faster than it by more than ``prefer_data_parallel_within`` of its step
    (:data:`DATA_PARALLEL_MARGIN`; 0 takes the best as modeled). A family that does not fit the
    budget is skipped. The replacement says why in ``stats["note"]``."""
    best, family, families = solution, None, {}
    for name in ARBITRATED:
        r = restriction(cg, name)
        if options.memory_budget is not None and static_floor(cg, options, r.allowed) > options.memory_budget:
            continue           # its parameters, gradients and optimizer state alone do not fit
        try:
            families[name] = candidate = solve(cg, _keep(options), allowed=r.allowed, reshard=r.reshard,
                                               name_minimum=False)
        except InfeasibleBudgetError:
            continue
        if candidate.time.total < best.time.total * (1 - 1e-9):
            best, family = candidate, name
    dp = families.get("data_parallel")
    # family None: the ILP's plan is the best, and no family is modeled faster than data parallelism's
    if (family is None and dp is not None and dp.choice != best.choice
            and all(dp.time.total <= f.time.total for f in families.values())
            and dp.time.total <= best.time.total * (1 + prefer_data_parallel_within)):
        dp.stats["note"] = (
            f"the data-parallel plan, modeled {dp.time.total * 1e3:.2f} ms per step, replaces the ILP's plan, "
            f"modeled {best.time.total * 1e3:.2f} ms: no plan is modeled more than "
            f"{prefer_data_parallel_within:.0%} faster than data parallelism (prefer_data_parallel_within; "
            "closer plans are within the cost model's error)")
        return dp
    if family is not None:
        best.stats["note"] = (f"the best {family} plan, modeled {best.time.total * 1e3:.2f} ms per step, replaces "
                              f"the ILP's plan, modeled {solution.time.total * 1e3:.2f} ms (the ILP prices "
                              "gradient sync, per-block gathers and deferred gradient all-reduces "
                              "approximately and stops within its gap; the step schedule decides)")
    return best


def baseline_minimum_budget(cg: CostGraph, name: str, options: SolverOptions = SolverOptions(),
                            **kwargs) -> float:
    """The smallest per-device peak (bytes) any plan of baseline family ``name`` reaches."""
    r = restriction(cg, name, **kwargs)
    return minimum_budget(cg, _keep(options), r.allowed, r.reshard)[0]
