"""What per-batch statistics are taken over: the modes of ``autoshard.plan(..., batch_norm=, loss=)``.

Each has a ``"global"`` mode (the single-device model's function, whatever the plan) and a
``"per_rank"`` mode, torch DDP's function: the batch cut into mesh-size equal, consecutive slices,
one per rank, each with its own statistic.
"""
from __future__ import annotations

from .mesh import MeshSpec

__all__ = ["BATCH_NORM_MODES", "LOSS_MODES", "batch_norm_groups", "loss_groups", "returns_per_rank",
           "op_function_args"]

BATCH_NORM_MODES = ("global", "per_rank")
"""What training batch norm normalises with: ``"global"``, the statistics of the whole batch;
``"per_rank"``, the statistics of each of mesh-size equal, consecutive slices of the batch (torch
DDP's function: every rank normalises its own share of the batch)."""

LOSS_MODES = ("global", "per_rank")
"""What a mean classification loss (cross-entropy, nll) divides by: ``"global"``, the count of the
whole batch's counted targets (non-ignored, or their class weights); ``"per_rank"``, the mean over
mesh-size equal, consecutive slices of the rows of each slice's own mean (torch DDP's function: each
rank's loss is its share's mean, and averaging the gradients over the ranks averages those means).
The two agree where every slice counts as many targets (no ``ignore_index`` hits, equal weights)."""


def _groups(option: str, modes: tuple[str, ...], mode: str, mesh: MeshSpec) -> int:
    if mode not in modes:
        raise ValueError(f"{option} must be one of {', '.join(repr(m) for m in modes)}, got {mode!r}")
    return mesh.size if mode == "per_rank" else 1


def batch_norm_groups(mode: str, mesh: MeshSpec) -> int:
    """Slices of the batch that training batch norm takes statistics over under ``mode``."""
    return _groups("batch_norm", BATCH_NORM_MODES, mode, mesh)


def loss_groups(mode: str, mesh: MeshSpec) -> int:
    """Slices of a mean loss's rows that each take their own mean under ``mode``."""
    return _groups("loss", LOSS_MODES, mode, mesh)


def returns_per_rank(outputs: str, loss: str) -> bool:
    """Whether a plan's graph returns 0-dim outputs (a loss) as each rank's value, whose mean over the
    ranks is the output, as each DDP rank returns its own loss: ``outputs="local"`` with ``loss="per_rank"``."""
    return outputs == "local" and loss == "per_rank"


def op_function_args(mesh: MeshSpec, outputs: str, batch_norm: str, loss: str) -> dict[str, int | bool]:
    """The keywords of :func:`autoshard.handlers.registry.op_info` that these modes set (the same
    when strategies are enumerated and when a plan is lowered); ValueError for an unknown mode."""
    return {"batch_norm_groups": batch_norm_groups(batch_norm, mesh), "loss_groups": loss_groups(loss, mesh),
            "returns_per_rank": returns_per_rank(outputs, loss)}
