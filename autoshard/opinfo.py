"""What a handler sees of a node: its tensor operands, outputs, arguments and measured op profile.

The op profile (forward/backward FLOPs and the tensors autograd saves) is measured once per node
*signature* by running the aten op on meta tensors under torch's FLOP counter and saved-tensor
hooks, so identical transformer layers are profiled once.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from .mesh import MeshSpec
from .strategy import dtype_name

if TYPE_CHECKING:
    from .capture import CapturedGraph, TensorMeta


class UnsupportedOpError(NotImplementedError):
    """A graph node whose op has no handler (raised by :func:`autoshard.enumerate_strategies`, and by a
    handler for arguments it cannot shard)."""


@dataclass(frozen=True)
class SavedTensor:
    """A tensor autograd keeps for backward: one of the op's operands/outputs, or a new buffer."""

    source: str      # "input" | "output" | "other"
    index: int
    nbytes: int      # global bytes
    scale: float = 1.0   # bytes per byte of the operand it stands for (a copy in another dtype)


@dataclass(frozen=True)
class OpProfile:
    fwd_flops: float
    bwd_flops: float
    saved: tuple[SavedTensor, ...]
    hooked: int = 0      # tensors the forward hands to autograd's saved-tensor hooks (a checkpoint packs each)


ZERO_PROFILE = OpProfile(0.0, 0.0, ())


def tensor_operand_nodes(node: fx.Node) -> list[fx.Node]:
    """The fx.Node leaves of a node's args and kwargs, in order (each occurrence once)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [x for x in leaves if isinstance(x, fx.Node)]


class OpInfo:
    """A node as a handler sees it."""

    def __init__(self, node: fx.Node, graph: "CapturedGraph", mesh: MeshSpec, *, free: bool = False,
                 grad_copies: bool = False, batch_norm_groups: int = 1, loss_groups: int = 1,
                 returns_per_rank: bool = False):
        self.node = node
        self.graph = graph
        self.mesh = mesh
        self.free = free
        self.grad_copies = grad_copies     # a free view whose backward writes its input's whole gradient
        # training batch norm normalises each of this many equal, consecutive slices of the batch
        # with its own statistics (1: the whole batch; see autoshard.handlers.norms)
        self.batch_norm_groups = batch_norm_groups
        # a mean classification loss averages this many equal, consecutive slices of its rows'
        # own means (1: the whole batch's mean; see autoshard.handlers.loss)
        self.loss_groups = loss_groups
        # the graph returns 0-dim outputs as each rank's value (outputs="local", loss="per_rank")
        self.returns_per_rank = returns_per_rank
        self.operand_nodes: list[fx.Node] = []
        self.operands: list["TensorMeta"] = []
        for n in tensor_operand_nodes(node):
            meta = graph.tensor_meta(n)
            if node.target is operator.getitem:
                meta = _element_meta(meta, node.args[1])
            if meta is None or isinstance(meta, tuple):
                continue
            self.operand_nodes.append(n)
            self.operands.append(meta)
        out = graph.tensor_meta(node)
        self.outputs: list["TensorMeta | None"] = list(out) if isinstance(out, tuple) else [out]

    # -- convenience for handlers ------------------------------------------------------------------
    @property
    def target(self) -> Any:
        return self.node.target

    @property
    def args(self) -> tuple:
        return self.node.args

    @property
    def kwargs(self) -> dict:
        return dict(self.node.kwargs)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional-or-keyword argument of the aten call, with its schema default."""
        if len(self.node.args) > index:
            return self.node.args[index]
        if name in self.node.kwargs:
            return self.node.kwargs[name]
        return default

    def operand_index(self, node: fx.Node) -> int:
        return self.operand_nodes.index(node)

    def shape(self, j: int) -> tuple[int, ...]:
        return self.operands[j].shape

    @property
    def out_shape(self) -> tuple[int, ...]:
        out = self.outputs[0]
        assert out is not None
        return out.shape

    def operand_requires_grad(self, j: int) -> bool:
        return self.graph.requires_grad(self.operand_nodes[j]) and self.operands[j].dtype.is_floating_point

    def operand_is_param(self, j: int) -> bool:
        return self.graph.is_param(self.operand_nodes[j])

    def operand_arange_dim(self, j: int) -> int | None:
        """The dim along which operand ``j`` holds its own position (see :func:`arange_dim`)."""
        if self.operands[j].dtype.is_floating_point or self.operands[j].dtype == torch.bool:
            return None
        return arange_dim(self.graph, self.operand_nodes[j])

    @property
    def n_grad_operands(self) -> int:
        return sum(self.operand_requires_grad(j) for j in range(len(self.operands)))

    @property
    def compute_dtype(self) -> str:
        for m in self.operands:
            if m.dtype.is_floating_point:
                return dtype_name(m.dtype)
        return "float32"

    def describe(self) -> str:
        path = self.graph.module_path(self.node)
        return f"{op_name(self.target)} at node '{self.node.name}' (module '{path or '<root>'}')"

    # -- signature and profile ---------------------------------------------------------------------
    def signature(self) -> tuple:
        """Everything a strategy list depends on, except node names."""
        return (
            self.target,
            tuple((m.shape, m.dtype, self.operand_requires_grad(j), self.operand_is_param(j))
                  for j, m in enumerate(self.operands)),
            tuple(None if m is None else (m.shape, m.dtype) for m in self.outputs),
            freeze_args(pytree.tree_map(lambda x: _node_key(self, x) if isinstance(x, fx.Node) else x,
                                    (self.node.args, self.node.kwargs))),
            self.mesh.shape,
            # rules may read this graph fact (index tensors built from an arange)
            tuple(self.operand_arange_dim(j) for j in range(len(self.operands))),
            self.batch_norm_groups,
            self.loss_groups,
            self.keeps_partial_outputs,
        )

    @property
    def keeps_partial_outputs(self) -> bool:
        """Outputs left as pending sums, not all-reduced: 0-dim outputs that only the graph's return
        reads, where it returns them as each rank's value (see ``autoshard.plan(..., loss=)``)."""
        return (self.returns_per_rank and bool(self.outputs)
                and all(m is not None and not m.shape for m in self.outputs)
                and all(user.op == "output" for user in self.node.users))

    def profile(self) -> OpProfile:
        if self.free:
            return ZERO_PROFILE
        return _profile_cached(self)


