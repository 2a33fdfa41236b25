"""Runtime speed: autoshard's parallel module vs hand-written PyTorch parallelism, measured on gloo ranks.

Three measurements, each a training step (forward + backward + AdamW step, fp32, dropout 0) timed
between two barriers on every rank (rank 0's wall time of a step is then the slowest rank's),
medians of interleaved rounds (every configuration runs a few steps in turn, so load on the
machine from other processes hits all configurations alike):

1. Megatron TP+DP on a 2x2 mesh (4 gloo ranks): autoshard running its ``baseline="megatron"`` plan
   vs the same plan written by hand with DTensor: ``parallelize_module`` on the TP sub-mesh (axis 1:
   q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, vocab-parallel embedding
   ``RowwiseParallel``, LM head ``ColwiseParallel`` with the logits gathered) and DDP over the DP
   sub-mesh (axis 0) via ``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``.
   Model: Llama, not GPT-2: HF GPT-2 uses ``Conv1D`` (weight ``[in, out]``), which
   ``ColwiseParallel``/``RowwiseParallel`` reject, and its fused ``c_attn`` is sharded contiguously
   by the Megatron baseline (q | k | v columns split in halves, not by head), which no stock
   DTensor style reproduces. Llama has separate ``nn.Linear`` q/k/v projections, so the standard
   DTensor TP plan is exactly the baseline's parameter layouts.
2. autoshard's solved plan (free optimum for the ``cpu-gloo`` profile) vs
   ``DistributedDataParallel`` over all 4 ranks (GPT-2 and Llama), both keeping each rank's shard of
   the logits (``outputs="local"``); one more row gathers GPT-2's logits to every rank (the default).
4. autoshard's ``baseline="zero3"`` plan vs torch FSDP2 (``fully_shard`` per transformer block,
   then the root, over all 4 ranks), both keeping each rank's shard of the logits.
3. Runtime overhead: a 1x1 mesh (one rank) running the solved plan vs the plain module.

Run: python bench/runtime_speed.py [--rounds 8] [--steps 4] [--warmup 3] [--no-profile]
(launches torchrun twice: 4 ranks for 1-2, 1 rank for 3; OMP_NUM_THREADS=1, malloc keeping freed
memory: see bench/_common.py KEEP_FREED_MEMORY).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH, SEQ = 8, 128
HARDWARE = "cpu-gloo"
MODELS = {
    "llama": ("llama-tiny", dict(hidden_size=128, intermediate_size=512, num_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=SEQ)),
    "gpt2": ("gpt2-tiny", dict(n_embd=128, num_layers=4, n_head=4, n_positions=SEQ, vocab_size=2048)),
}


# -- shared helpers (run on every rank) ----------------------------------------------------------------

def build(model_key: str):
    from autoshard.models import build_model

    preset, overrides = MODELS[model_key]
    model, _, kwargs = build_model(preset, device="cpu", batch=BATCH, seq=SEQ, dropout=0.0, **overrides)
    return model, kwargs


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class Config:
    """One thing to time: ``step()`` runs forward + backward + optimizer step and returns the loss.

    ``loss_group``: the process group over which the loss is a per-rank mean of an equal share of
    the batch (DDP ranks); the very first step's loss is averaged over it, so that every
    configuration's step-0 loss is the global batch's loss (a check that they train the same model)."""

    def __init__(self, name: str, model_key: str, module: torch.nn.Module, inputs: dict, params,
                 extra: dict | None = None, loss_group: Any = None, foreach: bool | None = None) -> None:
        self.name, self.model_key, self.module, self.inputs = name, model_key, module, inputs
        self.opt = torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
        self.times: list[float] = []
        self.settle_times: list[float] = []       # the untimed steps at the start of each turn, timed anyway
        self.unmeasured_turns = 0                 # back-to-back turns without a moment every rank was stepping
        self.phases: list[tuple[float, float, float]] = []
        self.first_loss: float | None = None
        self.loss_group = loss_group
        self.extra = extra or {}

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = self.module(**self.inputs).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.phases.append((t1 - t0, t2 - t1, t3 - t2))
        value = loss.detach()
        if self.first_loss is None:
            if self.loss_group is not None:
                import torch.distributed as dist

                value = value.clone()
                dist.all_reduce(value, group=self.loss_group)
                value /= dist.get_world_size(self.loss_group)
            self.first_loss = float(value)
        return float(value)

    def shared(self, name: str, foreach: bool) -> "Config":
        """The same module with another optimizer (e.g. ``foreach=True``)."""
        cfg = Config(name, self.model_key, self.module, self.inputs, self.module.parameters(), dict(self.extra),
                     self.loss_group, foreach)
        cfg.first_loss = float("nan")       # the module has trained already: no step-0 loss to compare
        return cfg


LOOP_TIMING = ("back to back as a training loop runs them, each configuration's turn (after its untimed "
               "settle steps and a barrier) timed as one: the job's step while every rank was stepping, from the "
               "last rank's start to the first rank's end of the turn, over the mean of the steps the ranks made in it")
"""How :func:`run_rounds` times back-to-back steps, for the benches' notes."""


