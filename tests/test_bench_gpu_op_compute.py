"""The GPU compute bench's CPU side: pricing an op as the planner does, and folding a one-GPU
measurement into a profile whose links come from elsewhere."""
import argparse
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_op_compute  # noqa: E402

from autoshard import load_hardware  # noqa: E402

MEASURED = ROOT / "bench" / "results" / "gpu_op_compute-profile.yaml"


@pytest.mark.parametrize("family, dtype", [("matmul", "float32"), ("attention", "bfloat16"), ("norm", "float32"),
                                           ("pointwise", "bfloat16"), ("matmul_unaligned", "bfloat16")])
def test_an_op_at_a_measured_size_is_priced_at_its_measured_point(family, dtype):
    """The captured op is looked up at the very work the profile timed it at: the curve's own point."""
    hw = load_hardware(MEASURED)
    sizes = hw.extra["measured"]["compute_sizes"][family]
    curve = hw.compute[dtype][family]
    i = len(sizes) // 2
    fwd, bwd = gpu_op_compute.graph_compute(gpu_op_compute.op_graph(family, sizes[i], gpu_op_compute.DTYPES[dtype]), hw)
    assert fwd == pytest.approx(curve.fwd[i], rel=1e-9) and bwd == pytest.approx(curve.bwd[i], rel=1e-9)


def test_fold_takes_compute_and_keeps_links_memory_and_host_link(tmp_path):
    into = tmp_path / "a100.yaml"
    shutil.copy(ROOT / "configs" / "hardware" / "a100-nvlink.yaml", into)
    before, measured = load_hardware(into), load_hardware(MEASURED)
    args = argparse.Namespace(measured=str(MEASURED), into=str(into), device="a GPU")
    assert gpu_op_compute.fold(args) == 0
    folded = load_hardware(into)
    assert (folded.name, folded.axes, folded.memory_per_device, folded.memory_bandwidth,
            folded.host_device_bandwidth) == (before.name, before.axes, before.memory_per_device,
                                              before.memory_bandwidth, before.host_device_bandwidth)
    assert folded.compute == measured.compute and folded.optimizer == measured.optimizer
    assert folded.peak_flops["bfloat16"] == measured.peak_flops["bfloat16"]
    assert folded.peak_flops["float32"] == measured.peak_flops["float32"]
    assert folded.peak_flops["tfloat32"] == before.peak_flops["tfloat32"]            # not measured: kept
    assert folded.description.startswith(before.description.strip()) and "a GPU" in folded.description
    assert gpu_op_compute.fold(args) == 0                                              # folding again ...
    assert load_hardware(into) == folded                                               # ... changes nothing


def test_measure_refuses_to_run_without_a_gpu_unless_quick(monkeypatch):
    monkeypatch.setattr("autoshard.profile.timing._ensure_initialised", lambda: False)
    monkeypatch.setattr("autoshard.profile.timing._device", lambda: torch.device("cpu"))
    with pytest.raises(SystemExit, match="needs a GPU"):
        gpu_op_compute.main(["measure", "--out", "unused.json"])
