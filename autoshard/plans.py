"""The plan: what the solver decided, as plain, versioned, JSON-serialisable data.

A :class:`Plan` is self-contained: it names the model and the fingerprint of its captured graph,
the mesh, the full hardware profile, the memory budget and the solver options, and records, per
graph node (named as torch.export names it), the chosen strategy with its input/output specs and
modeled costs; per repeated-block segment the memory decision; every non-identity resharding
between two nodes with its steps; and the predicted memory, step time and communication volume.

It is stored as JSON (never pickle) and checked on load: a corrupt, truncated or foreign file
raises :class:`PlanError`, a plan made for another model :class:`PlanMismatchError`.

Cost conventions follow the cost graph: seconds per training step, bytes per device; a node's
``params``/``grads`` memory is counted at the parameter's placeholder only.
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import io
import json
import math
import os
import types
import typing
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Union

from .enumerate import OUTPUT_MODES
from .hardware import HardwareError, HardwareProfile
from .reshard import SPLIT, TO_PARTIAL, ReshardStep, reshard_plan
from .specs import ShardSpec, SpecError
from .strategy import BWD, FWD, Strategy, local_bytes
from .solver.ilp import DECISIONS as MEMORY_DECISIONS
from .units import format_bytes

if TYPE_CHECKING:
    from rich.console import RenderableType

    import torch.fx as fx

    from .capture import CapturedGraph
    from .solver.costgraph import CostGraph
    from .solver.ilp import Solution, SolverOptions

__all__ = [
    "CollectiveEntry", "CommEntry", "NodePlan", "PLAN_FORMAT_VERSION", "Plan", "PlanError",
    "PlanMismatchError", "ReshardEntry", "SolverReport", "StepEntry",
]

PLAN_FORMAT_VERSION = 1
"""Version of the JSON layout. Bump it on any incompatible change to the fields below."""

RECOMPUTE = "recompute"
"""Phase of collectives re-run when a recomputed segment's forward runs again in backward."""

_RECOMPUTING = ("recompute", "partitioned", "selective")   # forward runs again in backward
_SUMMARY_RESHARDS = 10


class PlanError(ValueError):
    """A plan file that cannot be used: corrupt, truncated, of another format version, or
    missing fields."""


class PlanMismatchError(PlanError):
    """A plan made for a different model (graph fingerprints differ)."""


