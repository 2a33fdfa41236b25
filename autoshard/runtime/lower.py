"""Lower a plan to the local program of one rank: an fx graph over local shards with collectives.

Every graph node runs its handler's local kernel (:class:`autoshard.handlers.registry.LocalKernel`)
under the plan's decision for it, rebuilt from the plan entry alone (:func:`check_decision`; no
strategy is enumerated again). Around it the generated code inserts, by name:

- ``reshard(x, comm, fwd=..., bwd=...)`` where the producer's output spec differs from the
  consumer's input spec (the plan's forward moves; the gradient takes the plan's backward moves);
- ``sync_grad(x, comm, axes)`` on an operand that is replicated on axes where the computation is
  split (identity forward, gradient all-reduce backward) - except where that partial gradient can
  flow back through replicated computation to parameters, whose gradients are then synchronised
  after backward in buckets (:mod:`autoshard.grad_reduction` decides, as the cost model prices;
  :mod:`autoshard.runtime.grad_sync` runs the buckets);
- ``reduce_partial(y, comm, axes)`` on an output that is a pending sum (all-reduce forward,
  identity backward);
- ``shard_input(x, comm, dims)`` on a user input given as the global batch;
- ``gather_params(comm, axes, dims, *shards)`` before the first use of a block's sharded
  parameters that are read replicated: one all-gather for the block forward, one reduce-scatter
  of their gradients backward (FSDP's program; :mod:`autoshard.param_gather` decides which).

The graph's placeholders are the original ones (parameters, buffers, user inputs, in order), fed
with local tensors; the outputs are the original outputs, replicated (global), or, for a plan with
``outputs="local"``, those of rank >= 1 as this rank's shard in the layout the plan's output node
records (its producer's: nothing is gathered).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..batch_norm_modes import op_function_args
from ..capture import CapturedGraph
from ..decisions import Decision, stays_resident
from ..grad_reduction import GradReduction, grad_nodes, plan_gradient_reduction
from ..handlers import handler_for
from ..handlers.registry import default_kernel, op_info
from ..mesh import MeshSpec
from ..opinfo import OpInfo, op_name
from ..param_gather import ParamGathers, param_uses, plan_param_gathers
from ..plans import NodePlan, Plan, PlanError, ReshardEntry
from ..specs import ShardSpec, replicated_axes
from ..strategy import BWD, FWD, Strategy
from ..memory.annotations import CHECKPOINT_META, OFFLOAD_META, PARTITION_AXES_META, PARTITION_META
from ..memory.codegen import apply_memory_annotations
from ..memory.module_state import STATE_META, update_state_once
from .collectives import MeshComm, iter_moves

_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format,
             slice, type(Ellipsis))


@dataclass
class PlaceholderInfo:
    """One input of the local program: what it is and the layout it is held in."""

    name: str
    kind: str                      # "param", "buffer", "constant", "input", "unused"
    fqn: str | None
    spec: ShardSpec | None


@dataclass
class LocalProgram:
    """The generated module and what its caller must feed it."""

    module: fx.GraphModule
    placeholders: list[PlaceholderInfo]
    bucketed_grads: dict[str, tuple[int, ...]] = field(default_factory=dict)   # param placeholder -> axes
    output_specs: list[ShardSpec | None] = field(default_factory=list)   # per flat output: its layout
    # buffer FQN -> mesh axes over which kernels leave its copies differing (per-rank statistics)
    local_state: dict[str, tuple[int, ...]] = field(default_factory=dict)


class LoweringError(PlanError):
    """A plan that cannot be lowered onto this graph (names the node and what to do)."""


def lower(graph: CapturedGraph, plan: Plan, comm: MeshComm, device: torch.device, *,
          input_mode: str = "global", bucket_grads: bool = True) -> LocalProgram:
    """The local program of this rank for ``plan`` on ``graph`` (see the module docstring)."""
    return _Lowering(graph, plan, comm, device, input_mode, bucket_grads).run()


class _Lowering:
    def __init__(self, graph: CapturedGraph, plan: Plan, comm: MeshComm, device: torch.device,
                 input_mode: str, bucket_grads: bool) -> None:
        if input_mode not in ("global", "local"):
            raise ValueError(f"input_mode must be 'global' or 'local', got {input_mode!r}")
        self.graph, self.plan, self.comm, self.device = graph, plan, comm, device
        self.input_mode = input_mode
        self.mesh = MeshSpec.of(tuple(plan.mesh_shape))
        self.function_args = op_function_args(self.mesh, plan.outputs, plan.batch_norm, plan.loss)
        self.reshards: dict[tuple[str, int], ReshardEntry] = {(r.dst, r.operand): r for r in plan.reshards}
        self.out = fx.Graph()
        self.root = torch.nn.Module()
        self.root.comm = comm
        self.comm_node: fx.Node | None = None
        self.env: dict[str, Any] = {}          # old node name -> new node (or list, multi-output)
        self.spec_of: dict[str, Any] = {}      # old node name -> output spec (or list)
        self.n_consts = 0
        self.ops: dict[str, OpInfo] = {}             # call node -> the node as its handler sees it
        self.strategies: dict[str, Strategy] = {}    # call node -> the plan's decision, rebuilt and checked
        self.reduction = self._gradient_reduction() if bucket_grads else GradReduction()
        self.gathers = self._param_gathers() if bucket_grads else ParamGathers()
        self.bucketed = {**self.reduction.bucketed, **self.gathers.leftover()}
        self.gathered: dict[str, fx.Node] = {}   # parameter -> its gathered (whole) value
        self.regions: dict[str, int] = {}      # memory region (segment or selective run) -> region id
        self.region_of = plan.memory_regions()  # graph node -> (region, decision), not-kept nodes only
        self.gather_before = self._gather_points()
        self.synced: dict[tuple[fx.Node, tuple[int, ...]], fx.Node] = {}
        self.output_specs: list[ShardSpec | None] = []
        self.local_state: dict[str, tuple[int, ...]] = {}
        self.mp = plan.mixed_precision
        self.cast: dict[str, fx.Node] = {}     # parameter -> its working copy (mixed precision)
        self.cast_before = self._cast_points() if self.mp is not None else {}

    # -- driver ----------------------------------------------------------------------------------

    def run(self) -> LocalProgram:
        placeholders = []
        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                placeholders.append(self._placeholder(node))
            elif node.op == "call_function":
                for group in self.gather_before.get(node.name, ()):   # outside any memory region
                    self._gather_params(group)
                for param in self.cast_before.get(node.name, ()):     # likewise
                    self._working_copy(param)
                last = self.out._root.prev            # the graph's last node before this one's
                self._call(node)
                self._annotate_memory(node, last)
            elif node.op == "output":
                self._output(node)
            elif node.op == "get_attr":
                self.env[node.name] = self._constant(getattr(self.graph.graph_module, node.target), node.name)
            else:
                raise LoweringError(f"node '{node.name}' has fx op {node.op!r}, which the runtime cannot run")
        self.out.lint()
        gm = fx.GraphModule(self.root, self.out, class_name="LocalProgram")
        gm.comm = self.comm          # also where no collective reads it (partitioned checkpoints do)
        if self.regions:
            gm = apply_memory_annotations(gm)
        return LocalProgram(gm, placeholders, dict(self.bucketed), self.output_specs, dict(self.local_state))

    # -- memory decisions ------------------------------------------------------------------------

    def _annotate_memory(self, node: fx.Node, last: fx.Node) -> None:
        """Mark the nodes generated for ``node`` with its memory region's decision: a checkpoint
        region (recompute, or one run of a selective segment), a partitioned checkpoint region, or
        a host-offload region."""
        if node.name not in self.region_of:
            return
        key, decision = self.region_of[node.name]
        region = self.regions.setdefault(key, len(self.regions))
        new = last.next
        while new is not self.out._root:
            if new.op != "get_attr":
                if decision == Decision.OFFLOAD:
                    new.meta[OFFLOAD_META] = [region, True, True]
                else:
                    new.meta[CHECKPOINT_META] = region
                    if decision == Decision.PARTITIONED:
                        new.meta[PARTITION_META] = True
            new = new.next

    def _mark(self, new: fx.Node, spec: Any, node: fx.Node) -> None:
        """Record on ``new``, the generated value of graph node ``node``, the mesh axes a partitioned
        checkpoint may split it over: those it is replicated over, or none where it stays resident
        anyway (:func:`~autoshard.decisions.stays_resident`, the rule the solver prices)."""
        if not isinstance(spec, ShardSpec):
            return
        readers = {seg for u in node.users if (seg := self._node_plan(u.name).segment)}
        resident = stays_resident(self._node_plan(node.name).segment, readers)
        new.meta[PARTITION_AXES_META] = () if resident else replicated_axes(spec, self.comm.mesh_shape)

    # -- placeholders ----------------------------------------------------------------------------

    def _placeholder(self, node: fx.Node) -> PlaceholderInfo:
        g = self.graph
        name = node.name
        new = self.out.placeholder(name)
        spec = self._node_plan(name).output_specs()[0]
        if name in g.param_fqn:
            kind, fqn = "param", g.param_fqn[name]
        elif name in g.buffer_fqn:
            kind, fqn = "buffer", g.buffer_fqn[name]
        elif name in g.constant_fqn:
            kind, fqn = "constant", g.constant_fqn[name]
        elif name in g.tied_placeholders:
            kind, fqn = "unused", None
        else:
            kind, fqn = "input", g.user_input_specs.get(name)
        if kind == "input" and self.input_mode == "global" and spec is not None and not spec.is_replicated():
            new = self.out.call_method("shard_input", (self._comm(), new, spec.dims))
        if kind == "input":
            self._mark(new, spec, node)
        if kind == "buffer":
            new.meta[STATE_META] = True
        self.env[name] = new
        self.spec_of[name] = spec
        return PlaceholderInfo(name, kind, fqn, spec)

    # -- nodes -----------------------------------------------------------------------------------

    def _call(self, node: fx.Node) -> None:
        strategy = self._strategy(node)
        handler = handler_for(node.target)
        op = self._op(node)
        kernel = (handler.kernel if handler is not None else default_kernel)(op, strategy)
        local: dict[fx.Node, fx.Node] = {}
        for j, operand in enumerate(op.operand_nodes):
            value = self._operand(node, j, operand, strategy)
            if operand in local and local[operand] is not value:
                raise LoweringError(f"{op.describe()}: operand '{operand.name}' is used twice in different "
                                    f"layouts, which the runtime cannot express; re-plan with this node replicated")
            local[operand] = value
        if node.target is operator.getitem:       # the element itself, already in the input layout
            self.env[node.name] = local[op.operand_nodes[0]] if op.operand_nodes else self._literal(node.args)
            self.spec_of[node.name] = strategy.output_specs[0]
            self._mark(self.env[node.name], strategy.output_specs[0], node)
            return
        args, kwargs = self._substitute((kernel.args, kernel.kwargs), local)
        if kernel.uses_comm:
            kwargs = {**kwargs, "comm": self._comm()}
        state = tuple(i for i, a in enumerate(kernel.args) if isinstance(a, fx.Node) and a.name in self.graph.buffer_fqn)
        for i in state if kernel.state_axes else ():
            fqn = self.graph.buffer_fqn[kernel.args[i].name]
            self.local_state[fqn] = tuple(sorted({*self.local_state.get(fqn, ()), *kernel.state_axes}))
        if state and node.name in self.region_of:     # recomputed in backward: update the buffers once
            result = self.out.create_node("call_function", update_state_once,
                                          (self._constant(kernel.target, "kernel"), state, *args), dict(kwargs),
                                          name=node.name)
        else:
            result = self.out.create_node("call_function", kernel.target, tuple(args), dict(kwargs), name=node.name)
        is_tuple = isinstance(self.graph.tensor_meta(node), tuple)
        outs = self._outputs(op, strategy, result, is_tuple)
        if kernel.epilogue is not None:
            ins = tuple(local[o] for o in op.operand_nodes)
            packed = self.out.call_function(kernel.epilogue, (tuple(outs), ins))
            outs = [self.out.call_function(operator.getitem, (packed, j)) for j in range(len(outs))]
        self.env[node.name] = outs if is_tuple else outs[0]
        self.spec_of[node.name] = list(strategy.output_specs)
        for out, spec in zip(outs, strategy.output_specs):
            self._mark(out, spec, node)   # a tuple's elements: marked again by their getitem nodes

    def _outputs(self, op: OpInfo, strategy: Strategy, result: fx.Node, is_tuple: bool) -> list[fx.Node]:
        """Per-output nodes (elements of a tuple result), with the partial outputs all-reduced."""
        n = len(op.outputs)
        outs = [self.out.call_function(operator.getitem, (result, j)) for j in range(n)] if is_tuple else [result]
        for j in range(n):
            axes = _comm_axes(strategy, FWD, f"out{j}", self.comm)
            if axes:
                outs[j] = self.out.call_method("reduce_partial", (self._comm(), outs[j], axes))
        return outs

    def _operand(self, node: fx.Node, j: int, operand: fx.Node, strategy: Strategy) -> fx.Node:
        if (node.name, j) in self.gathers.uses:   # its group's gather; the reduce-scatter sums its gradient
            return self.gathered[operand.name]
        value = self._working_copy(operand.name)
        src_output = self.graph.output_index(node, operand)
        if isinstance(value, list):
            value = value[src_output]
        entry = self.reshards.get((node.name, j))
        if entry is not None:
            if entry.src != operand.name:
                raise LoweringError(f"plan reshards operand {j} of node '{node.name}' from '{entry.src}', "
                                    f"but the graph's operand is '{operand.name}': the plan is for another graph")
            value = self._reshard(value, entry, parameter=operand.name in self.graph.param_fqn,
                                  grad_dtype=self._grad_dtype(operand.name))
        axes = _comm_axes(strategy, BWD, f"in{j}", self.comm)
        if axes and (node.name, j) not in self.reduction.deferred:
            grad_dtype = self._grad_dtype(operand.name)
            sync_args = (self._comm(), value, axes) + ((grad_dtype,) if grad_dtype is not None else ())
            if entry is not None:
                return self.out.call_method("sync_grad", sync_args)
            # Consumers of one value that need the same gradient all-reduce share it: autograd
            # sums their partial gradients locally, then one all-reduce runs (the plan counts one).
            key = (value, axes)
            if key not in self.synced:
                self.synced[key] = self.out.call_method("sync_grad", sync_args)
            value = self.synced[key]
        return value

    def _working_copy(self, name: str) -> fx.Node:
        """The value an op reads for graph node ``name``: under mixed precision a floating-point
        parameter's working copy (cast at its point, :meth:`_cast_points`; one copy shared by its
        uses; the gradient flows back into the master in the master's dtype), anything else as it is."""
        value = self.env[name]
        if self.mp is None or name not in self.graph.param_fqn or not self.graph.tensor_meta(name).dtype.is_floating_point:
            return value
        if name not in self.cast:
            self.cast[name] = self.out.call_method("cast_param", (self._comm(), value, self.mp.param))
        return self.cast[name]

    def _grad_dtype(self, name: str) -> torch.dtype | None:
        """The dtype an inline reduction of parameter ``name``'s gradient runs in: mixed precision's
        reduce dtype where it differs from the working dtype, else None (the gradient's own)."""
        if self.mp is None or name not in self.graph.param_fqn or self.mp.reduce == self.mp.param:
            return None
        return self.mp.reduce

    def _output(self, node: fx.Node) -> None:
        plan_node = self._node_plan(node.name)
        specs = plan_node.input_specs()
        tensor_ops = [n for n in node.all_input_nodes if self.graph.tensor_meta(n) is not None
                      and not isinstance(self.graph.tensor_meta(n), tuple)]
        values: dict[fx.Node, fx.Node] = {}
        for j, operand in enumerate(tensor_ops):
            entry = self.reshards.get((node.name, j))
            value = self.env[operand.name]
            value = value[0] if isinstance(value, list) else value
            if entry is not None:
                value = self._reshard(value, entry)
            elif self._per_rank_scalar(operand, specs[j]):
                value = self.out.call_method("rank_share", (self._comm(), value, specs[j].partial))
            elif not specs[j].is_replicated() and not self._local_output(operand, specs[j]):
                raise LoweringError(f"output '{operand.name}' is not replicated and the plan has no resharding "
                                    f"for it; the plan is inconsistent")
            values[operand] = value
        layout = dict(zip(tensor_ops, specs))
        args = pytree.tree_map(lambda x: values.get(x, x) if isinstance(x, fx.Node) else x, node.args)
        flat = node.args[0] if len(node.args) == 1 else node.args
        self.output_specs = [layout.get(x) if isinstance(x, fx.Node) else None
                             for x in (flat if isinstance(flat, (tuple, list)) else [flat])]
        self.out.output(args[0] if len(args) == 1 else args)

    def _per_rank_scalar(self, operand: fx.Node, spec: ShardSpec) -> bool:
        """A 0-dim output that a plan with ``outputs="local"`` and ``loss="per_rank"`` returns as
        each rank's value (its pending sum scaled to the mean over the ranks, as a DDP rank's loss)."""
        return (bool(self.function_args["returns_per_rank"]) and bool(spec.partial)
                and not spec.dims and spec == self._produced(operand))

    def _produced(self, operand: fx.Node) -> ShardSpec:
        produced = self.spec_of[operand.name]
        return produced[0] if isinstance(produced, list) else produced

    def _local_output(self, operand: fx.Node, spec: ShardSpec) -> bool:
        """A plan with ``outputs="local"`` returns ``operand`` as this rank's shard: the plan's
        layout for it must be the one its producer computes it in, and not a pending sum."""
        return self.plan.outputs == "local" and not spec.partial and spec == self._produced(operand)

    # -- helpers ---------------------------------------------------------------------------------

    def _node_plan(self, name: str):
        try:
            return self.plan.nodes[name]
        except KeyError:
            raise LoweringError(f"the plan has no entry for graph node '{name}': it was made for another "
                                f"graph. Re-plan this model.") from None

    def _op(self, node: fx.Node) -> OpInfo:
        if node.name not in self.ops:
            self.ops[node.name] = op_info(node, self.graph, self.mesh, **self.function_args)
        return self.ops[node.name]

    def _strategy(self, node: fx.Node) -> Strategy:
        """The plan's decision for call node ``node``, rebuilt from its entry alone (no strategy is
        enumerated) and checked against the graph node (:func:`check_decision`)."""
        if node.name not in self.strategies:
            entry = self._node_plan(node.name)
            self.strategies[node.name] = check_decision(entry, self._op(node), bool(self.plan.fallbacks))
        return self.strategies[node.name]

    def _reshard(self, value: fx.Node, entry: ReshardEntry, parameter: bool = False,
                 grad_dtype: torch.dtype | None = None) -> fx.Node:
        kwargs: dict[str, Any] = {"fwd": tuple(iter_moves(entry.fwd)), "bwd": tuple(iter_moves(entry.bwd))}
        if parameter:
            kwargs["parameter"] = True
        if grad_dtype is not None:
            kwargs["grad_dtype"] = grad_dtype
        return self.out.create_node("call_method", "reshard", (self._comm(), value), kwargs,
                                    name=f"{entry.src}_{entry.dst_spec}".lower().replace("+", "p"))

    def _gather_points(self) -> dict[str, list]:
        """Graph node -> the gather groups to gather just before it: before the group's first use
        or, where that use is inside a memory region (which must stay one unbroken run of nodes),
        before the region's first node; the gather then runs once, never again in backward."""
        region_start: dict[object, str] = {}
        for node in self.graph.graph.nodes:
            if node.name in self.region_of:
                region_start.setdefault(self.region_of[node.name][0], node.name)
        points: dict[str, list] = {}
        for group in self.gathers.groups:
            at = group.first_use
            if at in self.region_of:
                at = region_start[self.region_of[at][0]]
            points.setdefault(at, []).append(group)
        return points

    def _cast_points(self) -> dict[str, list[str]]:
        """Graph node -> the parameters to cast to the working dtype just before it (mixed
        precision): before the first use that does not read the parameter gathered or, where that
        use is inside a memory region, before the region's first node, as for gathers. The copy is
        then held for the step, as the plan counts it, and never cast again in backward."""
        region_start: dict[object, str] = {}
        order = {}
        for i, node in enumerate(self.graph.graph.nodes):
            order[node.name] = i
            if node.name in self.region_of:
                region_start.setdefault(self.region_of[node.name][0], node.name)
        points: dict[str, list[str]] = {}
        for node in self.graph.graph.nodes:
            if node.name not in self.graph.param_fqn or not self.graph.tensor_meta(node.name).dtype.is_floating_point:
                continue
            uses = [u for u in node.users if u.op == "call_function" and any(
                n == node.name and (u.name, j) not in self.gathers.uses for j, n in enumerate(self._operand_names(u)))]
            if not uses:
                continue
            at = min(uses, key=lambda u: order[u.name]).name
            if at in self.region_of:
                at = region_start[self.region_of[at][0]]
            points.setdefault(at, []).append(node.name)
        return points

    def _gather_params(self, group) -> None:
        """One all-gather of a group's parameter shards (see :mod:`autoshard.param_gather`)."""
        shards = tuple(self.env[p.name] for p in group.params)     # master shards: cast inside, as FSDP2
        dims = tuple(p.dim for p in group.params)
        dtypes = {} if self.mp is None else {"param_dtype": self.mp.param, "reduce_dtype": self.mp.reduce}
        whole = self.out.call_method("gather_params", (self._comm(), group.axes, dims, *shards), dtypes)
        for j, p in enumerate(group.params):
            self.gathered[p.name] = self.out.call_function(operator.getitem, (whole, j))

    def _comm(self) -> fx.Node:
        if self.comm_node is None:        # created at its first use, so it precedes every use
            self.comm_node = self.out.get_attr("comm")
        return self.comm_node

    def _substitute(self, tree: Any, local: dict[fx.Node, fx.Node]) -> Any:
        def sub(x: Any) -> Any:
            if isinstance(x, fx.Node):
                if x in local:
                    return local[x]
                if x.name in self.env:
                    value = self.env[x.name]
                    return value[0] if isinstance(value, list) else value
                raise LoweringError(f"argument '{x.name}' of a kernel is not an operand the runtime knows")
            if isinstance(x, torch.device):
                return self.device
            if isinstance(x, _LITERALS) or isinstance(x, (tuple, list, dict)):
                return x
            return self._constant(x, "const")

        return pytree.tree_map(sub, tree, is_leaf=lambda x: isinstance(x, (fx.Node, torch.device)))

    def _literal(self, args: Any) -> Any:
        raise LoweringError(f"getitem with no tensor operand: {args}")

    def _constant(self, value: Any, hint: str) -> fx.Node:
        """A non-literal kernel argument (a sub-graph, a tensor constant) held by the module."""
        name = f"_{hint}_{self.n_consts}"
        self.n_consts += 1
        setattr(self.root, name, value)
        return self.out.get_attr(name)

    def _gradient_reduction(self) -> GradReduction:
        """Which gradients are all-reduced after backward in buckets (parameters) and which
        ``sync_grad`` all-reduces that makes unnecessary (see :mod:`autoshard.grad_reduction`)."""
        nodes = grad_nodes(self.graph, self._operand_names, self._strategy,
                           lambda name, j: (name, j) in self.reshards, self.comm.mesh_shape)
        return plan_gradient_reduction(nodes)

    def _param_gathers(self) -> ParamGathers:
        stored, uses = param_uses(self.graph, self._operand_names, self._strategy,
                                  lambda name: self._node_plan(name).output_specs()[0], self.comm.mesh_shape)
        return plan_param_gathers(stored, uses, self.comm.mesh_shape)

    def _operand_names(self, node: fx.Node) -> list[str]:
        return [n.name for n in self._op(node).operand_nodes]