def timed_step(cfg: Config, barrier: Callable[[], None], into: list[float] | None = None) -> None:
    barrier()
    t0 = time.perf_counter()
    cfg.step()
    barrier()
    (cfg.times if into is None else into).append(time.perf_counter() - t0)
    if into is not None:
        cfg.phases.pop()             # the phase medians are of the timed steps only


def run_rounds(configs: list[Config], warmup: int, rounds: int, steps: int, barrier, settle: int = 0,
               back_to_back: bool = False) -> None:
    """``warmup`` untimed steps per configuration, then ``rounds`` rounds in which every configuration
    runs ``settle`` untimed steps (its caches and allocator back to its own steady state after the
    others ran) and ``steps`` timed ones.

    Timed steps are each between two barriers (:func:`timed_step`; one time per step), or, with
    ``back_to_back``, run as a training loop runs them: a barrier starts the configuration's turn, its
    steps follow each other with nothing between them, and the turn gives one time, the job's step
    while every rank was stepping (:func:`_loop_turn`). A barrier after every
    step adds what the ranks drifted apart in the step's last stretch without a collective (its
    optimizer step) and the barrier itself (1-2 ms on 4
    gloo ranks sharing 2 cores: cnn-16's data-parallel step 18.9 ms between barriers, 17.4 back to back),
    which a loop does not pay: its next step's first collective absorbs the drift."""
    for cfg in configs:
        for _ in range(warmup):
            cfg.step()
        barrier()
    for cfg in configs:
        cfg.phases.clear()
    for r in range(rounds):
        # each round starts at another configuration, so that none always follows the same one
        # (a configuration run right after a memory-hungry one measured up to 30% slower)
        k = r % len(configs)
        for cfg in configs[k:] + configs[:k]:
            if back_to_back:
                _loop_turn(cfg, barrier, settle, steps)
                continue
            for _ in range(settle):
                timed_step(cfg, barrier, into=cfg.settle_times)
            for _ in range(steps):
                timed_step(cfg, barrier)


