"""Sharding strategies of one graph node, and the general per-axis expander.

A handler states, for ONE mesh axis, what that axis may shard for its op (an :class:`AxisOption`:
a dim of each tensor operand or ``None``, and for each output a dim, ``None`` or :data:`PARTIAL`).
:func:`expand` takes every combination of those options over the mesh axes, forms ``S01`` where
both axes pick the same dim, drops combinations whose shapes do not divide, and prices each one:
compute of the local shard (the hardware profile's measured curve for the op's family where it has
one, else the roofline; :func:`compute_seconds`), forward communication (the all-reduce that
resolves a partial output), backward communication (the all-reduce of the gradient of an operand that is
replicated on an axis whose computation is split), and memory per device.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .hardware import ELEMENTWISE_FUNCTIONS, FEW_ROWS, NARROW_HEAD_DIM
from .phases import Phase
from .specs import ShardSpec

if TYPE_CHECKING:
    from .capture import TensorMeta
    from .hardware import HardwareProfile
    from .opinfo import OpInfo, OpProfile
    from .plans.schema import NodePlan

PARTIAL = "P"
"""Output marker in an :class:`AxisOption`: the output is a pending sum over that axis."""

FWD, BWD = Phase.FWD, Phase.BWD


@dataclass(frozen=True)
class ExtraComm:
    """A collective an option needs beyond partial-output and gradient all-reduces (e.g. sync-BN stats).

    ``nbytes(op, input_specs, output_specs)`` gives the per-device buffer size in bytes, using the
    byte convention of :mod:`autoshard.comm_cost` for ``kind``.
    """

    kind: str
    phase: Phase
    nbytes: Callable[["OpInfo", Sequence[ShardSpec], Sequence[ShardSpec]], int]
    what: str


@dataclass(frozen=True)
class LocalCalls:
    """How a device runs a node's local kernel where that is not one call of the op on its shard:
    ``calls`` equal calls, each on ``1/calls`` of the work, and local copies around them (bytes
    each copy reads, per phase: concatenating the calls' outputs, or their input gradients)."""

    calls: int = 1
    copied_fwd: int = 0
    copied_bwd: int = 0


ONE_CALL = LocalCalls()


@dataclass(frozen=True)
class AxisOption:
    """What one mesh axis shards for an op.

    ``inputs[j]`` is the dim of tensor operand ``j`` sharded on this axis (``None``: replicated);
    ``outputs[j]`` likewise for output ``j``, or :data:`PARTIAL`.
    """

    inputs: tuple[int | None, ...]
    outputs: tuple[int | str | None, ...]
    tag: str = ""
    extra: tuple[ExtraComm, ...] = ()
    combine: str = ""     # options with different non-empty keys never share a strategy (their
                          # outputs resolve differently, e.g. a loss that is partial vs replicated)
    partial_grads: tuple[int, ...] = ()   # operands replicated on the axis whose gradient is still a
                                          # partial sum (the work is split and the output left partial)

    @property
    def splits_compute(self) -> bool:
        return any(d is not None for d in self.inputs) or any(d is not None for d in self.outputs)


@dataclass(frozen=True)
class CommAction:
    """One collective a strategy performs: ``kind`` over mesh ``axes`` on ``nbytes`` per device."""

    kind: str
    axes: tuple[int, ...]
    nbytes: int
    phase: Phase
    operand: str          # "out0", "in1", ... : which tensor it moves (or a description)
    cost: float           # seconds
    bucketed: bool = False  # a parameter's gradient all-reduce: the runtime batches these into
                            # buckets after backward (autoshard.comm_cost.grad_buckets), priced there

    def __str__(self) -> str:
        ax = "".join(str(a) for a in self.axes)
        return f"{self.phase}:{self.kind}[{ax}]({self.operand}, {self.nbytes} B)"


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per device a strategy implies."""

    params: int = 0          # local bytes of parameter operands
    grads: int = 0           # local bytes of their gradients
    saved: int = 0           # saved activations (autograd) that are not parameters
    outputs: int = 0         # local bytes of the outputs


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: specs of its tensor operands and outputs, and what that costs."""

    name: str
    input_specs: tuple[ShardSpec, ...]
    output_specs: tuple[ShardSpec | None, ...]
    compute_fwd: float
    compute_bwd: float
    comm: tuple[CommAction, ...]
    memory: MemoryCost
    split: int = 1                                 # devices the computation is divided over
    tags: tuple[str, ...] = field(default=(), compare=False)

    @property
    def output_spec(self) -> ShardSpec | None:
        return self.output_specs[0] if self.output_specs else None

    def comm_time(self, phase: Phase | None = None) -> float:
        """Seconds of this strategy's own collectives (all, or one phase's), bucketed gradient
        all-reduces priced one by one (the step-time model prices them as buckets)."""
        return sum(c.cost for c in self.comm if phase is None or c.phase == phase)

    def blocking_comm_time(self, phase: Phase) -> float:
        """Seconds of the collectives of ``phase`` that run inline (all but bucketed gradient sync)."""
        return sum(c.cost for c in self.comm if c.phase == phase and not c.bucketed)

    @property
    def total_time(self) -> float:
        """Compute and inline collectives (bucketed gradient sync is priced per step, in buckets)."""
        return self.compute_fwd + self.compute_bwd + self.blocking_comm_time(FWD) + self.blocking_comm_time(BWD)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "inputs": [str(s) for s in self.input_specs],
            "outputs": [None if s is None else str(s) for s in self.output_specs],
            "compute_fwd": self.compute_fwd,
            "compute_bwd": self.compute_bwd,
            "comm": [c.__dict__ for c in self.comm],
            "memory": self.memory.__dict__,
        }

    @classmethod
    def from_plan(cls, entry: "NodePlan") -> "Strategy":
        """The strategy a plan entry records, rebuilt from the entry alone (nothing is enumerated):
        its specs, per-axis option tags, split and collectives as the handler's kernel and the
        runtime read them, its costs as the plan counts them (a node's parameter memory is counted
        at the parameter's placeholder). Raises ``ValueError`` (a :class:`~autoshard.specs.SpecError`
        for a spec) on an entry with a malformed spec or an unknown phase."""
        comm = tuple(CommAction(c.kind, tuple(c.axes), c.nbytes, Phase(c.phase), c.operand, c.cost, c.bucketed)
                     for c in entry.collectives)
        memory = MemoryCost(**{f.name: entry.memory.get(f.name, 0) for f in fields(MemoryCost)})
        return cls(name=entry.strategy, input_specs=tuple(entry.input_specs()),
                   output_specs=tuple(entry.output_specs()), compute_fwd=entry.compute_fwd,
                   compute_bwd=entry.compute_bwd, comm=comm, memory=memory, split=entry.split, tags=tuple(entry.tags))