# -- entries -------------------------------------------------------------------------------------------

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
    or user-input path of a placeholder. ``inputs``/``outputs``: spec strings
    (:meth:`ShardSpec.parse` reads them; ``None`` for a non-tensor output). ``memory``: bytes
    per device (``params``, ``grads``, ``saved``, ``outputs``).
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

    Build it with :func:`autoshard.plan` or :meth:`Plan.from_solution`; store it with
    :meth:`save` and :meth:`load`; read it with :meth:`explain` and :meth:`strategy_of`.

    Fields: ``fingerprint`` (of the captured graph, checked by :meth:`check`), ``mesh_shape``,
    ``hardware`` (the full profile), ``memory_budget`` (bytes per device, None: unconstrained),
    ``solver_options``; ``nodes`` (graph node name -> :class:`NodePlan`, graph order);
    ``segments`` (repeated-block instance -> keep / recompute / offload / partitioned /
    selective); ``recompute_runs`` (per selective segment, the graph nodes of each checkpoint
    region it recomputes, see :mod:`autoshard.solver.selective`);
    ``reshards`` (every non-identity resharding, :class:`ReshardEntry`); ``memory`` (predicted
    bytes per device: params, grads, optimizer, param_copies (parameters read larger than stored,
    e.g. gathered per block, held until backward), activations, working_set, peak); ``time``
    (modeled seconds per step: compute, comm, reshard, recompute, offload, total); ``comm``
    (predicted bytes per device per step by collective kind, mesh axes and phase ``fwd`` /
    ``bwd`` / ``recompute``); ``solver``; ``timings`` (seconds per planning stage);
    ``fallbacks`` (ops replicated without a handler); ``created`` (UTC, ISO 8601); ``outputs``
    (``"global"``: the parallelized model returns every tensor output whole on every rank;
    ``"local"``: a tensor output of rank >= 1 as each rank's shard, in the layout the output node's
    ``inputs`` record, with no collective to gather it; plans written before the field existed
    read as ``"global"``).
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
    training: bool = True
    other_mode: "Plan | None" = None

    # ``training``: the mode the model was captured in (its graph is ``nodes``); plans written before
    # the field existed read as training. ``other_mode``: the plan of the model's graph in the other
    # mode (eval for a training plan), parameters laid out as here (see :mod:`autoshard.modes`); None
    # when the model's graph is the same in both modes or the plan was made from a captured graph
    # (then :func:`autoshard.parallelize` derives it when the model is switched).

    # ``inputs``: the call signature the graph was captured with (``in_spec``: the pytree spec of
    # ``(args, kwargs)`` as ``treespec_dumps`` writes it; ``leaves``: per leaf ``{"shape", "dtype"}``
    # for a tensor or ``{"value"}`` for a constant), so that the runtime can capture the same graph
    # without example inputs. None when the signature cannot be written as JSON.

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_solution(cls, cg: "CostGraph", solution: "Solution", *, model_name: str,
                      options: "SolverOptions", budget: int | None,
                      timings: dict[str, float] | None = None) -> "Plan":
        """The plan of an ILP ``solution`` over cost graph ``cg``.

        ``budget`` is the per-device memory budget in bytes the solution was asked to meet (None:
        unconstrained); ``timings`` the seconds of each planning stage.
        """
        from . import __version__

        choice = cg.graph_choice(solution.choice)
        nodes = {ns.node: _node_plan(cg, ns.node, _strategy(cg, ns.node, choice), choice) for ns in cg.table}
        reshards = _reshards(cg, choice)
        decisions = {seg: str(d) for seg, d in solution.decisions.items()}
        runs = _selective_runs(cg, decisions)
        memory = {k: float(v) for k, v in solution.memory.to_dict().items()}
        if "offload" in decisions.values():
            memory["offloaded"] = float(_offloaded_bytes(cg, nodes.values(), decisions, reshards))
        return cls(
            format_version=PLAN_FORMAT_VERSION,
            autoshard_version=__version__,
            model_name=model_name,
            fingerprint=cg.graph.fingerprint(),
            mesh_shape=[int(s) for s in cg.mesh.shape],
            hardware=_jsonable(cg.hardware.to_dict()),
            memory_budget=None if budget is None else int(budget),
            solver_options=_jsonable(dataclasses.asdict(options)),
            nodes=nodes,
            segments=decisions,
            reshards=reshards,
            memory=memory,
            time={k: float(v) for k, v in solution.time.to_dict().items()},
            comm=_comm_entries(nodes.values(), reshards, _recomputed(nodes.values(), decisions, runs),
                               _partition_gathers(cg, solution), _gradient_buckets(cg, solution),
                               _param_gathers(cg, solution)),
            solver=SolverReport(str(solution.status), float(solution.objective),
                                float(solution.build_seconds), float(solution.solve_seconds),
                                int(solution.n_variables), int(solution.n_constraints), str(solution.solver),
                                solution.gap, solution.stats.get("note")),
            timings={k: float(v) for k, v in (timings or {}).items()},
            fallbacks=list(cg.table.fallbacks),
            inputs=input_signature(cg.graph),
            recompute_runs=runs,
            outputs=cg.table.outputs,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )

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
                            f"{_type_name(data)}. {_REPLAN}")
        version = data.get("format_version")
        if version is None:
            raise PlanError(f"{source} is not an autoshard plan: it has no 'format_version'. {_REPLAN}")
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"{source} has plan format version {version!r}, this autoshard reads version "
                            f"{PLAN_FORMAT_VERSION}. {_REPLAN} with this version of autoshard.")
        plan = _load(cls, data, source)
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
        text = _read_plan_text(path)
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except (json.JSONDecodeError, RecursionError, ValueError) as e:
            raise PlanError(f"plan file '{path}' is not valid JSON ({str(e)[:200]}); it is corrupt or truncated. "
                            f"{_REPLAN} (`autoshard plan ... --out {path}`).") from None
        plan = cls.from_dict(data, source=f"plan file '{path}'")
        from .capture import CapturedGraph

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
        from .plan_validation import check_against_graph

        check_against_graph(self, graph)

    def _validate(self, source: str) -> None:
        """Cross-field checks the type check cannot do (specs parse, profile loads, mesh is 2D)."""
        if len(self.mesh_shape) != 2 or any(s < 1 for s in self.mesh_shape):
            raise PlanError(f"{source}: 'mesh_shape' must be two positive ints, got {self.mesh_shape}. {_REPLAN}.")
        if self.outputs not in OUTPUT_MODES:
            raise PlanError(f"{source}: 'outputs' must be one of {', '.join(repr(m) for m in OUTPUT_MODES)}, "
                            f"got {self.outputs!r}. {_REPLAN}.")
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
            _check_decision(seg, decision, f"{source}: ")
            if decision == "selective" and not self.recompute_runs.get(seg):
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
        from .plan_validation import check_consistency

        check_consistency(self, source)
        if self.other_mode is not None:
            self._validate_other_mode(source)

    def _validate_other_mode(self, source: str) -> None:
        other = self.other_mode
        assert other is not None
        where = f"{source}: its other-mode plan"
        if other.training == self.training or other.other_mode is not None or other.mesh_shape != self.mesh_shape:
            raise PlanError(f"{where} must be for the other mode ({'eval' if self.training else 'training'}) on the "
                            f"same mesh, with no other mode of its own. {_REPLAN}.")
        other._validate(where)
        from .modes import ModeError, check_layouts_agree

        try:
            check_layouts_agree(self, other)
        except ModeError as e:
            raise PlanError(f"{where}: {e}") from None

    def memory_regions(self) -> dict[str, tuple[str, str]]:
        """Graph node -> (region, decision) for every node whose saved activations the plan does not
        simply keep: the region is the node's segment (recompute, partitioned, offload) or, for a
        selective segment, the run it is recomputed in (``'<segment>#<run index>'``)."""
        return _memory_regions(self.nodes.values(), self.segments, self.recompute_runs)

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
        return _summary_lines(self)

    def renderable(self, full: bool = False) -> "RenderableType":
        """The explanation as a rich renderable (what :meth:`explain` renders)."""
        return _renderable(self, full)

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
            return _plain_text(self, full)
        from rich.console import Console

        console = Console(file=io.StringIO(), record=True, width=width, force_terminal=True,
                          color_system="standard")
        console.print(self.renderable(full))
        return console.export_text(styles=True)

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())


_REPLAN = "Re-create the plan"

MAX_PLAN_BYTES = 1 << 30
"""The largest plan file :meth:`Plan.load` reads (a 70B model's plan is a few MiB)."""

