"""Capture on the meta device: a model's graph whatever device its weights and the inputs are on,
allocating nothing, in either mode (training or eval). Planning (:func:`autoshard.plan`), the
other-mode plan (:mod:`autoshard.modes`) and the runtime (:func:`autoshard.parallelize`, which
checks a plan against the model's graph) all capture this way."""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .export import capture
from .graph import CapturedGraph

__all__ = ["capture_in_mode", "capture_meta", "meta_copy", "to_meta"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device, allocating nothing (parameters and buffers are
    replaced by meta tensors in the deep-copy memo)."""
    memo: dict[int, Any] = {}
    for t in [t for _, t in model.named_parameters(remove_duplicate=False)] + [t for _, t in model.named_buffers(remove_duplicate=False)]:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def to_meta(tree: Any) -> Any:
    """Every tensor of ``tree`` as an empty meta tensor of its shape, dtype and ``requires_grad``."""
    return pytree.tree_map(lambda x: torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
                           if isinstance(x, torch.Tensor) else x, tree)


def capture_meta(model: nn.Module, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
                 name: str | None = None) -> CapturedGraph:
    """Capture ``model`` on the meta device whatever device its weights and the inputs are on (plans are
    made and checked against meta captures; nothing is allocated)."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    with torch.device("meta"):
        meta_model = meta_copy(model)
    return capture(meta_model, to_meta(args), to_meta(dict(kwargs or {})), name=name)


def capture_in_mode(model: nn.Module, args: Any, kwargs: Mapping[str, Any] | None, training: bool, *,
                    name: str | None = None) -> CapturedGraph:
    """``model`` captured on meta tensors with every module in ``training`` mode (the model itself
    is not touched: a meta copy is switched)."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    with torch.device("meta"):
        model_copy = meta_copy(model)
    model_copy.train(training)
    return capture(model_copy, to_meta(args), to_meta(dict(kwargs or {})), name=name)
