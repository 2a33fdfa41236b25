"""The plan's schema: what the solver decided, as plain, versioned, JSON-serialisable data.

A :class:`Plan` is self-contained: it names the model and the fingerprint of its captured graph,
the mesh, the full hardware profile, the memory budget and the solver options, and records, per
graph node (named as torch.export names it), the chosen strategy with its input/output specs and
modeled costs; per repeated-block segment the memory decision; every non-identity resharding
between two nodes with its steps; and the predicted memory, step time and communication volume.

It is stored as JSON (never pickle, see :mod:`.jsonio`) and checked on load (types here, cross-field
consistency in :mod:`.validation`): a corrupt, truncated or foreign file raises :class:`PlanError`,
a plan made for another model :class:`PlanMismatchError`. Nothing here imports the solver: the
runtime reads plans with this module alone (a plan is built from a solution by :mod:`.build`).

Cost conventions follow the cost graph: seconds per training step, bytes per device; a node's
``params``/``grads`` memory is counted at the parameter's placeholder only.
"""
from __future__ import annotations

import dataclasses
import difflib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..batch_norm_modes import BATCH_NORM_MODES, LOSS_MODES
from ..decisions import DECISIONS, Decision
from ..enumerate import OUTPUT_MODES
from ..hardware import HardwareError, HardwareProfile
from ..phases import Phase
from ..precision import MixedPrecision
from ..reshard import SPLIT, TO_PARTIAL
from ..specs import ShardSpec, SpecError
from .errors import REPLAN as _REPLAN
from .errors import ModeError, PlanError, PlanMismatchError
from .explain import plain_text, renderable, summary_lines
from .jsonio import load_dataclass, parse_constant, read_plan_text, type_name
from .validation import check_against_graph, check_consistency, check_layouts_agree

if TYPE_CHECKING:
    from rich.console import RenderableType

    from ..capture import CapturedGraph

__all__ = [
    "CollectiveEntry", "CommEntry", "NodePlan", "PLAN_FORMAT_VERSION", "Plan", "RECOMPUTE", "ReshardEntry",
    "SolverReport", "StepEntry", "check_decision", "node_memory_regions",
]

PLAN_FORMAT_VERSION = 2
"""Version of the JSON layout. Bump it on any incompatible change to the fields below.

Version 2 records each node's decision structurally (:class:`NodePlan`'s ``tags`` and ``split``
with its specs and collectives), which is all the runtime reads; version 1 named the strategy only,
and the runtime enumerated the node's strategies again to find it."""

RECOMPUTE = Phase.RECOMPUTE
"""Phase of collectives re-run when a recomputed segment's forward runs again in backward."""


@dataclass
class CollectiveEntry:
    """One collective of a node's strategy: ``kind`` over mesh ``axes`` on ``nbytes`` per device."""

    kind: str
    axes: list[int]
    nbytes: int
    phase: str
    operand: str
    cost: float
    bucketed: bool = False   # a parameter-gradient all-reduce the step-time model prices as buckets


@dataclass
class NodePlan:
    """The decision for one graph node and its modeled costs.

    ``kind``: the fx op (placeholder, call_function, output). ``fqn``: the parameter/buffer FQN
    or user-input path of a placeholder. ``strategy``: the strategy's name, for people. The
    decision itself is structural, all the runtime needs to run the node with its handler's kernel
    (:meth:`autoshard.strategy.Strategy.from_plan` rebuilds it; nothing is enumerated again):
    ``inputs``/``outputs``, spec strings (:meth:`ShardSpec.parse` reads them back exactly;
    ``None`` for a non-tensor output); ``tags``, per mesh axis the tag of the handler's per-axis
    option that axis takes (``"R"``: replicated; what a kernel special-cases, e.g. ``"k"`` for a
    matmul whose contracted dim is sharded; one per mesh axis for a call node, none for the
    others); ``split``, the devices the computation is divided over; ``collectives``, the node's
    own collectives (a partial output's all-reduce, an operand's gradient all-reduce, a kernel's
    own). ``memory``: bytes per device (``params``, ``grads``, ``saved``, ``outputs``).
    """

    name: str
    kind: str
    op: str
    module: str
    fqn: str | None
    segment: str | None
    strategy: str
    inputs: list[str]
    outputs: list[str | None]
    compute_fwd: float
    compute_bwd: float
    collectives: list[CollectiveEntry]
    memory: dict[str, int]
    operands: list[str] = dataclasses.field(default_factory=list)   # producer node of each tensor operand
    tags: list[str] = dataclasses.field(default_factory=list)
    split: int = 1

    @property
    def comm_seconds(self) -> float:
        """Seconds of the node's own collectives (forward + backward)."""
        return sum(c.cost for c in self.collectives)

    @property
    def comm_bytes(self) -> int:
        """Bytes per device of the node's own collectives (forward + backward)."""
        return sum(c.nbytes for c in self.collectives)

    def input_specs(self) -> list[ShardSpec]:
        return [ShardSpec.parse(s) for s in self.inputs]

    def output_specs(self) -> list[ShardSpec | None]:
        return [None if s is None else ShardSpec.parse(s) for s in self.outputs]