def _loop_turn(cfg: Config, barrier: Callable[[], None], settle: int, steps: int) -> None:
    """One configuration's turn: ``settle`` untimed steps (each step's time, from the moment the first
    rank left the barrier or the last rank ended the step before to the moment the last rank ends it,
    to ``cfg.settle_times``), a barrier, then ``steps`` back-to-back steps timed as one: the job's
    step while every rank was stepping (:func:`busy_step`) to ``cfg.times``, their phases to
    ``cfg.phases``.

    Not from the first to the last rank's end: after a rank's last step it waits in the closing
    barrier and, where ranks share cores, leaves its core to the others, whose last steps then run
    faster than a training loop's, whose ranks never stop. A plan with no collective (every rank the
    whole batch; its ranks drift apart freely) measured 6.2 ms a step that way in turns of 3 steps
    and 10.3 over turns of 24 (cnn-12:8x32, 4 gloo ranks on 2 cores, modeled 10.5). Nor on each
    rank's own clock: the scheduler leaves a rank without a core for up to 180 ms (27 steps of the
    same plan: one rank's first 3 steps took 177 ms, another's 27 took 143), so a rank's own steps
    are timed partly on a core of its own."""
    barrier()
    first_leave = time.perf_counter()
    ends = []
    for _ in range(settle):
        cfg.step()
        ends.append(time.perf_counter())
        cfg.phases.pop()                  # the phase medians are of the timed steps only
    if settle:
        (first_leave,) = _over_ranks([first_leave], "min")
        ends = _over_ranks(ends, "max")
        cfg.settle_times += [end - before for before, end in zip([first_leave, *ends], ends)]
    barrier()
    moments = [time.perf_counter()]
    for _ in range(steps):
        cfg.step()
        moments.append(time.perf_counter())
    barrier()
    step = busy_step(_gathered(moments))
    if step is None:
        cfg.unmeasured_turns += 1
    else:
        cfg.times.append(step)


def busy_step(moments: list[list[float]]) -> float | None:
    """The job's seconds per step while every rank was stepping, from each rank's moments (its start,
    then the end of each step): the window from the last rank's start to the first rank's end of its
    last step, over the mean of the steps the ranks made in it (fractions of a step by linear
    interpolation within it). Where ranks share cores and one has none for a while, the others make
    its steps' worth in its place: the mean is the steps a training loop's ranks make, each in turn
    without a core, in that time. None where there is no such window (a rank ended its steps before
    another started: the scheduler kept one from its core for the whole turn)."""
    t0 = max(m[0] for m in moments)
    t1 = min(m[-1] for m in moments)
    if t1 <= t0:
        return None
    made = statistics.mean(_steps_made(m, t1) - _steps_made(m, t0) for m in moments)
    return (t1 - t0) / made


def _steps_made(moments: list[float], t: float) -> float:
    """Steps a rank had made at moment ``t`` (its start, then the end of each step), fractions by
    linear interpolation within the step ``t`` falls in."""
    k = bisect.bisect_right(moments, t) - 1
    if k >= len(moments) - 1:
        return float(len(moments) - 1)
    return k + (t - moments[k]) / (moments[k + 1] - moments[k])


def _gathered(moments: list[float]) -> list[list[float]]:
    """Every rank's ``moments`` (the same count on each), rank by rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [moments]
    mine = torch.tensor(moments, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _over_ranks(moments: list[float], which: str) -> list[float]:
    """Each of this rank's ``moments`` (``time.perf_counter()``) replaced by the earliest (``"min"``)
    or the latest (``"max"``) over the ranks. The ranks share one host here, whose monotonic clock
    (``perf_counter``) all processes read alike."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return moments
    op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[which]
    t = torch.tensor(moments, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def stats(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs),
            "n": len(xs), "all_ms": [round(1e3 * x, 3) for x in xs]}


