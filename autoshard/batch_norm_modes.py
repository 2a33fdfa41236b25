"""What training batch norm normalises with: the modes of ``autoshard.plan(..., batch_norm=)``."""
from __future__ import annotations

from .mesh import MeshSpec

__all__ = ["BATCH_NORM_MODES", "batch_norm_groups"]

BATCH_NORM_MODES = ("global", "per_rank")
"""What training batch norm normalises with: ``"global"``, the statistics of the whole batch (the
single-device model's function, whatever the plan); ``"per_rank"``, the statistics of each of
mesh-size equal, consecutive slices of the batch (torch DDP's function: every rank normalises its
own share of the batch)."""


def batch_norm_groups(mode: str, mesh: MeshSpec) -> int:
    """Slices of the batch that training batch norm takes statistics over under ``mode``."""
    if mode not in BATCH_NORM_MODES:
        raise ValueError(f"batch_norm must be one of {', '.join(repr(m) for m in BATCH_NORM_MODES)}, got {mode!r}")
    return mesh.size if mode == "per_rank" else 1
