"""The view family's one mechanism, and the helpers its handlers share.

A *dim map* says which output dim each input dim becomes, and a mesh axis may shard an input dim
exactly when the dim map carries it to an output dim (the output is then sharded there). Per op
only the dim map differs (``reshape.py``, ``permute_expand.py``, ``indexing.py``, ``identity.py``;
``factory.py`` and ``sorting.py`` use the helpers too): options from (input dim, output dim)
pairs, an aten call's arguments by schema name, and local sizes for the kernels that rewrite
size arguments (view/reshape/expand/unflatten shapes).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..opinfo import OpInfo
from ..strategy import AxisOption, Strategy
from .registry import LocalKernel

DimPairs = list[tuple[int, int]]


def bound_args(op: OpInfo) -> dict[str, Any]:
    """The aten call's arguments by schema name, defaults filled in."""
    schema = op.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(op.args):
            out[a.name] = op.args[i]
        elif a.name in op.node.kwargs:
            out[a.name] = op.node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def norm_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def with_arg(op: OpInfo, index: int, value: Any) -> tuple[tuple, dict]:
    """The node's args/kwargs with schema argument ``index`` replaced by ``value``."""
    args, kwargs = list(op.args), dict(op.node.kwargs)
    name = op.target._schema.arguments[index].name
    if index < len(args):
        args[index] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def local_out_shape(op: OpInfo, strategy: Strategy, j: int = 0) -> list[int]:
    meta, spec = op.outputs[j], strategy.output_specs[j]
    assert meta is not None and spec is not None
    return list(spec.local_shape(meta.shape, op.mesh.shape))


def pair_options(pairs: DimPairs, n_outputs: int = 1, extra_inputs: int = 0) -> list[AxisOption]:
    """One option per (input dim, output dim) pair of a single-tensor op; every output follows.

    ``extra_inputs`` further operands stay replicated."""
    return [AxisOption((i,) + (None,) * extra_inputs, (o,) * n_outputs, f"d{i}") for i, o in pairs]


def free_operand_options(options: Sequence[AxisOption], free: dict[int, int], n_inputs: int,
                         n_outputs: int) -> list[AxisOption]:
    """Add variants where operands read only for metadata (dtype/device) take any layout.

    ``free`` maps operand index -> rank. Their layout never changes the result, so forcing them
    replicated would only charge a pointless resharding on their edge.
    """
    base = [AxisOption((None,) * n_inputs, (None,) * n_outputs, "R"), *options]
    out: list[AxisOption] = []
    seen = set()
    for opt in base:
        variants = [opt]
        for j, rank in free.items():
            variants = variants + [
                AxisOption(tuple(d if k == j else x for k, x in enumerate(v.inputs)), v.outputs,
                           f"{v.tag}+in{j}d{d}")
                for v in variants if v.inputs[j] is None for d in range(rank)]
        for v in variants:
            key = (v.inputs, v.outputs)
            if v.splits_compute and key not in seen:
                seen.add(key)
                out.append(v)
    return out


def sized_kernel(arg_index: int, sizes: Callable[[OpInfo, Strategy], Any]):
    """Kernel: the node's op with schema argument ``arg_index`` replaced by local sizes."""

    def kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
        args, kwargs = with_arg(op, arg_index, sizes(op, strategy))
        return LocalKernel(op.target, args, kwargs)

    return kernel


def identity_pairs(op: OpInfo) -> DimPairs:
    return [(d, d) for d, s in enumerate(op.shape(0)) if s > 1]


def other_dims(ndim: int, dim: int, shift: int = 0) -> DimPairs:
    """Every dim but ``dim`` maps to itself; those after it move by ``shift``."""
    return [(d, d if d < dim else d + shift) for d in range(ndim) if d != dim]