def profile_configs(configs: list[Config], steps: int, barrier, top: int = 25) -> dict:
    """torch.profiler over ``steps`` steps of each config (all ranks run them; rank 0's table is kept)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for cfg in configs:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                barrier()
                cfg.step()
        barrier()
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        out[cfg.name] = [{"op": e.key, "calls": e.count // steps,
                          "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                          "total_ms_per_step": e.cpu_time_total / 1e3 / steps} for e in rows]
    return out


def plan_on_rank0(model, kwargs, mesh_shape, baseline, rank: int, outputs: str = "global", hardware: Any = HARDWARE,
                  **options: Any):
    """Rank 0 solves the plan of ``model`` (a module run on ``kwargs``, or a captured graph, then
    ``kwargs`` None); every rank gets it (as in examples/train_gpt2.py). ``options``: more
    ``autoshard.plan`` keywords (``name``, ``batch_norm``, ``loss``, ...)."""
    import torch.distributed as dist

    import autoshard
    from autoshard.plans import Plan

    box: list[Any] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        p = autoshard.plan(model, (), kwargs, mesh=mesh_shape, hardware=hardware, baseline=baseline, outputs=outputs,
                           **options)
        box = [{"plan": p.to_dict(), "seconds": time.perf_counter() - t0}]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, 0)
    return Plan.from_dict(box[0]["plan"]), box[0]["seconds"]


def plan_info(plan, seconds: float) -> dict:
    from collections import Counter

    return {"modeled_ms": {k: 1e3 * v for k, v in plan.time.items()},
            "reshardings": len(plan.reshards), "memory_decisions": dict(Counter(plan.segments.values())),
            "plan_s": seconds, "summary": plan.summary_lines()}


def autoshard_config(name: str, model_key: str, mesh, mesh_shape, baseline, rank: int,
                     outputs: str = "global") -> Config:
    import autoshard

    model, kwargs = build(model_key)
    plan, seconds = plan_on_rank0(model, kwargs, mesh_shape, baseline, rank, outputs)
    pm = autoshard.parallelize(model, plan, mesh)
    cfg = Config(name, model_key, pm, kwargs, pm.parameters(), {"plan": plan_info(plan, seconds)})
    with pm.comm.counter.recording() as counter:      # one step: the collectives this rank runs
        cfg.step()
    totals = counter.totals()
    cfg.extra["collectives_per_step"] = sum(n for _, n in totals.values())
    cfg.extra["comm_bytes_per_step"] = sum(b for b, _ in totals.values())
    cfg.extra["comm"] = {f"{k[0]} axes={list(k[1])} {k[2]}": {"bytes": b, "calls": n} for k, (b, n) in totals.items()}
    return cfg


def ddp_config(name: str, model_key: str, rank: int, world: int) -> Config:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, kwargs = build(model_key)
    local = {k: v.chunk(world, 0)[rank].contiguous() for k, v in kwargs.items()}
    ddp = DDP(model)
    return Config(name, model_key, ddp, local, ddp.parameters(), loss_group=dist.group.WORLD)


def fsdp2_config(name: str, model_key: str, rank: int, world: int) -> Config:
    """torch FSDP2: ``fully_shard`` on every transformer block, then on the root, over all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, kwargs = build(model_key)
    mesh1d = init_device_mesh("cpu", (world,))
    blocks = model.transformer.h if model_key == "gpt2" else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh1d)
    fully_shard(model, mesh=mesh1d)
    local = {k: v.chunk(world, 0)[rank].contiguous() for k, v in kwargs.items()}
    return Config(name, model_key, model, local, model.parameters(), loss_group=dist.group.WORLD)