_aten = torch.ops.aten
# Ops whose value is their first operand's, element for element and in the same shape.
_SAME_VALUES = {_aten.clone.default, _aten.contiguous.default, _aten.alias.default,
                _aten.detach.default, _aten.lift_fresh_copy.default}
# Casts: the same values when the new dtype is an integer type that holds them.
_CASTS = {_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout, _aten._to_copy.default,
          _aten.type_as.default}
# Shape ops that may only add or drop size-1 dims (anything else is refused by shape).
_UNIT_RESHAPES = {_aten.unsqueeze.default, _aten.squeeze.default, _aten.squeeze.dim,
                  _aten.squeeze.dims, _aten.view.default, _aten.reshape.default,
                  _aten._unsafe_view.default, _aten.flatten.using_ints, _aten.unflatten.int}


def arange_dim(graph: "CapturedGraph", node: fx.Node, _depth: int = 0) -> int | None:
    """The dim ``b`` along which ``node``'s integer value is its own position: ``v[..., i, ...] = i``
    for ``i < n = shape[b]``, ``n > 1``, the same at every position of its other dims. None when
    the graph does not show it.

    Read from the graph, not from values: an ``arange(n)`` (start 0, step 1) followed by ops that
    keep the property - reshapes that only add or drop size-1 dims (unsqueeze, squeeze, view),
    expand, permute/transpose, adding or subtracting a literal 0, clones and casts to an integer
    type that holds ``n - 1``. (``x[batch_idx, kv_idx]`` with ``batch_idx = arange(B)[:, None,
    None, None]`` is Hugging Face's padding mask.)
    """
    meta = graph.tensor_meta(node)
    if _depth > 32 or meta is None or isinstance(meta, tuple) or node.op != "call_function":
        return None
    if meta.dtype.is_floating_point or meta.dtype.is_complex or meta.dtype == torch.bool:
        return None
    shape, target, args = tuple(meta.shape), node.target, node.args
    if target in (_aten.arange.default, _aten.arange.start, _aten.arange.start_step):
        named = dict(zip(("start", "end", "step") if len(args) > 1 else ("end",), args))
        named.update({k: v for k, v in node.kwargs.items() if k in ("start", "step")})
        ok = named.get("start", 0) == 0 and named.get("step", 1) == 1
        return 0 if ok and len(shape) == 1 and shape[0] > 1 else None
    src = args[0] if args and isinstance(args[0], fx.Node) else None
    src_meta = graph.tensor_meta(src) if src is not None else None
    if src is None or src_meta is None or isinstance(src_meta, tuple):
        return None
    if target in _CASTS:
        if src_meta.dtype == meta.dtype or torch.iinfo(meta.dtype).max >= max(shape, default=0):
            target = _aten.alias.default
        else:
            return None
    if target in (_aten.add.Tensor, _aten.sub.Tensor):
        literal_zero = len(args) == 2 and type(args[1]) is int and args[1] == 0
        if not literal_zero or node.kwargs.get("alpha", 1) != 1:
            return None
        target = _aten.alias.default
    b = arange_dim(graph, src, _depth + 1)
    if b is None:
        return None
    in_shape = tuple(src_meta.shape)
    if target in _SAME_VALUES:
        return b if in_shape == shape else None
    if target in _UNIT_RESHAPES:
        kept_in = [d for d, s in enumerate(in_shape) if s != 1]
        kept_out = [d for d, s in enumerate(shape) if s != 1]
        if [in_shape[d] for d in kept_in] != [shape[d] for d in kept_out]:
            return None
        return kept_out[kept_in.index(b)]
    if target is _aten.expand.default:
        lead = len(shape) - len(in_shape)
        return b + lead if lead >= 0 and shape[b + lead] == in_shape[b] else None
    if target is _aten.permute.default:
        perm = [d % len(shape) for d in args[1]]
        return perm.index(b)
    if target is _aten.transpose.int:
        d0, d1 = (d % len(shape) for d in args[1:3])
        return d1 if b == d0 else d0 if b == d1 else b
    return None