_PICKLE = (b"\x80",)           # pickle protocols 2+ start with PROTO (0x80)


def _read_plan_text(path: Path) -> str:
    """The text of a plan file: a regular file (not a device such as /dev/zero, a directory or a
    pipe), at most :data:`MAX_PLAN_BYTES`, UTF-8; never unpickled or executed."""
    import stat

    try:
        st = path.stat()
    except OSError as e:
        raise PlanError(f"cannot read plan file '{path}': {e.strerror or e}; pass the JSON file "
                        f"`autoshard plan --out` or Plan.save wrote") from None
    if not stat.S_ISREG(st.st_mode):
        raise PlanError(f"plan path '{path}' is not a regular file (a directory, device or pipe); pass the JSON "
                        f"file `autoshard plan --out` or Plan.save wrote")
    if st.st_size > MAX_PLAN_BYTES:
        raise PlanError(f"plan file '{path}' is {format_bytes(st.st_size)}, more than a plan can be "
                        f"({format_bytes(MAX_PLAN_BYTES)}); pass the JSON file `autoshard plan --out` wrote")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise PlanError(f"cannot read plan file '{path}': {e.strerror or e}") from None
    if raw.startswith(_PICKLE):
        raise PlanError(f"plan file '{path}' is a Python pickle, not a JSON plan; autoshard never unpickles plans. "
                        f"{_REPLAN} (`autoshard plan ... --out {path}`).")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError(f"plan file '{path}' is binary, not a JSON plan (not UTF-8 text); it is corrupt or another "
                        f"kind of file. {_REPLAN} (`autoshard plan ... --out {path}`).") from None


def _no_constant(name: str) -> Any:
    """JSON's non-standard constants: Infinity is a number a plan may hold (an unbounded solver gap),
    NaN is not."""
    if name == "Infinity":
        return math.inf
    if name == "-Infinity":
        return -math.inf
    raise ValueError(f"{name} is not a number a plan can hold")


# -- building entries ----------------------------------------------------------------------------------

def input_signature(graph: "CapturedGraph") -> dict[str, Any] | None:
    """The JSON form of the graph's call signature (see :attr:`Plan.inputs`), or None."""
    import torch.utils._pytree as pytree
    from torch.export.graph_signature import InputKind

    leaves: list[dict[str, Any]] = []
    for spec in graph.exported.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        name = spec.arg.name
        meta = graph.tensor_meta(name) if name not in graph.constant_inputs else None
        if meta is None or isinstance(meta, tuple):
            value = graph.constant_inputs.get(name)
            if not isinstance(value, (bool, int, float, str, type(None))):
                return None
            leaves.append({"value": value})
        else:
            leaves.append({"shape": [int(d) for d in meta.shape], "dtype": str(meta.dtype).removeprefix("torch.")})
    try:
        in_spec = pytree.treespec_dumps(graph.exported.call_spec.in_spec)
    except (TypeError, NotImplementedError):     # a container pytree cannot serialise
        return None
    return {"in_spec": in_spec, "leaves": leaves}


def _strategy(cg: "CostGraph", name: str, choice: dict[str, int]) -> Strategy:
    return cg.table[name].strategies[choice[name]]


def _node_plan(cg: "CostGraph", name: str, s: Strategy, choice: dict[str, int]) -> NodePlan:
    graph = cg.graph
    ns = cg.table[name]
    kind = graph.node(name).op
    stores = kind == "placeholder"
    m = s.memory
    # An operand taken as produced (input spec None) is recorded in its producer's layout.
    inputs = [x if x is not None else _strategy(cg, producer, choice).output_specs[_output_index(cg, name, j)]
              for j, (x, producer) in enumerate(zip(s.input_specs, ns.operand_nodes))]
    return NodePlan(
        name=name, kind=kind, op=ns.op, module=ns.module_path, fqn=_fqn(graph, name),
        segment=cg.nodes[cg.node_of[name]].segment, strategy=s.name,
        inputs=[str(x) for x in inputs],
        outputs=[None if x is None else str(x) for x in s.output_specs],
        compute_fwd=float(s.compute_fwd), compute_bwd=float(s.compute_bwd),
        collectives=[CollectiveEntry(c.kind, [int(a) for a in c.axes], int(c.nbytes), c.phase, c.operand,
                                     float(c.cost), bool(c.bucketed)) for c in s.comm],
        memory={"params": int(m.params) if stores else 0, "grads": int(m.grads) if stores else 0,
                "saved": int(m.saved), "outputs": int(m.outputs)},
        operands=list(ns.operand_nodes),
    )


def _fqn(graph: "CapturedGraph", name: str) -> str | None:
    for table in (graph.param_fqn, graph.buffer_fqn, graph.constant_fqn, graph.user_input_specs):
        if name in table:
            return str(table[name])
    return None


def _tensor_edges(cg: "CostGraph") -> Iterable[tuple[str, str, int, int, Any, bool]]:
    """Every tensor edge of the graph as (producer, consumer, operand, producer output, tensor
    meta, gradient flows): the cost graph's edges and those inside merged nodes."""
    for e in cg.edges:
        yield e.src_member, e.dst_member, e.operand, e.src_output, e.tensor, e.grad
    graph = cg.graph
    for node in cg.nodes.values():
        for follower in node.members[1:]:
            producer = cg.table[follower].operand_nodes[0]
            out_idx = _output_index(cg, follower)
            meta = graph.tensor_meta(producer)
            meta = meta[out_idx] if isinstance(meta, tuple) else meta
            if meta is None:
                continue
            grad = bool(meta.requires_grad and graph.requires_grad(follower))
            yield producer, follower, 0, out_idx, meta, grad