@dataclass
class StepEntry:
    """One resharding move (see :class:`autoshard.reshard.ReshardStep`)."""

    kind: str
    axis: int
    dims: list[int]
    nbytes: int
    cost: float
    after: str
    text: str

    @property
    def is_collective(self) -> bool:
        """False for local moves (split, to_partial), which communicate nothing."""
        return self.kind not in (SPLIT, TO_PARTIAL)


@dataclass
class ReshardEntry:
    """Operand ``operand`` of ``dst`` reads output ``src_output`` of ``src`` in another layout.

    ``fwd`` turns ``src_spec`` into ``dst_spec``; ``bwd`` (empty when no gradient flows) turns the
    gradient, delivered in ``dst_spec``, back into ``src_spec``.
    """

    src: str
    dst: str
    operand: int
    src_output: int
    shape: list[int]
    dtype: str
    src_spec: str
    dst_spec: str
    fwd: list[StepEntry]
    bwd: list[StepEntry]
    cost_fwd: float
    cost_bwd: float

    @property
    def cost(self) -> float:
        return self.cost_fwd + self.cost_bwd


@dataclass
class CommEntry:
    """Predicted bytes per device per training step of one (collective kind, mesh axes, phase)."""

    kind: str
    axes: list[int]
    phase: str
    nbytes: int
    count: int


@dataclass
class SolverReport:
    """How the ILP went: status ('optimal', or 'feasible' when stopped by the time limit or
    gap), objective (modeled seconds per step), seconds to build and solve, and its size."""

    status: str
    objective: float
    build_seconds: float
    solve_seconds: float
    n_variables: int
    n_constraints: int
    solver: str
    gap: float | None = None      # relative distance to the solver's proven bound (None: not reported)
    note: str | None = None       # e.g. a baseline family's plan taken over the ILP's (see best_by_step_model)