def replicate_option(n_inputs: int, n_outputs: int) -> AxisOption:
    return AxisOption((None,) * n_inputs, (None,) * n_outputs, tag="R")


def _norm_dim(d: int | str | None, ndim: int) -> int | str | None:
    if d is None or d == PARTIAL:
        return d
    assert isinstance(d, int)
    if not -ndim <= d < ndim:
        raise IndexError(f"dim {d} out of range for a rank-{ndim} tensor")
    return d % ndim


def _itemsize(meta: "TensorMeta | None") -> int:
    return 0 if meta is None else meta.dtype.itemsize


def local_bytes(meta: "TensorMeta | None", spec: ShardSpec | None, mesh_shape: Sequence[int]) -> int:
    """Bytes per device of a tensor laid out as ``spec`` on a mesh of ``mesh_shape`` (0 for none)."""
    if meta is None or spec is None:
        return 0
    return spec.local_numel(meta.shape, mesh_shape) * _itemsize(meta)


def _specs_for(
    combo: Sequence[tuple[int, AxisOption]],
    operands: Sequence["TensorMeta"],
    outputs: Sequence["TensorMeta | None"],
) -> tuple[list[ShardSpec], list[ShardSpec | None], list[tuple[int, ...]]] | None:
    """Combine one option per axis into specs; ``None`` when the combination is not a valid layout."""
    in_dims = [[[] for _ in m.shape] for m in operands]
    out_dims = [[[] for _ in m.shape] if m is not None else [] for m in outputs]
    out_partial: list[list[int]] = [[] for _ in outputs]
    for axis, opt in combo:
        for j, d in enumerate(opt.inputs):
            if d is not None:
                in_dims[j][_norm_dim(d, len(operands[j].shape))].append(axis)  # type: ignore[index]
        for j, d in enumerate(opt.outputs):
            if d == PARTIAL:
                out_partial[j].append(axis)
            elif d is not None:
                meta = outputs[j]
                if meta is None:
                    return None
                out_dims[j][_norm_dim(d, len(meta.shape))].append(axis)  # type: ignore[index]
    try:
        in_specs = [ShardSpec(tuple(tuple(d) for d in dims)) for dims in in_dims]
        out_specs = [ShardSpec(tuple(tuple(d) for d in dims)) if m is not None else None
                     for dims, m in zip(out_dims, outputs)]
    except ValueError:
        return None
    return in_specs, out_specs, [tuple(p) for p in out_partial]


