"""``parallelize``: a plan applied to a model on the ranks of a device mesh.

Each rank holds its shards of every parameter and buffer as plain tensors under the original FQNs
(``torch.optim`` optimizers work unchanged and pay no DTensor dispatch), with their layouts in
``pmodel.specs``; DTensor views of them serve ``torch.distributed.checkpoint``
(:meth:`ParallelModule.sharded_state_dict`), the gathered state dict and gradients, and the
global-norm :meth:`ParallelModule.clip_grad_norm_`. It runs the local program that
:mod:`autoshard.runtime.lower` generates from the plan: the handlers' local kernels with the plan's
collectives in between. ``pmodel.code`` shows that program. What it does with the shards (state
dicts, gradient clipping) is :mod:`autoshard.runtime.module_shards`; its arguments are checked in
:mod:`autoshard.runtime.arguments`, and the plan across ranks in :mod:`autoshard.runtime.plan_agreement`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..capture import CapturedGraph, TensorMeta, capture_in_mode, meta_copy, to_meta
from ..mesh import MeshError
from ..plans import ModeError, Plan, PlanError
from ..plans.validation import check_layouts_agree
from ..precision import cast_input, cast_inputs, precision_copy
from ..progress import Progress
from ..specs import ShardSpec
from .arguments import capture_as_planned, check_arguments, check_master_dtype, example_inputs
from .collectives import CommCounter, MeshComm
from .compiled import CompiledProgram, compile_options, compile_program
from .constants import ConstantError, lifted_constants
from .grad_sync import DEFAULT_BUCKET_BYTES, GradBucket, GradSync
from .inputs import InputBinder, check_constant, check_tensor
from .lower import LocalProgram, PlaceholderInfo, lower
from .module_shards import ShardedState
from .plan_agreement import agree_across_ranks
from .replicas import agree_on_step, random_nodes
from .step_watch import StepWatch

__all__ = ["ParallelModule", "parallelize"]


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
    in a collective (that backward's gradient all-reduce), else at their first call once 0.25 s has
    passed since they last looked. No collective is added per step (a key-value store write per step,
    a read at most every 0.25 s of calls); with ``"always"`` every rank waits for every
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
    gather it (0-dim outputs such as a loss are whole, unless the plan was made with
    ``loss="per_rank"``: then each rank returns its own value, their mean over the ranks being the
    output, as each DDP rank returns its share's loss). The layout of the i-th output (in
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


class ParallelModule(ShardedState):
    """The per-rank parallel model (see :func:`parallelize`).

    Attributes: ``plan``, ``device_mesh``, ``comm`` (this rank's collectives, with ``comm.counter``
    recording every collective), ``program`` (the generated ``fx.GraphModule`` of the current mode),
    ``code`` (its Python source), ``graph`` (the captured graph the plan was applied to, current
    mode), ``output_specs`` (the layout of each flat output as returned: replicated, or this rank's
    shard; see :func:`parallelize`; a 0-dim output partial over some axes under ``outputs="local"``
    and ``loss="per_rank"`` is this rank's value, whose mean over the ranks is the output), ``replicas`` (how the ranks' parameter copies were made to agree),
    ``compiled`` (the current mode's compiled program with ``compile=True``, else None).
    Under a plan made with ``batch_norm="per_rank"`` each rank updates the running statistics from
    its own share of the batch; :meth:`sync_buffers` averages them (by itself before an eval
    forward and a state dict).
    """

    def __init__(self, model: nn.Module, plan: Plan, device_mesh, *, args: Any = None,
                 kwargs: Mapping[str, Any] | None = None, input_mode: str = "global",
                 checkpoint: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 graph: CapturedGraph | None = None, replicas: str = "check", check_inputs: str = "first",
                 progress: bool = False, compile: bool | Mapping[str, Any] = False) -> None:
        super().__init__()
        self._compile = compile_options(compile)
        check_arguments(model, plan, device_mesh, input_mode, bucket_bytes, replicas, check_inputs)
        if tuple(device_mesh.shape) != tuple(plan.mesh_shape):
            raise MeshError(f"the plan is for a {plan.mesh} mesh but the device mesh is "
                            f"{'x'.join(map(str, device_mesh.shape))}; plan for this mesh or build the mesh "
                            f"with autoshard.init_mesh({tuple(plan.mesh_shape)})")
        if plan.mixed_precision is not None:
            check_master_dtype(model, plan)
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
                graph = capture_as_planned(model, plan, args, kwargs)
        with stages.stage("checking the plan against the graph on every rank"):
            plan.check(graph)
            serial = agree_across_ranks(plan, graph, device_mesh)
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

    @property
    def grad_buckets(self) -> list[GradBucket]:
        """The buckets parameter gradients are all-reduced in after backward, as the runtime made them
        (per mesh axes and dtype, in reverse order of first use); empty where no gradient is
        all-reduced in buckets."""
        return [b.describe() for b in self._grad_sync.buckets]

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
        if not self.training:
            self.sync_buffers()          # eval reads the running statistics each rank updated alone
        out = mode.run(*feeds)
        if self.training and mode.program.local_state:
            self._mark_buffers_stale(mode.program.local_state)
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

    def extra_repr(self) -> str:
        return f"plan={self.plan.model_name!r}, mesh={self.plan.mesh}, coord={self.comm.coord}"

