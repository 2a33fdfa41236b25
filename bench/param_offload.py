"""Parameter offload: losses vs the plain model, parameter residency, step time.

For num_slices in 2/4/8 (plus one checkpointed + microbatched variant) this trains a small GPT-2
for a few AdamW steps through ``offload_parameters`` and through the plain model, and reports:
the largest loss difference, the most slices / bytes of parameters that had device copies at
once (ResidencyTracker) against the model's total parameter bytes, and the median step time.

On a machine without CUDA the "device" is the CPU: the copies are real, so residency means the
same thing, but the GPU peak (torch.cuda.max_memory_allocated) is only meaningful on a GPU and is
measured only when ``torch.cuda.is_available()``.

    .venv/bin/python bench/param_offload.py [--steps 5] [--layers 8] [--hidden 128]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write  # noqa: E402

from autoshard.models import build_model  # noqa: E402
from autoshard.offload import offload_parameters  # noqa: E402
from autoshard.units import format_bytes  # noqa: E402


def _train(module, params, args, kwargs, steps, device):
    opt = torch.optim.AdamW(module.parameters() if params is None else params, lr=1e-3)
    losses, times = [], []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad()
        loss = module(*args, **kwargs).loss
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    return losses, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    base, args, kwargs = build_model("gpt2-tiny", device="cpu", batch=a.batch, num_layers=a.layers,
                                     n_embd=a.hidden)
    total = sum(p.numel() * p.element_size() for p in base.parameters())

    # plain model on the device (on CUDA: all parameters resident; the peak to beat)
    plain = copy.deepcopy(base).to(device)
    dev_kwargs = {k: v.to(device) for k, v in kwargs.items()}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ref_losses, ref_times = _train(plain, plain.parameters(), args, dev_kwargs, a.steps, device)
    plain_peak = torch.cuda.max_memory_allocated() if cuda else None
    # timed again from a fresh copy at the end (the machine is shared: keep the faster median)
    again = lambda: _train(copy.deepcopy(base).to(device), None, args, dev_kwargs, a.steps, device)[1]  # noqa: E731

    configs = [dict(num_slices=n) for n in (2, 4, 8)]
    configs.append(dict(num_slices=4, checkpoint_activations=True, num_microbatches=2))
    if not cuda:
        configs.append(dict(num_slices=4, prefetch=True))
    rows, results = [], []
    pending = []
    for cfg in configs:
        model = copy.deepcopy(base)
        off = offload_parameters(model, args, kwargs, device=device, **cfg)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        losses, times = _train(off, model.parameters(), args, kwargs, a.steps, device)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        diff = max(abs(x - y) for x, y in zip(losses, ref_losses))
        t = median(times[1:])
        name = f"slices={cfg['num_slices']}" + (" ckpt mb=2" if cfg.get("checkpoint_activations") else "") + \
            (" prefetch" if cfg.get("prefetch") else "")
        res = dict(config=cfg, name=name, losses=losses, max_loss_diff=diff,
                   max_resident_slices=off.tracker.max_slices, planned_max_resident=off.planned_max_resident,
                   max_resident_bytes=off.tracker.max_bytes, total_param_bytes=total,
                   slice_bytes=[p.nbytes for p in off.plan], step_s=t, step_s_all=times, gpu_peak_bytes=peak)
        results.append(res)
        pending.append([name, f"{off.tracker.max_slices} / {off.planned_max_resident}",
                     format_bytes(off.tracker.max_bytes), f"{off.tracker.max_bytes / total:.0%}", format_bytes(total),
                     f"{diff:.1e}", t, format_bytes(peak) if cuda else "n/a"])
    t_ref = min(median(ref_times[1:]), median(again()[1:]))
    rows.append(["plain model", "-", "-", "-", format_bytes(total), "0", f"{t_ref * 1e3:.1f}", "1.00x",
                 format_bytes(plain_peak) if cuda else "n/a"])
    for r in pending:
        t = r.pop(6)
        rows.append(r[:6] + [f"{t * 1e3:.1f}", f"{t / t_ref:.2f}x"] + r[6:])
    note = (f"GPT-2 ({a.layers} layers, hidden {a.hidden}, batch {a.batch}, seq 16), {a.steps} AdamW steps, "
            f"device={device}; step time = median over steps 2..{a.steps} (plain: the faster of two runs, the machine is shared). 'resident' = the most slices (and their "
            "parameter bytes) that had device copies at once, from ResidencyTracker, vs the plan's bound. "
            + ("GPU peak = torch.cuda.max_memory_allocated during training." if cuda else
               "No GPU on this machine: the 'device' is the CPU (copies are real clones, so residency is "
               "meaningful, but the copies cost time and save nothing); the GPU peak column "
               "(torch.cuda.max_memory_allocated) is only meaningful on a GPU and was not measured. "
               "Prefetch is off by default on CPU; the 'prefetch' row exercises its bookkeeping (2 resident)."))
    write("param_offload", dict(device=str(device), reference_losses=ref_losses, reference_step_s=t_ref,
                                total_param_bytes=total, results=results),
          ["config", "resident slices (max / plan)", "resident bytes (max)", "of total", "total params",
           "max |loss diff|", "step ms", "vs plain", "GPU peak"], rows, note)


if __name__ == "__main__":
    main()
