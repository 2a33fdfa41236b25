"""Consistency of a plan's decisions: what a loaded plan must satisfy beyond its JSON types.

:func:`check_consistency` runs on every :meth:`Plan.from_dict` (so on every :meth:`Plan.load`): node
entries name real operands, each consumer reads an operand in the layout its producer makes it or
through a recorded resharding whose moves, replayed, turn the one into the other (forward) and back
(backward), on mesh axes the plan's mesh has, for shapes the layouts divide. :func:`check_against_graph`
runs when the plan meets its graph (:meth:`Plan.check`): every node planned, no node the graph lacks,
and the resharded tensors' shapes and dtypes those of the graph.

Both raise :class:`~autoshard.plans.PlanError` naming the node, the operand and what disagrees; a plan
that fails them was edited or corrupted, and the fix is always to re-create it.
:func:`check_layouts_agree` checks that a plan and its other-mode plan (see :mod:`autoshard.modes`)
lay out every parameter, buffer and input alike (:class:`~autoshard.plans.ModeError` otherwise).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..phases import Phase
from ..reshard import MOVE_KINDS, ReshardError, replay_moves
from ..specs import ShardSpec, SpecError
from .errors import ModeError, PlanError

if TYPE_CHECKING:
    from ..capture import CapturedGraph
    from .schema import Plan, ReshardEntry

NODE_KINDS = ("placeholder", "call_function", "output", "get_attr")
PHASES = (Phase.FWD, Phase.BWD)
"""The phases of a node's own collectives (a recomputed forward's are counted by the plan's ``comm``)."""
_REPLAN = "Re-create the plan (autoshard.plan(...).save(path) or `autoshard plan ... --out path`)"


def _error(source: str, message: str) -> Exception:
    return PlanError(f"{source}: {message}. {_REPLAN}.")


def check_consistency(plan: "Plan", source: str) -> None:
    """:class:`PlanError` unless ``plan``'s nodes, operands and reshardings agree with each other."""
    mesh = tuple(plan.mesh_shape)
    order = {name: i for i, name in enumerate(plan.nodes)}
    for key, node in plan.nodes.items():
        if key != node.name:
            raise _error(source, f"node entry '{key}' is named '{node.name}'")
        if node.kind not in NODE_KINDS:
            raise _error(source, f"node '{key}' has kind {node.kind!r}, not one of {', '.join(NODE_KINDS)}")
        for j, producer in enumerate(node.operands):
            if producer not in plan.nodes:
                raise _error(source, f"node '{key}' reads operand {j} from '{producer}', which the plan does not have")
            if order[producer] >= order[key]:
                raise _error(source, f"node '{key}' reads operand {j} from '{producer}', which comes after it")
        if node.operands and node.kind != "output" and len(node.inputs) != len(node.operands):
            raise _error(source, f"node '{key}' has {len(node.inputs)} input specs for {len(node.operands)} operands")
        if node.kind == "call_function" and len(node.tags) != len(mesh):
            raise _error(source, f"node '{key}' records {len(node.tags)} per-axis option tag(s), the {plan.mesh} mesh "
                                 f"has {len(mesh)} axes")
        if node.split < 1:
            raise _error(source, f"node '{key}' has split {node.split}; the devices a computation is divided over "
                                 f"number at least 1")
        for c in node.collectives:
            if c.phase not in PHASES:
                raise _error(source, f"node '{key}' has a {c.kind} in phase {c.phase!r}, not one of "
                                     f"{', '.join(PHASES)}")
            if not c.axes or any(a not in range(len(mesh)) for a in c.axes):
                raise _error(source, f"node '{key}' has a {c.kind} over mesh axes {c.axes}; the {plan.mesh} mesh has "
                                     f"axes 0 and 1")
    if plan.inputs is not None:
        check_input_signature(plan.inputs, source)
    resharded: dict[tuple[str, int], "ReshardEntry"] = {}
    for r in plan.reshards:
        if (r.dst, r.operand) in resharded:
            raise _error(source, f"operand {r.operand} of node '{r.dst}' is resharded twice")
        resharded[(r.dst, r.operand)] = r
        _check_reshard(plan, r, source)
    for key, node in plan.nodes.items():
        for j, producer in enumerate(node.operands):
            if (key, j) in resharded or j >= len(node.inputs):
                continue
            made = [ShardSpec.parse(s) for s in plan.nodes[producer].outputs if s is not None]
            if not made:
                continue
            wanted = ShardSpec.parse(node.inputs[j])
            if wanted not in made:
                raise _error(source, f"node '{key}' reads operand {j} ('{producer}') as {wanted}, but '{producer}' "
                                     f"produces {', '.join(map(str, made))} and the plan records no resharding "
                                     f"between them")