def _output_index(cg: "CostGraph", consumer: str, operand: int = 0) -> int:
    """Which output of its producer operand ``operand`` of ``consumer`` reads (a getitem of a
    tuple reads element ``args[1]``, anything else output 0)."""
    import operator

    node = cg.graph.node(consumer)
    producer = cg.table[consumer].operand_nodes[operand]
    if node.target is operator.getitem and isinstance(cg.graph.tensor_meta(producer), tuple):
        return int(node.args[1])
    return 0


def _reshards(cg: "CostGraph", choice: dict[str, int]) -> list[ReshardEntry]:
    """The non-identity reshardings under ``choice``, in graph order of their consumer."""
    order = {ns.node: i for i, ns in enumerate(cg.table)}
    out = []
    for src, dst, operand, out_idx, meta, grad in _tensor_edges(cg):
        src_spec = _strategy(cg, src, choice).output_specs[out_idx]
        dst_spec = _strategy(cg, dst, choice).input_specs[operand]
        if src_spec is None or src_spec == dst_spec:
            continue
        out.append(_reshard_entry(cg, src, dst, operand, out_idx, meta, grad, src_spec, dst_spec))
    out.sort(key=lambda r: (order[r.dst], r.operand))
    return out


def _reshard_entry(cg: "CostGraph", src: str, dst: str, operand: int, out_idx: int, meta: Any,
                   grad: bool, src_spec: ShardSpec, dst_spec: ShardSpec) -> ReshardEntry:
    args = (meta.shape, meta.dtype.itemsize, cg.mesh.shape, cg.hardware)
    fwd = reshard_plan(src_spec, dst_spec, *args)
    bwd = reshard_plan(dst_spec, src_spec, *args) if grad else None
    return ReshardEntry(
        src=src, dst=dst, operand=operand, src_output=out_idx, shape=[int(d) for d in meta.shape],
        dtype=str(meta.dtype).removeprefix("torch."), src_spec=str(src_spec), dst_spec=str(dst_spec),
        fwd=[_step_entry(s) for s in fwd.steps], bwd=[_step_entry(s) for s in bwd.steps] if bwd else [],
        cost_fwd=float(fwd.cost), cost_bwd=float(bwd.cost) if bwd else 0.0)


def _step_entry(step: ReshardStep) -> StepEntry:
    return StepEntry(step.kind, int(step.axis), [int(d) for d in step.dims], int(step.nbytes),
                     float(step.cost), str(step.after), str(step))


def _partition_gathers(cg: "CostGraph", solution: "Solution") -> list[tuple[str, list[int], int]]:
    """(segment, axes, bytes) of the all-gathers that rebuild partitioned checkpoints."""
    parted = {seg for seg, d in solution.decisions.items() if d == "partitioned"}
    if not parted:
        return []
    from .solver.ilp import memory_segments, replicated_axes

    mesh_shape = cg.mesh.shape
    out = []
    for seg in memory_segments(cg):
        if seg.name not in parted:
            continue
        for e in seg.ckpt_edges:
            spec = e.src_specs[e.src_index[solution.choice[e.src]]]
            axes = list(replicated_axes(spec, mesh_shape))
            if axes:
                out.append((seg.name, axes, spec.local_numel(e.tensor.shape, mesh_shape) * e.tensor.dtype.itemsize))
    return out


def _offloaded_bytes(cg: "CostGraph", nodes: Iterable[NodePlan], decisions: dict[str, str],
                     reshards: list[ReshardEntry]) -> int:
    """Bytes per device that host offload copies away in a step: the saved activations of the
    offloaded segments' nodes, a tensor that several ops of one segment save (RMSNorm's input,
    saved by pow and mul; rotary tables) counted once, as the offload hooks copy it once.

    The ILP counts such a tensor once per op that saves it (an over-count, so its memory model errs
    on the safe side); this is the exact figure. A saved operand is the producer's tensor unless the
    plan reshards it into the consumer (then a tensor of its own); parameters are never offloaded.
    """
    from .opinfo import OpInfo

    graph, mesh = cg.graph, cg.mesh
    resharded = {(r.dst, r.operand) for r in reshards}
    seen: dict[str, set[tuple]] = defaultdict(set)
    total = 0
    for node in nodes:
        if node.kind != "call_function" or decisions.get(node.segment or "") != "offload":
            continue
        total += node.memory["saved"]
        op = OpInfo(graph.node(node.name), graph, mesh)
        for saved in op.profile().saved:
            if saved.source == "input" and not op.operand_is_param(saved.index):
                key = _saved_operand_key(node.name, saved.index, op.operand_nodes[saved.index], resharded)
                meta, spec = op.operands[saved.index], node.inputs[saved.index]
            elif saved.source == "output":
                key, meta, spec = (node.name, saved.index), op.outputs[saved.index], node.outputs[saved.index]
            else:
                continue
            if key in seen[str(node.segment)]:
                total -= local_bytes(meta, ShardSpec.parse(spec), mesh.shape)
            seen[str(node.segment)].add(key)
    return total


def _saved_operand_key(consumer: str, index: int, operand: "fx.Node", resharded: set[tuple[str, int]]) -> tuple:
    """Identity of the tensor a consumer saves for operand ``index``: its own resharded copy, or the
    producer's output (an element of a multi-output node read through ``getitem`` is that node's
    output)."""
    import operator

    import torch.fx as fx

    if (consumer, index) in resharded:
        return ("resharded", consumer, index)
    if operand.target is operator.getitem and isinstance(operand.args[0], fx.Node):
        return (operand.args[0].name, int(operand.args[1]))
    return (operand.name, 0)


