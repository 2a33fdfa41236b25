"""Train a small GPT-2 with an autoshard plan on every rank of a torchrun job.

    torchrun --nproc_per_node=4 examples/train_gpt2.py --mesh 2x2 --steps 30
    torchrun --nproc_per_node=4 examples/train_gpt2.py --plan plan.json     # a plan from `autoshard plan gpt2-mini`

CPU ranks use gloo, GPUs NCCL (one GPU per rank); the code is the same. Rank 0 solves the plan
(``autoshard.plan_once``) and every rank receives it (or every rank loads ``--plan``), and
``autoshard.parallelize`` checks that all ranks hold
the same plan for the same graph before the first step. The data is a synthetic next-token task
(each sequence counts up modulo the vocabulary), so the loss visibly falls within a few dozen steps.
With ``--check`` the same steps run on one device alongside: the largest loss difference is printed
and the script exits with status 1 when it exceeds ``--tolerance`` (relative, default 1e-4).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.models import PRESETS, build_model
from autoshard.plans import Plan


def batches(vocab: int, batch: int, seq: int, seed: int):
    """Sequences ``start, start+1, ...`` (mod vocab) with random starts; labels = inputs (HF shifts them)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        ids = (start + torch.arange(seq)) % vocab
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def get_plan(args, model, example: dict) -> Plan:
    """The plan file on every rank, or one plan solved on rank 0 and handed to every rank."""
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        plan = autoshard.plan_once(model, kwargs=example, mesh=args.mesh, hardware=args.hardware,
                                   memory_budget=args.budget, baseline=args.baseline, outputs=args.outputs,
                                   progress=True)   # the planning rank reports each stage on stderr
    if dist.get_rank() == 0:
        print("\n".join(plan.summary_lines()), flush=True)
    return plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="2x2")
    p.add_argument("--model", default="gpt2-mini", choices=[n for n in PRESETS if n.startswith("gpt2")],
                   help="GPT-2 preset to train (default: %(default)s)")
    p.add_argument("--plan", help="a saved plan (made for --model with the same --batch/--seq)")
    p.add_argument("--hardware", default="h100-nvlink", help="hardware profile to plan for")
    p.add_argument("--budget", default=None, help="per-device memory budget, e.g. 1MiB")
    p.add_argument("--baseline", default=None, choices=["data_parallel", "megatron", "zero3"])
    p.add_argument("--outputs", default="global", choices=["global", "local"],
                   help="local: each rank keeps its shard of the logits (the loop only reads .loss), no gather")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="also train on one device and compare losses")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest relative loss difference from one device --check accepts, "
                        "|loss - single| / |single| (default: %(default)s)")
    args = p.parse_args()

    mesh = autoshard.init_mesh(args.mesh)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, _, example = build_model(args.model, device="cpu", batch=args.batch, seq=args.seq)
    seq = example["input_ids"].shape[1]
    plan = get_plan(args, model, example)
    reference = copy.deepcopy(model) if args.check else None
    pmodel = autoshard.parallelize(model, plan, mesh, progress=True)   # rank 0 reports each stage on stderr
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    if rank == 0:
        lines = pmodel.code.strip("\n").splitlines()
        print(f"\nrank 0 runs this program (the first 20 of its {len(lines)} lines; pmodel.code has all):\n"
              + "\n".join(line[:160] for line in lines[:20]), flush=True)

    data = batches(model.config.vocab_size, args.batch, seq, seed=1)
    worst = 0.0
    for step in range(args.steps):
        batch = next(data)
        start = time.perf_counter()
        with pmodel.comm.counter.recording() if step == 0 else contextlib.nullcontext():
            loss = pmodel(**batch).loss
            loss.backward()
        pmodel.clip_grad_norm_(1.0)      # the global norm over all shards
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        if reference is not None:
            ref_loss = reference(**batch).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, abs(ref_loss.item() - loss.item()) / max(abs(ref_loss.item()), 1e-12))
        if step == 0 and rank == 0:
            report_comm(pmodel, plan)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  {seconds * 1e3:7.1f} ms", flush=True)
    failed = reference is not None and worst > args.tolerance
    if rank == 0 and reference is not None:
        print(f"largest relative loss difference from single-device training over {args.steps} steps: {worst:.2e} "
              f"({'FAILED: above' if failed else 'within'} the tolerance {args.tolerance:g})")
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


def report_comm(pmodel, plan: Plan) -> None:
    measured = pmodel.comm.counter.totals()
    predicted = {(c.kind, tuple(c.axes), c.phase): c.nbytes for c in plan.comm}
    print("communication of step 0 (bytes per device): measured vs plan")
    for key in sorted(set(measured) | set(predicted)):
        got = measured.get(key, (0, 0))[0]
        print(f"  {key[0]:>15} axes {key[1]} {key[2]:>9}: {got:>9} vs {predicted.get(key, 0):>9}"
              f"{'' if got == predicted.get(key, 0) else '  <- differs'}")


if __name__ == "__main__":
    main()
