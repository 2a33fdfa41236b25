"""``init_mesh``: the process group and torch ``DeviceMesh`` a plan runs on."""
from __future__ import annotations

import datetime
import math
import os
from typing import Sequence

import torch
import torch.distributed as dist

from ..mesh import MeshError, MeshSpec

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def init_mesh(shape: "MeshSpec | Sequence[int] | str | int", *, backend: str | None = None,
              timeout: datetime.timedelta | float = DEFAULT_TIMEOUT):
    """A ``DeviceMesh`` of ``shape`` over all ranks of this job (launched with torchrun).

    Initialises the default process group if needed: NCCL when CUDA is available (each rank on
    ``cuda:LOCAL_RANK``), gloo otherwise. ``timeout`` (a timedelta or seconds) bounds every
    collective of the mesh axes, so a rank that stops answering makes the others fail instead of
    hanging (one that exits makes them fail at once: its connections close). When the default
    process group already exists, its own timeout applies to it; the axis groups still get ``timeout``. Raises
    :class:`~autoshard.mesh.MeshError` when the mesh size differs from the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = MeshSpec.of(shape)
    if not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
            raise MeshError(f"timeout must be a datetime.timedelta or a finite number of seconds, got {timeout!r}")
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise MeshError(f"timeout must be positive (it bounds every collective), got {timeout}")
    if backend not in (None, "nccl", "gloo"):
        raise MeshError(f"backend must be 'nccl', 'gloo' or None (NCCL when CUDA is available), got {backend!r}")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise MeshError("init_mesh needs a distributed launch: run the script with "
                            f"torchrun --nproc_per_node={mesh.size} (RANK/WORLD_SIZE are not set)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(f"mesh {mesh} has {mesh.size} devices but this job has {world} ranks; launch with "
                        f"torchrun --nproc_per_node={mesh.size} (per node) or choose a mesh of {world} devices")
    backend = dist.get_backend()
    device_type = "cuda" if backend == "nccl" else "cpu"
    # The mesh axes get process groups of their own: give them the same timeout (new groups would
    # otherwise take the backend's default, 30 minutes for gloo).
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=("axis0", "axis1"),
                            backend_override={0: (backend, options), 1: (backend, options)})
