"""Mixed precision: FSDP2's ``MixedPrecisionPolicy`` as plain plan data, and the model copy it is captured from.

A plan made with ``mp_policy`` prices and runs the model as FSDP2 does under that policy:

- parameters are kept in their own dtype (the *master* dtype, fp32 as a rule) as the optimizer's
  tensors, and cast to ``param_dtype`` where they are used (before the all-gather of a gathered
  parameter: the all-gather runs in ``param_dtype``);
- the graph is captured with the model's parameters in ``param_dtype`` (a meta copy; buffers keep
  their dtype, as FSDP2 leaves them), so the literal casts of the model's code (an RMSNorm's
  ``.to(input_dtype)``) are recorded as they run, and every op is priced at the working dtype's rate;
- floating user inputs are cast to ``param_dtype`` when ``cast_forward_inputs``; floating outputs
  to ``output_dtype`` when it is set;
- parameter gradients are reduced in ``reduce_dtype`` (None: ``param_dtype``, as in FSDP2) and
  kept, like FSDP2's sharded gradients, in the master dtype on the master shards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from .errors import ArgumentError

__all__ = ["MixedPrecision", "cast_inputs", "master_dtype_of", "precision_copy"]


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point torch dtype")
    return value


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy as a plan records it (dtype names, e.g. ``"bfloat16"``).

    ``param_dtype``: the working dtype of parameters (and of the captured graph); ``reduce_dtype``:
    the dtype parameter gradients are reduced in; ``master_dtype``: the dtype the parameters are
    stored and stepped in (the model's); ``output_dtype``: floating outputs cast to it, or None;
    ``cast_forward_inputs``: floating user inputs cast to ``param_dtype``."""

    param_dtype: str
    reduce_dtype: str
    master_dtype: str = "float32"
    output_dtype: str | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy: Any, master_dtype: torch.dtype) -> "MixedPrecision":
        """From ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or a :class:`MixedPrecision`);
        :class:`ArgumentError` naming what to change for anything else."""
        if isinstance(policy, MixedPrecision):
            try:
                policy.check()
            except ValueError as e:
                raise ArgumentError(f"mp_policy: {e}") from None
            return dataclasses.replace(policy, master_dtype=_name(master_dtype))    # the model's, always
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # pragma: no cover - torch without FSDP2
            MixedPrecisionPolicy = ()  # type: ignore[assignment,misc]
        if not isinstance(policy, MixedPrecisionPolicy):
            raise ArgumentError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                                f"{type(policy).__name__}; e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                                f"reduce_dtype=torch.float32)")
        if policy.param_dtype is None:
            raise ArgumentError("mp_policy.param_dtype is None: autoshard's mixed precision needs the working dtype "
                                "of parameters (e.g. param_dtype=torch.bfloat16); for full precision omit mp_policy")
        for label in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(policy, label)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ArgumentError(f"mp_policy.{label} must be a floating-point torch dtype or None, got {value!r}")
        if not master_dtype.is_floating_point:
            raise ArgumentError(f"the model's parameters are {master_dtype}; mixed precision needs floating-point "
                                f"parameters")
        reduce = policy.reduce_dtype if policy.reduce_dtype is not None else policy.param_dtype
        return cls(_name(policy.param_dtype), _name(reduce), _name(master_dtype),
                   None if policy.output_dtype is None else _name(policy.output_dtype),
                   bool(policy.cast_forward_inputs))

    def check(self) -> None:
        """ValueError unless every dtype names a floating-point torch dtype."""
        for label in ("param_dtype", "reduce_dtype", "master_dtype", "output_dtype"):
            value = getattr(self, label)
            if value is not None:
                try:
                    _dtype(value)
                except ValueError as e:
                    raise ValueError(f"mixed precision {label}: {e}") from None

    @property
    def param(self) -> torch.dtype:
        return _dtype(self.param_dtype)

    @property
    def reduce(self) -> torch.dtype:
        return _dtype(self.reduce_dtype)

    @property
    def master(self) -> torch.dtype:
        return _dtype(self.master_dtype)

    @property
    def output(self) -> torch.dtype | None:
        return None if self.output_dtype is None else _dtype(self.output_dtype)

    @property
    def reduce_ratio(self) -> float:
        """Bytes of a gradient in the reduce dtype per byte of it in the working dtype."""
        return self.reduce.itemsize / self.param.itemsize

    @property
    def master_ratio(self) -> float:
        """Bytes of a parameter in the master dtype per byte of it in the working dtype."""
        return self.master.itemsize / self.param.itemsize

    def to_policy(self) -> Any:
        """The equivalent ``torch.distributed.fsdp.MixedPrecisionPolicy`` (for FSDP2 comparisons)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param, reduce_dtype=self.reduce, output_dtype=self.output,
                                    cast_forward_inputs=self.cast_forward_inputs)

    def __str__(self) -> str:
        out = f"params {self.param_dtype} (master {self.master_dtype}), gradients reduced in {self.reduce_dtype}"
        return out + (f", outputs {self.output_dtype}" if self.output_dtype else "")


def master_dtype_of(model: nn.Module) -> torch.dtype:
    """The one dtype of the model's floating-point parameters; ArgumentError when they differ."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ArgumentError(f"mixed precision needs the model's floating-point parameters in one dtype (the master "
                            f"dtype), found {sorted(map(_name, dtypes)) or 'none'}; cast the model (e.g. model.float()) "
                            f"before planning")
    return dtypes.pop()


def precision_copy(model: nn.Module, mp: MixedPrecision) -> nn.Module:
    """A meta copy of ``model`` with its floating-point parameters in ``param_dtype`` (buffers keep
    their dtype): the model the graph of a mixed-precision plan is captured from."""
    from .capture import meta_copy

    with torch.device("meta"):
        copy = meta_copy(model)
    for p in copy.parameters():
        if p.is_floating_point():
            p.data = p.data.to(mp.param)
    return copy


def cast_inputs(args: Any, kwargs: Mapping[str, Any] | None, mp: MixedPrecision) -> tuple[Any, dict]:
    """``(args, kwargs)`` with every floating-point tensor cast to ``param_dtype`` when the policy
    casts forward inputs (else unchanged)."""
    kwargs = dict(kwargs or {})
    if not mp.cast_forward_inputs:
        return args, kwargs
    return pytree.tree_map(lambda x: cast_input(x, mp), (args, kwargs))


def cast_input(x: Any, mp: MixedPrecision) -> Any:
    """One user input as the policy feeds it to the model."""
    if mp.cast_forward_inputs and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(mp.param)
    return x