def _selective_runs(cg: "CostGraph", decisions: dict[str, str]) -> dict[str, list[list[str]]]:
    """Per selective segment, the graph nodes of each run it recomputes."""
    if "selective" not in decisions.values():
        return {}
    from .solver.ilp import memory_segments

    return {seg.name: [list(run.nodes) for run in seg.runs] for seg in memory_segments(cg)
            if decisions.get(seg.name) == "selective"}


def _memory_regions(nodes: Iterable[NodePlan], decisions: dict[str, str], runs: dict[str, list[list[str]]]
                    ) -> dict[str, tuple[str, str]]:
    """See :meth:`Plan.memory_regions`."""
    run_of = {n: f"{seg}#{i}" for seg, seg_runs in runs.items() for i, run in enumerate(seg_runs) for n in run}
    out: dict[str, tuple[str, str]] = {}
    for node in nodes:
        decision = decisions.get(node.segment or "", "keep")
        if node.kind != "call_function" or decision == "keep":
            continue
        _check_decision(str(node.segment), decision)
        if decision != "selective":
            out[node.name] = (str(node.segment), decision)
        elif node.name in run_of:
            out[node.name] = (run_of[node.name], decision)
    return out


def _check_decision(segment: str, decision: str, where: str = "") -> None:
    if decision not in MEMORY_DECISIONS:
        raise PlanError(f"{where}segment '{segment}' has memory decision {decision!r}, not one of "
                        f"{', '.join(MEMORY_DECISIONS)}. {_REPLAN}.")


def _recomputed(nodes: Iterable[NodePlan], decisions: dict[str, str], runs: dict[str, list[list[str]]]
                ) -> set[str]:
    """The call_function nodes whose forward runs again in backward (recomputed, partitioned, and
    the runs of selective segments)."""
    return {n for n, (_, d) in _memory_regions(nodes, decisions, runs).items() if d in _RECOMPUTING}


def _gradient_buckets(cg: "CostGraph", solution: "Solution") -> tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int]]]:
    """The gradient all-reduces the runtime leaves to its buckets ((node, operand) pairs) and the
    bucketed parameter gradients ((axes, bytes per device) each), see :mod:`autoshard.grad_reduction`."""
    from .solver.ilp import gradient_reduction

    from .solver.ilp import param_gathers

    reduction = gradient_reduction(cg, solution.choice)
    buckets = []
    for param, axes in {**reduction.bucketed, **param_gathers(cg, solution.choice).leftover()}.items():
        host = cg.node_of[param]
        buckets.append((axes, int(cg.nodes[host].costs.grads[solution.choice[host]])))
    return reduction.deferred, buckets


def _param_gathers(cg: "CostGraph", solution: "Solution") -> tuple[frozenset[tuple[str, int]],
                                                                   list[tuple[tuple[int, ...], int]]]:
    """The (node, operand) pairs that read a parameter gathered with its block, and per gather
    group its mesh axes and bytes per device (see :mod:`autoshard.param_gather`)."""
    from .param_gather import gathered_bytes
    from .solver.ilp import param_gathers

    gathers = param_gathers(cg, solution.choice)
    return gathers.uses, [(g.axes, gathered_bytes(cg.graph, g)) for g in gathers.groups]


def _comm_entries(nodes: Iterable[NodePlan], reshards: list[ReshardEntry], recomputed: set[str],
                  gathers: list[tuple[str, list[int], int]],
                  grad_buckets: tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int]]],
                  param_gathers: tuple[frozenset[tuple[str, int]], list[tuple[tuple[int, ...], int]]]
                  ) -> list[CommEntry]:
    """Bytes per device per step by (kind, axes, phase): every node's collectives and every
    resharding's collective steps, forward and backward, the gradient all-reduces left to the
    buckets counted once per parameter (``grad_buckets``: the skipped (node, operand) pairs and the
    bucketed gradients), the parameters gathered per block (``param_gathers``: the uses they
    replace, whose resharding and gradient all-reduce do not run, and per group one all-gather
    forward and one reduce-scatter backward); plus, phase ``recompute``, what runs again in
    backward (the forward collectives of the ``recomputed`` nodes, the forward reshardings into
    them) and the all-gathers of partitioned checkpoints."""
    totals: dict[tuple[str, tuple[int, ...], str], list[int]] = defaultdict(lambda: [0, 0])

    def add(kind: str, axes: Iterable[int], phase: str, nbytes: int) -> None:
        t = totals[(kind, tuple(axes), phase)]
        t[0] += int(nbytes)
        t[1] += 1

    resharded = {(r.dst, r.operand) for r in reshards}
    deferred, buckets = grad_buckets
    gathered, groups = param_gathers
    synced: set[tuple[str, tuple[int, ...]]] = set()
    for node in nodes:
        again = node.name in recomputed
        for c in node.collectives:
            if c.phase == BWD and c.operand.startswith("in") and (
                    (node.name, int(c.operand[2:])) in deferred or (node.name, int(c.operand[2:])) in gathered):
                continue
            shared = _shared_gradient_sync(node, c, resharded)
            if shared is not None:        # consumers of one value share its gradient all-reduce
                if shared in synced:
                    continue
                synced.add(shared)
            add(c.kind, c.axes, c.phase, c.nbytes)
            if again and c.phase == FWD:
                add(c.kind, c.axes, RECOMPUTE, c.nbytes)
    for r in reshards:
        if (r.dst, r.operand) in gathered:
            continue
        again = r.dst in recomputed
        for phase, steps in ((FWD, r.fwd), (BWD, r.bwd)):
            for step in steps:
                if step.is_collective:
                    add(step.kind, [step.axis], phase, step.nbytes)
                    if again and phase == FWD:
                        add(step.kind, [step.axis], RECOMPUTE, step.nbytes)
    for axes, nbytes in buckets:
        add("all_reduce", axes, BWD, nbytes)
    for axes, nbytes in groups:
        add("all_gather", axes, FWD, nbytes)
        add("reduce_scatter", axes, BWD, nbytes)
    for _, axes, nbytes in gathers:
        add("all_gather", axes, RECOMPUTE, nbytes)
    return [CommEntry(kind, list(axes), phase, n, count)
            for (kind, axes, phase), (n, count) in sorted(totals.items())]


