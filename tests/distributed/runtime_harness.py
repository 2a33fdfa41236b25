"""Run a module under a plan on the real ranks and compare with the single-device module.

Forward outputs are compared as global tensors, parameter gradients after gathering
(``full_grads``), input gradients on this rank's block of the input (a rank only back-propagates
into the block of the global batch it was given). The loss is ``sum(out * w)`` with fixed random
``w`` per float output, the same on every rank, scaled by ``1/sqrt(numel)`` so that gradients have
the size a mean-reduced loss gives them (fp32 summation-order differences then stay within the
absolute tolerance where a gradient element cancels to nearly zero).
"""
from __future__ import annotations

import copy
import zlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import autoshard
from autoshard.enumerate import enumerate_strategies
from autoshard.plans import Plan
from autoshard.plans.build import plan_from_solution
from autoshard.runtime import capture_meta
from autoshard.solver.costgraph_build import build_cost_graph
from autoshard.solver.fixed import fixed_solution
from autoshard.solver.ilp import SolverOptions
from autoshard.verify import shard_of

RTOL, ATOL = 1e-5, 1e-6
_MESHES: dict[tuple[int, int], Any] = {}


def device_mesh(shape: tuple[int, int]):
    """One DeviceMesh per shape for the whole session (creating groups is collective and slow)."""
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("axis0", "axis1"))
    return _MESHES[shape]


def _weights(outs: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) / max(o.numel(), 1) ** 0.5
            if o.dtype.is_floating_point and o.requires_grad else None for o in outs]


def _loss(outs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    terms = [(o * w).sum() for o, w in zip(outs, weights) if w is not None]
    return torch.stack(terms).sum() if terms else None


def _fresh_inputs(inputs: Sequence[Any]) -> list[Any]:
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]


class Reference:
    """The single-device run of ``module`` on ``inputs``: outputs and gradients."""

    def __init__(self, module: torch.nn.Module, inputs: Sequence[Any], seed: int = 0) -> None:
        self.module = copy.deepcopy(module)
        self.inputs = _fresh_inputs(inputs)
        self.seed = seed
        torch.manual_seed(seed)           # random ops (rand, dropout) draw the same as the parallel run
        self.outs = [o for o in pytree.tree_leaves(self.module(*self.inputs)) if isinstance(o, torch.Tensor)]
        self.weights = _weights(self.outs, seed)
        loss = _loss(self.outs, self.weights)
        if loss is not None:
            loss.backward()
        self.param_grads = {n: p.grad for n, p in self.module.named_parameters()}


def check_plan(module: torch.nn.Module, inputs: Sequence[Any], plan: Plan, graph, ref: Reference, what: str) -> None:
    """Raise AssertionError naming ``what`` if the parallel run differs from ``ref``."""
    mesh = device_mesh(tuple(plan.mesh_shape))
    pm = autoshard.parallelize(module, plan, mesh, graph=graph)
    xs = _fresh_inputs(inputs)
    torch.manual_seed(ref.seed)
    outs = [o for o in pytree.tree_leaves(pm(*xs)) if isinstance(o, torch.Tensor)]
    assert len(outs) == len(ref.outs), f"{what}: {len(outs)} outputs, expected {len(ref.outs)}"
    for j, (o, r) in enumerate(zip(outs, ref.outs)):
        torch.testing.assert_close(o.detach(), r.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: output {j}: {m}")
    loss = _loss(outs, ref.weights)
    if loss is not None:
        loss.backward()
    for name, got in pm.full_grads().items():
        want = ref.param_grads[name]
        if want is None or got is None:
            assert want is None and (got is None or not got.any()), f"{what}: gradient of {name}: {got} vs {want}"
            continue
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: grad of {name}: {m}")
    specs = {p.name: p.spec for p in pm.placeholders if p.kind == "input"}
    for j, (x, rx, name) in enumerate(zip(xs, ref.inputs, graph.user_inputs)):
        if not isinstance(x, torch.Tensor) or rx.grad is None:
            continue
        spec = specs[name]
        coord = pm.comm.coord
        torch.testing.assert_close(shard_of(x.grad, spec, plan.mesh_shape, coord),
                                   shard_of(rx.grad, spec, plan.mesh_shape, coord), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: grad of input {j}: {m}")


def forced_plans(graph, mesh_shape: tuple[int, int], hardware: str = "cpu-gloo"
                 ) -> Iterator[tuple[str, str, Plan]]:
    """(node, strategy name, plan) for every strategy of every call_function node, that node
    forced and every other node replicated."""
    table = enumerate_strategies(graph, mesh_shape=mesh_shape, hardware=hardware)
    cg = build_cost_graph(table, merge_followers=False, alias_blocks=False)
    options = SolverOptions()
    for ns in table:
        if ns.op in ("placeholder", "output", "get_attr"):
            continue
        for k, s in enumerate(ns.strategies):
            solution = fixed_solution(cg, {ns.node: k}, options)
            yield ns.node, s.name, plan_from_solution(cg, solution, model_name=graph.name, options=options, budget=None)


def case_seed(name: str) -> int:
    return zlib.crc32(name.encode())


def on_all_ranks(what: str, fn, *args: Any) -> None:
    """Run ``fn(*args)`` on every rank; if it raises on any rank, raise on every rank (naming the
    ranks), so that one rank's failure fails the test everywhere instead of desynchronising the
    collectives of the next check."""
    error: BaseException | None = None
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - re-raised below on this rank, reported on the others
        error = e
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, None if error is None else f"{type(error).__name__}: {error}")
    failed = {r: f for r, f in enumerate(flags) if f is not None}
    if error is not None:
        raise AssertionError(f"{what}: {error}") from error
    if failed:
        raise AssertionError(f"{what}: failed on rank(s) {sorted(failed)}: {next(iter(failed.values()))}")


def capture_case(module: torch.nn.Module, inputs: Sequence[Any], name: str):
    return capture_meta(module, tuple(inputs), name=name)