def _fits(specs: Sequence[ShardSpec | None], metas: Sequence["TensorMeta | None"], mesh_shape) -> bool:
    return all(s is None or m is None or s.fits(m.shape, mesh_shape) for s, m in zip(specs, metas))


def expand(op: "OpInfo", options: Sequence[AxisOption], hw: "HardwareProfile",
           namer: Callable[["OpInfo", Sequence[ShardSpec], Sequence[ShardSpec | None], Sequence[AxisOption]], str],
           family: "str | Callable[[Sequence[ShardSpec], Sequence[ShardSpec | None]], str] | None" = None,
           local_calls: "Callable[[Sequence[ShardSpec], Sequence[ShardSpec | None]], LocalCalls] | None" = None
           ) -> list[Strategy]:
    """Every valid combination of per-axis ``options`` over the mesh, priced and named.

    The replicate option is always added. Mesh axes of size 1 only replicate (sharding over them
    would duplicate strategies without changing anything). ``family`` is the curve family that
    prices the op's compute (see :func:`compute_seconds`), or a function of a strategy's input and
    output specs that names it; None prices compute by the roofline. ``local_calls``, a function of
    the same specs, says where the local kernel is not one call of the op (see :class:`LocalCalls`).
    """
    from .comm_cost import collective_cost

    mesh_shape = op.mesh.shape
    n_in, n_out = len(op.operands), len(op.outputs)
    for opt in options:
        if len(opt.inputs) != n_in or len(opt.outputs) != n_out:
            raise ValueError(f"handler option {opt.tag!r} for {op.describe()} gives {len(opt.inputs)} inputs/"
                             f"{len(opt.outputs)} outputs, the node has {n_in}/{n_out}")
    rep = replicate_option(n_in, n_out)
    per_axis = [[(axis, o) for o in ([*options, rep] if mesh_shape[axis] > 1 else [rep])]
                for axis in range(len(mesh_shape))]
    profile = op.profile()
    seen: set = set()
    out: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        if len({o.combine for _, o in combo} - {""}) > 1:
            continue
        built = _specs_for(combo, op.operands, op.outputs)
        if built is None:
            continue
        in_specs, out_specs, out_partial = built
        if op.keeps_partial_outputs:        # returned as pending sums: no all-reduce, the spec says so
            out_specs = [s if s is None or not p else s.with_partial(p) for s, p in zip(out_specs, out_partial)]
            out_partial = [() for _ in out_partial]
        if not (_fits(in_specs, op.operands, mesh_shape) and _fits(out_specs, op.outputs, mesh_shape)):
            continue
        key = (tuple(in_specs), tuple(out_specs), tuple(out_partial))
        if key in seen:
            continue
        seen.add(key)
        opts = [o for _, o in combo]
        split = math.prod(mesh_shape[a] for a, o in combo if o.splits_compute)
        comm = _comm_actions(op, combo, in_specs, out_specs, out_partial, hw, collective_cost)
        curve = family(in_specs, out_specs) if callable(family) else family
        calls = local_calls(in_specs, out_specs) if local_calls is not None else ONE_CALL
        io_bytes = _io_bytes(op, in_specs, out_specs)
        out.append(Strategy(
            name=namer(op, in_specs, out_specs, opts),
            input_specs=tuple(in_specs),
            output_specs=tuple(out_specs),
            compute_fwd=_local_seconds(op, hw, curve, FWD, profile, split, io_bytes, calls),
            compute_bwd=_local_seconds(op, hw, curve, BWD, profile, split, io_bytes, calls),
            comm=tuple(comm),
            memory=_memory(op, in_specs, out_specs, split, profile),
            split=split,
            tags=tuple(o.tag for o in opts),
        ))
    return out


