"""Folded capture: the exported graph of a deep model without tracing every layer.

``torch.export`` traces every layer, so capture time grows linearly with depth (Llama-2-70B: 80
layers, 11-16 s on meta). A stack of identical layers exports to a periodic graph: a prefix, one
copy of the block per layer, a suffix. :func:`capture_folded` exports the model at two small depths
(2 and 3 layers by default), cuts the shallow graph into prefix / blocks / suffix, and writes the
graph export WOULD produce at the full depth: the same nodes, node names (export names nodes by op
with global counters, ``linear``, ``linear_1``, ...; the counters are reproduced), arguments,
``meta['val']``, ``nn_module_stack`` with the right layer indices, one placeholder per parameter
and buffer with the right FQN, graph signature, state_dict and module call graph. The result is a
real :class:`torch.export.ExportedProgram` wrapped in a :class:`~autoshard.capture.CapturedGraph`.

Nothing is assumed silently. The shallow graph must be periodic (block ``n-1`` = block ``n-2``
with every layer index, node-name counter and module path shifted by one layer); the unfolding of
the shallow graph to the second probe depth must equal that depth's real export exactly (nodes,
names, args, metas, signature, state_dict, module call graph); and the full-depth model's parameters
must be exactly the unfolded signature's, in shape, dtype and requires_grad. The per-layer step
of ``meta['torch_fn']`` counters after the layers is read off the two probes (those count Python
calls that may leave no node). Anything else raises :class:`FoldError` and callers fall
back to a full capture (:func:`capture_preset` does so, with a warning).

Fake tensors (``meta['val']``) of the synthesised layers are shared with the template layer of the
shallow export (they are equal in shape, stride, dtype and device; treat them as read-only).
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.export import ExportedProgram

from .compare import exported_differences
from .export import capture
from .graph import CapturedGraph
from .periodic import FoldError, _find_layer_list, _layout, _Layout, _learn_suffix_fn_steps
from .unfold import _unfold

__all__ = ["capture_folded", "capture_module_folded", "capture_preset"]

log = logging.getLogger(__name__)

Built = tuple[nn.Module, tuple, dict]
Builder = Callable[[int], Built]


def capture_folded(build: Builder, num_layers: int, *, name: str | None = None,
                   probes: tuple[int, int] = (2, 3)) -> CapturedGraph:
    """Capture the model ``build(num_layers)`` builds, exporting only shallow copies of it.

    ``build(depth)`` returns ``(model, args, kwargs)`` for the same model with ``depth`` repeated
    layers (build on ``meta`` to allocate nothing). The models at the two ``probes`` depths are
    exported; the shallow graph is unfolded to the deeper probe's depth and must equal that real
    export exactly, then it is unfolded to ``num_layers``. Raises :class:`FoldError` when the
    model is not a periodic stack of identical layers (callers then capture in full) and
    :class:`~autoshard.capture.CaptureError` when a probe cannot be exported at all.
    At ``num_layers`` <= the deeper probe this is a plain :func:`~autoshard.capture.capture`.
    ``graph.timings`` has ``export_s`` (both probes), ``verify_s``, ``fold_s`` (building the
    full-depth model and program) and ``postprocess_s`` (CapturedGraph's annotation).
    """
    shallow, deep = probes
    if not 2 <= shallow < deep:
        raise ValueError(f"probes must be two depths 2 <= a < b, got {probes}")
    if num_layers <= deep:
        return capture(*build(num_layers), name=name)
    start = time.perf_counter()
    small_model, small = _export(build, shallow, name)
    deep_model, check = _export(build, deep, name)
    exported = time.perf_counter()
    layers = _find_layer_list(small.exported, check.exported, shallow)
    src = _layout(small.exported, layers, shallow)
    _learn_suffix_fn_steps(src, check.exported, deep)
    _verify(src, deep, deep_model, check.exported)
    verified = time.perf_counter()
    model, args, kwargs = build(num_layers)
    program = _unfold(src, num_layers, model)
    unfolded = time.perf_counter()
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    graph = CapturedGraph(program, model, args, kwargs, name=name or type(model).__name__)
    graph.timings = {"export_s": exported - start, "verify_s": verified - exported,
                     "fold_s": unfolded - verified,
                     "postprocess_s": time.perf_counter() - unfolded}
    return graph


def _export(build: Builder, depth: int, name: str | None) -> tuple[nn.Module, CapturedGraph]:
    model, args, kwargs = build(depth)
    return model, capture(model, args, kwargs, name=name)


def _verify(src: _Layout, depth: int, model: nn.Module, real: ExportedProgram) -> None:
    """The unfolding to ``depth`` (the deeper probe's) must be that probe's real export."""
    diffs = exported_differences(_unfold(src, depth, model), real)
    if diffs:
        raise FoldError(f"unfolding the {src.depth}-layer graph to {depth} layers does not "
                        "reproduce the real export:\n  " + "\n  ".join(diffs))


def capture_module_folded(model: nn.Module, args: Any = (), kwargs: Mapping[str, Any] | None = None, *,
                          name: str | None = None) -> CapturedGraph | None:
    """A model's folded capture on meta tensors, from the model itself (what
    :func:`autoshard.plan` uses): a Hugging Face model (``config.num_hidden_layers`` > 3) whose
    layers are the one ``nn.ModuleList`` of that length. The probes are copies of the model with
    that list cut to 2 and 3 layers (and ``config.num_hidden_layers``, ``config.layer_types`` to
    match), so whatever the user changed in the model (dtype, replaced modules, attributes) is in
    them; the full-depth model is the model's own meta copy, whose parameters the unfolded
    signature must match exactly. None when the model does not qualify; :class:`FoldError` when
    folding cannot reproduce export (capture in full then)."""
    from .meta_device import meta_copy, to_meta

    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth <= 3:
        return None
    lists = [path for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if len(lists) != 1:
        return None
    parent_path, _, attr = lists[0].rpartition(".")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    meta_args, meta_kwargs = to_meta(args), to_meta(dict(kwargs or {}))
    with torch.device("meta"):
        full = meta_copy(model)

    def build(layers: int) -> Built:
        if layers == depth:
            return full, meta_args, meta_kwargs
        parent = full.get_submodule(parent_path)
        every = getattr(parent, attr)
        setattr(parent, attr, nn.ModuleList(list(every)[:layers]))
        try:
            probe = copy.deepcopy(full)       # meta: allocates nothing; the config is copied with it
        finally:
            setattr(parent, attr, every)
        probe.config.num_hidden_layers = layers
        if isinstance(getattr(probe.config, "layer_types", None), list):
            probe.config.layer_types = probe.config.layer_types[:layers]
        return probe, meta_args, meta_kwargs

    return capture_folded(build, depth, name=name)


def capture_preset(name: str, *, device: "str | torch.device" = "meta", batch: int | None = None,
                   seq: int | None = None, num_layers: int | None = None, fold: bool = True,
                   before_capture: "Callable[[tuple, dict], None] | None" = None,
                   **overrides: Any) -> CapturedGraph:
    """Build a model-zoo preset (see :func:`autoshard.models.build_model`) and capture it.

    Hugging Face presets (anything whose config has ``num_hidden_layers``) are captured folded
    (:func:`capture_folded`) unless ``fold=False``; a :class:`FoldError` falls back to a full
    capture with a warning. Other presets and ``file.py:factory`` models are captured in full.
    ``before_capture(args, kwargs)`` sees the example inputs once the model is built, before the
    capture (which can take minutes): a check that raises there saves it.
    """
    from ..models import build_model

    options = dict(overrides, device=device, batch=batch, seq=seq)
    if num_layers is not None:
        options["num_layers"] = num_layers
    model, args, kwargs = build_model(name, **options)
    if before_capture is not None:
        before_capture(tuple(args), dict(kwargs or {}))
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not fold or not isinstance(depth, int):
        if torch.device(device).type == "meta":
            # a factory without device= builds where it likes; capture it on meta as parallelize does
            from .meta_device import capture_meta

            return capture_meta(model, args, kwargs, name=name)
        return capture(model, args, kwargs, name=name)

    def build(layers: int) -> Built:
        if layers == depth:
            return model, args, kwargs
        return build_model(name, **dict(options, num_layers=layers))

    try:
        return capture_folded(build, depth, name=name)
    except FoldError as e:
        log.warning("folded capture of %s failed, capturing all %d layers: %s", name, depth, e)
        return capture(model, args, kwargs, name=name)
