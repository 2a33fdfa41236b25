"""Classification losses: cross_entropy_loss and nll_loss (nll_loss_nd, nll_loss, nll_loss2d).

The input is ``[N, C, *d]`` (or ``[C]`` unbatched) with the classes on dim 1; the target holds
class indices ``[N, *d]`` (``ignore_index`` entries are skipped) or, for cross-entropy only,
class probabilities shaped like the input. Per mesh axis:

- ``row<d>``: a row dim (N or a spatial dim): input and target alike. Reduction ``none``: the
  output is sharded like the target; ``sum``: partial output; ``mean``: partial output only if
  every device divides its local sum by the *global* denominator (the count of non-ignored
  targets, or their summed class weights): the kernel all-reduces that denominator (an
  ``ExtraComm``), so rows with ``ignore_index`` are counted exactly. Probability targets divide
  by the global row count, a static number. (The class weight is replicated here; aten's
  nll_loss is not differentiable in it, so it never needs a gradient all-reduce.) A mean over
  class-index targets may instead come out replicated from ONE all-reduce of the local sum and
  denominator together (``row<d>-global``): the partial form needs two (the denominator, then
  the partial output), which is what a data-parallel step pays for its loss.
- ``c``: the classes (vocab-parallel, as Megatron's parallel cross-entropy): input dim 1, class
  weight dim 0, a probability target dim 1; class-index targets replicated. Each device
  forms its log-softmax from the all-reduced max and sum of exponentials (ExtraComms, the sum
  also in backward), picks the target logit only if its class block holds it, and returns its
  summand of the loss (partial for every reduction; mean divides by the global denominator).

Label smoothing, class weights and ``ignore_index`` follow ``aten.cross_entropy_loss`` exactly.

Planned with ``loss="per_rank"`` (``op.loss_groups`` = mesh size), a mean over class-index targets
is torch DDP's: the mean over ``groups`` equal, consecutive slices of the rows (dim 0, the batch)
of each slice's own mean. A device then holds whole slices under every strategy offered: the rows
split on dim 0 (partial output, no collective: each slice's denominator is the device's own) or
replicated; one call of the op per slice it holds. Splitting another row dim or the classes would
need collectives to count a slice's targets and is not offered.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..opinfo import OpInfo, UnsupportedOpError
from ..specs import ShardSpec
from ..strategy import BWD, FWD, ONE_CALL, PARTIAL, AxisOption, ExtraComm, LocalCalls, Strategy
from .nn_common import operand_slots, option
from .registry import LocalKernel, default_kernel, register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2     # at::Reduction


class _Loss:
    """Operands and arguments of one loss node."""

    def __init__(self, op: OpInfo):
        slots = operand_slots(op)
        self.x, self.t, self.w = slots["self"], slots["target"], slots.get("weight")
        self.x_shape = op.shape(self.x)
        self.cdim = 0 if len(self.x_shape) == 1 else 1
        self.n_classes = self.x_shape[self.cdim]
        self.prob_target = op.operands[self.t].dtype.is_floating_point
        self.reduction = int(op.arg(3, "reduction", MEAN))
        self.ignore_index = int(op.arg(4, "ignore_index", -100))
        self.label_smoothing = float(op.arg(5, "label_smoothing", 0.0)) if _is_ce(op) else 0.0
        self.rows = math.prod(self.x_shape) // self.n_classes

    def target_dim(self, x_dim: int) -> int:
        """The target dim aligned with input dim ``x_dim`` (not the class dim)."""
        return x_dim if self.prob_target or x_dim < self.cdim else x_dim - 1


def _per_rank(op: OpInfo, loss: _Loss) -> bool:
    """Planned ``loss="per_rank"`` and a mean over class-index targets: slices take their own means."""
    return op.loss_groups > 1 and loss.reduction == MEAN and not loss.prob_target


def _local_slices(op: OpInfo, x_spec: ShardSpec) -> int:
    """How many of the rows' per-rank slices a device holds under input spec ``x_spec``."""
    return op.loss_groups // x_spec.shard_factor(0, op.mesh.shape)


