"""What the capture stage says about one node: its tensors' static shape and dtype
(:class:`TensorMeta`), its op's readable name, the repeated block its module is in, and the
capture error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

__all__ = ["CaptureError", "Meta", "NodeRef", "TensorMeta", "op_name", "repeated_block"]


class CaptureError(ValueError):
    """The model could not be captured as a static aten graph."""


@dataclass(frozen=True)
class TensorMeta:
    """Static shape, dtype and (propagated) requires-grad flag of one tensor in the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


Meta = TensorMeta | tuple[TensorMeta | None, ...] | None   # what tensor_meta() returns
NodeRef = fx.Node | str                                     # a node or its name


def repeated_block(module_path: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the repeated block (a ModuleList/Sequential entry) a module path is
    in: its first numeric component (``model.layers.3.mlp`` -> ``("model.layers", 3)``); None
    outside any block."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdecimal():
            return ".".join(parts[:i]), int(part)
    return None


def op_name(node: fx.Node) -> str:
    """Readable, process-stable name of a node's target: ``aten.linear.default``, ``getitem``."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", None) or str(target)