def _shared_gradient_sync(node: NodePlan, c: CollectiveEntry, resharded: set[tuple[str, int]]
                          ) -> tuple[str, tuple[int, ...]] | None:
    """(producer, axes) of a gradient all-reduce on an operand read as produced (not resharded):
    the runtime runs one such all-reduce per value and axes, however many consumers need it."""
    if c.phase != BWD or c.kind != "all_reduce" or not c.operand.startswith("in") or not node.operands:
        return None
    j = int(c.operand[2:])
    if (node.name, j) in resharded or j >= len(node.operands):
        return None
    return node.operands[j], tuple(c.axes)


def _jsonable(x: Any) -> Any:
    """Tuples to lists, numpy scalars to Python numbers, recursively (JSON round-trips equal)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


# -- loading (typed validation of plain data) ------------------------------------------------------

def _type_name(x: Any) -> str:
    return "null" if x is None else {dict: "an object", list: "a list", str: "a string",
                                     bool: "a boolean", int: "a number", float: "a number"}.get(type(x), type(x).__name__)


def _load(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, checking every field against its type hint."""
    if not isinstance(data, dict):
        raise PlanError(f"{where} should be an object, got {_type_name(data)}. {_REPLAN}.")
    hints = typing.get_type_hints(cls)
    def required(f: dataclasses.Field) -> bool:
        return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING

    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and required(f)]
    if missing:
        raise PlanError(f"{where} lacks field(s) {', '.join(repr(m) for m in missing)}; the file is "
                        f"incomplete or not an autoshard plan. {_REPLAN}.")
    values = {f.name: _convert(data[f.name], hints[f.name], f"{where}: field '{f.name}'")
              for f in dataclasses.fields(cls) if f.name in data}
    return cls(**values)


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against ``hint`` (dataclasses, list[X], dict[str, X], unions, scalars)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _load(hint, value, where)
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                return _convert(value, option, where)
            except PlanError:
                continue
        raise _wrong_type(value, " or ".join(_hint_name(a) for a in args), where)
    if origin is list:
        if not isinstance(value, list):
            raise _wrong_type(value, "a list", where)
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(value, "an object", where)
        return {k: _convert(v, args[1], f"{where}['{k}']") for k, v in value.items()}
    return _scalar(value, hint, where)


def _scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is type(None):
        if value is not None:
            raise _wrong_type(value, "null", where)
        return None
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and type(value) is hint:
        return value
    raise _wrong_type(value, _hint_name(hint), where)


