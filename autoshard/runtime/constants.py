"""Values of the tensor constants torch.export lifts out of a model's forward.

A literal that forward turns into a tensor (an index list, ``x[..., [-2], :]``; a
``torch.tensor(...)`` built on an input's device) becomes a lifted constant placeholder. In a
capture on meta tensors, the one plans are made from, such a constant is a meta tensor: its values
are gone. The runtime gets them from a second capture of the real module (export traces with fake
tensors, so this computes nothing and allocates only the example inputs), matched by the
constant's FQN, which export derives from the module path and the constant's order.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..capture import CapturedGraph, capture


class ConstantError(RuntimeError):
    """A lifted tensor constant of the captured graph whose value the runtime cannot get."""


def _real_inputs(args: tuple, kwargs: Mapping[str, Any], device: torch.device) -> tuple[tuple, dict]:
    """The example inputs with every meta tensor replaced by zeros of its shape on ``device``."""
    def real(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return torch.zeros(x.shape, dtype=x.dtype, device=device).requires_grad_(x.requires_grad)
        return x
    return pytree.tree_map(real, (tuple(args), dict(kwargs)))


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def lifted_constants(model: nn.Module, graph: CapturedGraph) -> dict[str, torch.Tensor]:
    """FQN -> value of every lifted tensor constant of ``graph``; meta ones are read from a capture
    of ``model`` (which must hold real weights) with the graph's example inputs (meta tensors in
    them replaced by zeros)."""
    values = {fqn: graph.exported.constants[fqn] for fqn in graph.constant_fqn.values()}
    missing = sorted(fqn for fqn, v in values.items() if isinstance(v, torch.Tensor) and v.is_meta)
    if not missing:
        return values
    device = _model_device(model)
    if device.type == "meta":
        raise ConstantError(f"the captured graph of {graph.name!r} has tensor constants made in forward "
                            f"({', '.join(missing)}) whose values a meta capture "
                            "does not keep, and the model given to parallelize is on the meta device too; "
                            "parallelize the model with its real weights")
    args, kwargs = graph.exported.example_inputs or ((), {})
    real = capture(model, *_real_inputs(args, kwargs, device), name=graph.name)
    for fqn in missing:
        want = values[fqn]
        got = real.exported.constants.get(fqn)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            found = (f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else "nothing")
            raise ConstantError(f"tensor constant {fqn!r} of {graph.name!r} is {tuple(want.shape)} {want.dtype} in "
                                f"the planned graph but a capture of the model's real weights gives {found}; was "
                                "the model changed after planning?")
        values[fqn] = got
    return values

