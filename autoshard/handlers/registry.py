"""Registry of node handlers, keyed by aten op (or Python callable for getitem / higher-order ops, or
the name of a custom op)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..opinfo import OpInfo, op_name
from ..specs import ShardSpec
from ..strategy import AxisOption, LocalCalls, Strategy, default_name

Rules = Callable[[OpInfo], Sequence[AxisOption]]
Namer = Callable[[OpInfo, Sequence[ShardSpec], Sequence["ShardSpec | None"], Sequence[AxisOption]], str]
CurveFn = Callable[[OpInfo, Sequence[ShardSpec], Sequence["ShardSpec | None"]], str]
LocalCallsFn = Callable[[OpInfo, Sequence[ShardSpec], Sequence["ShardSpec | None"]], LocalCalls]


@dataclass(frozen=True)
class LocalKernel:
    """How one device runs a node under a strategy.

    ``args``/``kwargs`` are the node's, with fx.Node operands left in place (the caller substitutes
    local shards) and shape-like arguments rewritten for local shapes. ``epilogue``, if set, runs on
    the outputs after the strategy's forward collectives (e.g. a bias added once after the
    all-reduce of a k-sharded matmul); it receives the outputs and the local operands.
    With ``uses_comm`` the target is also called with ``comm=`` a :class:`autoshard.kernel_comm.DeviceComm`
    (the device's mesh coordinate and autograd-aware collectives), for ops that need a collective
    inside them (sync batch-norm statistics, a global token count, a vocab-sharded lookup).
    ``state_axes``: the kernel updates the buffers among its operands (running statistics) from
    this device's shard alone, so their copies differ across these mesh axes until the runtime
    averages them (before anything reads them; see ``ParallelModule.sync_buffers``).
    """

    target: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    epilogue: Callable[[tuple[torch.Tensor, ...], Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None = None
    uses_comm: bool = False
    state_axes: tuple[int, ...] = ()


KernelFn = Callable[[OpInfo, Strategy], LocalKernel]


def default_kernel(op: OpInfo, strategy: Strategy) -> LocalKernel:
    """Run the node's own op on local shards, arguments unchanged."""
    return LocalKernel(op.target, tuple(op.node.args), dict(op.node.kwargs))


@dataclass(frozen=True)
class Handler:
    """Per-axis rules of an op family, plus how to name its strategies."""

    family: str
    rules: Rules
    namer: Namer = default_name
    free: bool = False              # no compute cost (views, metadata, asserts)
    # A free view whose backward still writes a whole gradient of its input (a cat for split, zeros
    # plus a copy for slice, a sum for expand): its backward is priced as a memory-bound op.
    grad_copies: bool = False
    replicate_only: bool = False    # explicitly replicate-only (cheap mask-building ops)
    doc: str = ""
    kernel: KernelFn = default_kernel
    # The measured compute curve that prices the op where it is not the family's own (tanh and the
    # other transcendental functions cost several times an add per byte on a CPU), or a function of
    # the node and one strategy's input and output specs that names it (training batch norm has a
    # curve of its own, eval batch norm does not; a matmul's alignment is its local shard's)
    curve: "str | CurveFn | None" = None
    # Where the kernel a strategy gets is not one call of the op on the local shard (see
    # :class:`autoshard.strategy.LocalCalls`): a function of the node and the strategy's specs
    local_calls: LocalCallsFn | None = None

    def cost_family(self, op: "OpInfo", in_specs: Sequence[ShardSpec], out_specs: Sequence[ShardSpec | None]) -> str:
        """The family whose measured curve prices ``op`` under a strategy with these specs (see
        :func:`autoshard.strategy.compute_seconds`)."""
        curve = self.curve(op, in_specs, out_specs) if callable(self.curve) else self.curve
        return curve or self.family


REGISTRY: dict[Any, Handler] = {}


def register(*targets: Any, family: str, namer: Namer = default_name, free: bool = False,
             grad_copies: bool = False, replicate_only: bool = False, doc: str = "",
             kernel: KernelFn = default_kernel,
             curve: "str | CurveFn | None" = None, local_calls: LocalCallsFn | None = None
             ) -> Callable[[Rules], Rules]:
    """Decorator: register ``rules`` for every op in ``targets`` (``curve``, ``local_calls``: see
    :class:`Handler`)."""

    def deco(rules: Rules) -> Rules:
        h = Handler(family=family, rules=rules, namer=namer, free=free, grad_copies=grad_copies,
                    replicate_only=replicate_only,
                    doc=doc or (rules.__doc__ or "").strip().split("\n")[0], kernel=kernel, curve=curve,
                    local_calls=local_calls)
        for t in targets:
            if t in REGISTRY:
                raise ValueError(f"{op_name(t)} registered twice ({REGISTRY[t].family} and {family})")
            REGISTRY[t] = h
        return rules

    return deco


def register_replicate_only(*targets: Any, family: str, doc: str, free: bool = False) -> None:
    """Ops that are explicitly replicate-only: only the all-replicated strategy exists."""

    def no_options(op: OpInfo) -> list[AxisOption]:
        return []

    register(*targets, family=family, free=free, replicate_only=True, doc=doc)(no_options)


def handler_for(target: Any) -> Handler | None:
    """The handler of an op, registered by the op itself or by its name (custom ops of a library
    that may not be imported when the handlers are: ``"transformers.grouped_mm_fallback.default"``)."""
    return REGISTRY.get(target) or REGISTRY.get(op_name(target))


def op_info(node: Any, graph: Any, mesh: Any, *, batch_norm_groups: int = 1, loss_groups: int = 1,
            returns_per_rank: bool = False) -> OpInfo:
    """``node`` as its handler sees it (free views and gradient-copying views flagged as the
    handler registered them, so that their profile is the handler's, not a measured one)."""
    handler = handler_for(node.target)
    return OpInfo(node, graph, mesh, free=bool(handler and handler.free),
                  grad_copies=bool(handler and handler.grad_copies), batch_norm_groups=batch_norm_groups,
                  loss_groups=loss_groups, returns_per_rank=returns_per_rank)
