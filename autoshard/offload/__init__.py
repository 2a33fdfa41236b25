"""Parameter offload: train models whose parameters do not fit on the device.

``offload_parameters(model, example_args, num_slices=...)`` captures ``model`` with
``torch.export`` (training IR), cuts its node sequence into ``num_slices`` contiguous *slices*
with roughly equal parameter bytes, and returns an :class:`OffloadedModule` whose generated code
runs the slices one after another. Every parameter stays on the host (CPU memory, pinned when
the device is CUDA). Before a slice runs, its parameters are copied to the device; after it ran
they are released. In backward each slice's parameters are copied to the device again for that
slice's backward, and their gradients are sent back and accumulated into the host parameters'
``.grad``, so an ordinary optimizer over ``model.parameters()`` steps on the host.

This is the L2L / ZeRO-Offload idea of fairscale's ``OffloadModel``, generalised from
``nn.Sequential`` to any graph ``torch.export`` can capture.

Microbatches (``num_microbatches > 1``)
    The graph is captured at microbatch size. Tensor inputs whose dim 0 equals the batch size
    (dim 0 of the first tensor input) are split into equal microbatches along dim 0, the other
    inputs go to every microbatch. Each slice loads its parameters once and runs every
    microbatch before it is released (as fairscale does), and in backward it runs every
    microbatch's backward with one load; gradients accumulate over microbatches. Outputs are
    combined: 0-dim tensors (losses) are *averaged* over microbatches, other tensors are
    concatenated along dim 0, non-tensors are taken from the first microbatch. The average of
    per-microbatch losses equals the full-batch loss only for mean-reduced losses whose
    microbatches hold the same number of counted elements (e.g. HF GPT-2's ``labels`` loss when
    no label is ``-100``; with ignored labels spread unevenly it differs). Sum-reduced losses
    come out divided by ``num_microbatches``.

Modules: :mod:`.slicing` (the graph cut into slices), :mod:`.runtime` (loading, prefetch, the two
ways back for backward), :mod:`.driver` (the generated driver code), :mod:`.module` (the returned
:class:`OffloadedModule`), :mod:`.residency` (how many slices are resident at once).

Limits: the code is specialised to the example input shapes (and the train/eval mode at
capture); buffers and lifted constants are copied to the device once and stay resident (they are
not trained, and the captured graph must not mutate them: no BatchNorm statistics updates in
train mode); saved-tensor hooks active outside the module are bypassed inside non-checkpointed
slices; ``torch.device('cpu')`` constants in the graph (``arange(..., device='cpu')``) are
rewritten to the target device.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from ..exported import export_program
from .driver import driver_code
from .module import OffloadedModule
from .residency import ResidencyTracker
from .runtime import SliceRuntime
from .slicing import OffloadError, SlicePlan, slice_graph

__all__ = ["OffloadError", "OffloadedModule", "ResidencyTracker", "SlicePlan", "offload_parameters"]


def _split_example(flat: list[Any], m: int) -> tuple[list[Any], int | None]:
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    if m == 1:
        return flat, batch
    if batch is None:
        raise OffloadError("num_microbatches > 1 needs a tensor input with a batch dim (dim 0)")
    if batch % m:
        raise OffloadError(f"the batch size {batch} (dim 0 of the first tensor input) is not divisible "
                           f"by num_microbatches={m}")
    out = [x[: batch // m] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch else x
           for x in flat]
    return out, batch


def offload_parameters(model: nn.Module, example_args: Any, example_kwargs: Mapping[str, Any] | None = None, *,
                       num_slices: int, device: str | torch.device | None = None, num_microbatches: int = 1,
                       checkpoint_activations: bool = False, prefetch: bool | None = None,
                       tracker: ResidencyTracker | None = None) -> OffloadedModule:
    """Train ``model`` with its parameters on the host, streamed to ``device`` slice by slice.

    Args:
        model: the module, with its parameters on the CPU (they stay there; on CUDA they are
            pinned in place, the ``Parameter`` objects are kept).
        example_args, example_kwargs: inputs with the shapes the result will be called with.
        num_slices: how many contiguous slices of the graph to stream (>= 1, at most the number
            of places where the graph can be cut: nodes that use parameters).
        device: where slices compute; default ``"cuda"`` if available, else ``"cpu"``.
        num_microbatches: split the batch (dim 0) into this many microbatches per slice load.
        checkpoint_activations: keep only slice inputs and recompute each slice in backward.
        prefetch: copy the next slice's parameters while the current one computes (default: on
            CUDA only); at most two slices are then resident.
        tracker: a :class:`ResidencyTracker` to update (default: a new one).

    Returns:
        An :class:`OffloadedModule` computing what ``model`` computes.

    Raises:
        OffloadError: bad ``num_slices``/``num_microbatches``, a graph ``torch.export`` cannot
            capture, or graph features this runtime does not handle (state mutation).
    """
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise OffloadError(f"num_slices must be a positive int, got {num_slices!r}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise OffloadError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if prefetch is None:
        prefetch = device.type == "cuda"
    off_host = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
    if off_host:
        raise OffloadError(f"model parameters must be on the CPU (the host copy), found {off_host}; "
                           "call model.cpu() first")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    kwargs = dict(example_kwargs or {})
    flat, in_spec = pytree.tree_flatten((example_args, kwargs))
    mb_flat, batch = _split_example(flat, num_microbatches)
    mb_args, mb_kwargs = pytree.tree_unflatten(mb_flat, in_spec)
    ep = export_program(model, tuple(mb_args), dict(mb_kwargs), OffloadError)
    if device.type == "cuda":
        for p in model.parameters():
            if not p.is_pinned():
                p.data = p.data.pin_memory()
    rt, driver, code = _build(model, ep, num_slices, device, num_microbatches, checkpoint_activations,
                              prefetch, tracker or ResidencyTracker())
    return OffloadedModule(model, rt, driver, code, ep.call_spec.in_spec, ep.call_spec.out_spec, flat, batch)


def _build(model: nn.Module, ep: ExportedProgram, num_slices: int, device: torch.device, m: int,
           checkpoint: bool, prefetch: bool, tracker: ResidencyTracker) -> tuple[SliceRuntime, Callable, str]:
    sliced = slice_graph(model, ep, num_slices, device)
    plans, modules = sliced.plans, sliced.modules
    rt = SliceRuntime(plans, modules, sliced.states, device, m, checkpoint, prefetch, tracker)
    code, driver = driver_code(plans, sliced.user_inputs, sliced.out_node, prefetch, checkpoint, m, device)
    full = code + "".join(f"\n\n# ---- self.slices[{p.index}] ----{modules[p.index].code}" for p in plans)
    return rt, driver, full