def hand_megatron_config(name: str, mesh) -> Config:
    """The Megatron baseline written by hand with DTensor: TP on mesh axis 1, DDP on axis 0 (Llama)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, kwargs = build("llama")
    tp, dp = mesh["axis1"], mesh["axis0"]
    layout: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),    # vocab-parallel embedding
        "lm_head": ColwiseParallel(output_layouts=Replicate()),             # vocab-sharded head, logits gathered
    }
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}"
        for col in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            layout[f"{pre}.{col}"] = ColwiseParallel()
        for row in ("self_attn.o_proj", "mlp.down_proj"):
            layout[f"{pre}.{row}"] = RowwiseParallel()
    parallelize_module(model, tp, layout)
    _pre_dp_module_transform(model)
    ddp = DDP(model, process_group=dp.get_group())
    d = dp.get_local_rank()
    local = {k: v.chunk(dp.size(), 0)[d].contiguous() for k, v in kwargs.items()}
    return Config(name, "llama", ddp, local, ddp.parameters(), loss_group=dp.get_group())


# -- workers (run under torchrun) -------------------------------------------------------------------------

def worker_mesh(args) -> dict:
    """4 ranks, 2x2 mesh: (1) autoshard megatron vs DTensor hand plan, (2) autoshard solved vs DDP."""
    import torch.distributed as dist

    import autoshard

    mesh = autoshard.init_mesh((2, 2))
    rank, world = dist.get_rank(), dist.get_world_size()
    barrier = dist.barrier
    t0 = time.perf_counter()
    as_meg = autoshard_config("llama autoshard megatron", "llama", mesh, (2, 2), "megatron", rank)
    hand = hand_megatron_config("llama DTensor hand megatron", mesh)
    configs = [
        as_meg, hand,
        as_meg.shared("llama autoshard megatron, AdamW foreach", True),
        # (2): each rank keeps its shard of the logits, as under DDP (the loss is global either way)
        autoshard_config("llama autoshard solved", "llama", mesh, (2, 2), None, rank, "local"),
        autoshard_config("llama autoshard data_parallel", "llama", mesh, (2, 2), "data_parallel", rank, "local"),
        ddp_config("llama DDP", "llama", rank, world),
        autoshard_config("gpt2 autoshard solved", "gpt2", mesh, (2, 2), None, rank, "local"),
        autoshard_config("gpt2 autoshard data_parallel", "gpt2", mesh, (2, 2), "data_parallel", rank, "local"),
        autoshard_config("gpt2 autoshard solved, global outputs", "gpt2", mesh, (2, 2), None, rank),
        ddp_config("gpt2 DDP", "gpt2", rank, world),
        # (4): ZeRO-3 / FSDP, each rank keeping its shard of the logits
        autoshard_config("llama autoshard zero3", "llama", mesh, (2, 2), "zero3", rank, "local"),
        fsdp2_config("llama FSDP2", "llama", rank, world),
        autoshard_config("gpt2 autoshard zero3", "gpt2", mesh, (2, 2), "zero3", rank, "local"),
        fsdp2_config("gpt2 FSDP2", "gpt2", rank, world),
    ]
    setup_s = time.perf_counter() - t0
    run_rounds(configs, args.warmup, args.rounds, args.steps, barrier)
    names = ("llama autoshard megatron", "llama DTensor hand megatron", "llama autoshard data_parallel", "llama DDP")
    summaries = [summary(c) for c in configs]
    prof = profile_configs([c for c in configs if c.name in names], 3, barrier) if args.profile else {}
    return {"world_size": world, "setup_s": setup_s, "configs": summaries, "profile": prof}


def worker_single(args) -> dict:
    """1 rank, 1x1 mesh: the runtime's overhead over the plain module."""
    import torch.distributed as dist

    import autoshard

    mesh = autoshard.init_mesh((1, 1))
    rank = dist.get_rank()
    configs = []
    for key in ("gpt2", "llama"):
        model, kwargs = build(key)
        plain = Config(f"{key} plain module", key, model, kwargs, model.parameters())
        pm = autoshard_config(f"{key} autoshard 1x1", key, mesh, (1, 1), None, rank)
        configs += [plain, pm, plain.shared(f"{key} plain module, AdamW foreach", True),
                    pm.shared(f"{key} autoshard 1x1, AdamW foreach", True)]
    run_rounds(configs, args.warmup, args.rounds, args.steps, dist.barrier)
    summaries = [summary(c) for c in configs]
    prof = profile_configs([c for c in configs if c.name.startswith("llama") and "foreach" not in c.name], 3,
                           dist.barrier) if args.profile else {}
    return {"world_size": 1, "configs": summaries, "profile": prof}


