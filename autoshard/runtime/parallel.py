"""``parallelize``: a plan applied to a model on the ranks of a device mesh.

Each rank holds its shards of every parameter and buffer as plain tensors under the original FQNs
(``torch.optim`` optimizers work unchanged and pay no DTensor dispatch), with their layouts in
``pmodel.specs``; DTensor views of them serve ``torch.distributed.checkpoint``
(:meth:`ParallelModule.sharded_state_dict`), the gathered state dict and gradients, and the
global-norm :meth:`ParallelModule.clip_grad_norm_`. It runs the local program that
:mod:`autoshard.runtime.lower` generates from the plan: the handlers' local kernels with the plan's
collectives in between. ``pmodel.code`` shows that program.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..capture import CapturedGraph, TensorMeta, capture_in_mode, capture_meta, meta_copy, to_meta
from ..errors import ArgumentError
from ..mesh import MeshError
from ..plans import ModeError, Plan, PlanError, PlanMismatchError
from ..plans.validation import check_layouts_agree
from ..precision import cast_input, cast_inputs, precision_copy
from ..progress import Progress
from ..specs import ShardSpec
from .collectives import CommCounter, MeshComm, gather_whole, shard_input
from .compiled import CompiledProgram, compile_options, compile_program
from .constants import ConstantError, lifted_constants
from .grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from .inputs import InputBinder, check_constant, check_tensor
from .lower import LocalProgram, PlaceholderInfo, lower
from .replicas import INPUT_CHECKS, REPLICA_MODES, agree_on_step, agree_on_tensors, random_nodes
from .step_watch import StepWatch

log = logging.getLogger(__name__)

__all__ = ["ParallelModule", "PlanDisagreementError", "capture_meta", "example_inputs", "parallelize"]


class PlanDisagreementError(PlanError):
    """Ranks hold different plans, models or meshes (checked before the first step)."""


def parallelize(model: nn.Module, plan: Plan, mesh, *, args: Any = None, kwargs: Mapping[str, Any] | None = None,
                input_mode: str = "global", checkpoint: str | None = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, graph: CapturedGraph | None = None,
                replicas: str = "check", check_inputs: str = "first", progress: bool = False,
                compile: bool | Mapping[str, Any] = False) -> "ParallelModule":
    """The module this rank runs: ``model`` sharded and executed as ``plan`` says.

    ``mesh``: the ``DeviceMesh`` of :func:`autoshard.init_mesh` (its shape must be the plan's).
    ``args``/``kwargs``: example inputs to capture the graph with; by default the plan's recorded
    input shapes are used (meta tensors; nothing is allocated). ``input_mode``: ``"global"`` (call
    it like the original model with the full batch on every rank; each rank takes its shard) or
    ``"local"`` (each rank passes its own shard, laid out as the plan's input specs say).
    ``checkpoint``: a safetensors file or a ``torch.distributed.checkpoint`` directory to read the
    parameters from, each rank reading only its shards (for a ``model`` built on the meta device).
    ``bucket_bytes``: size of the gradient all-reduce buckets. ``graph``: the graph the plan was
    made from, captured on meta (skips capturing again; its fingerprint is still checked).
    ``replicas``: every rank shards its own copy of ``model``, so the copies must be equal:
    ``"check"`` (default) compares an exact checksum of every parameter and buffer across ranks and
    raises :class:`~autoshard.runtime.replicas.ReplicaMismatchError` naming what differs;
    ``"broadcast"`` gives every rank rank 0's values. ``pmodel.replicas`` says which was done.
    ``check_inputs``: ``"first"`` (default) checks on the first call in each mode that every rank passed the same
    batch (global input mode) and, when the model draws random numbers (dropout), has the same RNG
    state; ``"always"`` on every call; ``"never"`` not at all. Unless ``"never"``, every rank must also run
    backward on the same steps (calls whose outputs need a gradient): a rank that skips one while
    others run it gets :class:`~autoshard.runtime.step_watch.SkippedBackwardError` (a
    ``ReplicaMismatchError``) at its next call, and so do the others: within a second where they wait
    in a collective (that backward's gradient all-reduce), else at their next call. No collective is
    added per step (a key-value store write and read); with ``"always"`` every rank waits for every
    rank's word at each call and all raise at the same call. Every rank skipping backward
    (evaluation under grad mode) is fine. ``progress``: rank 0 reports each stage (capture, plan
    check, lowering, parameter shards) on stderr (:mod:`autoshard.progress`).
    ``compile``: ``True`` runs the generated program through ``torch.compile`` (inductor,
    ``dynamic=False``), a dict passes those ``torch.compile`` options instead (e.g.
    ``{"backend": "aot_eager", "fullgraph": True}``). The compiled program is the same program with
    its collectives written as functional collectives inside autograd functions that trace, so dynamo
    captures the whole forward in one graph (no graph break from a collective) and AOTAutograd its
    backward; the bucketed gradient all-reduce, input checks and step watch stay eager around it. It
    compiles at the first call in each mode; losses and gradients equal the eager program's within
    fp32 reassociation. ``recompute`` segments compile (what backward recomputes in them is then
    AOTAutograd's choice under the regions' recompute tags). Not supported, a
    :class:`~autoshard.runtime.compiled.CompileError` naming what to do: selective, partitioned and
    offload decisions, recomputed regions that update module state (BatchNorm statistics), and
    calling it while ``pmodel.comm.counter`` records (collectives inside a compiled graph are not
    counted). Collectives inside the compiled graph wait up to the process group's timeout, not through
    the skipped-backward watch (see :mod:`autoshard.runtime.compiled`).
    Collective: every rank of the mesh must call it.

    Inputs bind as they bind to the model's ``forward``: ``pmodel(x)`` and ``pmodel(x=x)`` are the same
    call. Each tensor input must have the planned dtype and shape (global, or this rank's shard in
    local input mode); a non-tensor input the value the graph was captured with
    (:class:`~autoshard.runtime.inputs.InputError` otherwise).

    Modes: ``pmodel.train()`` / ``pmodel.eval()`` switch as on the original module. The plan is made
    in the mode the model was in (``plan.training``); the other mode runs the graph the model has
    there (dropout off, BatchNorm reading its running statistics in eval) with the parameters in the
    same layouts: ``plan.other_mode``, or derived from the plan when it lacks one (see
    :mod:`autoshard.modes`; :class:`~autoshard.modes.ModeError` from ``train()``/``eval()`` when the
    other mode cannot keep the layouts). ``pmodel`` starts in the mode ``model`` is in.

    Outputs come back as the plan was made for (``autoshard.plan(..., outputs=)``, recorded in
    ``plan.outputs``): ``"global"``, every output whole on every rank, as the model returns it;
    ``"local"``, every tensor output of rank >= 1 as this rank's shard, with no collective run to
    gather it (0-dim outputs such as a loss are whole). The layout of the i-th output (in
    ``torch.utils._pytree.tree_flatten`` order of what the model returns) is
    ``pmodel.output_specs[i]``: a dim sharded over mesh axis ``a`` of size ``n_a`` is cut into
    ``n_a`` equal consecutive blocks and this rank holds block ``pmodel.comm.coord[a]``; a dim
    sharded over both axes (``S01``) into ``n_0 * n_1`` blocks, of which it holds block
    ``coord[0] * n_1 + coord[1]`` (its rank on the row-major mesh); a replicated dim is whole.
    ``pmodel.comm.shard_input(t, spec.dims)`` cuts a global tensor ``t`` the same way (e.g. the
    labels matching local logits). A data-parallel plan on 2x2 returns a language model's logits
    ``[batch, seq, vocab]`` as ``[batch/4, seq, vocab]``: rows ``rank*batch/4`` to
    ``(rank+1)*batch/4 - 1``, the rows of the batch this rank computed (what DDP returns).
    """
    return ParallelModule(model, plan, mesh, args=args, kwargs=kwargs, input_mode=input_mode,
                          checkpoint=checkpoint, bucket_bytes=bucket_bytes, graph=graph, replicas=replicas,
                          check_inputs=check_inputs, progress=progress, compile=compile)


@dataclass
class _Mode:
    """What runs in one mode (training or eval): its graph, plan and generated program."""

    graph: CapturedGraph
    plan: Plan
    program: LocalProgram
    binder: InputBinder
    out_spec: Any
    random: list[str]
    constants: dict[str, torch.Tensor]     # placeholder -> this rank's block of a lifted tensor constant
    run: Any                               # what runs the program: its module, or its CompiledProgram


class ParallelModule(nn.Module):
    """The per-rank parallel model (see :func:`parallelize`).

    Attributes: ``plan``, ``device_mesh``, ``comm`` (this rank's collectives, with ``comm.counter``
    recording every collective), ``program`` (the generated ``fx.GraphModule`` of the current mode),
    ``code`` (its Python source), ``graph`` (the captured graph the plan was applied to, current
    mode), ``output_specs`` (the layout of each flat output as returned: replicated, or this rank's
    shard; see :func:`parallelize`), ``replicas`` (how the ranks' parameter copies were made to agree),
    ``compiled`` (the current mode's compiled program with ``compile=True``, else None).
    """

    def __init__(self, model: nn.Module, plan: Plan, device_mesh, *, args: Any = None,
                 kwargs: Mapping[str, Any] | None = None, input_mode: str = "global",
                 checkpoint: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 graph: CapturedGraph | None = None, replicas: str = "check", check_inputs: str = "first",
                 progress: bool = False, compile: bool | Mapping[str, Any] = False) -> None:
        super().__init__()
        self._compile = compile_options(compile)
        _check_arguments(model, plan, device_mesh, input_mode, bucket_bytes, replicas, check_inputs)
        if tuple(device_mesh.shape) != tuple(plan.mesh_shape):
            raise MeshError(f"the plan is for a {plan.mesh} mesh but the device mesh is "
                            f"{'x'.join(map(str, device_mesh.shape))}; plan for this mesh or build the mesh "
                            f"with autoshard.init_mesh({tuple(plan.mesh_shape)})")
        if plan.mixed_precision is not None:
            _check_master_dtype(model, plan)
        self.plan = plan
        self.device_mesh = device_mesh
        self.input_mode = input_mode
        self.check_inputs = check_inputs
        self.device = torch.device(device_mesh.device_type, torch.cuda.current_device()) \
            if device_mesh.device_type == "cuda" else torch.device(device_mesh.device_type)
        if args is None and kwargs is None and (graph is None or plan.inputs is not None):
            args, kwargs = example_inputs(plan)
        stages = Progress(bool(progress) and dist.get_rank() == 0)
        if graph is None:
            with stages.stage(f"capturing {plan.model_name} on meta tensors"):
                graph = _capture_meta(model, plan, args, kwargs)
        with stages.stage("checking the plan against the graph on every rank"):
            plan.check(graph)
            serial = _agree_across_ranks(plan, graph, device_mesh)
        self.comm = MeshComm(device_mesh, CommCounter())
        # whether every rank runs backward on the same steps (keys of this model: its serial number)
        self._watch = None if check_inputs == "never" else \
            StepWatch(f"{serial}", barrier=check_inputs == "always", poll=device_mesh.device_type == "cpu")
        self.comm.watch = self._watch
        self._constant_values = lifted_constants(model, graph)
        try:
            self._signature: inspect.Signature | None = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self._signature = None
        with stages.stage(f"lowering the plan to this rank's program ({len(graph.graph.nodes)} nodes)"):
            main = self._make_mode(graph, plan)
        self._modes: dict[bool, _Mode] = {plan.training: main}
        self._checked_modes: set[bool] = set()    # modes whose first call was checked (check_inputs="first")
        # What the other mode is captured from: a meta copy (no storage) and meta example inputs.
        if plan.mixed_precision is not None and (args is not None or kwargs is not None):
            args, kwargs = cast_inputs(args, kwargs, plan.mixed_precision)
        object.__setattr__(self, "_meta_model", None if args is None and kwargs is None else
                           meta_copy(model) if plan.mixed_precision is None else
                           precision_copy(model, plan.mixed_precision))
        self._example = (to_meta(tuple(args) if isinstance(args, (tuple, list)) else (args,)) if args is not None else (),
                         to_meta(dict(kwargs or {})))
        with stages.stage("placing this rank's parameter shards" + (f" from {checkpoint}" if checkpoint else "")):
            self._install_state(model, graph, checkpoint, replicas)
        mp = plan.mixed_precision
        self._grad_sync = GradSync(self.comm, [(self._tensor_of(p), axes) for p, axes in self._bucketed(main)],
                                   bucket_bytes, reduce_dtype=None if mp is None else mp.reduce)
        self.train(model.training)

    # -- modes -----------------------------------------------------------------------------------

    def _make_mode(self, graph: CapturedGraph, plan: Plan) -> _Mode:
        program = lower(graph, plan, self.comm, self.device, input_mode=self.input_mode)
        in_spec = graph.exported.call_spec.in_spec
        binder = InputBinder(self._signature, in_spec)
        run = program.module if self._compile is None else \
            compile_program(program.module, self.comm, plan, self._compile)
        return _Mode(graph, plan, program, binder, graph.exported.call_spec.out_spec, random_nodes(graph.graph.nodes),
                     self._local_constants(graph, program), run)

    def _local_constants(self, graph: CapturedGraph, program: LocalProgram) -> dict[str, torch.Tensor]:
        """This rank's block of each lifted tensor constant of ``program`` (values from the plan's
        mode, matched by FQN), cut as parameters are."""
        from .state import load_local_shards

        placeholders = [p for p in program.placeholders if p.kind == "constant"]
        values = {}
        for p in placeholders:
            value = self._constant_values.get(p.fqn)           # type: ignore[arg-type]
            if value is None:
                value = graph.exported.constants[p.fqn]        # type: ignore[index]
                if value.is_meta:
                    raise ConstantError(f"tensor constant {p.fqn!r} of {graph.name!r} appears only in this mode's "
                                        "graph and its value is not known (it was captured on meta tensors); "
                                        "plan with the model in this mode")
            values[p.fqn] = value
        local = load_local_shards(values, {p.fqn: p.spec for p in placeholders}, self.comm, self.device, None)
        return {p.name: local[p.fqn] for p in placeholders}                 # type: ignore[index]

    def _mode(self, training: bool) -> _Mode:
        """The program of mode ``training``, built at the first switch to it (see :mod:`autoshard.modes`)."""
        mode = self._modes.get(training)
        if mode is not None:
            return mode
        from ..modes import plan_other_mode      # plans the other mode: loads the solver, only when needed

        label = "training" if training else "eval"
        main = self._modes[self.plan.training]
        if self._meta_model is None:
            raise ModeError(f"{label} mode cannot be set up: parallelize was given a graph but no example inputs to "
                            f"capture the model's {label}-mode graph with; pass args=/kwargs= (meta tensors work)")
        graph = capture_in_mode(self._meta_model, *self._example, training, name=self.plan.model_name)
        if graph.fingerprint() == main.graph.fingerprint():
            self._modes[training] = main               # the model's graph is the same in both modes
            return main
        other = self.plan.other_mode
        if other is not None:
            other.check(graph)
        else:
            other = plan_other_mode(self.plan, graph)
        check_layouts_agree(self.plan, other)
        mode = self._make_mode(graph, other)
        if dict(self._bucketed(mode)) != dict(self._bucketed(main)):
            raise ModeError(f"{label} mode would synchronise parameter gradients differently from the plan's mode; "
                            f"re-plan with the model in {label} mode for {label}-mode training")
        self._modes[training] = mode
        return mode

    def train(self, mode: bool = True) -> "ParallelModule":
        """Switch training/eval mode as the original module would (``eval()`` calls ``train(False)``);
        the first switch to the plan's other mode builds its program (raising
        :class:`~autoshard.modes.ModeError` if it cannot keep the plan's layouts)."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode) takes True or False, got {mode!r}")
        self._mode(mode)
        return super().train(mode)

    @property
    def graph(self) -> CapturedGraph:
        """The captured graph of the current mode."""
        return self._mode(self.training).graph

    @property
    def program(self) -> Any:
        """The generated ``fx.GraphModule`` of the current mode."""
        return self._mode(self.training).program.module

    @property
    def compiled(self) -> CompiledProgram | None:
        """The compiled program of the current mode (``compile=True``; its ``functional`` is the
        uncompiled program on functional collectives), or None."""
        run = self._mode(self.training).run
        return run if isinstance(run, CompiledProgram) else None

    @property
    def placeholders(self) -> list[PlaceholderInfo]:
        """The inputs of the current mode's program: parameters, buffers and user inputs with their
        layouts (``spec``; in local input mode each rank passes its block of a user input)."""
        return self._mode(self.training).program.placeholders

    @property
    def output_specs(self) -> list[ShardSpec | None]:
        """The layout of each flat output of the current mode (see :func:`parallelize`)."""
        return self._mode(self.training).program.output_specs

    # -- state -----------------------------------------------------------------------------------

    def _install_state(self, model: nn.Module, graph: CapturedGraph, checkpoint: str | None, replicas: str) -> None:
        """Register this rank's shard of every parameter and buffer under all of its original FQNs,
        in the original module order (so state-dict keys come in the original order). Parameters
        are plain local tensors (optimizers and autograd see no DTensor dispatch); their layouts are
        kept in ``self.specs`` and DTensor views are built for checkpoints and state dicts. The
        ranks' copies are checked equal (or broadcast from rank 0) first, as ``replicas`` says."""
        from .state import load_local_shards

        placeholders = self._modes[self.plan.training].program.placeholders
        specs = {p.fqn: p.spec for p in placeholders if p.kind in ("param", "buffer")}
        canonical = {name: fqn for fqn, names in graph.tied_params.items() for name in names}
        sources = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        sources, self.replicas = agree_on_tensors(sources, "check" if checkpoint is not None else replicas)
        log.info("autoshard.parallelize: %s", self.replicas)
        local = load_local_shards(sources, specs, self.comm, self.device, checkpoint)
        made: dict[str, torch.Tensor] = {}
        self.specs: dict[str, ShardSpec] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            owner = _owner(self, f"{prefix}.x" if prefix else "x")[0]
            for attr, original in [*module._parameters.items(), *module._buffers.items()]:
                if original is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                fqn = canonical.get(name, name)
                if fqn not in specs:
                    raise PlanError(f"'{name}' of the model is not in the captured graph's inputs; the plan cannot "
                                    f"place it (was the model changed after planning?)")
                if fqn not in made:
                    made[fqn] = nn.Parameter(local[fqn], requires_grad=original.requires_grad) \
                        if isinstance(original, nn.Parameter) else local[fqn]
                self.specs[name] = specs[fqn] or ShardSpec.replicate(original.ndim)
                if isinstance(original, nn.Parameter):
                    owner.register_parameter(attr, made[fqn])        # type: ignore[arg-type]
                else:
                    owner.register_buffer(attr, made[fqn], persistent=attr not in module._non_persistent_buffers_set)

    def _tensor_of(self, fqn_or_placeholder: str) -> torch.Tensor:
        owner, attr = _owner(self, fqn_or_placeholder, create=False)
        return getattr(owner, attr)

    def _bucketed(self, mode: _Mode) -> Iterator[tuple[str, tuple[int, ...]]]:
        program = mode.program
        by_name = {p.name: p for p in program.placeholders}
        for placeholder, axes in program.bucketed_grads.items():
            fqn = by_name[placeholder].fqn
            assert fqn is not None
            yield fqn, axes

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._watch is not None:
            self._watch.before_forward()             # before any collective: did a rank skip a backward?
        mode = self._mode(self.training)
        leaves = mode.binder.flatten(args, kwargs)
        feeds = []
        given: list[tuple[str, Any]] = []
        user = iter(leaves)
        for p in mode.program.placeholders:
            if p.kind == "input":
                value = next(user)
                given.append((mode.graph.user_input_specs.get(p.name, p.name), value))
                feeds.append(self._input(value, p, mode.graph))
            elif p.kind in ("param", "buffer"):
                feeds.append(self._tensor_of(p.fqn))             # type: ignore[arg-type]
            elif p.kind == "constant":
                feeds.append(mode.constants[p.name])
            elif p.kind == "unused":
                feeds.append(None)
            else:
                raise PlanError(f"placeholder '{p.name}' ({p.kind}) is not supported by the runtime yet")
        always = self.check_inputs == "always"
        if always or (self.check_inputs == "first" and self.training not in self._checked_modes and
                      (self.input_mode == "global" or mode.random)):
            agree_on_step(given if self.input_mode == "global" else None, mode.random, self.device,
                          wait=self.comm.wait if self._watch is not None and self._watch.poll else None)
        self._checked_modes.add(self.training)
        out = mode.run(*feeds)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        mp = self.plan.mixed_precision
        if mp is not None and mp.output is not None:      # FSDP2's output_dtype
            out = [o.to(mp.output) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out]
        if self._watch is not None and torch.is_grad_enabled() and \
                any(isinstance(o, torch.Tensor) and o.requires_grad for o in out):
            self._watch_backward(out)
        return pytree.tree_unflatten(out, mode.out_spec)

    def _watch_backward(self, outputs: list[Any]) -> None:
        """Count this call as a step that needs a backward, and tell the watch when a gradient reaches
        any of its outputs (the start of its backward, before any backward collective)."""
        watch = self._watch
        assert watch is not None
        step = watch.new_step()

        def done(grad: torch.Tensor) -> None:
            watch.backward_started(step)

        for o in outputs:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(done)

    def _input(self, value: Any, p: PlaceholderInfo, graph: CapturedGraph) -> Any:
        where = graph.user_input_specs.get(p.name, p.name)
        if p.name in graph.constant_inputs:
            check_constant(value, where, graph.constant_inputs[p.name])
            return value
        meta = graph.tensor_meta(p.name)
        if not isinstance(meta, TensorMeta):
            return value
        if self.plan.mixed_precision is not None:     # FSDP2's cast_forward_inputs
            value = cast_input(value, self.plan.mixed_precision)
        want = tuple(meta.shape)
        if self.input_mode == "local" and p.spec is not None:
            want = p.spec.local_shape(want, self.comm.mesh_shape)
        layout = (f"this rank's {p.spec} shard of the planned {tuple(meta.shape)}" if self.input_mode == "local"
                  else "the global batch the plan was made for")
        check_tensor(value, where, meta, want, layout)
        return value if value.device == self.device else value.to(self.device)

    @property
    def code(self) -> str:
        """The Python source of this rank's local program."""
        return self.program.code

    # -- state dicts -----------------------------------------------------------------------------

    def _dtensor(self, name: str, t: torch.Tensor) -> DTensor:
        """A DTensor view of a local shard (same storage: loading into it loads into the module)."""
        return DTensor.from_local(t.detach(), self.device_mesh, self.specs[name].to_placements(2), run_check=False)

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """Original FQNs -> DTensor views of this rank's shards (what ``torch.distributed.checkpoint``
        saves and loads; loading into them loads into the module)."""
        return {k: self._dtensor(k, v) for k, v in super().state_dict(keep_vars=True).items()}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full, gathered state dict with the original FQNs (collective: every rank must call it)."""
        # gathered by the runtime's own collectives, one per sharded dim (DTensor's full_tensor gathers
        # a dim sharded over both axes in two steps and logs a warning about it on every rank)
        return {k: gather_whole(v.detach(), self.comm, self.specs[k].dims)
                for k, v in super().state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load a full (global tensors) or sharded (DTensor) state dict; each rank keeps its shards."""
        own = super().state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for k, target in own.items():
                if k not in state_dict:
                    continue
                src = state_dict[k]
                if isinstance(src, DTensor):
                    src = src.full_tensor()
                target.copy_(shard_input(src.to(self.device), self.comm, self.specs[k].dims))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Parameter FQN -> the full (gathered) gradient, or None (collective)."""
        return {k: None if p.grad is None else gather_whole(p.grad, self.comm, self.specs[k].dims)
                for k, p in self.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over all shards, like ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model; returns that norm (collective). Call this, not torch's function,
        which would only see this rank's shards."""
        local = []
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            replicas = 1
            for a, n in enumerate(self.comm.mesh_shape):
                if a not in self.specs[name].used_axes():
                    replicas *= n
            local.append((p.grad, replicas))
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = torch.stack([g.detach().abs().max() for g, _ in local]).max() if local \
                else torch.zeros((), device=self.device)
            total = self.comm.raw_all_reduce(total.reshape(1).float(), _all_axes(self.comm), op="max",
                                             phase="optimizer")[0]
        else:
            powered = sum((torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type / r for g, r in local),
                          torch.zeros((), device=self.device))
            total = self.comm.raw_all_reduce(powered.reshape(1), _all_axes(self.comm), phase="optimizer")[0]
            total = total ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g, _ in local:
            g.detach().mul_(coef.to(g.dtype))
        return total

    def extra_repr(self) -> str:
        return f"plan={self.plan.model_name!r}, mesh={self.plan.mesh}, coord={self.comm.coord}"


# -- helpers -----------------------------------------------------------------------------------------

def _owner(root: nn.Module, fqn: str, create: bool = True) -> tuple[nn.Module, str]:
    *path, attr = fqn.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            if not create:
                raise KeyError(f"no module '{part}' on the path to '{fqn}'")
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, attr


def _all_axes(comm: MeshComm) -> tuple[int, ...]:
    return comm.live_axes(range(len(comm.mesh_shape))) or (0,)


def _placements(spec: ShardSpec | None, original: torch.Tensor) -> tuple:
    return (spec or ShardSpec.replicate(original.ndim)).to_placements(2)


def example_inputs(plan: Plan) -> tuple[tuple, dict]:
    """Meta tensors shaped like the inputs the plan was captured with."""
    sig = plan.inputs
    if sig is None:
        raise PlanError("this plan does not record its input shapes; pass args=/kwargs= (example inputs, meta "
                        "tensors are fine) to parallelize")
    leaves = [torch.empty(leaf["shape"], dtype=getattr(torch, leaf["dtype"]), device="meta") if "shape" in leaf
              else leaf["value"] for leaf in sig["leaves"]]
    args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(sig["in_spec"]))
    return tuple(args), dict(kwargs)


def _capture_meta(model: nn.Module, plan: Plan, args: Any, kwargs: Mapping[str, Any] | None) -> CapturedGraph:
    """The graph of ``model`` in the mode the plan was made in (the model's own per-module modes when
    its root is in that mode)."""
    if plan.mixed_precision is not None:       # captured as planned: parameters and float inputs in param_dtype
        model = precision_copy(model, plan.mixed_precision)
        args, kwargs = cast_inputs(args, kwargs, plan.mixed_precision)
    if model.training == plan.training:
        return capture_meta(model, args, kwargs, name=plan.model_name)
    return capture_in_mode(model, args, kwargs, plan.training, name=plan.model_name)


def _check_master_dtype(model: nn.Module, plan: Plan) -> None:
    """A mixed-precision plan keeps the model's parameters as master weights: they must be in the
    master dtype the plan was made with (PlanMismatchError otherwise)."""
    mp = plan.mixed_precision
    assert mp is not None
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    if found and found != [mp.master_dtype]:
        raise PlanMismatchError(f"the plan keeps {mp.master_dtype} master weights ({mp}), but the model's parameters "
                                f"are {', '.join(found)}; pass the model in {mp.master_dtype} (e.g. model.float()), "
                                f"as it was planned")


def _check_arguments(model: Any, plan: Any, device_mesh: Any, input_mode: Any, bucket_bytes: Any, replicas: Any,
                     check_inputs: Any) -> None:
    """ArgumentError for an argument of :func:`parallelize` of the wrong type or not a known value."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"parallelize needs the nn.Module the plan was made for, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise ArgumentError(f"parallelize needs a Plan (autoshard.plan(...) or Plan.load(path)), got "
                            f"{type(plan).__name__}")
    if not hasattr(device_mesh, "shape") or not hasattr(device_mesh, "device_type"):
        raise ArgumentError(f"parallelize needs the DeviceMesh of autoshard.init_mesh({tuple(plan.mesh_shape)}), "
                            f"got {type(device_mesh).__name__}")
    for label, value, allowed in (("input_mode", input_mode, ("global", "local")), ("replicas", replicas, REPLICA_MODES),
                                  ("check_inputs", check_inputs, INPUT_CHECKS)):
        if value not in allowed:
            raise ArgumentError(f"{label} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ArgumentError(f"bucket_bytes must be an int >= 1 (bytes per gradient all-reduce bucket, e.g. 25 * 2**20), "
                            f"got {bucket_bytes!r}")


_DECIDING_FIELDS = ("fingerprint", "mesh_shape", "hardware", "memory_budget", "solver_options", "nodes",
                    "segments", "reshards", "inputs", "outputs", "training", "other_mode",
                    "mixed_precision")


def _plan_digest(plan: Plan) -> str:
    """Hash of what a plan decides (not of when or how fast it was solved: ranks that each solve the
    same problem agree)."""
    full = plan.to_dict()
    data = {k: full[k] for k in _DECIDING_FIELDS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


_next_serial = 0            # the serial number this process proposes for its next parallel model


def _agree_across_ranks(plan: Plan, graph: CapturedGraph, device_mesh) -> int:
    """Every rank must hold the same plan for the same graph on the same mesh; a difference is an
    error on every rank (never a hang: all ranks reach this exchange). Returns the model's serial
    number, the same on every rank and new in this process (the largest any rank proposes)."""
    global _next_serial
    mine = {"plan": _plan_digest(plan), "graph": graph.fingerprint(), "mesh": list(device_mesh.shape)}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**mine, "serial": _next_serial})
    serial = max(theirs.pop("serial") for theirs in everyone)
    _next_serial = serial + 1
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        what = sorted({k for r in differ for k in mine if everyone[r][k] != everyone[0][k]})
        raise PlanDisagreementError(f"ranks {differ} differ from rank 0 in {', '.join(what)}: every rank must "
                                    f"load the same plan for the same model (save it once, load it everywhere)")
    return serial