def tensor_operand_nodes_index(op: OpInfo, x: fx.Node) -> int:
    try:
        return op.operand_nodes.index(x)
    except ValueError:
        return -1


def _node_key(op: OpInfo, x: fx.Node) -> tuple:
    """A node argument in a signature: its operand index, or the sub-graph a get_attr names
    (two higher-order ops with different bodies must not share strategies or a profile)."""
    if x.op == "get_attr":
        return ("attr", x.target)
    return ("node", tensor_operand_nodes_index(op, x))


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):   # aten.add.Tensor, mylib.scale.default
        namespace, _, name = target._schema.name.partition("::")
        return f"{namespace}.{name}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _element_meta(meta: Any, index: Any) -> Any:
    if isinstance(meta, tuple) and isinstance(index, int):
        return meta[index]
    return meta


def freeze_args(x: Any) -> Any:
    """A hashable form of node arguments: lists, tuples and dicts become tuples, torch dtypes,
    devices, layouts and memory formats their names, fx nodes a marker (name-free: map them to
    something first to tell them apart), anything else unhashable its repr."""
    if isinstance(x, fx.Node):
        return "%node"
    if isinstance(x, (list, tuple)):
        return tuple(freeze_args(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, freeze_args(v)) for k, v in x.items()))
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


class _ProfileKey:
    """Hash an OpInfo by its signature so identical layers share one measured profile."""

    def __init__(self, op: OpInfo):
        self.op = op
        self.key = (op.signature()[:4])

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ProfileKey) and self.key == other.key


