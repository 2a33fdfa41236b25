"""Where a rank's parameter shards come from, and sharded checkpoints.

Sources: the tensors of a real module (each rank copies its block), a safetensors file (each rank
reads only its block through ``get_slice``), or a ``torch.distributed.checkpoint`` directory (each
rank loads only the chunks that overlap its shards; the directory may have been saved on another
mesh). Saving: :func:`save_checkpoint` writes the sharded state with DCP, every rank its shards.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from ..specs import ShardSpec
from .collectives import MeshComm


def _block(shape: tuple[int, ...], spec: ShardSpec, comm: MeshComm) -> tuple[slice, ...]:
    """Index of this rank's block of a tensor of global ``shape`` under ``spec``."""
    index = []
    for d, axes in enumerate(spec.dims):
        if not axes:
            index.append(slice(None))
            continue
        n = 1
        for a in axes:
            n *= comm.mesh_shape[a]
        size = shape[d] // n
        start = comm.shard_index(axes) * size
        index.append(slice(start, start + size))
    return tuple(index)


def load_local_shards(sources: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec | None], comm: MeshComm,
                      device: torch.device, checkpoint: "str | os.PathLike[str] | None") -> dict[str, torch.Tensor]:
    """This rank's block of every tensor in ``specs`` (FQN -> spec), as new tensors on ``device``."""
    out: dict[str, torch.Tensor] = {}
    from_file = _read_checkpoint(sources, specs, comm, device, checkpoint) if checkpoint is not None else {}
    for fqn, spec in specs.items():
        spec = spec or ShardSpec.replicate(sources[fqn].ndim)
        if fqn in from_file:
            out[fqn] = from_file[fqn]
            continue
        src = sources[fqn]
        if src.is_meta:
            hint = ("it is not in the checkpoint (a non-persistent buffer? materialise it on the model before "
                    "parallelize)" if checkpoint is not None else "pass checkpoint= (a safetensors file or a "
                    "torch.distributed.checkpoint directory) to read the weights from")
            raise ValueError(f"'{fqn}' is on the meta device and {hint}")
        out[fqn] = src.detach()[_block(tuple(src.shape), spec, comm)].to(device, copy=True).contiguous()
    return out


def _read_checkpoint(sources, specs, comm: MeshComm, device, checkpoint) -> dict[str, torch.Tensor]:
    path = Path(checkpoint)
    if path.is_dir():
        return _read_dcp(sources, specs, comm, device, path)
    if path.suffix == ".safetensors":
        return _read_safetensors(sources, specs, comm, device, path)
    raise ValueError(f"checkpoint {str(path)!r} is neither a .safetensors file nor a torch.distributed.checkpoint "
                     f"directory")


def _read_safetensors(sources, specs, comm: MeshComm, device, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for fqn, spec in specs.items():
            if fqn not in keys:
                continue
            sl = f.get_slice(fqn)
            shape = tuple(sl.get_shape())
            if shape != tuple(sources[fqn].shape):
                raise ValueError(f"'{fqn}' has shape {shape} in {path}, the model has {tuple(sources[fqn].shape)}")
            spec = spec or ShardSpec.replicate(len(shape))
            out[fqn] = sl[_block(shape, spec, comm)].to(device).contiguous()
    return out


def _read_dcp(sources, specs, comm: MeshComm, device, path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {}
    for fqn, spec in specs.items():
        spec = spec or ShardSpec.replicate(sources[fqn].ndim)
        local_shape = spec.local_shape(tuple(sources[fqn].shape), comm.mesh_shape)
        local = torch.empty(local_shape, dtype=sources[fqn].dtype, device=device)
        state[fqn] = DTensor.from_local(local, comm.device_mesh, spec.to_placements(2), run_check=False)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    present = {k: v for k, v in state.items() if k in metadata.state_dict_metadata}
    dcp.load(present, checkpoint_id=str(path))
    return {k: v._local_tensor for k, v in present.items()}


def save_checkpoint(pmodel, path: "str | os.PathLike[str]") -> None:
    """Save ``pmodel``'s sharded state with ``torch.distributed.checkpoint`` (collective).

    Load it with ``parallelize(meta_model, plan, mesh, checkpoint=path)`` on any mesh, or with
    :func:`load_checkpoint` into an existing parallel module."""
    import torch.distributed.checkpoint as dcp

    dcp.save(pmodel.sharded_state_dict(), checkpoint_id=str(path))


def load_checkpoint(pmodel, path: "str | os.PathLike[str]") -> None:
    """Load a DCP checkpoint (saved on any mesh) into ``pmodel``'s shards in place (collective)."""
    import torch.distributed.checkpoint as dcp

    state = pmodel.sharded_state_dict()
    dcp.load(state, checkpoint_id=str(path))
