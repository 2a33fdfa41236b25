"""The top-level planning call: model + example inputs + mesh + hardware + budget -> :class:`Plan`.

:func:`plan` runs the pipeline once, in one direction: capture (torch.export on whatever tensors
the inputs are; meta tensors allocate nothing) -> strategy enumeration -> cost graph -> the ILP
-> a :class:`~autoshard.plan.Plan`. Inputs are validated first, with errors that say what to do.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from .batch_norm_modes import BATCH_NORM_MODES, LOSS_MODES
from .capture import CapturedGraph, TensorMeta, capture_meta
from .enumerate import OUTPUT_MODES, enumerate_strategies
from .hardware import HardwareProfile, load_hardware
from .mesh import MeshError, MeshSpec
from .errors import ArgumentError, BudgetError
from .plans import Plan
from .precision import MixedPrecision, cast_inputs, master_dtype_of, precision_copy
from .plans.build import plan_from_solution
from .progress import Progress
from .solver.baselines import DATA_PARALLEL_MARGIN
from .solver.costgraph_build import build_cost_graph
from .solver.ilp import SolverOptions, solve
from .units import format_bytes, parse_bytes

DEFAULT_GAP = 0.02
"""The relative optimality gap :func:`plan` stops at by default: the first plan proven within 2% of
the best modeled step time. Well inside the model's own error against measured steps (about 20%,
``bench/plan_fidelity.py``); proving the optimum took Llama-7B on 2x4 under its 80 GiB budget
several times longer for a plan 0.07% faster."""

__all__ = ["ArgumentError", "BudgetError", "plan"]

_SOLVERS = ("highs", "cbc")
_FALLBACKS = ("error", "replicate")


def plan(model_or_graph: "nn.Module | CapturedGraph", args: Any = (), kwargs: Mapping[str, Any] | None = None,
         *, mesh: "MeshSpec | Sequence[int] | str | int", hardware: "str | HardwareProfile | Mapping" = "h100-nvlink",
         memory_budget: "int | float | str | None" = None, optimizer_bytes_per_param: float = 8.0,
         fallback: str = "error", merge_followers: bool = True, alias_blocks: bool = True,
         solver: str = "highs", time_limit: float = 60.0, gap_rel: float = DEFAULT_GAP, progress: bool = False,
         name: str | None = None, check_batch: bool = True, baseline: str | None = None,
         outputs: str = "global", batch_norm: str = "global", loss: str = "global", other_mode: bool = False,
         mp_policy: Any = None, prefer_data_parallel_within: float = DATA_PARALLEL_MARGIN) -> Plan:
    """Plan sharding, recomputation and offloading of one training step of a model.

    ``model_or_graph``: an ``nn.Module`` (captured here on its example ``args``/``kwargs``; meta
    tensors work and allocate nothing) or a :class:`CapturedGraph`. ``mesh``: ``(2, 4)``,
    ``"2x4"`` or ``8`` (a 1D mesh). ``hardware``: a profile name from ``configs/hardware``, a YAML
    path or a profile. ``memory_budget``: bytes per device or a size such as ``"40GiB"``; None
    uses the profile's ``memory_per_device``. ``optimizer_bytes_per_param``: optimizer state per
    parameter element (8 for AdamW in fp32). ``fallback="replicate"`` runs ops without a handler
    replicated (listed in ``plan.fallbacks``). ``merge_followers``/``alias_blocks`` simplify the
    cost graph (see :func:`autoshard.solver.build_cost_graph`). ``solver``, ``time_limit`` (s)
    and ``gap_rel`` configure the ILP (``gap_rel``: stop at a plan proven within this fraction of
    the best modeled step time, :data:`DEFAULT_GAP` by default; 0 proves the optimum). ``progress`` shows each stage with its time on stderr.
    ``name`` labels the model in the plan (default: the graph's name). ``check_batch``: require
    the mesh size to divide dim 0 of every input tensor. ``baseline``: instead of the free
    optimum, the best plan of a hand-written family (``"data_parallel"``, ``"megatron"``,
    ``"zero3"``, ``"replicated"``: every rank the whole step, no collective; see
    :mod:`autoshard.solver.baselines`), memory decisions fixed to keep.
    ``prefer_data_parallel_within``: with no ``baseline``, return the data-parallel plan (where it
    fits the budget and no ZeRO-3 or replicated plan is modeled faster) unless the ILP's plan is
    modeled faster by more than this fraction of its step (5% by default, :data:`~autoshard.solver.baselines.DATA_PARALLEL_MARGIN`: plans closer than that
    are within the cost model's error; 0 returns the fastest as modeled); ``plan.solver.note`` says
    when it did.
    ``outputs``: how :func:`autoshard.parallelize` returns the model's outputs: ``"global"``
    (every tensor output whole on every rank, gathered as the plan prices it) or ``"local"``
    (a tensor output of rank >= 1 as each rank's shard in the layout its producer has, with no
    collective and nothing priced for it; 0-dim outputs such as a loss stay global). Use
    ``"local"`` when the training loop only needs the loss, as with DDP, where each rank keeps
    its own logits. ``batch_norm``: what training batch norm normalises with: ``"global"``
    (the statistics of the whole batch, the single-device model's function; a plan that splits
    the batch then all-reduces each batch norm's statistics, forward and backward) or
    ``"per_rank"`` (each of the mesh's devices' equal, consecutive share of the batch with its own
    statistics, torch DDP's function, whatever the plan: a batch split over the devices needs no
    communication; the running statistics are the mean of the shares' updates, averaged across
    ranks when read, see ``ParallelModule.sync_buffers``; recorded in ``plan.batch_norm``).
    ``loss``: what a mean cross-entropy / nll loss divides by: ``"global"`` (the count of the whole
    batch's counted targets, the single-device model's function: a plan that splits the rows
    all-reduces that count, or the sum and count together, in forward) or ``"per_rank"`` (the mean
    over the mesh's devices of each one's equal, consecutive share of the rows' own mean, torch DDP's
    function: a batch split over the devices needs no collective for the loss; the same value where
    no target is ignored and class weights are equal; recorded in ``plan.loss``). With
    ``outputs="local"`` a per-rank plan also returns 0-dim outputs as produced: each rank's value,
    whose mean over the ranks is the output (a DDP rank's loss), with no collective.
    ``other_mode``: also plan the model's graph in its other mode now (eval for a model in
    training mode), every parameter in the layout the main plan gives it, and store it in
    ``plan.other_mode`` (see :mod:`autoshard.modes`). Off by default: it costs a second capture
    (about doubling planning time for a Hugging Face model), and the parallelized model derives the
    same plan (nothing is solved) at its first ``.eval()`` when the plan lacks it. Skipped when both
    modes capture the same graph. ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``
    (``param_dtype`` required) to plan and run the model in mixed precision as FSDP2 does: the graph
    is captured with the parameters in ``param_dtype`` and priced at that dtype's rates; memory counts
    the master parameters (the model's dtype), their gradients, the optimizer state per master
    element and the working copies the consumers hold; gradients are reduced in ``reduce_dtype``
    (see :mod:`autoshard.precision`; recorded in ``plan.mixed_precision``). Needs an ``nn.Module``.

    Raises :class:`ArgumentError` (an argument of the wrong type or range, an unknown ``solver``,
    ``fallback``, ``outputs``, ``batch_norm``, ``loss`` or ``baseline``, an example input with a zero-size
    dim), :class:`MeshError` (malformed mesh, or a batch the mesh does not divide),
    :class:`~autoshard.hardware.HardwareError` (unknown profile), :class:`BudgetError`,
    :class:`~autoshard.capture.CaptureError`, :class:`~autoshard.enumerate.UnsupportedOpError`
    and :class:`~autoshard.errors.InfeasibleBudgetError` (naming the smallest feasible budget).
    """
    mesh_spec = _mesh(mesh)
    hw = load_hardware(hardware)
    budget = resolve_budget(memory_budget, hw)
    _check_choice("solver", solver, _SOLVERS)
    _check_choice("fallback", fallback, _FALLBACKS)
    _check_choice("outputs", outputs, OUTPUT_MODES)
    _check_choice("batch_norm", batch_norm, BATCH_NORM_MODES)
    _check_choice("loss", loss, LOSS_MODES)
    if baseline is not None:
        from .solver.baselines import BASELINES

        _check_choice("baseline", baseline, tuple(BASELINES))
    opt_bytes = _number("optimizer_bytes_per_param", optimizer_bytes_per_param, zero=True,
                        hint="bytes of optimizer state per parameter element: 8 for AdamW in fp32, 0 for SGD")
    seconds = _number("time_limit", time_limit, hint="seconds the ILP may run, e.g. 60")
    gap = _number("gap_rel", gap_rel, zero=True, high=1.0, hint="a relative optimality gap in [0, 1), e.g. 0.01")
    dp_margin = _number("prefer_data_parallel_within", prefer_data_parallel_within, zero=True, high=1.0,
                        hint="a fraction of the data-parallel plan's step in [0, 1), e.g. 0.05; 0 takes the fastest "
                             "plan as modeled")
    for label, flag in (("merge_followers", merge_followers), ("alias_blocks", alias_blocks),
                        ("progress", progress), ("check_batch", check_batch), ("other_mode", other_mode)):
        if not isinstance(flag, bool):
            raise ArgumentError(f"{label} must be True or False, got {flag!r} ({type(flag).__name__})")
    if name is not None and (not isinstance(name, str) or not name):
        raise ArgumentError(f"name must be a non-empty string (the model's label in the plan) or None, got {name!r}")
    if not isinstance(model_or_graph, (nn.Module, CapturedGraph)):
        raise ArgumentError(f"plan needs an nn.Module or a CapturedGraph, got {type(model_or_graph).__name__}; "
                            f"pass the model, then its example inputs")
    precision = _precision(mp_policy, model_or_graph)
    if precision is not None:      # captured from a meta copy with parameters (and float inputs) in param_dtype
        model_or_graph = precision_copy(model_or_graph, precision)
        args, kwargs = cast_inputs(args, kwargs, precision)
    inputs = _input_tensors(model_or_graph, args, kwargs)
    _check_inputs(inputs)
    if check_batch:
        _check_batch([(where, tuple(shape)) for where, shape, _ in inputs], mesh_spec)
    options = SolverOptions(memory_budget=budget, optimizer_bytes_per_param=opt_bytes,
                            solver=solver, time_limit=seconds, gap_rel=gap)
    stages = Progress(progress)
    if isinstance(model_or_graph, CapturedGraph):       # captured already: no stage to show
        graph, stages.seconds["capture_s"] = model_or_graph, 0.0
    else:
        with stages.stage(f"capturing {name or _label(model_or_graph)} on meta tensors", "capture_s"):
            graph = _captured(model_or_graph, args, kwargs, name)
    with stages.stage(f"enumerating strategies on mesh {mesh_spec}", "enumerate_s"):
        table = enumerate_strategies(graph, mesh_shape=mesh_spec, hardware=hw, fallback=fallback, outputs=outputs,
                                     batch_norm=batch_norm, loss=loss)
    with stages.stage("building the cost graph", "costgraph_s"):
        cg = build_cost_graph(table, merge_followers=merge_followers, alias_blocks=alias_blocks, precision=precision)
    budget_text = "no memory budget" if budget is None else f"budget {format_bytes(budget)}/device"
    with stages.stage(f"solving the ILP ({solver}, {budget_text}, {len(cg)} decision nodes)", "solving_s"), \
            _stdout_to_stderr():
        from .solver.baselines import best_by_step_model, solve_baseline

        if baseline is None:
            solution = best_by_step_model(cg, solve(cg, options), options, dp_margin)
        else:
            solution = solve_baseline(cg, baseline, options).solution
    # build_s / solve_s: the ILP of the plan picked (the free ILP's, or the baseline family's that
    # replaced it); solving_s: the whole stage, every ILP solved to pick the plan
    timings = {**stages.seconds, "build_s": solution.build_seconds, "solve_s": solution.solve_seconds}
    result = plan_from_solution(cg, solution, model_name=name or graph.name, options=options, budget=budget,
                                timings=timings)
    if isinstance(model_or_graph, nn.Module):
        result.training = model_or_graph.training
        if other_mode:
            with stages.stage(f"planning {'eval' if result.training else 'training'} mode", "other_mode_s"):
                result.other_mode = _other_mode(result, graph, model_or_graph, args, kwargs, name)
    return result


# -- validation ----------------------------------------------------------------------------------------

def _precision(mp_policy: Any, model_or_graph: Any) -> MixedPrecision | None:
    """The plan's mixed-precision policy from ``mp_policy`` (None: none); ArgumentError for a policy
    autoshard cannot run or a captured graph (whose master dtype it cannot know)."""
    if mp_policy is None:
        return None
    if not isinstance(model_or_graph, nn.Module):
        raise ArgumentError("mp_policy needs the nn.Module (autoshard captures it with its parameters in "
                            "param_dtype), not a CapturedGraph; pass the model")
    return MixedPrecision.of(mp_policy, master_dtype_of(model_or_graph))


def _mesh(mesh: Any) -> MeshSpec:
    """A MeshSpec from any accepted form; MeshError (with the accepted forms) otherwise."""
    try:
        return MeshSpec.of(mesh)
    except MeshError:
        raise
    except (TypeError, ValueError) as e:
        raise MeshError(f"mesh {mesh!r} is malformed ({e}); write it as (2, 4), '2x4' or 8") from None


def resolve_budget(value: "int | float | str | None", hw: HardwareProfile) -> int:
    """Bytes per device: the profile's memory when None, else a positive size no larger than it;
    :class:`BudgetError` otherwise (the one check of a budget, for the library and the CLI)."""
    if value is None:
        return int(hw.memory_per_device)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BudgetError(f"memory budget {value!r} must be a byte count or a size such as '40GiB'")
    try:
        budget = parse_bytes(value)
    except ValueError as e:
        raise BudgetError(f"memory budget: {e}") from None
    if budget <= 0:
        raise BudgetError(f"memory budget must be positive, got {value!r}; write e.g. '40GiB'")
    if budget > hw.memory_per_device:
        raise BudgetError(
            f"memory budget {format_bytes(budget)} exceeds the {format_bytes(hw.memory_per_device)} a device of "
            f"hardware profile '{hw.name}' has; pass at most {format_bytes(hw.memory_per_device)} (or omit the "
            f"budget to use all of it), or a profile of the device you run on")
    return budget


def _check_choice(label: str, value: Any, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ArgumentError(f"{label} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def _number(label: str, value: Any, *, zero: bool = False, high: float = math.inf, hint: str) -> float:
    """``value`` as a finite float above 0 (or equal to 0 with ``zero``), below ``high``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > 0 or (zero and value == 0)) and value < high
    if not ok:
        bound = "a finite number >= 0" if zero else "a finite number > 0"
        if high < math.inf:
            bound += f" and < {high:g}"
        raise ArgumentError(f"{label} must be {bound}, got {value!r}: {hint}")
    return float(value)


def _input_tensors(model_or_graph: Any, args: Any, kwargs: Mapping[str, Any] | None
                   ) -> list[tuple[str, tuple, torch.dtype]]:
    """(where, shape, dtype) of every user-input tensor: from the graph, or from the example inputs."""
    if isinstance(model_or_graph, CapturedGraph):
        g = model_or_graph
        metas = [(g.user_input_specs.get(p, p), g.tensor_meta(p)) for p in g.user_inputs]
        return [(where, tuple(m.shape), m.dtype) for where, m in metas if isinstance(m, TensorMeta)]
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ArgumentError(f"kwargs must be a mapping of keyword arguments, got {type(kwargs).__name__}")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    leaves, _ = pytree.tree_flatten_with_path((args, dict(kwargs or {})))
    return [(_describe(path), tuple(leaf.shape), leaf.dtype) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]


def _check_inputs(inputs: list[tuple[str, tuple, torch.dtype]]) -> None:
    """ArgumentError for an example input with a zero-size dim (nothing to plan)."""
    if not inputs:
        raise ArgumentError("the model has no tensor inputs to plan for; pass example inputs: "
                            "autoshard.plan(model, (x,), mesh=...) (meta tensors work)")
    for where, shape, _ in inputs:
        if 0 in shape:
            raise ArgumentError(f"example input {where} has shape {list(shape)} with a zero-size dim: there is "
                                f"nothing to plan; pass inputs of the shapes you train with (meta tensors work)")


def _describe(path: Sequence[Any]) -> str:
    """``args[0]`` / ``kwargs['input_ids']`` for a pytree path of ``(args, kwargs)``."""
    text = pytree.keystr(tuple(path))          # "[0][0]" or "[1]['input_ids']"
    head, _, rest = text[1:].partition("]")
    return ("args" if head == "0" else "kwargs") + rest


def _check_batch(inputs: list[tuple[str, tuple]], mesh: MeshSpec) -> None:
    """MeshError unless the mesh size divides dim 0 (the batch) of every input tensor."""
    for where, shape in inputs:
        if shape and shape[0] % mesh.size:
            batch = shape[0]
            multiple = (batch // mesh.size + 1) * mesh.size
            raise MeshError(
                f"the batch size {batch} (dim 0 of input {where}, shape {list(shape)}) is not divisible by "
                f"the {mesh.size} devices of mesh {mesh}: use a batch that is a multiple of {mesh.size} "
                f"(e.g. {multiple}), or a mesh whose size divides {batch}")


# -- pipeline helpers ----------------------------------------------------------------------------------

def _other_mode(result: Plan, graph: CapturedGraph, model: nn.Module, args: Any, kwargs: Mapping[str, Any] | None,
                name: str | None) -> "Plan | None":
    """The plan of the model's other-mode graph, or None when it is the same graph. A model whose
    other mode cannot keep the main plan's layouts gets None and a warning: the runtime raises the
    same :class:`~autoshard.modes.ModeError` if the model is switched."""
    import logging

    from .modes import ModeError, capture_in_mode, plan_other_mode

    other_graph = capture_in_mode(model, args, kwargs, not result.training, name=name)
    if other_graph.fingerprint() == graph.fingerprint():
        return None
    try:
        return plan_other_mode(result, other_graph)
    except ModeError as e:
        logging.getLogger(__name__).warning("%s", e)
        return None


def _label(model_or_graph: Any) -> str:
    return getattr(model_or_graph, "name", None) or type(model_or_graph).__name__


def _captured(model_or_graph: Any, args: Any, kwargs: Mapping[str, Any] | None, name: str | None) -> CapturedGraph:
    if isinstance(model_or_graph, CapturedGraph):
        return model_or_graph
    if not isinstance(model_or_graph, nn.Module):
        raise TypeError(f"plan needs an nn.Module or a CapturedGraph, got {type(model_or_graph).__name__}")
    # Always on meta, whatever device the model and inputs are on: nothing is allocated, and the
    # graph is the one the runtime captures (export records slightly different graphs per device).
    # A Hugging Face stack of layers is captured folded (exported at 2 and 3 layers, unrolled: the
    # graph a full export gives, in a fraction of its time); anything that does not fold, in full.
    from .capture import FoldError, capture_module_folded

    try:
        folded = capture_module_folded(model_or_graph, args, kwargs, name=name)
    except FoldError as e:
        logging.getLogger(__name__).info("folded capture of %s failed, capturing in full: %s", name, e)
        folded = None
    return folded if folded is not None else capture_meta(model_or_graph, args, kwargs, name=name)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 (the HiGHS banner) to stderr, so that stdout
    carries only what autoshard prints (a plan explanation piped to a file stays clean)."""
    import os
    import sys

    try:
        out, err = sys.__stdout__.fileno(), sys.__stderr__.fileno()   # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):    # no real descriptors (e.g. an embedded interpreter)
        yield
        return
    sys.stdout.flush()
    saved = os.dup(out)
    try:
        os.dup2(err, out)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, out)
        os.close(saved)