def _comm_actions(op, combo, in_specs, out_specs, out_partial, hw, collective_cost) -> list[CommAction]:
    mesh_shape = op.mesh.shape
    actions: list[CommAction] = []

    def add(kind: str, axes: Sequence[int], nbytes: int, phase: Phase, operand: str, bucketed: bool = False) -> None:
        axes = tuple(a for a in sorted(axes) if mesh_shape[a] > 1)
        if axes and nbytes:
            cost = collective_cost(kind, nbytes, axes, mesh_shape, hw)
            if kind == "all_reduce" and not bucketed:   # the runtime all-reduces a clone (buckets: priced
                                                          # with their own copies, see solver.steptime)
                cost += hw.copy_seconds(nbytes, op.compute_dtype)
            actions.append(CommAction(kind, axes, nbytes, phase, operand, cost, bucketed))

    for j, axes in enumerate(out_partial):
        add("all_reduce", axes, local_bytes(op.outputs[j], out_specs[j], mesh_shape), FWD, f"out{j}")
    out_sharded = set()
    for s in out_specs:
        if s is not None:
            out_sharded |= s.used_axes()
    for j, meta in enumerate(op.operands):
        if not op.operand_requires_grad(j):
            continue
        # Replicated operand, sharded output (or work split as the option says): each device's
        # gradient is a partial sum.
        axes = [a for a in out_sharded if a not in in_specs[j].used_axes()]
        axes += [a for a, opt in combo if j in opt.partial_grads and a not in axes]
        add("all_reduce", axes, local_bytes(meta, in_specs[j], mesh_shape), BWD, f"in{j}",
            bucketed=op.operand_is_param(j))
    # An extra collective several axes ask for runs once over all of them (the kernels reduce
    # over every axis that shards the statistic at once).
    extra_axes: dict[ExtraComm, list[int]] = {}
    for axis, opt in combo:
        for extra in opt.extra:
            extra_axes.setdefault(extra, []).append(axis)
    for extra, axes in extra_axes.items():
        add(extra.kind, axes, extra.nbytes(op, in_specs, out_specs), extra.phase, extra.what)
    return actions


def _io_bytes(op: "OpInfo", in_specs, out_specs) -> int:
    mesh_shape = op.mesh.shape
    return (sum(local_bytes(m, s, mesh_shape) for m, s in zip(op.operands, in_specs))
            + sum(local_bytes(m, s, mesh_shape) for m, s in zip(op.outputs, out_specs)))


