"""Runtime inputs of a parallelized model: bound as the model's ``forward`` binds them, then checked.

:class:`InputBinder` turns a call (``pmodel(x)``, ``pmodel(x=x)``, ``pmodel(input_ids, mask=m)``)
into the structure the graph was captured with, by the names of the model's ``forward`` parameters,
and says what is wrong when it cannot: an argument the model does not take, one it needs, one the
plan was captured without. :func:`check_tensor` checks one tensor against the planned one (dtype,
shape, device), :func:`check_constant` a non-tensor argument the graph was specialised to.
Every error is an :class:`InputError` naming the argument and what to pass.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture import TensorMeta

__all__ = ["InputBinder", "InputError", "check_constant", "check_tensor"]


class InputError(TypeError, ValueError):
    """An input of the parallelized model that the plan cannot run: wrong argument names or
    structure (a TypeError, as Python reports a bad call), or a tensor of the wrong dtype, shape or
    device (a ValueError)."""


class InputBinder:
    """Binds calls to the captured input structure ``in_spec`` (the pytree spec of ``(args, kwargs)``)
    through ``signature``, that of the model's ``forward``."""

    def __init__(self, signature: inspect.Signature | None, in_spec: pytree.TreeSpec) -> None:
        self.in_spec = in_spec
        self.signature = signature           # None (a builtin forward): calls must match the captured structure
        args, kwargs = pytree.tree_unflatten([None] * in_spec.num_leaves, in_spec)
        self.n_args = len(args)
        self.kw_names = list(kwargs)
        params = list(self.signature.parameters.values()) if self.signature else []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.arg_names = positional[:self.n_args] if len(positional) >= self.n_args else None
        self.described = ", ".join([*(self.arg_names or [f"args[{i}]" for i in range(self.n_args)]),
                                    *(f"{k}=" for k in self.kw_names)])

    def flatten(self, args: tuple, kwargs: dict) -> list[Any]:
        """The input leaves in captured order; :class:`InputError` when the call cannot be bound."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec == self.in_spec:
            return leaves
        args, kwargs = self._rebind(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(f"the inputs are structured differently from those the plan was captured with "
                             f"(forward({self.described})): a nested argument (list, dict, tuple) has other keys or "
                             f"length, or None where a tensor was. Call the parallel model with inputs shaped like the "
                             f"planned ones, or re-plan with these")
        return leaves

    def _rebind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` as captured, from a call that passes the same arguments another way."""
        sig = self.signature
        if sig is None or self.arg_names is None or any(
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
            raise InputError(f"call the parallel model as the plan was captured: forward({self.described}) "
                             f"(got {len(args)} positional argument(s) and keyword(s) {sorted(kwargs)})")
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise InputError(f"the model's forward{sig} does not accept this call: {e}") from None
        captured = [*self.arg_names, *self.kw_names]
        extra = [n for n in bound.arguments if n not in captured]
        if extra:
            raise InputError(f"argument(s) {', '.join(extra)} were not passed when the plan was captured "
                             f"(forward({self.described})); the graph does not read them: drop them, or re-plan with "
                             f"example inputs that include them")
        missing = [n for n in captured if n not in bound.arguments]
        if missing:
            raise InputError(f"argument(s) {', '.join(missing)} are missing; the plan was captured with "
                             f"forward({self.described})")
        return (tuple(bound.arguments[n] for n in self.arg_names),
                {k: bound.arguments[k] for k in self.kw_names})


def check_tensor(value: Any, where: str, meta: TensorMeta, want_shape: tuple[int, ...], layout: str) -> None:
    """:class:`InputError` unless ``value`` is a tensor of the planned dtype and ``want_shape`` that is
    not on the meta device (``layout`` says what the shape is: the global batch or this rank's shard)."""
    if not isinstance(value, torch.Tensor):
        raise InputError(f"input {where} must be a tensor ({str(meta.dtype).removeprefix('torch.')} of shape "
                         f"{list(want_shape)}), got {type(value).__name__}")
    if value.dtype != meta.dtype:
        have, want = str(value.dtype).removeprefix("torch."), str(meta.dtype).removeprefix("torch.")
        raise InputError(f"input {where} has dtype {have}, the plan was made for {want}: pass it as {want} "
                         f"(x.to(torch.{want})), or re-plan with {have} example inputs")
    if tuple(value.shape) != want_shape:
        raise InputError(f"input {where} has shape {tuple(value.shape)}, expected {want_shape} ({layout}); the plan "
                         f"and the graph are fixed to the planned input shapes: re-plan for these shapes, with a "
                         f"batch the mesh divides")
    if value.device.type == "meta":
        raise InputError(f"input {where} is a meta tensor (no data); pass a real tensor")


def check_constant(value: Any, where: str, captured: Any) -> None:
    """:class:`InputError` unless a non-tensor argument equals the value the graph was specialised to."""
    same = type(value) is type(captured) and value == captured
    if not same:
        raise InputError(f"input {where} is {value!r}, but the plan was captured with {captured!r} and the graph is "
                         f"specialised to that value; pass {captured!r}, or re-plan with {value!r}")
