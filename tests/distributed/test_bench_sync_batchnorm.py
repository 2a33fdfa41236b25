"""The fidelity bench's CPU port of SyncBatchNorm (bench/cpu_sync_batchnorm.py) computes batch norm
over the whole batch: its output, input gradient, parameter gradients (summed over ranks, as DDP
does) and running statistics equal one device's BatchNorm2d on the global batch."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from cpu_sync_batchnorm import convert_sync_batchnorm  # noqa: E402


def test_cpu_sync_batchnorm_equals_batchnorm_on_the_global_batch():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, 5) * 2 + 1
    dy = torch.randn(8, 3, 5, 5)
    ref = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    with torch.no_grad():
        ref[0].weight.uniform_(0.5, 1.5)
        ref[0].bias.uniform_(-1, 1)
    synced = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    synced.load_state_dict(ref.state_dict())

    xg = x.clone().requires_grad_()
    ref(xg).backward(dy)
    mine = x.chunk(world)[rank].clone().requires_grad_()
    y = synced(mine)
    y.backward(dy.chunk(world)[rank])

    with torch.no_grad():
        ref_eval = torch.nn.functional.batch_norm(x, None, None, ref[0].weight, ref[0].bias, True, 0.0, ref[0].eps)
    torch.testing.assert_close(y.detach(), ref_eval.chunk(world)[rank], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.grad, xg.grad.chunk(world)[rank], rtol=1e-5, atol=1e-5)
    for p, q in zip(synced.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(synced[0].running_mean, ref[0].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(synced[0].running_var, ref[0].running_var, rtol=1e-5, atol=1e-6)