# The measured curves (HardwareProfile.compute) that price an op of each handler family, the first
# one the profile has (a profile measured before convolutions, few-row matmuls, transcendental functions, batch norm,
# sync batch norm, pooling or the per-function elementwise curves had a curve prices them as matmuls,
# as arithmetic, as a layer norm, as the op's own batch norm or by the transcendental median); every
# other family that is not free (views are) goes by its bytes, as a pointwise op.
_CURVES_OF_FAMILY = {"matmul": ("matmul",), "matmul_unaligned": ("matmul_unaligned", "matmul"),
                     **{f"matmul_rows{r}": (f"matmul_rows{r}", "matmul") for r in FEW_ROWS}, "conv": ("conv", "matmul"),
                     "conv_unaligned": ("conv_unaligned", "conv", "matmul"), "attention": ("attention",),
                     "norm": ("norm",), "loss": ("loss",), "transcendental": ("transcendental", "pointwise"),
                     "batch_norm": ("batch_norm", "norm"),
                     "sync_batch_norm": ("sync_batch_norm", "batch_norm", "norm"), "max_pool": ("max_pool", "pointwise"),
                     "avg_pool": ("avg_pool", "pointwise"),
                     **{name: (name, "transcendental", "pointwise") for name in ELEMENTWISE_FUNCTIONS}}


