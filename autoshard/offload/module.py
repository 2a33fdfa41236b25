"""The module parameter offload returns: the model's forward as a driver that streams slices."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..exported import FixedInputs
from .residency import ResidencyTracker
from .runtime import SliceRuntime
from .slicing import OffloadError, SlicePlan

__all__ = ["OffloadedModule"]


class OffloadedModule(nn.Module):
    """``model``'s forward as generated code that streams parameters slice by slice.

    ``code``: the driver and each slice's code; ``plan``: the :class:`SlicePlan` list;
    ``tracker``: the :class:`ResidencyTracker`; ``planned_max_resident``: how many slices may be
    resident at once (1, or 2 with prefetch). Parameters are ``model``'s own (host) parameters:
    ``offloaded.parameters()`` and ``model.parameters()`` are the same tensors.
    """

    def __init__(self, model: nn.Module, runtime: SliceRuntime, driver: Callable[..., Any], code: str,
                 in_spec: Any, out_spec: Any, example: list[Any], batch: int | None) -> None:
        super().__init__()
        self.model = model
        self.slices = nn.ModuleList(runtime.modules)
        self.code = code
        self._rt = runtime
        self._driver = driver
        self._inputs = FixedInputs(in_spec, example, OffloadError,
                                   "the captured graph is specialised to them: call offload_parameters again")
        self._out_spec = out_spec
        self._batch = batch

    @property
    def plan(self) -> list[SlicePlan]:
        return self._rt.slices

    @property
    def tracker(self) -> ResidencyTracker:
        return self._rt.tracker

    @property
    def device(self) -> torch.device:
        return self._rt.device

    @property
    def num_microbatches(self) -> int:
        return self._rt.m

    @property
    def planned_max_resident(self) -> int:
        return 2 if self._rt.do_prefetch and len(self.plan) > 1 else 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._inputs.flatten(args, kwargs)
        rt = self._rt
        per_input = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                x = x.to(rt.device)
                if rt.m > 1 and x.dim() >= 1 and x.shape[0] == self._batch:
                    per_input.append(list(torch.chunk(x, rt.m, dim=0)))
                    continue
            per_input.append([x] * rt.m)
        try:
            out = self._driver(rt, *per_input)
        finally:
            rt.release_all("forward")
        return pytree.tree_unflatten(list(out), self._out_spec)
