"""Tensors that stand for parameters: the collectives flag the parameter copies they make (gathered
per block, resharded for a consumer), and activation offload and the saved-tensor meter leave flagged
tensors in place, like ``nn.Parameter`` s. Shared by :mod:`autoshard.runtime.collectives` and
:mod:`autoshard.memory`."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["PARAMETER_FLAG", "is_parameter_like"]

PARAMETER_FLAG = "_autoshard_parameter"
"""Attribute set on tensors that stand for parameters without being ``nn.Parameter`` (the local
shards the parallel runtime feeds its program): offload leaves them, like parameters, in place."""


def is_parameter_like(t: torch.Tensor) -> bool:
    """True for an ``nn.Parameter``, a tensor flagged with :data:`PARAMETER_FLAG`, or a view of
    either (autograd saves ``weight.t()`` for linear)."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or getattr(base, PARAMETER_FLAG, False) or getattr(t, PARAMETER_FLAG, False)