def summary(cfg: Config) -> dict:
    """Rank 0's view of one configuration (phases: forward / backward / optimizer step of the timed
    steps, rank 0's clock, no barrier between them, so a phase includes waiting for other ranks)."""
    if not cfg.times:
        raise RuntimeError(f"{cfg.model_key} {cfg.name}: no timed step ({cfg.unmeasured_turns} back-to-back turns "
                           "without a moment every rank was stepping): time more rounds or steps per turn")
    phases = {k: 1e3 * statistics.median(p[i] for p in cfg.phases) for i, k in enumerate(("fwd", "bwd", "opt"))}
    settle = {"settle_median_ms": 1e3 * statistics.median(cfg.settle_times)} if cfg.settle_times else {}
    unmeasured = {"unmeasured_turns": cfg.unmeasured_turns} if cfg.unmeasured_turns else {}
    return {"name": cfg.name, "model": cfg.model_key, **stats(cfg.times), **settle, **unmeasured, "phase_median_ms": phases,
            "first_loss": None if cfg.first_loss != cfg.first_loss else cfg.first_loss, **cfg.extra}


def worker_main(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {"mesh": worker_mesh, "single": worker_single}[args.worker](args)
    if dist.get_rank() == 0:
        result["torch_threads"] = torch.get_num_threads()
        result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
        Path(args.out).write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------------------------

def launch(worker: str, nproc: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(Path(__file__).resolve()), "--worker", worker, "--out", str(out), "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + ([] if args.profile else ["--no-profile"])
        sys.path.insert(0, str(HERE))
        from _common import rank_env

        env = rank_env(ROOT)
        print("$", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, cwd=ROOT)
        data = json.loads(out.read_text())
        data["wall_s"] = time.perf_counter() - t0
        return data


def by_name(result: dict) -> dict:
    return {c["name"]: c for c in result["configs"]}


def driver(args) -> int:
    sys.path.insert(0, str(HERE))
    from _common import write

    mesh = launch("mesh", 4, args)
    single = launch("single", 1, args)
    m, s = by_name(mesh), by_name(single)

    def ratio(a: dict, b: dict) -> float:
        return a["median_ms"] / b["median_ms"]

    comparisons = [
        ("(1) Megatron TP+DP, 2x2", "llama autoshard megatron", "llama DTensor hand megatron", m, 1.0),
        ("(1) same, autoshard with AdamW(foreach=True)", "llama autoshard megatron, AdamW foreach",
         "llama DTensor hand megatron", m, 1.0),
        ("(2) solved plan vs DDP, 2x2", "gpt2 autoshard solved", "gpt2 DDP", m, None),
        ("(2) solved plan vs DDP, 2x2", "llama autoshard solved", "llama DDP", m, None),
        ("(2') autoshard's data_parallel plan vs DDP", "gpt2 autoshard data_parallel", "gpt2 DDP", m, None),
        ("(2') autoshard's data_parallel plan vs DDP", "llama autoshard data_parallel", "llama DDP", m, None),
        ("(2'') solved plan with the logits gathered to every rank vs DDP", "gpt2 autoshard solved, global outputs",
         "gpt2 DDP", m, None),
        ("(4) ZeRO-3 plan vs FSDP2 (fully_shard per block), 2x2", "gpt2 autoshard zero3", "gpt2 FSDP2", m, 1.05),
        ("(4) ZeRO-3 plan vs FSDP2 (fully_shard per block), 2x2", "llama autoshard zero3", "llama FSDP2", m, 1.05),
        ("(3) runtime overhead, 1x1", "gpt2 autoshard 1x1", "gpt2 plain module", s, 1.05),
        ("(3) runtime overhead, 1x1", "llama autoshard 1x1", "llama plain module", s, 1.05),
        ("(3) same, both AdamW(foreach=True)", "gpt2 autoshard 1x1, AdamW foreach", "gpt2 plain module, AdamW foreach",
         s, 1.05),
        ("(3) same, both AdamW(foreach=True)", "llama autoshard 1x1, AdamW foreach",
         "llama plain module, AdamW foreach", s, 1.05),
    ]
    rows, checks = [], []
    for what, a, b, res, target in comparisons:
        r = ratio(res[a], res[b])
        ok = "-" if target is None else ("yes" if r <= target else "NO")
        checks.append({"comparison": what, "autoshard": a, "reference": b, "ratio": r, "target": target,
                       "met": None if target is None else r <= target,
                       "loss_diff_first_step": None if None in (res[a]["first_loss"], res[b]["first_loss"])
                       else abs(res[a]["first_loss"] - res[b]["first_loss"])})
        fmt = lambda c: f"{c['median_ms']:.1f} ({c['min_ms']:.1f}-{c['max_ms']:.1f})"  # noqa: E731
        diff = checks[-1]["loss_diff_first_step"]
        rows.append([what, a, fmt(res[a]), b, fmt(res[b]), f"{r:.2f}x",
                     "-" if target is None else f"<= {target:.2f}x", ok, "-" if diff is None else f"{diff:.1e}"])
    env = {"torch": torch.__version__, "OMP_NUM_THREADS": mesh.get("omp_num_threads"),
           "torch_threads_per_rank": mesh.get("torch_threads"), "backend": "gloo", "cpus": os.cpu_count(),
           "loadavg_at_end": os.getloadavg()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    data = {"settings": {"batch": BATCH, "seq": SEQ, "hardware_profile": HARDWARE, "models": MODELS,
                         "rounds": args.rounds, "steps_per_round": args.steps, "warmup": args.warmup,
                         "timing": "barrier; forward+backward+AdamW step+zero_grad; barrier (rank 0 wall time)"},
            "environment": env, "comparisons": checks, "mesh_2x2": mesh, "single_rank": single}
    note = ("Step = forward + backward + AdamW step, fp32, batch 8 x seq 128 (global), median (min-max) ms of "
            f"{args.rounds} interleaved rounds x {args.steps} steps after {args.warmup} warm-up steps, gloo, "
            "OMP_NUM_THREADS=1, glibc malloc keeping freed memory (GLIBC_TUNABLES, see bench/_common.py), one torchrun launch for the 2x2 rows and one (1 rank) for the 1x1 rows. "
            "(1) uses Llama: HF GPT-2's Conv1D layers are not nn.Linear, which DTensor's Colwise/RowwiseParallel "
            "require. (2) and (2') plans are made with outputs='local' (each rank keeps its shard of the logits, "
            "as under DDP; the loss is global); (2'') and (1) gather the outputs (outputs='global', the default). "
            "Models: " + ", ".join(f"{k}: {p} {o}" for k, (p, o) in MODELS.items()) + ".")
    detail = ["", "Every configuration (rank 0; phases are medians on rank 0's clock without barriers between them, "
              "so a phase includes waiting for the other ranks; collectives: autoshard's own count for one step):", "",
              "| launch | configuration | median ms | min-max ms | fwd / bwd / opt ms | collectives/step | plan "
              "(memory decisions, reshardings, modeled ms) | step-0 loss |", "|---|---|---|---|---|---|---|---|"]
    for label, res in (("2x2", mesh), ("1x1", single)):
        for c in res["configs"]:
            ph = c["phase_median_ms"]
            pl = c.get("plan")
            plan_text = "-" if pl is None else (f"{' '.join(f'{n} {k}' for k, n in pl['memory_decisions'].items())}, "
                                                 f"{pl['reshardings']}, {pl['modeled_ms']['total']:.0f}")
            detail.append(f"| {label} | {c['name']} | {c['median_ms']:.1f} | {c['min_ms']:.1f}-{c['max_ms']:.1f} | "
                          f"{ph['fwd']:.0f} / {ph['bwd']:.0f} / {ph['opt']:.0f} | {c.get('collectives_per_step', '-')} | "
                          f"{plan_text} | {'-' if c['first_loss'] is None else format(c['first_loss'], '.5f')} |")
    write("runtime_speed", data, ["comparison", "autoshard", "ms", "reference", "ms", "ratio", "target", "met",
                                  "step-0 loss diff"], rows, note + "\n" + "\n".join(detail))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the torch.profiler tables (3 steps of the main configurations, rank 0)")
    ap.add_argument("--worker", choices=["mesh", "single"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
