"""The ``torch.export`` program of a model that a product regenerates as Python code.

AutoChunk (:mod:`autoshard.autochunk`) and parameter offload (:mod:`autoshard.offload`) both capture
the real model with ``torch.export``, read its placeholders by kind, generate code from the flat aten
graph and return a module specialised to the example inputs. What they share lives here:
:func:`export_program` (the capture; its failure is the product's error), :func:`graph_inputs` (the
user inputs and the state placeholders, and the error for a graph neither handles) and
:class:`FixedInputs` (the input structure and shapes the returned module accepts).
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

__all__ = ["FixedInputs", "STATE_KINDS", "export_program", "graph_inputs", "input_shapes"]

#: Placeholder kinds that hold module state (read by the generated code from the model, not passed in).
STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def export_program(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], error: type[Exception], *,
                   no_grad: bool = False, hint: str = "") -> ExportedProgram:
    """``torch.export.export(model, args, kwargs)`` (non-strict); any failure is raised as ``error``
    naming the model and the cause, followed by ``hint``. ``no_grad``: capture under ``torch.no_grad()``."""
    try:
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            return torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as e:  # torch.export raises many types
        message = f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {e}"
        raise error(f"{message}. {hint}" if hint else message) from e


def graph_inputs(ep: ExportedProgram, error: type[Exception], who: str,
                 mutation: str) -> tuple[list[fx.Node], list[tuple[fx.Node, InputKind, str]]]:
    """The user-input placeholders of ``ep`` and its state placeholders ``(node, kind, target)``, both
    in signature order. Raises ``error`` (naming ``who``, the product) unless the graph is flat aten
    calls that read only those kinds and write no state; ``mutation`` completes the message for a
    graph that writes state (what to do about it)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user: list[fx.Node] = []
    state: list[tuple[fx.Node, InputKind, str]] = []
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            user.append(node)
        elif spec.kind in STATE_KINDS:
            state.append((node, spec.kind, spec.target))
        else:
            raise error(f"graph input {spec.arg.name} of kind {spec.kind.name} is not supported; {who} handles "
                        "parameters, buffers, tensor constants and user inputs")
    for node in ep.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise error(f"graph node {node.name} is a {node.op} ({node.target}); {who} handles flat aten graphs "
                        "(no control-flow or other higher-order ops)")
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise error(f"the captured graph writes {spec.kind.name} {spec.target!r}; {mutation}")
    return user, state


def input_shapes(flat: list[Any]) -> list[tuple[int, ...] | None]:
    """The shape of every tensor among the flattened inputs (None for other values)."""
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]


class FixedInputs:
    """The structure (the pytree spec of ``(args, kwargs)``) and the tensor shapes of the example
    inputs that generated code is specialised to; :meth:`flatten` checks a call against them."""

    def __init__(self, in_spec: pytree.TreeSpec | None, example: list[Any], error: type[Exception],
                 again: str) -> None:
        self.in_spec = in_spec
        self.shapes = input_shapes(example)
        self.error = error
        self.again = again          # what to do about other shapes

    def flatten(self, args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
        """The leaves of a call's ``(args, kwargs)``; ``error`` when their structure or shapes differ."""
        flat, spec = pytree.tree_flatten((args, dict(kwargs)))
        if self.in_spec is not None and spec != self.in_spec:
            raise self.error(f"inputs do not have the structure of the example inputs ({self.in_spec})")
        shapes = input_shapes(flat)
        if shapes != self.shapes:
            raise self.error(f"input shapes {shapes} differ from the example inputs' {self.shapes}; {self.again}")
        return flat