def check_decision(entry: NodePlan, op: OpInfo, fallbacks: bool) -> Strategy:
    """The strategy plan entry ``entry`` records for call node ``op`` (see
    :meth:`Strategy.from_plan`), after checking that it fits the node: one input spec per tensor
    operand read from the producers the plan names, one output spec per output (None exactly where
    the node has no tensor output), every spec of the tensor's rank and dividing its shape on the
    mesh, one option tag per mesh axis, and a handler for the op unless the plan replicates the node
    as a fallback. :class:`LoweringError` naming the node, op and module otherwise."""
    def bad(what: str, why: str = "the plan does not fit this graph (edited, or made for another model)") \
            -> LoweringError:
        return LoweringError(f"node '{op.node.name}' ({op_name(op.target)}, module "
                             f"'{op.graph.module_path(op.node) or '<root>'}'): the plan's decision {what}; {why}. "
                             f"Re-plan this model.")

    try:
        s = Strategy.from_plan(entry)
    except ValueError as e:
        raise bad(f"cannot be read ({e})") from None
    mesh_shape = op.mesh.shape
    names = [n.name for n in op.operand_nodes]
    if len(s.input_specs) != len(names) or (entry.operands and entry.operands != names):
        raise bad(f"reads {len(s.input_specs)} operand(s) {entry.operands}, the node reads {len(names)} ({names})")
    if len(s.output_specs) != len(op.outputs):
        raise bad(f"lays out {len(s.output_specs)} output(s), the node has {len(op.outputs)}")
    if len(s.tags) != len(mesh_shape):
        raise bad(f"has {len(s.tags)} per-axis option tag(s) for a mesh of {len(mesh_shape)} axes")
    tensors = [(f"operand {j}", spec, meta) for j, (spec, meta) in enumerate(zip(s.input_specs, op.operands))]
    tensors += [(f"output {j}", spec, meta) for j, (spec, meta) in enumerate(zip(s.output_specs, op.outputs))]
    for what, spec, meta in tensors:
        if (spec is None) != (meta is None):
            raise bad(f"gives {what} the layout {spec}, but the node's {what} is "
                      f"{'not a tensor' if meta is None else f'a tensor of shape {list(meta.shape)}'}")
        if spec is not None and not spec.fits(meta.shape, mesh_shape):
            raise bad(f"lays out {what} as {spec}, which does not fit its shape {list(meta.shape)} on the "
                      f"{'x'.join(map(str, mesh_shape))} mesh")
    if handler_for(op.target) is None and not (fallbacks and not s.comm and all(
            spec is None or spec.is_replicated() for spec in (*s.input_specs, *s.output_specs))):
        raise bad(f"{s.name!r} runs the handler of {op_name(op.target)}",
                  "none is registered in this process: register the one the plan was made with before "
                  "parallelize, or re-plan (with fallback='replicate' to run the op replicated)")
    return s


def _comm_axes(strategy: Strategy, phase: str, operand: str, comm: MeshComm) -> tuple[int, ...]:
    axes: set[int] = set()
    for c in strategy.comm:
        if c.phase == phase and c.operand == operand and c.kind == "all_reduce":
            axes |= set(c.axes)
    return comm.live_axes(axes)

