"""The module AutoChunk returns: the model's forward as generated code with chunk loops."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from ..exported import FixedInputs
from .codegen import compile_source
from .report import AutoChunkError, ChunkReport

__all__ = ["ChunkedModule"]


class ChunkedModule(nn.Module):
    """The model's forward as generated Python code with chunk loops (inference only).

    ``code`` holds the source; ``report`` the plan. Parameters and buffers are read from the
    original ``model`` on every call, so they stay shared with it. The code is specialised to the
    shapes of the example inputs; calling with other shapes raises :class:`AutoChunkError`.
    """

    def __init__(self, model: nn.Module, ep: ExportedProgram, code: str, globals_: dict[str, Any],
                 report: ChunkReport, example: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.constants = dict(ep.constants)
        self.code = code
        self.report = report
        self._inputs = FixedInputs(ep.call_spec.in_spec, example, AutoChunkError,
                                   "the chunk loops are planned for fixed shapes: call autochunk again")
        self._out_spec = ep.call_spec.out_spec
        self._fn = compile_source(code, globals_, f"<autochunk:{type(model).__name__}:{id(self)}>")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._inputs.flatten(args, kwargs)
        with torch.no_grad():
            out = self._fn(self, *flat)
        return pytree.tree_unflatten(list(out), self._out_spec)