def _hint_name(hint: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _wrong_type(value: Any, expected: str, where: str) -> PlanError:
    return PlanError(f"{where} should be {expected}, got {_type_name(value)} ({str(value)[:40]!r}); the "
                     f"file is corrupt or not an autoshard plan. {_REPLAN}.")


# -- explanation ---------------------------------------------------------------------------------------

_TIME_PARTS = ("compute", "comm", "reshard", "grad_sync", "optimizer", "recompute", "offload")


def _fmt_time(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if abs(seconds) < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _peak_formula(mem: dict[str, float]) -> str:
    """``params + grads + optimizer [+ gathered parameters] + max(activations, worst rebuild)``, as
    the peak is modeled (gathered parameters: copies read larger than stored, held to backward):
    the activations held at the end of forward, or, if higher, those live when the worst segment
    is rebuilt in backward (only the segments before it still hold theirs); plus the ILP's
    position-free bound when a segment is rebuilt (see :class:`~autoshard.solver.ilp.MemoryPrediction`)."""
    static = " + ".join(f"{k} {format_bytes(mem.get(k, 0.0))}" for k in ("params", "grads", "optimizer"))
    if mem.get("param_copies"):
        static += f" + gathered parameters {format_bytes(mem['param_copies'])}"
    held = f"{static} + activations {format_bytes(mem.get('activations', 0.0))}"
    if not mem.get("working_set"):
        return held
    text = (f"{static} + max(activations {format_bytes(mem.get('activations', 0.0))}, at the worst rebuild in "
            f"backward {format_bytes(mem.get('backward_peak', 0.0))})")
    return text + f"; the budget bounds {format_bytes(mem.get('bound', 0.0))} (every segment held while the " \
        f"largest working set, {format_bytes(mem['working_set'])}, is rebuilt)"


_OUTPUTS_TEXT = {"global": "global", "local": "local (tensors of rank >= 1 as each rank's shard)"}


def _summary_lines(plan: Plan) -> list[str]:
    budget = "unconstrained" if plan.memory_budget is None else f"{format_bytes(plan.memory_budget)} per device"
    devices = math.prod(plan.mesh_shape)
    mem, t, s = plan.memory, plan.time, plan.solver
    lines = [
        f"autoshard plan for {plan.model_name} (graph fingerprint {plan.fingerprint[:16]}, "
        f"{len(plan.nodes)} nodes)",
        f"mesh {plan.mesh} ({devices} devices), hardware {plan.hardware.get('name', '?')}, "
        f"memory budget {budget}, outputs returned {_OUTPUTS_TEXT[plan.outputs]}",
        "predicted peak memory per device: " + format_bytes(mem.get("peak", 0.0)) + " = " + _peak_formula(mem),
        "modeled step time: " + _fmt_time(t.get("total", 0.0)) + " = " + " + ".join(
            f"{k} {_fmt_time(t.get(k, 0.0))}" for k in _TIME_PARTS),
        _comm_line(plan),
        _sharding_line(plan),
        _decision_line(plan),
        f"solver: {s.solver} {s.status}"
        + (f" (within {100 * s.gap:.2f}% of the proven bound)" if s.status != "optimal" and s.gap is not None else "")
        + f", objective {_fmt_time(s.objective)}, build {s.build_seconds:.2f} s + "
        f"solve {s.solve_seconds:.2f} s, {s.n_variables} variables, {s.n_constraints} constraints",
    ]
    if s.note:
        lines.append(f"plan picked: {s.note}")
    mode, other = ("training", "eval") if plan.training else ("eval", "training")
    lines.append(f"modes: planned in {mode} mode; " + (
        f"{other} mode planned too ({len(plan.other_mode.nodes)} nodes, parameters laid out alike)"
        if plan.other_mode is not None else f"{other} mode derived when the model is switched (same graph, or "
        f"planned from a captured graph)"))
    if plan.timings:
        lines.append("planning time: " + ", ".join(
            f"{k.removesuffix('_s')} {v:.2f} s" for k, v in plan.timings.items()))
    if plan.fallbacks:
        lines.append(f"replicated without a handler (fallback): {'; '.join(plan.fallbacks)}")
    return lines


def _comm_line(plan: Plan) -> str:
    by_phase: Counter[str] = Counter()
    for c in plan.comm:
        by_phase[c.phase] += c.nbytes
    parts = ", ".join(f"{phase} {format_bytes(n)}" for phase, n in sorted(by_phase.items()))
    total = sum(by_phase.values())
    return (f"communication per step and device: {format_bytes(total)}" + (f" ({parts})" if parts else "")
            + f"; {len(plan.reshards)} reshardings")


def _sharding_line(plan: Plan) -> str:
    """How much of the step runs on shards: compute ops with a sharded (or partial) operand or
    output, and parameters stored sharded."""
    def sharded(specs: Iterable[str | None]) -> bool:
        return any(spec is not None and ShardSpec.parse(spec).used_axes() for spec in specs)

    ops = [n for n in plan.nodes.values() if n.kind == "call_function" and n.compute_fwd + n.compute_bwd > 0]
    split = sum(sharded([*n.inputs, *n.outputs]) for n in ops)
    params = [n for n in plan.nodes.values() if n.kind == "placeholder" and n.memory.get("params", 0)]
    stored = sum(sharded(n.outputs) for n in params)
    if ops and not split:
        return (f"sharding: none - every device runs all {len(ops)} compute ops on the whole batch "
                f"(under this profile, communication would cost more than splitting the work saves)")
    return (f"sharding: {split} of {len(ops)} compute ops run on a shard of their work, "
            f"{len(ops) - split} replicated; parameters: {stored} of {len(params)} stored sharded")


def _decision_line(plan: Plan) -> str:
    if not plan.segments:
        return "memory decisions: none (no repeated blocks)"
    by_decision: dict[str, list[str]] = defaultdict(list)
    for seg, d in plan.segments.items():
        by_decision[d].append(seg)
    parts = [f"{d} {len(segs)} ({_ranges(segs)})" for d, segs in sorted(by_decision.items())]
    return "memory decisions per segment: " + ", ".join(parts)


def _split_segment(seg: str) -> tuple[str, int] | None:
    prefix, _, idx = seg.rpartition(".")
    return (prefix, int(idx)) if idx.isdigit() else None


def _ranges(segments: list[str]) -> str:
    """'model.layers.0-3, model.layers.7' for a list of segment names."""
    by_prefix: dict[str, list[int]] = defaultdict(list)
    others = []
    for seg in segments:
        parts = _split_segment(seg)
        if parts is None:
            others.append(seg)
        else:
            by_prefix[parts[0]].append(parts[1])
    out = []
    for prefix, idx in by_prefix.items():
        for lo, hi in _runs(sorted(idx)):
            label = f"{lo}" if lo == hi else f"{lo}-{hi}"
            out.append(f"{prefix}.{label}" if prefix else label)
    return ", ".join(out + others)


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


@dataclass
class _Row:
    node: str
    module: str
    op: str
    strategy: str
    comm: str
    memory: str
    group: bool = False


def _short_op(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _node_row(n: NodePlan) -> _Row:
    comm = "-" if not n.collectives else f"{format_bytes(n.comm_bytes)} / {_fmt_time(n.comm_seconds)}"
    held = n.memory["params"] + n.memory["grads"] + n.memory["saved"]
    return _Row(n.name, n.module or (n.fqn or ""), _short_op(n.op), n.strategy, comm,
                format_bytes(held) if held else "-")


def _segment_signature(plan: Plan, seg: str, names: list[str]) -> tuple:
    """What must match for a segment to be shown as 'same as' another: per node its kind, op,
    module (relative to the segment), strategy and specs; and the segment's memory decision."""
    def rel(path: str | None) -> str:
        return (path or "").replace(seg, "<block>", 1)

    nodes = tuple((n.kind, n.op, rel(n.module), rel(n.fqn), n.strategy, tuple(n.inputs), tuple(n.outputs))
                  for n in (plan.nodes[x] for x in names))
    return nodes, plan.segments.get(seg)


def _collapsed_runs(plan: Plan) -> dict[str, tuple[str, str, int]]:
    """For runs of consecutive identical segments (``model.layers.0-31``): the first segment ->
    (label of the others, itself, nodes per segment), each other segment -> ('', first, 0)."""
    members: dict[str, list[str]] = defaultdict(list)
    for n in plan.nodes.values():
        if n.segment is not None:
            members[n.segment].append(n.name)
    by_prefix: dict[str, list[int]] = defaultdict(list)
    for seg in members:
        parts = _split_segment(seg)
        if parts is not None:
            by_prefix[parts[0]].append(parts[1])
    out: dict[str, tuple[str, str, int]] = {}
    for prefix, indices in by_prefix.items():
        def name(i: "int | str", prefix: str = prefix) -> str:
            return f"{prefix}.{i}" if prefix else str(i)

        sigs = {i: _segment_signature(plan, name(i), members[name(i)]) for i in indices}
        for run in _identical_runs(sorted(indices), sigs):
            first = name(run[0])
            rest = name(f"{run[1]}-{run[-1]}" if len(run) > 2 else run[1])
            out[first] = (rest, first, len(members[first]))
            out.update({name(j): ("", first, 0) for j in run[1:]})
    return out


def _identical_runs(indices: list[int], sigs: dict[int, tuple]) -> list[list[int]]:
    """Maximal runs (length >= 2) of consecutive indices with equal signatures."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1 and sigs[i] == sigs[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [r for r in runs if len(r) > 1]


def _rows(plan: Plan, full: bool) -> list[_Row]:
    """The per-node rows; unless ``full``, runs of identical segments become one row after the
    last node of their first segment."""
    runs = {} if full else _collapsed_runs(plan)
    last_of: dict[str, str] = {}
    for n in plan.nodes.values():
        if n.segment is not None:
            last_of[n.segment] = n.name
    rows = []
    for n in plan.nodes.values():
        run = runs.get(n.segment or "")
        if run is not None and run[0] == "":
            continue
        rows.append(_node_row(n))
        if run is not None and last_of[n.segment] == n.name:   # type: ignore[index]
            label, rep, count = run
            rows.append(_Row(label, "", "", f"same as {rep} ({count} nodes each)", "", "", group=True))
    return rows


def _reshard_rows(plan: Plan, full: bool) -> list[list[str]]:
    chosen = plan.reshards if full else sorted(plan.reshards, key=lambda r: -r.cost)[:_SUMMARY_RESHARDS]
    return [[f"{r.src} -> {r.dst}[{r.operand}]", f"{r.src_spec} -> {r.dst_spec}",
             "; ".join(s.text for s in r.fwd) or "-", _fmt_time(r.cost)] for r in chosen]


_NODE_COLUMNS = ("node", "module", "op", "strategy", "comm (bytes / time)", "memory")
_RESHARD_COLUMNS = ("edge", "specs", "forward steps", "cost fwd+bwd")


def _reshard_title(plan: Plan, full: bool) -> str:
    if full or len(plan.reshards) <= _SUMMARY_RESHARDS:
        return f"reshardings ({len(plan.reshards)})"
    return f"reshardings: the {_SUMMARY_RESHARDS} most expensive of {len(plan.reshards)} (full=True lists all)"


def _renderable(plan: Plan, full: bool) -> "RenderableType":
    from rich.console import Group
    from rich.markup import escape
    from rich.text import Text

    summary = Text("\n".join(_summary_lines(plan)))
    nodes = _table(_NODE_COLUMNS, "per-node decisions")
    for r in _rows(plan, full):
        cells = [escape(x) for x in (r.node, r.module, r.op, r.strategy, r.comm, r.memory)]
        nodes.add_row(*cells, style="dim italic" if r.group else None)
    parts: list = [summary, nodes]
    if plan.reshards:
        reshards = _table(_RESHARD_COLUMNS, _reshard_title(plan, full))
        for row in _reshard_rows(plan, full):
            reshards.add_row(*(escape(x) for x in row))
        parts.append(reshards)
    return Group(*parts)


def _table(columns: Iterable[str], title: str) -> Any:
    """A rich table whose cells wrap rather than being cut off with an ellipsis."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, overflow="fold")
    return table


def _plain_table(title: str, header: Iterable[str], rows: list[list[str]]) -> list[str]:
    header = list(header)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [title, line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _plain_text(plan: Plan, full: bool) -> str:
    rows = [[r.node, r.module, r.op, r.strategy, r.comm, r.memory] for r in _rows(plan, full)]
    lines = _summary_lines(plan) + [""] + _plain_table("per-node decisions", _NODE_COLUMNS, rows)
    if plan.reshards:
        lines += [""] + _plain_table(_reshard_title(plan, full), _RESHARD_COLUMNS, _reshard_rows(plan, full))
    return "\n".join(lines) + "\n"