def _local_seconds(op: "OpInfo", hw: "HardwareProfile", family: str | None, phase: Phase, profile: "OpProfile",
                   split: int, io_bytes: int, calls: LocalCalls) -> float:
    """Seconds of ``phase`` of the local kernel: ``calls.calls`` calls of the op on equal parts of
    the shard (:func:`compute_seconds` each), and its copies (one memory-bound pass each)."""
    each = compute_seconds(op, hw, family, phase, profile, split * calls.calls, io_bytes // calls.calls)
    if phase == BWD and each == 0.0:         # no backward: nothing to copy either
        return 0.0
    copied = calls.copied_fwd if phase == FWD else calls.copied_bwd
    return calls.calls * each + hw.copy_seconds(copied, op.compute_dtype)


def compute_seconds(op: "OpInfo", hw: "HardwareProfile", family: str | None, phase: Phase, profile: "OpProfile",
                    split: int, io_bytes: int) -> float:
    """Seconds of ``phase`` of the local shard of ``op``, whose computation is divided over ``split``
    devices and whose local forward operands and outputs take ``io_bytes``.

    Where the profile has measured the curve of the op's ``family`` for its dtype, that curve at the
    local forward work (FLOPs ``profile.fwd_flops / split`` for matmul/conv and attention, never below
    :func:`_memory_floor`, attention never below :func:`_narrow_head_floor` either; else ``io_bytes``); an op with no float operand that needs a gradient, or
    no float output, has no backward. Otherwise (an unmeasured profile or dtype, or no family given) the roofline:
    ``max(flops / peak FLOP/s, bytes / memory bandwidth)``, backward bytes counted once per operand
    that needs a gradient.

    A free op (a view) moves no data: an aten op costs its dispatch, and in backward (where it has
    a float output and an operand that needs a gradient) its autograd node's, both as the profile's
    ``view`` curve measured them (:meth:`~autoshard.hardware.HardwareProfile.view_seconds`; 0 on
    GPUs and in profiles without that curve); a getitem of a multi-output node dispatches nothing.
    The backward of a view whose gradient autograd builds whole (``op.grad_copies``: split's is a
    cat, slice's zeros plus a copy, expand's a sum) is priced as the forward of a memory-bound op
    over the view's input and output bytes.
    """
    from .hardware import COMPUTE_FAMILIES

    if op.free:
        if not isinstance(op.target, torch._ops.OpOverload):
            return 0.0
        has_backward = op.n_grad_operands > 0 and any(m is not None and m.dtype.is_floating_point for m in op.outputs)
        if phase == BWD and not has_backward:
            return 0.0
        if phase == FWD or not op.grad_copies:
            return hw.view_seconds(phase) or 0.0
        phase = FWD       # one memory-bound pass over the bytes, as a pointwise op's forward
    for curve in _CURVES_OF_FAMILY.get(family, ("pointwise",)) if family is not None else ():
        by_flops = COMPUTE_FAMILIES[curve] == "FLOPs"
        measured = hw.op_seconds(curve, profile.fwd_flops / split if by_flops else io_bytes, phase, op.compute_dtype)
        if measured is not None:
            has_backward = op.n_grad_operands > 0 and any(
                m is not None and m.dtype.is_floating_point for m in op.outputs)
            if phase == BWD and not has_backward:
                return 0.0
            if not by_flops:
                return measured
            floor = _memory_floor(op, hw, phase, io_bytes)
            if family == "attention":
                floor = max(floor, _narrow_head_floor(op, hw, phase, profile.fwd_flops / split))
            return max(measured, floor)
    flops = profile.fwd_flops if phase == FWD else profile.bwd_flops
    nbytes = io_bytes if phase == FWD else io_bytes * op.n_grad_operands
    return max(flops / split / hw.flops_for(op.compute_dtype), nbytes / hw.memory_bandwidth)


def _narrow_head_floor(op: "OpInfo", hw: "HardwareProfile", phase: Phase, flops: float) -> float:
    """The least an attention op (query operand 0, head dim last) of forward ``flops`` takes: the
    ``attention_narrow`` curve at the same batch, heads and positions, whose FLOPs are ``flops`` x
    ``NARROW_HEAD_DIM / head dim`` (the score matrix's work does not shrink with the head dim, see
    :data:`~autoshard.hardware.NARROW_HEAD_DIM`); 0 where the profile has no such curve."""
    head_dim = op.shape(0)[-1]
    if head_dim <= 0:
        return 0.0
    narrow = hw.op_seconds("attention_narrow", flops * NARROW_HEAD_DIM / head_dim, phase, op.compute_dtype)
    return 0.0 if narrow is None else narrow


def _memory_floor(op: "OpInfo", hw: "HardwareProfile", phase: Phase, io_bytes: int) -> float:
    """The least an op priced by its FLOPs takes: one pass over its operands and outputs in forward,
    one per operand that needs a gradient in backward, each at the measured pointwise rate (0 where
    none is measured). A FLOPs curve is timed on square operands; a matmul on a few rows (a linear on
    a batch of 8) moves its whole weight for few FLOPs, and on a CPU rank took 3-9x the curve's time
    (the ``matmul_rows<r>`` curves price those where a profile has them)."""
    one = hw.op_seconds("pointwise", io_bytes, Phase.FWD, op.compute_dtype)
    if one is None:
        return 0.0
    return one * (1 if phase == FWD else op.n_grad_operands)


def _memory(op: "OpInfo", in_specs, out_specs, split: int, profile) -> MemoryCost:
    mesh_shape = op.mesh.shape
    params = grads = 0
    for j, meta in enumerate(op.operands):
        if op.operand_is_param(j):
            b = local_bytes(meta, in_specs[j], mesh_shape)
            params += b
            grads += b if op.operand_requires_grad(j) else 0
    saved = 0
    for s in profile.saved:
        if s.source == "input":
            if not op.operand_is_param(s.index):
                saved += round(local_bytes(op.operands[s.index], in_specs[s.index], mesh_shape) * s.scale)
        elif s.source == "output":
            saved += local_bytes(op.outputs[s.index], out_specs[s.index], mesh_shape)
        else:
            saved += s.nbytes // split
    outputs = sum(local_bytes(m, s, mesh_shape) for m, s in zip(op.outputs, out_specs))
    return MemoryCost(params=params, grads=grads, saved=saved, outputs=outputs)


# -- naming ----------------------------------------------------------------------------------------

def default_name(op: "OpInfo", in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None],
                 options: Sequence[AxisOption]) -> str:
    """``OUT = IN0, IN1`` in compact spec notation, a partial output marked ``+P<axes>`` (two
    strategies with the same specs may differ only in that)."""
    def out(j: int, spec: ShardSpec) -> str:
        partial = "".join(str(a) for a, o in enumerate(options) if o.outputs[j] == PARTIAL)
        return f"{str(spec) or '()'}+P{partial}" if partial else str(spec)

    outs = ", ".join(out(j, s) for j, s in enumerate(out_specs) if s is not None) or "()"
    ins = ", ".join(str(s) for s in in_specs) or "()"
    return f"{outs} = {ins}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