def _is_ce(op: OpInfo) -> bool:
    return op.target is aten.cross_entropy_loss.default


def _row_stat_bytes(op: OpInfo, ins: Sequence[ShardSpec], outs) -> int:
    """Bytes of one per-row statistic (max, sum of exponentials) on one device."""
    loss = _Loss(op)
    local = ins[loss.x].local_shape(loss.x_shape, op.mesh.shape)
    return math.prod(local) // local[loss.cdim] * op.operands[loss.x].dtype.itemsize


def _denominator_bytes(op: OpInfo, ins, outs) -> int:
    loss = _Loss(op)
    return 8 if loss.w is None else op.operands[loss.w].dtype.itemsize


_DENOMINATOR = ExtraComm("all_reduce", FWD, _denominator_bytes, "loss denominator")
_GLOBAL = "-global"    # tag suffix of the row options whose output is replicated (one fused all-reduce);
                       # they combine only with each other (AxisOption.combine)
_SUM_AND_DENOMINATOR = ExtraComm("all_reduce", FWD, lambda op, ins, outs: 16, "loss sum and denominator")
_MAX = ExtraComm("all_reduce", FWD, _row_stat_bytes, "softmax max")
_SUMEXP = ExtraComm("all_reduce", FWD, _row_stat_bytes, "softmax sum-exp")
_SUMEXP_GRAD = ExtraComm("all_reduce", BWD, _row_stat_bytes, "softmax sum-exp grad")


def loss_rules(op: OpInfo) -> list[AxisOption]:
    """cross_entropy_loss / nll_loss(input[N, C, *d], target, weight?, reduction, ignore_index, ...)"""
    loss = _Loss(op)
    n = len(op.operands)
    if _per_rank(op, loss):
        rows = loss.x_shape[0] if loss.cdim == 1 else 1
        if rows % op.loss_groups:
            raise UnsupportedOpError(
                f"{op.describe()}: loss='per_rank' takes the mean of each of the mesh's {op.loss_groups} devices' "
                f"equal share of the loss's rows, but its input has {rows} row(s) on dim 0; make the batch a "
                f"multiple of {op.loss_groups} or plan with loss='global'")
        return [option(n, {loss.x: 0, loss.t: 0}, (PARTIAL,), "row0", combine="partial")]
    mean_by_count = loss.reduction == MEAN and not loss.prob_target
    options = []
    for d in range(len(loss.x_shape)):
        if d == loss.cdim:
            continue
        td = loss.target_dim(d)
        out = td if loss.reduction == NONE else PARTIAL
        extra = (_DENOMINATOR,) if mean_by_count else ()
        options.append(option(n, {loss.x: d, loss.t: td}, (out,), f"row{td}", extra, combine="partial"))
        if mean_by_count:
            options.append(option(n, {loss.x: d, loss.t: td}, (None,), f"row{td}{_GLOBAL}",
                                  (_SUM_AND_DENOMINATOR,), combine="replicated"))
    dims = {loss.x: loss.cdim, loss.t: loss.cdim if loss.prob_target else None}
    if loss.w is not None:
        dims[loss.w] = 0
    extra: tuple[ExtraComm, ...] = (_MAX, _SUMEXP, _SUMEXP_GRAD) if _is_ce(op) else ()
    if mean_by_count and loss.w is not None:
        extra += (_DENOMINATOR,)
    options.append(option(n, dims, (PARTIAL,), "c", extra, combine="partial"))
    return options


