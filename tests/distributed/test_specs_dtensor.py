"""Our spec semantics equal DTensor's on real ranks: same local shard on every rank for every spec."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from autoshard.specs import ShardSpec, all_specs
from autoshard.verify import shard_of

MESHES = [(2, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_every_spec_matches_dtensor_local_shard(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    global_t = torch.arange(4 * 8 * 4, dtype=torch.float32).reshape(4, 8, 4)
    checked = 0
    for spec in all_specs(3, 2):
        if not spec.fits(global_t.shape, mesh_shape):
            continue
        dt = distribute_tensor(global_t, mesh, spec.to_placements(2))
        local = dt.to_local()
        assert tuple(local.shape) == spec.local_shape(global_t.shape, mesh_shape), str(spec)
        assert torch.equal(local, shard_of(global_t, spec, mesh_shape, coord)), str(spec)
        assert ShardSpec.from_placements(dt.placements, 3) == spec
        checked += 1
    assert checked >= 10


def test_partial_spec_redistributes_to_the_sum():
    """A partial spec's placements sum like ours: every rank holds a summand."""
    mesh = init_device_mesh("cpu", (2, 2))
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    local = torch.full((4, 2), float(rank + 1))
    spec = ShardSpec.parse("RR+P01")
    dt = DTensor.from_local(local, mesh, spec.to_placements(2), run_check=False)
    full = dt.full_tensor()
    assert torch.equal(full, torch.full((4, 2), 1.0 + 2 + 3 + 4))