def check_input_signature(inputs: Any, source: str) -> None:
    """The recorded call signature (:attr:`Plan.inputs`) must rebuild example inputs: an ``in_spec``
    pytree can read with one leaf per entry of ``leaves``, each a tensor (``shape`` of ints >= 0,
    ``dtype`` a torch dtype name) or a JSON constant (``value``)."""
    import torch
    import torch.utils._pytree as pytree

    if not isinstance(inputs, dict) or set(inputs) != {"in_spec", "leaves"} or not isinstance(inputs["leaves"], list) \
            or not isinstance(inputs["in_spec"], str):
        raise _error(source, "'inputs' must be {\"in_spec\": <pytree spec>, \"leaves\": [...]}")
    try:
        spec = pytree.treespec_loads(inputs["in_spec"])
    except Exception as e:  # pytree raises JSON, type and registration errors alike: all mean "unreadable"
        raise _error(source, f"'inputs.in_spec' is not a pytree spec autoshard can read ({type(e).__name__}: {e})") \
            from None
    if spec.num_leaves != len(inputs["leaves"]):
        raise _error(source, f"'inputs.in_spec' has {spec.num_leaves} leaves but 'inputs.leaves' lists "
                             f"{len(inputs['leaves'])}")
    for i, leaf in enumerate(inputs["leaves"]):
        if not isinstance(leaf, dict):
            raise _error(source, f"'inputs.leaves[{i}]' must be an object")
        if "shape" in leaf:
            shape, dtype = leaf.get("shape"), leaf.get("dtype")
            if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise _error(source, f"'inputs.leaves[{i}].shape' must be a list of ints >= 0, got {shape!r}")
            if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise _error(source, f"'inputs.leaves[{i}].dtype' is {dtype!r}, not a torch dtype name")
        elif set(leaf) != {"value"}:
            raise _error(source, f"'inputs.leaves[{i}]' must hold a tensor's shape and dtype or a constant's value")


def _check_reshard(plan: "Plan", r: "ReshardEntry", source: str) -> None:
    where = f"the resharding of operand {r.operand} of node '{r.dst}' (from '{r.src}')"
    src, dst = plan.nodes.get(r.src), plan.nodes.get(r.dst)
    if src is None or dst is None:
        raise _error(source, f"{where} names a node the plan does not have")
    if dst.operands and (r.operand >= len(dst.operands) or dst.operands[r.operand] != r.src):
        raise _error(source, f"{where}: node '{r.dst}' has no operand {r.operand} read from '{r.src}'")
    if not 0 <= r.src_output < len(src.outputs) or src.outputs[r.src_output] is None:
        raise _error(source, f"{where} reads output {r.src_output} of '{r.src}', which has no such tensor output")
    if not r.shape or any(d < 1 for d in r.shape):
        raise _error(source, f"{where} has shape {r.shape}; a resharded tensor has dims >= 1")
    import torch

    if not isinstance(getattr(torch, r.dtype, None), torch.dtype):
        raise _error(source, f"{where} has dtype {r.dtype!r}, not a torch dtype name")
    try:
        src_spec, dst_spec = ShardSpec.parse(r.src_spec), ShardSpec.parse(r.dst_spec)
    except SpecError as e:
        raise _error(source, f"{where} has a malformed spec ({e})") from None
    produced = ShardSpec.parse(src.outputs[r.src_output])
    if src_spec != produced:
        raise _error(source, f"{where} starts from {src_spec}, but '{r.src}' produces {produced}")
    if dst.operands and r.operand < len(dst.inputs) and ShardSpec.parse(dst.inputs[r.operand]) != dst_spec:
        raise _error(source, f"{where} ends at {dst_spec}, but '{r.dst}' reads the operand as {dst.inputs[r.operand]}")
    if src_spec == dst_spec:
        raise _error(source, f"{where} goes from {src_spec} to itself")
    _check_moves(r.fwd, src_spec, dst_spec, r.shape, plan.mesh_shape, f"{where}, forward", source)
    if r.bwd:
        _check_moves(r.bwd, dst_spec, src_spec, r.shape, plan.mesh_shape, f"{where}, backward", source)