def _profile_cached(op: OpInfo) -> OpProfile:
    return _measure(_ProfileKey(op))


@functools.lru_cache(maxsize=None)
def _measure(key: _ProfileKey) -> OpProfile:
    op = key.op
    metas = op.operands
    leaves = [torch.empty(m.shape, dtype=m.dtype, device="meta",
                          requires_grad=op.operand_requires_grad(j)) for j, m in enumerate(metas)]
    # An operand the op writes in place (add_, masked_fill_, copy_, ...) is, in the model, an
    # intermediate value with a grad_fn; a fresh meta tensor requiring grad would be a leaf, which
    # autograd refuses to mutate. Hand the op a clone (a non-leaf, free under the FLOP counter)
    # and take gradients with respect to the leaf behind it, as the model's autograd graph does.
    written = _written_operands(op)
    inputs = [t.clone() if j in written and t.requires_grad else t for j, t in enumerate(leaves)]
    by_node = dict(zip(op.operand_nodes, inputs))
    args, kwargs = pytree.tree_map(lambda x: _profile_arg(x, by_node), (op.node.args, op.node.kwargs))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    # Boolean-mask indexing (index_put with a mask: a static output shape) calls nonzero, which
    # has no size on meta tensors; profile it as if every element were selected (an upper bound).
    from torch.fx.experimental import _config as fx_config

    try:
        with FlopCounterMode(display=False) as fwd_counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            result = op.target(*args, **kwargs)
    except Exception as e:  # re-raised with the node's identity
        raise RuntimeError(f"cannot profile {op.describe()} on meta tensors: {e}") from e
    outs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    bwd_flops = 0.0
    grad_inputs = [t for t in leaves if t.requires_grad]
    grad_outputs = [t for t in outs if t.requires_grad]
    if grad_inputs and grad_outputs:
        with FlopCounterMode(display=False) as bwd_counter, \
                fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            torch.autograd.grad(grad_outputs, grad_inputs, [torch.ones_like(t) for t in grad_outputs],
                                allow_unused=True)
        bwd_flops = float(bwd_counter.get_total_flops())
    casts: dict[int, torch.Tensor] = {}
    if op.target is torch.ops.aten.scaled_dot_product_attention.default:
        saved, outs, casts = _fused_attention_saved(args, kwargs, saved, outs)
    return OpProfile(float(fwd_counter.get_total_flops()), bwd_flops,
                     tuple(_classify_saved(saved, inputs, outs, casts)), len(saved))


