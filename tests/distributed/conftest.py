"""The distributed suite runs inside ONE torchrun launch: every rank runs pytest on these files.

The process group (gloo) is created once per session; tests build the meshes they need.
Run: OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 --standalone -m pytest tests/distributed -q
"""
import datetime
import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))   # op_cases, runtime_harness
sys.path.insert(1, os.path.dirname(os.path.dirname(__file__)))   # handler_utils


def pytest_configure(config):
    if "RANK" not in os.environ:
        raise pytest.UsageError("tests/distributed must run under torchrun --nproc_per_node=4 "
                                "(see scripts/test.sh)")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if dist.get_world_size() != 4:
        raise pytest.UsageError(f"the distributed suite needs 4 ranks, got {dist.get_world_size()}")


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def rank() -> int:
    return dist.get_rank()