def loss_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """The aten op itself unless the classes are sharded or a mean needs the global denominator."""
    loss = _Loss(op)
    x_spec = strategy.input_specs[loss.x]
    if _per_rank(op, loss):
        weight = op.operand_nodes[loss.w] if loss.w is not None else None
        return LocalKernel(per_rank_mean_loss, (op.operand_nodes[loss.x], op.operand_nodes[loss.t], weight),
                           dict(slices=_local_slices(op, x_spec), groups=op.loss_groups,
                                ignore_index=loss.ignore_index, label_smoothing=loss.label_smoothing,
                                log_softmax=_is_ce(op)))
    class_axes = x_spec.dims[loss.cdim]
    row_axes = tuple(sorted(a for i, d in enumerate(x_spec.dims) if i != loss.cdim for a in d))
    if not class_axes and (not row_axes or loss.reduction != MEAN):
        return default_kernel(op, strategy)
    weight = op.operand_nodes[loss.w] if loss.w is not None else None
    args = (op.operand_nodes[loss.x], op.operand_nodes[loss.t], weight)
    if any(tag.endswith(_GLOBAL) for tag in strategy.tags):     # every sharding axis a global row
        kwargs = dict(ignore_index=loss.ignore_index, label_smoothing=loss.label_smoothing, row_axes=row_axes,
                      log_softmax=_is_ce(op))
        return LocalKernel(replicated_mean_loss, args, kwargs, uses_comm=True)
    kwargs = dict(reduction=loss.reduction, ignore_index=loss.ignore_index,
                  label_smoothing=loss.label_smoothing, row_axes=row_axes, class_axes=class_axes,
                  n_classes=loss.n_classes, n_rows=loss.rows, log_softmax=_is_ce(op))
    return LocalKernel(sharded_class_loss, args, kwargs, uses_comm=True)


def sharded_class_loss(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, *,
                       reduction: int, ignore_index: int, label_smoothing: float,
                       row_axes: tuple[int, ...], class_axes: tuple[int, ...], n_classes: int,
                       n_rows: int, log_softmax: bool, comm) -> torch.Tensor:
    """This device's summand (or shard, for reduction none) of a cross-entropy (``log_softmax``)
    or nll loss whose rows are sharded over ``row_axes`` and classes over ``class_axes``."""
    if not class_axes:       # rows only, mean: the aten sum over local rows / global denominator
        args = (x, target, weight, SUM, ignore_index) + ((label_smoothing,) if log_softmax else ())
        total = (aten.cross_entropy_loss.default if log_softmax else aten.nll_loss_nd.default)(*args)
        if target.dtype.is_floating_point:
            return total / n_rows
        return total / _global_denominator(target, weight, ignore_index, 0, row_axes, comm)
    cdim = 0 if x.dim() == 1 else 1
    c_local = x.shape[cdim]
    start = comm.shard_index(class_axes) * c_local
    logp = _parallel_log_softmax(x, cdim, class_axes, comm) if log_softmax else x
    w_b = None if weight is None else weight.view([-1 if i == cdim else 1 for i in range(x.dim())])
    weighted = logp if w_b is None else logp * w_b
    if target.dtype.is_floating_point:
        t = target * (1 - label_smoothing) + label_smoothing / n_classes if label_smoothing else target
        terms = -(weighted * t).sum(cdim)
        if reduction == NONE:
            return terms
        return terms.sum() / n_rows if reduction == MEAN else terms.sum()
    ignored = target == ignore_index
    mine = ~ignored & (target >= start) & (target < start + c_local)
    local_t = torch.where(mine, target - start, 0)
    picked = logp.gather(cdim, local_t.unsqueeze(cdim)).squeeze(cdim)
    if weight is not None:
        picked = picked * weight[local_t]
    terms = torch.where(mine, -picked, 0)
    if label_smoothing:
        smooth = torch.where(ignored, 0, -weighted.sum(cdim))
        terms = (1 - label_smoothing) * terms + label_smoothing / n_classes * smooth
    if reduction == NONE:
        return terms
    if reduction == SUM:
        return terms.sum()
    return terms.sum() / _global_denominator(target, weight, ignore_index, start, row_axes, comm,
                                             class_axes)


