"""Custom (non-aten) ops inlined as the aten ops of their decomposition, so that those ops'
handlers shard them; custom ops without a decomposition stay whole.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from .nodes import CaptureError

__all__ = ["INLINED_FROM", "custom_op_decomposition", "inline_custom_ops"]

INLINED_FROM = "autoshard_inlined_from"
"""``node.meta`` key of the nodes a custom op's decomposition was inlined as: the op's name."""


def custom_op_decomposition(target: Any) -> Any:
    """How to inline a custom (non-aten) op: its registered decomposition
    (``torch._decomp.register_decomposition``), else its CompositeImplicitAutograd kernel; None
    when it has neither (an opaque ``torch.library.custom_op``)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace == "aten":
        return None
    from torch._decomp import decomposition_table

    if target in decomposition_table:
        return decomposition_table[target]
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    return None


def inline_custom_ops(gm: fx.GraphModule) -> dict[str, str]:
    """Replace every custom-op node that has a decomposition by the aten ops of that decomposition
    (traced on meta tensors of the node's shapes), so that the ops' own handlers shard it.
    Custom ops without one stay: the enumerator names them (or runs them replicated, reported,
    under ``fallback="replicate"``). Returns ``{old node name: new node name}`` for nodes whose
    value is now another node's (the caller renames graph outputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = gm.graph
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        decomp = custom_op_decomposition(node.target)
        if decomp is None:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, fx.Node)]
        vals = [leaves[i].meta.get("val") for i in slots]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue          # a non-tensor graph value as argument: left to the enumerator
        device = vals[0].device if vals else torch.device("cpu")

        def call(*tensors: torch.Tensor, _leaves=leaves, _slots=slots, _spec=spec, _decomp=decomp) -> Any:
            filled = list(_leaves)
            for i, t in zip(_slots, tensors):
                filled[i] = t
            args, kwargs = pytree.tree_unflatten(filled, _spec)
            return _decomp(*args, **kwargs)

        examples = [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for v in vals]
        sub = make_fx(call, pre_dispatch=True)(*examples)
        for n in sub.graph.nodes:       # traced on meta: the captured device is the node's
            n.args, n.kwargs = pytree.tree_map(
                lambda v: device if isinstance(v, torch.device) else v, (n.args, n.kwargs))
        inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        before = set(graph.nodes)
        with graph.inserting_before(node):
            out = graph.graph_copy(sub.graph, {ph: leaves[i] for ph, i in zip(inputs, slots)})
        for n in graph.nodes:           # the inlined ops belong to the custom op's module
            if n not in before:
                n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                n.meta[INLINED_FROM] = str(node.target)
        if isinstance(out, fx.Node):
            node.replace_all_uses_with(out)
            renamed[node.name] = out.name
        else:
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise CaptureError(f"custom op {node.target} at node '{node.name}' returns a tuple "
                                       f"that '{user.name}' uses whole; autoshard cannot inline it")
                user.replace_all_uses_with(out[user.args[1]])
                renamed[user.name] = out[user.args[1]].name
                graph.erase_node(user)
        graph.erase_node(node)
    if renamed:
        graph.lint()
        gm.recompile()
    return renamed
