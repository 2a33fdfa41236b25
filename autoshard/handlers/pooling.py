"""Pooling: max/avg/adaptive pools over 1, 2 or 3 trailing spatial dims.

Every plane ``x[n, c]`` is pooled on its own, so per mesh axis any leading dim (N, C; C only
for unbatched inputs) may be sharded, the same dim of every output following (max pools'
indices are positions inside a plane, unchanged by sharding N or C). Spatial dims are never
sharded: a window straddles shard borders (halo exchange), and adaptive windows depend on the
global size.
"""
from __future__ import annotations

import torch

from ..opinfo import OpInfo, op_name
from ..strategy import AxisOption
from .registry import register

aten = torch.ops.aten

_SPATIAL_RANK = {
    1: ("max_pool1d", "max_pool1d_with_indices", "avg_pool1d", "adaptive_avg_pool1d",
        "adaptive_max_pool1d"),
    2: ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
        "_adaptive_avg_pool2d", "adaptive_max_pool2d"),
    3: ("max_pool3d", "max_pool3d_with_indices", "avg_pool3d", "adaptive_avg_pool3d",
        "_adaptive_avg_pool3d", "adaptive_max_pool3d"),
}


def _pool_rules(spatial: int):
    def rules(op: OpInfo) -> list[AxisOption]:
        lead = len(op.shape(0)) - spatial
        n_out = len(op.outputs)
        return [AxisOption((d,), (d,) * n_out, f"d{d}") for d in range(lead)]

    rules.__doc__ = f"pool over {spatial} spatial dims: shard a leading (N or C) dim"
    return rules


def _pool_curve(op: OpInfo, *_specs) -> str:
    """Windowed pools have measured curves (on a CPU a 2x2 max pool costs some 40x an add per byte,
    an average pool 15x); adaptive average pools, usually global means, go by the pointwise one."""
    name = op_name(op.node.target).split(".")[1]      # aten.<name>.default
    return "max_pool" if "max_pool" in name else "avg_pool" if name.startswith("avg_pool") else "pooling"


for _rank, _names in _SPATIAL_RANK.items():
    register(*(getattr(aten, name).default for name in _names), family="pooling", curve=_pool_curve,
             doc=f"{_rank}d pooling: shard N or C (the leading dims), never spatial dims"
             )(_pool_rules(_rank))
