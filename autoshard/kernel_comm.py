"""What a local kernel may ask of the mesh: its coordinate and autograd-aware all-reduces.

Two implementations: the thread-simulated mesh of :mod:`autoshard.verify` (single process) and the
DeviceMesh-backed one of the runtime (torchrun ranks). Kernels are written once against this API.
:class:`LocalComm` is a one-device mesh (every all-reduce is the tensor itself): the profile times
a kernel's local compute with it, the collectives being priced apart.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch


class DeviceComm(Protocol):
    coord: tuple[int, ...]
    mesh_shape: tuple[int, ...]

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                   backward: str = "sum", phase: str | None = None) -> torch.Tensor:
        """All-reduce ``t`` over mesh ``axes``.

        ``op``: 'sum' or 'max' (max is not differentiable: use it on detached tensors).
        ``backward``: 'sum' when every device goes on to use the result for its own part of the
        work (sync-BN statistics: the gradient is the sum of all devices' gradients), 'identity'
        when the downstream work is duplicated on every device (a resolved partial sum).
        ``phase``: what the collective is counted as ('bwd' for one a kernel's own backward runs);
        by default 'fwd', or 'recompute' inside backward.
        """
        ...

    def axis_index(self, axis: int) -> int:
        """This device's position along ``axis``."""
        ...

    def shard_index(self, axes: Sequence[int]) -> int:
        """This device's block index for a dim sharded over ``axes`` (outer axis first)."""
        ...

    def shard_count(self, axes: Sequence[int]) -> int:
        """How many blocks a dim sharded over ``axes`` has."""
        ...


class MeshCoordinates:
    """``axis_index``/``shard_index`` from ``coord`` and ``mesh_shape`` (shared by both implementations)."""

    coord: tuple[int, ...]
    mesh_shape: tuple[int, ...]

    def axis_index(self, axis: int) -> int:
        return self.coord[axis]

    def shard_index(self, axes: Sequence[int]) -> int:
        idx = 0
        for a in axes:                   # outer axis first
            idx = idx * self.mesh_shape[a] + self.coord[a]
        return idx

    def shard_count(self, axes: Sequence[int]) -> int:
        # A loop, not math.prod over a generator: kernels run under torch.compile, and dynamo
        # breaks the graph on a generator passed to a call.
        n = 1
        for a in axes:
            n *= self.mesh_shape[a]
        return n


class LocalComm(MeshCoordinates):
    """A one-device mesh: every all-reduce returns its tensor (there is nobody to reduce with). The
    profile runs kernels that communicate (sync batch norm) with it to time their local compute."""

    coord = (0,)
    mesh_shape = (1,)

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], *, op: str = "sum",
                   backward: str = "sum", phase: str | None = None) -> torch.Tensor:
        return t
