"""`autoshard profile` on real ranks: alpha/beta fitted from real gloo all-reduces."""
import pytest
import torch.distributed as dist

from autoshard.hardware import HardwareProfile
from autoshard.mesh import MeshError
from autoshard.profile import measure_profile


def test_measure_profile_on_four_ranks(tmp_path_factory):
    sizes = [4096 * 16**k for k in range(4)]   # 4 KiB .. 16 MiB, a few iterations: a quick measurement
    prof = measure_profile((2, 2), name="test", sizes=sizes, iters=4, warmup=1)
    assert isinstance(prof, HardwareProfile)
    for link in prof.axes:
        assert link.alpha >= 0 and link.beta > 0
        assert 1e6 < 1 / link.beta < 1e12, "a bandwidth between 1 MB/s and 1 TB/s"
    assert prof.peak_flops["float32"] > 0 and prof.memory_bandwidth > 0
    # every rank reports the same numbers (the max over ranks was agreed collectively)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, prof.to_dict())
    assert all(g["axes"] == gathered[0]["axes"] for g in gathered)
    path = tmp_path_factory.mktemp(f"rank{dist.get_rank()}") / "p.yaml"
    prof.save(path)
    from autoshard.hardware import load_hardware
    assert load_hardware(path).axes == prof.axes


def test_measure_profile_rejects_a_mesh_of_the_wrong_size():
    with pytest.raises(MeshError, match="needs 8 ranks"):
        measure_profile((2, 4), sizes=[4096, 65536], iters=1, warmup=0)