def _check_moves(steps: list[Any], src: ShardSpec, dst: ShardSpec, shape: list[int], mesh: list[int], where: str,
                 source: str) -> None:
    """The recorded moves, replayed, must take ``src`` to ``dst``, each landing where it says."""
    for i, step in enumerate(steps):
        if step.kind not in MOVE_KINDS:
            raise _error(source, f"{where}: move {i} is {step.kind!r}, not one of {', '.join(MOVE_KINDS)}")
    spec = src
    for i, step in enumerate(steps):
        try:
            spec = replay_moves(spec, [(step.kind, step.axis, step.dims)], shape, mesh)
        except (ReshardError, SpecError) as e:
            raise _error(source, f"{where}: move {i} ({step.text}) is not valid: {e}") from None
        try:
            after = ShardSpec.parse(step.after)
        except SpecError as e:
            raise _error(source, f"{where}: move {i} records a malformed result spec ({e})") from None
        if after != spec:
            raise _error(source, f"{where}: move {i} ({step.text}) gives {spec}, but the plan records {after}")
    if spec != dst:
        raise _error(source, f"{where}: the moves end at {spec}, not at {dst}")


def check_against_graph(plan: "Plan", graph: "CapturedGraph") -> None:
    """:class:`PlanError` unless every node of ``graph`` is planned, the plan names no node the graph
    lacks, and each resharded tensor has the graph's shape and dtype (call after the fingerprints
    matched: this catches a plan file edited after it was made)."""
    source = f"the plan for '{plan.model_name}'"
    names = [n.name for n in graph.graph.nodes]
    missing = [n for n in names if n not in plan.nodes]
    extra = [n for n in plan.nodes if n not in set(names)]
    if missing or extra:
        raise _error(source, f"its nodes differ from the graph's (unplanned: {missing[:3]}, unknown: {extra[:3]})")
    for r in plan.reshards:
        meta = graph.tensor_meta(r.src)
        if isinstance(meta, tuple):
            meta = meta[r.src_output] if r.src_output < len(meta) else None
        if meta is None:
            raise _error(source, f"it reshards '{r.src}' into '{r.dst}', but '{r.src}' has no tensor output "
                                 f"{r.src_output} in the graph")
        dtype = str(meta.dtype).removeprefix("torch.")
        if list(meta.shape) != list(r.shape) or dtype != r.dtype:
            raise _error(source, f"it reshards '{r.src}' into '{r.dst}' as a {r.dtype} tensor of shape {r.shape}, "
                                 f"but the graph has {dtype} of shape {list(meta.shape)}")


def check_layouts_agree(plan: "Plan", other: "Plan") -> None:
    """:class:`ModeError` unless every parameter, buffer and input both plans place has one layout."""
    main = {n.fqn: n.outputs[0] for n in plan.nodes.values() if n.kind == "placeholder" and n.fqn}
    for n in other.nodes.values():
        if n.kind == "placeholder" and n.fqn in main and n.outputs[0] != main[n.fqn]:
            raise ModeError(f"'{n.fqn}' is laid out {main[n.fqn]} in the {'training' if plan.training else 'eval'} "
                            f"plan but {n.outputs[0]} in the other mode's; both modes must hold it alike. "
                            f"Re-create the plan")