# -- the plan ------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """A sharding + memory plan for one model on one mesh (plain data; see the module docstring).

    Build it with :func:`autoshard.plan` or :func:`autoshard.plans.build.plan_from_solution`; store it with
    :meth:`save` and :meth:`load`; read it with :meth:`explain` and :meth:`strategy_of`.

    Fields: ``fingerprint`` (of the captured graph, checked by :meth:`check`), ``mesh_shape``,
    ``hardware`` (the full profile), ``memory_budget`` (bytes per device, None: unconstrained),
    ``solver_options``; ``nodes`` (graph node name -> :class:`NodePlan`, graph order);
    ``segments`` (repeated-block instance -> keep / recompute / offload / partitioned /
    selective); ``recompute_runs`` (per selective segment, the graph nodes of each checkpoint
    region it recomputes, see :mod:`autoshard.solver.selective`);
    ``reshards`` (every non-identity resharding, :class:`ReshardEntry`); ``memory`` (predicted
    bytes per device: params, grads, optimizer, param_copies (parameters read larger than stored,
    e.g. gathered per block, held until backward), grad_buckets (the runtime's gradient bucket
    buffers), activations, working_set, peak); ``time``
    (modeled seconds per step: compute, comm, reshard, recompute, offload, total); ``comm``
    (predicted bytes per device per step by collective kind, mesh axes and phase ``fwd`` /
    ``bwd`` / ``recompute``); ``solver``; ``timings`` (seconds per planning stage);
    ``fallbacks`` (ops replicated without a handler); ``created`` (UTC, ISO 8601); ``outputs``
    (``"global"``: the parallelized model returns every tensor output whole on every rank;
    ``"local"``: a tensor output of rank >= 1 as each rank's shard, in the layout the output node's
    ``inputs`` record, with no collective to gather it; plans written before the field existed
    read as ``"global"``); ``batch_norm`` (``"global"`` or ``"per_rank"``: the statistics training
    batch norm normalises with, see :mod:`autoshard.batch_norm_modes`; plans written
    before the field existed read as ``"global"``); ``loss`` (``"global"`` or ``"per_rank"``: what a
    mean classification loss divides by, see :data:`autoshard.batch_norm_modes.LOSS_MODES`; likewise
    ``"global"`` for older plans).
    """

    format_version: int
    autoshard_version: str
    model_name: str
    fingerprint: str
    mesh_shape: list[int]
    hardware: dict[str, Any]
    memory_budget: int | None
    solver_options: dict[str, Any]
    nodes: dict[str, NodePlan]
    segments: dict[str, str]
    reshards: list[ReshardEntry]
    memory: dict[str, float]
    time: dict[str, float]
    comm: list[CommEntry]
    solver: SolverReport
    timings: dict[str, float]
    fallbacks: list[str]
    created: str
    inputs: dict[str, Any] | None = None
    recompute_runs: dict[str, list[list[str]]] = dataclasses.field(default_factory=dict)
    outputs: str = "global"
    batch_norm: str = "global"
    loss: str = "global"
    training: bool = True
    other_mode: "Plan | None" = None
    mixed_precision: MixedPrecision | None = None

    # ``mixed_precision``: the policy the plan was made under (``autoshard.plan(..., mp_policy=)``,
    # see :mod:`autoshard.precision`): the graph was captured with parameters in its
    # ``param_dtype`` and the runtime casts, reduces and keeps master weights as it says. None (and
    # plans written before the field existed): the model runs in its own dtypes.

    # ``training``: the mode the model was captured in (its graph is ``nodes``); plans written before
    # the field existed read as training. ``other_mode``: the plan of the model's graph in the other
    # mode (eval for a training plan), parameters laid out as here (see :mod:`autoshard.modes`); None
    # when the model's graph is the same in both modes or the plan was made from a captured graph
    # (then :func:`autoshard.parallelize` derives it when the model is switched).

    # ``inputs``: the call signature the graph was captured with (``in_spec``: the pytree spec of
    # ``(args, kwargs)`` as ``treespec_dumps`` writes it; ``leaves``: per leaf ``{"shape", "dtype"}``
    # for a tensor or ``{"value"}`` for a constant), so that the runtime can capture the same graph
    # without example inputs. None when the signature cannot be written as JSON.

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable data (dicts, lists, str, int, float, bool, None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> "Plan":
        """Validate ``data`` (as produced by :meth:`to_dict`) and build the plan; raises
        :class:`PlanError` saying what is wrong. ``source`` names the data in messages."""
        if not isinstance(data, dict):
            raise PlanError(f"{source} is not an autoshard plan: expected a JSON object, got "
                            f"{type_name(data)}. {_REPLAN}")
        version = data.get("format_version")
        if version is None:
            raise PlanError(f"{source} is not an autoshard plan: it has no 'format_version'. {_REPLAN}")
        if version == 1:
            raise PlanError(f"{source} has plan format version 1, which names each node's strategy but does not "
                            f"record the decision itself (per-axis option tags, split) that the runtime now runs "
                            f"from; this autoshard reads version {PLAN_FORMAT_VERSION}. {_REPLAN} with this version "
                            f"of autoshard.")
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"{source} has plan format version {version!r}, this autoshard reads version "
                            f"{PLAN_FORMAT_VERSION}. {_REPLAN} with this version of autoshard.")
        plan = load_dataclass(cls, data, source)
        plan._validate(source)
        return plan

    def save(self, path: "str | os.PathLike[str]") -> Path:
        """Write the plan as JSON (atomically: a crash leaves the old file or the new one)."""
        path = Path(path)
        if path.is_dir():
            raise PlanError(f"cannot write the plan to '{path}': it is a directory; name a file, e.g. "
                            f"'{path / 'plan.json'}'")
        if not path.parent.is_dir():
            raise PlanError(f"cannot write the plan to '{path}': folder '{path.parent}' does not exist; create it "
                            f"first or save elsewhere")
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: "str | os.PathLike[str]", graph: "CapturedGraph | None" = None) -> "Plan":
        """Read a plan saved by :meth:`save`. Raises :class:`PlanError` for a missing, corrupt,
        truncated or foreign file, and, when ``graph`` is given, :class:`PlanMismatchError` if the
        plan was made for another model."""
        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"a plan path must be a str or a path, got {type(path).__name__}; pass the file "
                            f"Plan.save or `autoshard plan --out` wrote")
        path = Path(path)
        text = read_plan_text(path)
        try:
            data = json.loads(text, parse_constant=parse_constant)
        except (json.JSONDecodeError, RecursionError, ValueError) as e:
            raise PlanError(f"plan file '{path}' is not valid JSON ({str(e)[:200]}); it is corrupt or truncated. "
                            f"{_REPLAN} (`autoshard plan ... --out {path}`).") from None
        plan = cls.from_dict(data, source=f"plan file '{path}'")
        from ..capture import CapturedGraph

        if graph is not None and not isinstance(graph, CapturedGraph):
            raise TypeError(f"graph must be a CapturedGraph (autoshard.capture(model, args)), got {type(graph).__name__}")
        if graph is not None:
            plan.check(graph)
        return plan

    def check(self, graph: "CapturedGraph") -> None:
        """Raise :class:`PlanMismatchError` unless ``graph`` is the graph this plan was made for, and
        :class:`PlanError` when the plan's nodes or resharded tensors disagree with it."""
        theirs = graph.fingerprint()
        if theirs != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for model '{self.model_name}' (graph fingerprint {self.fingerprint}), "
                f"but the given model '{graph.name}' has graph fingerprint {theirs}: the model, its input "
                "shapes or dtypes differ. Re-plan for this model (autoshard.plan(model, inputs, ...) or "
                "`autoshard plan`).")
        check_against_graph(self, graph)

    def _validate(self, source: str) -> None:
        """Cross-field checks the type check cannot do (specs parse, profile loads, mesh is 2D)."""
        if len(self.mesh_shape) != 2 or any(s < 1 for s in self.mesh_shape):
            raise PlanError(f"{source}: 'mesh_shape' must be two positive ints, got {self.mesh_shape}. {_REPLAN}.")
        if self.outputs not in OUTPUT_MODES:
            raise PlanError(f"{source}: 'outputs' must be one of {', '.join(repr(m) for m in OUTPUT_MODES)}, "
                            f"got {self.outputs!r}. {_REPLAN}.")
        for field_name, modes in (("batch_norm", BATCH_NORM_MODES), ("loss", LOSS_MODES)):
            value = getattr(self, field_name)
            if value not in modes:
                raise PlanError(f"{source}: '{field_name}' must be one of {', '.join(repr(m) for m in modes)}, "
                                f"got {value!r}. {_REPLAN}.")
        try:
            HardwareProfile.from_dict(self.hardware)
        except (HardwareError, TypeError, ValueError) as e:
            raise PlanError(f"{source}: its hardware profile is malformed ({e}). {_REPLAN}.") from None
        for node in self.nodes.values():
            try:
                node.input_specs()
                node.output_specs()
            except SpecError as e:
                raise PlanError(f"{source}: node '{node.name}' has a malformed spec ({e}). {_REPLAN}.") from None
        for seg, decision in self.segments.items():
            check_decision(seg, decision, f"{source}: ")
            if decision == Decision.SELECTIVE and not self.recompute_runs.get(seg):
                raise PlanError(f"{source}: segment '{seg}' is selective but the plan lists no run to "
                                f"recompute there. {_REPLAN}.")
        unknown = [n for runs in self.recompute_runs.values() for run in runs for n in run if n not in self.nodes]
        if unknown:
            raise PlanError(f"{source}: 'recompute_runs' names node(s) {unknown[:3]} the plan does not have. "
                            f"{_REPLAN}.")
        unknown = [seg for seg in self.segments if seg not in {n.segment for n in self.nodes.values()}]
        if unknown:
            raise PlanError(f"{source}: 'segments' names segment(s) {unknown[:3]} no node belongs to. {_REPLAN}.")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise PlanError(f"{source}: 'memory_budget' must be positive or null, got {self.memory_budget}. "
                            f"{_REPLAN}.")
        if self.mixed_precision is not None:
            try:
                self.mixed_precision.check()
            except ValueError as e:
                raise PlanError(f"{source}: {e}. {_REPLAN}.") from None
        check_consistency(self, source)
        if self.other_mode is not None:
            self._validate_other_mode(source)

    def _validate_other_mode(self, source: str) -> None:
        other = self.other_mode
        assert other is not None
        where = f"{source}: its other-mode plan"
        if other.training == self.training or other.other_mode is not None or other.mesh_shape != self.mesh_shape \
                or other.mixed_precision != self.mixed_precision:
            raise PlanError(f"{where} must be for the other mode ({'eval' if self.training else 'training'}) on the "
                            f"same mesh under the same mixed precision, with no other mode of its own. {_REPLAN}.")
        other._validate(where)
        try:
            check_layouts_agree(self, other)
        except ModeError as e:
            raise PlanError(f"{where}: {e}") from None

    def memory_regions(self) -> dict[str, tuple[str, str]]:
        """Graph node -> (region, decision) for every node whose saved activations the plan does not
        simply keep: the region is the node's segment (recompute, partitioned, offload) or, for a
        selective segment, the run it is recomputed in (``'<segment>#<run index>'``)."""
        return node_memory_regions(self.nodes.values(), self.segments, self.recompute_runs)

    # -- queries -------------------------------------------------------------------------------

    def hardware_profile(self) -> HardwareProfile:
        """The hardware profile the plan was made for (stored in full in the plan)."""
        return HardwareProfile.from_dict(self.hardware)

    def strategy_of(self, node: str) -> dict[str, Any]:
        """The decision for graph node ``node``: op, module, strategy, specs and costs."""
        entry = self.nodes.get(node)
        if entry is None:
            close = difflib.get_close_matches(node, list(self.nodes), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise KeyError(f"the plan has no node {node!r}{hint}")
        return dataclasses.asdict(entry)

    def comm_bytes(self) -> dict[tuple[str, tuple[int, ...], str], int]:
        """Predicted bytes per device per step by (collective kind, mesh axes, phase)."""
        return {(c.kind, tuple(c.axes), c.phase): c.nbytes for c in self.comm}

    @property
    def mesh(self) -> str:
        return "x".join(str(s) for s in self.mesh_shape)

    # -- explanation ---------------------------------------------------------------------------

    def summary_lines(self) -> list[str]:
        """The explain summary: model, mesh, hardware, budget, memory, time, comm, solver."""
        return summary_lines(self)

    def renderable(self, full: bool = False) -> "RenderableType":
        """The explanation as a rich renderable (what :meth:`explain` renders)."""
        return renderable(self, full)

    def explain(self, plain: bool | None = None, full: bool = False, width: int = 160, *,
                color: bool = False) -> str:
        """A human-readable account of the plan: a summary and a per-node table.

        Repeated blocks with identical decisions are shown once ('model.layers.1-31: same as
        model.layers.0') unless ``full``. Plain ASCII text without escape codes (safe to print, log or
        write to a file) unless ``color=True`` asks for rich tables with ANSI colours, ``width``
        columns wide. ``plain=False`` is the older spelling of ``color=True``.
        """
        if plain is not None and not isinstance(plain, bool):
            raise TypeError(f"plain must be True, False or None, got {plain!r}")
        if not (color or plain is False):
            return plain_text(self, full)
        from rich.console import Console

        console = Console(file=io.StringIO(), record=True, width=width, force_terminal=True,
                          color_system="standard")
        console.print(self.renderable(full))
        return console.export_text(styles=True)

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())


def node_memory_regions(nodes: Iterable[NodePlan], decisions: dict[str, str], runs: dict[str, list[list[str]]]
                    ) -> dict[str, tuple[str, str]]:
    """See :meth:`Plan.memory_regions`."""
    run_of = {n: f"{seg}#{i}" for seg, seg_runs in runs.items() for i, run in enumerate(seg_runs) for n in run}
    out: dict[str, tuple[str, str]] = {}
    for node in nodes:
        decision = decisions.get(node.segment or "", Decision.KEEP)
        if node.kind != "call_function" or decision == Decision.KEEP:
            continue
        check_decision(str(node.segment), decision)
        if decision != Decision.SELECTIVE:
            out[node.name] = (str(node.segment), decision)
        elif node.name in run_of:
            out[node.name] = (run_of[node.name], decision)
    return out


def check_decision(segment: str, decision: str, where: str = "") -> None:
    if decision not in DECISIONS:
        raise PlanError(f"{where}segment '{segment}' has memory decision {decision!r}, not one of "
                        f"{', '.join(DECISIONS)}. {_REPLAN}.")