def replicated_mean_loss(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, *,
                         ignore_index: int, label_smoothing: float, row_axes: tuple[int, ...],
                         log_softmax: bool, comm) -> torch.Tensor:
    """The whole batch's mean loss on every device, rows sharded over ``row_axes``: the local sum
    and denominator go through one all-reduce (float64, so a count stays exact; identity backward:
    every device holds the same mean and differentiates its own rows)."""
    args = (x, target, weight, SUM, ignore_index) + ((label_smoothing,) if log_softmax else ())
    total = (aten.cross_entropy_loss.default if log_softmax else aten.nll_loss_nd.default)(*args)
    kept = target != ignore_index
    count = kept.sum() if weight is None else torch.where(kept, weight[torch.where(kept, target, 0)], 0).sum()
    both = torch.stack([total.to(torch.float64), count.detach().to(torch.float64)])
    both = comm.all_reduce(both, row_axes, backward="identity")
    return (both[0] / both[1]).to(total.dtype)


def per_rank_mean_loss(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, *, slices: int,
                       groups: int, ignore_index: int, label_smoothing: float, log_softmax: bool) -> torch.Tensor:
    """This device's summand of the mean over ``groups`` equal, consecutive row slices of each
    slice's own mean loss: the op's own mean on each of the ``slices`` slices it holds (dim 0),
    summed and divided by ``groups``. One slice (data parallel) is the op itself on the whole local
    batch: a one-piece split would cost a copy of the input gradient in backward (the split's
    concatenation, ~1 ms for GPT-2's [256, 2048] logits on a CPU rank)."""
    op = aten.cross_entropy_loss.default if log_softmax else aten.nll_loss_nd.default
    extra = (label_smoothing,) if log_softmax else ()
    if slices == 1:
        return op(x, target, weight, MEAN, ignore_index, *extra) / groups
    rows = x.shape[0] // slices
    means = [op(xs, ts, weight, MEAN, ignore_index, *extra) for xs, ts in zip(x.split(rows), target.split(rows))]
    return torch.stack(means).sum() / groups


def _loss_calls(op: OpInfo, in_specs: Sequence[ShardSpec], out_specs) -> LocalCalls:
    """Planned per rank, a device runs the op once per row slice it holds."""
    loss = _Loss(op)
    if not _per_rank(op, loss):
        return ONE_CALL
    return LocalCalls(_local_slices(op, in_specs[loss.x]))


def _parallel_log_softmax(x: torch.Tensor, cdim: int, class_axes: tuple[int, ...], comm) -> torch.Tensor:
    """log_softmax over a class dim sharded over ``class_axes``, for this device's classes.

    The max only stabilises the exponentials (the value does not depend on it), so it is a
    constant for autograd; the sum of exponentials is all-reduced with a summing backward, as
    every device's log-probabilities depend on all of it.
    """
    m = comm.all_reduce(x.detach().amax(cdim, keepdim=True), class_axes, op="max")
    shifted = x - m
    sumexp = comm.all_reduce(shifted.exp().sum(cdim, keepdim=True), class_axes, backward="sum")
    return shifted - sumexp.log()


def _global_denominator(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
                        start: int, row_axes: tuple[int, ...], comm,
                        class_axes: tuple[int, ...] = ()) -> torch.Tensor:
    """Count of non-ignored targets (or the sum of their class weights) over the whole batch.

    Targets are replicated over the class axes, so a count only needs the row axes; a weight
    sum takes each target's weight from the device whose class block holds it.
    """
    kept = target != ignore_index
    if weight is None:
        local = kept.sum()
        return comm.all_reduce(local, row_axes) if row_axes else local
    c_local = weight.shape[0]
    mine = kept & (target >= start) & (target < start + c_local)
    local = torch.where(mine, weight[torch.where(mine, target - start, 0)], 0).sum()
    axes = tuple(sorted(row_axes + class_axes))
    return comm.all_reduce(local, axes, backward="sum") if axes else local


register(aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
         aten.nll_loss2d.default, family="loss", kernel=loss_kernel, local_calls=_loss_calls,
         doc="classification loss: shard rows (N/spatial; mean uses the global target count) or "
             "the classes (vocab-parallel log-softmax); planned per rank, N with no comm")(loss_rules)