def _written_operands(op: OpInfo) -> set[int]:
    """Indices (in ``op.operands``) of the operands the op's schema says it writes to."""
    schema = getattr(op.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return set()
    names = [a.name for a in schema.arguments]
    written_names = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    written_nodes = set()
    for name, value in list(zip(names, op.node.args)) + list(op.node.kwargs.items()):
        if name in written_names:
            written_nodes.update(x for x in pytree.tree_leaves(value) if isinstance(x, fx.Node))
    return {j for j, n in enumerate(op.operand_nodes) if n in written_nodes}


def _fused_attention_saved(args: tuple, kwargs: dict, saved: list[torch.Tensor], outs: list[torch.Tensor]
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor]]:
    """What a fused SDPA kernel keeps for backward: q, k, v, the mask, the output and the row
    log-sum-exp (CPU flash attention; CUDA flash/efficient kernels keep the same). On meta tensors
    ``scaled_dot_product_attention`` takes the math path, which keeps the full attention matrix
    instead; devices run the fused kernel whenever it accepts the arguments, so profile that one.
    Arguments the fused kernel refuses (it raises) leave the math path's saved tensors, as on a device.
    The third value maps the boolean mask's additive copy (by id) to the mask operand: the copy has
    the mask's layout (replicated where the mask is), at the query's itemsize."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = {**dict(zip(names, args)), **kwargs}
    if a.get("enable_gqa"):
        return saved, outs, {}
    mask = a.get("attn_mask")
    casts: dict[int, torch.Tensor] = {}
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        # scaled_dot_product_attention hands the kernel an additive mask in the query's dtype
        original, mask = mask, torch.empty(mask.shape, dtype=a["query"].dtype, device="meta")
        casts[id(mask)] = original
    fused: list[torch.Tensor] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: fused.append(t) or t, lambda t: t):
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                a["query"], a["key"], a["value"], float(a.get("dropout_p", 0.0)), bool(a.get("is_causal", False)),
                attn_mask=mask, scale=a.get("scale"))
    except RuntimeError:        # e.g. a mask dtype or shape the fused kernel does not take
        return saved, outs, {}
    return fused, [out], casts


def _profile_arg(x: Any, by_node: dict) -> Any:
    """An argument for the meta run: a node's meta tensor, the sub-graph a get_attr names (the
    body of a higher-order op such as wrap_with_set_grad_enabled), and ``meta`` for a device (a
    captured ``to(device)`` or factory device must not leave the meta device)."""
    if isinstance(x, torch.device):
        return torch.device("meta")
    if not isinstance(x, fx.Node):
        return x
    if x in by_node:
        return by_node[x]
    if x.op == "get_attr":
        sub = getattr(x.graph.owning_module, x.target)  # type: ignore[arg-type]
        return _devices_to_meta(sub) if isinstance(sub, fx.GraphModule) else sub
    return x


def _devices_to_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a sub-graph whose captured device arguments all say ``meta``."""
    import copy

    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        node.args, node.kwargs = pytree.tree_map(
            lambda v: torch.device("meta") if isinstance(v, torch.device) else v, (node.args, node.kwargs))
    gm.recompile()
    return gm


def _classify_saved(saved: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor], casts: dict[int, torch.Tensor] | None = None) -> list[SavedTensor]:
    """Each saved tensor as an operand, an output or a buffer of its own; ``casts``: copies of an
    operand in another dtype (by id), filed as that operand at the copy's itemsize."""
    casts = casts or {}
    result: list[SavedTensor] = []
    seen: set[tuple[str, int]] = set()
    for t in saved:
        if id(t) in casts:
            src = _same(casts[id(t)], inputs, "input")
            if src is not None:
                result.append(SavedTensor(src[0], src[1], t.numel() * t.element_size(),
                                          t.element_size() / casts[id(t)].element_size()))
                continue
        src = (_same(t, inputs, "input") or _same(t, outs, "output")
               or _match(t, inputs, "input") or _match(t, outs, "output"))
        if src is None:
            result.append(SavedTensor("other", -1, t.numel() * t.element_size()))
        elif src not in seen:          # a tensor saved twice (or as a view) is stored once
            seen.add(src)
            result.append(SavedTensor(src[0], src[1], t.numel() * t.element_size()))
    return result


def _same(t: torch.Tensor, candidates: Sequence[torch.Tensor], kind: str) -> tuple[str, int] | None:
    """The candidate ``t`` is, or is a view of (identity: meta tensors share no storage)."""
    base = t._base if t._base is not None else t
    for i, c in enumerate(candidates):
        if t is c or base is c or (c._base is not None and base is c._base):
            return (kind, i)
    return None


def _match(t: torch.Tensor, candidates: Sequence[torch.Tensor], kind: str) -> tuple[str, int] | None:
    """A candidate of the same size and dtype: views of operands re-created by the op (``W.t()``)."""
    for i, c in enumerate(candidates):
        if t.numel() == c.numel() and t.dtype == c.dtype:
            return (kind, i)
    return None


def clear_profile_cache() -> None:
    """Forget measured op profiles (benchmarks use it to time cold runs)."""
    _measure.cache_clear()
