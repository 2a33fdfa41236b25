"""CUDA paths on one GPU: memory techniques, mixed precision and compiled execution as a GPU runs them.

The CPU suite runs every path of the runtime on gloo ranks; what it cannot run is CUDA's own code:
offload's pinned host buffers, side-stream copies and prefetch, the caching allocator's peak, bf16
kernels, inductor's GPU code. This bench runs them on one GPU (one rank, NCCL, a 1x1 mesh), for
GPT-2 (the ``gpt2`` preset: 124M's blocks, ``--layers`` of them, batch x seq from the flags) planned
under ``--hardware`` (``h100-nvlink``):

* ``plain module``: the model itself (fp32), the reference;
* ``keep``: the free plan (every block's activations kept);
* ``recompute every block`` / ``offload every block``: the free plan's strategies with every block
  recomputed / offloaded to host memory (priced by ``predict``, as the activation-memory bench's hand
  plans are);
* ``budget``: the ILP at params + grads + optimizer state + ``--fraction`` of the free plan's
  activations (whatever it chooses; a partitioned checkpoint runs as recompute on one device);
* ``mixed precision``: planned and run with FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters,
  fp32 reductions); its reference is FSDP2 (``fully_shard`` per block, then the root, on the same
  GPU) with the same policy;
* ``compiled``: the free plan run with ``parallelize(compile=True)`` (inductor); its reference is
  the eager ``keep`` run.

Each configuration starts from the same weights and trains ``--steps`` AdamW steps on one batch;
measured per configuration: the largest relative loss difference to its reference over those
steps; the saved activations at the end of forward (:class:`SavedTensorMeter`, parameters
excluded) against ``plan.memory['activations']``; bytes copied to host against
``plan.memory['offloaded']``; the CUDA allocator's peak over one whole step
(``max_memory_allocated``, everything the process holds) against ``plan.memory['peak']``; the
median step time (CUDA-synchronised, ``--rounds`` interleaved rounds) against ``plan.time['total']``.

Needs a GPU; writes ``NAME.json`` and ``NAME.md`` into ``--out`` (default ``bench/results``)::

    python bench/gpu_paths.py [--layers 12] [--batch 8] [--seq 512]

``--device cpu`` runs the same on one gloo rank (a dry run of the script, not a measurement of
anything CUDA does).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine  # noqa: E402
from activation_memory import as_run, decision_label, hand_plan  # noqa: E402

import autoshard  # noqa: E402
from autoshard.capture import capture_meta  # noqa: E402
from autoshard.enumerate import enumerate_strategies  # noqa: E402
from autoshard.hardware import load_hardware  # noqa: E402
from autoshard.memory.host_offload import HOST_OFFLOAD_COUNTER  # noqa: E402
from autoshard.models import build_model  # noqa: E402
from autoshard.runtime.memory_meter import SavedTensorMeter  # noqa: E402
from autoshard.solver.costgraph_build import build_cost_graph  # noqa: E402
from autoshard.solver.ilp import InfeasibleBudgetError, SolverOptions, minimum_budget, predict, solve  # noqa: E402

MIB = 2**20
LR = 1e-4


class Run:
    """One configuration: a module to train, its optimizer, and what was measured."""

    def __init__(self, name: str, module: torch.nn.Module, inputs: dict, plan: "autoshard.Plan | None",
                 reference: str | None, note: str = "", reprice: "Callable[[Any], float] | None" = None) -> None:
        self.name, self.module, self.inputs, self.plan = name, module, inputs, plan
        self.reference, self.note = reference, note
        self.reprice = reprice            # modeled step seconds under another profile (the same strategies)
        self.opt = torch.optim.AdamW(module.parameters(), lr=LR)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.memory: dict[str, Any] = {}

    def step(self, device: torch.device) -> float:
        _sync(device)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.module(**self.inputs).loss
        loss.backward()
        self.opt.step()
        _sync(device)
        dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach().float()))
        return dt

    def measure_memory(self, device: torch.device) -> None:
        """One step with the saved-tensor meter around forward and the allocator's peak in each phase
        (forward, backward, optimizer step), less what the other configurations hold meanwhile."""
        params = [*self.module.parameters(), *self.module.buffers()]
        self.opt.zero_grad(set_to_none=True)
        _sync(device)
        cuda = device.type == "cuda"
        held = torch.cuda.memory_allocated(device) if cuda else 0
        others = held - _own_bytes(self.module, self.opt, device)   # constant during this step
        host_before = HOST_OFFLOAD_COUNTER.snapshot()[1]
        peaks = []

        def phase_end() -> None:
            if cuda:
                _sync(device)
                peaks.append(torch.cuda.max_memory_allocated(device) - others)
                torch.cuda.reset_peak_memory_stats(device)

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with SavedTensorMeter(params) as meter:
            loss = self.module(**self.inputs).loss
        phase_end()
        report = meter.report()
        loss.backward()
        phase_end()
        self.opt.step()
        phase_end()
        self.losses.append(float(loss.detach().float()))
        self.memory = {"saved_at_end_of_forward": report.activation_bytes,
                       "host_offload_bytes": HOST_OFFLOAD_COUNTER.snapshot()[1] - host_before,
                       "own_before_step": held - others if cuda else None,
                       "peak_fwd_bwd_opt": peaks or None,
                       "cuda_peak": max(peaks) if peaks else None}


def _own_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` of a module's parameters, buffers, gradients and
    optimizer state (a DTensor's local shard)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            if t.device == device:
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()

    for t in [*module.parameters(), *module.buffers()]:
        add(t)
        add(t.grad)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    return sum(seen.values())


def _host_link(device: torch.device) -> float | None:
    """Bytes/s of a pinned host <-> device copy, the slower direction, as `autoshard profile` times it."""
    if device.type != "cuda":
        return None
    from autoshard.profile.compute import _COPY_BYTES, _copy_seconds

    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    pinned = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    return _COPY_BYTES / max(_copy_seconds(pinned, src, device, 10, 2), _copy_seconds(src, pinned, device, 10, 2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fsdp2(model: torch.nn.Module, policy: Any, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (1,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_runs(a: argparse.Namespace, device: torch.device, mesh: Any) -> list[Run]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = dict(num_layers=a.layers, dropout=0.0)
    torch.manual_seed(0)
    model, args, inputs = build_model("gpt2", device=device, batch=a.batch, seq=a.seq, **config)
    meta_model, meta_args, meta_inputs = build_model("gpt2", device="meta", batch=a.batch, seq=a.seq, **config)
    graph = capture_meta(meta_model, meta_args, meta_inputs, name="gpt2")
    hw = load_hardware(a.hardware)
    options = SolverOptions(memory_budget=None)
    cg = build_cost_graph(enumerate_strategies(graph, mesh_shape=(1, 1), hardware=hw))
    free_solution = solve(cg, options)
    free = autoshard.plan(graph, mesh=(1, 1), hardware=hw)
    blocks = list(free.segments)
    static = free.memory["params"] + free.memory["grads"] + free.memory["optimizer"]
    budget = math.ceil(static + a.fraction * free.memory["activations"])
    budget_note = f"budget {budget / MIB:.0f} MiB"
    try:
        by_budget = autoshard.plan(graph, mesh=(1, 1), hardware=hw, memory_budget=budget)
    except InfeasibleBudgetError:
        budget = int(minimum_budget(cg, options)[0]) + 1
        budget_note = f"infeasible; run at the smallest feasible budget, {budget / MIB:.0f} MiB"
        by_budget = autoshard.plan(graph, mesh=(1, 1), hardware=hw, memory_budget=budget)
    by_budget, changed = as_run(by_budget, cg, free_solution.choice, options)

    def reprice(decisions: dict[str, str]) -> Callable[[Any], float]:
        def under(other: Any) -> float:
            other_cg = build_cost_graph(enumerate_strategies(graph, mesh_shape=(1, 1), hardware=other))
            return predict(other_cg, free_solution.choice, decisions, options)[0].total
        return under

    recompute_all, offload_all = ({s: d for s in blocks} for d in ("recompute", "offload"))
    plans = {
        "keep": (free, ""),
        "recompute every block": (hand_plan(cg, free_solution, recompute_all, options, graph.name), ""),
        "offload every block": (hand_plan(cg, free_solution, offload_all, options, graph.name), ""),
        f"budget {a.fraction:.0%} of activations":
            (by_budget, budget_note + ("; partitioned run as recompute" if changed else "")),
    }

    def fresh() -> torch.nn.Module:
        return copy.deepcopy(model)

    runs = [Run("plain module", fresh(), inputs, None, None)]
    for name, (p, note) in plans.items():
        pm = autoshard.parallelize(fresh(), p, mesh, graph=graph)
        runs.append(Run(name, pm, inputs, p, "plain module", note,
                        reprice(offload_all) if name == "offload every block" else None))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp_plan = autoshard.plan(fresh(), args, inputs, mesh=(1, 1), hardware=hw, mp_policy=policy)
    runs.append(Run("FSDP2, bf16 params", _fsdp2(fresh(), policy, device), inputs, None, None))
    runs.append(Run("mixed precision (bf16 params, fp32 reduce)", autoshard.parallelize(fresh(), mp_plan, mesh),
                    inputs, mp_plan, "FSDP2, bf16 params"))
    compiled = autoshard.parallelize(fresh(), free, mesh, graph=graph, compile=True)
    runs.append(Run("compiled (keep plan)", compiled, inputs, free, "keep"))
    return runs


def measure(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    if "RANK" not in os.environ:         # one process, no torchrun: a group of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    mesh = autoshard.init_mesh((1, 1), backend="nccl" if device.type == "cuda" else "gloo")
    t0 = time.perf_counter()
    runs = build_runs(a, device, mesh)
    print(f"planned and built {len(runs)} configurations in {time.perf_counter() - t0:.1f} s", flush=True)
    for r in runs:          # the loss check: every run trains the same steps from the same weights
        t = time.perf_counter()
        for _ in range(a.steps):
            r.step(device)
        print(f"{r.name}: losses {[round(x, 5) for x in r.losses]} ({time.perf_counter() - t:.1f} s, "
              f"compiling included)", flush=True)
    for r in runs:
        r.measure_memory(device)
    for i in range(a.rounds):
        for r in runs[i % len(runs):] + runs[:i % len(runs)]:
            r.step(device)                       # settle after the previous configuration
            r.times.append(r.step(device))
    host_bw = _host_link(device)
    by_name = {r.name: r for r in runs}
    rows = []
    for r in runs:
        ref = by_name.get(r.reference) if r.reference else None
        n = a.steps
        diff = (max(abs(x - y) / abs(y) for x, y in zip(r.losses[:n], ref.losses[:n])) if ref else None)
        p = r.plan
        rows.append({
            "name": r.name, "reference": r.reference, "note": r.note,
            "decisions": decision_label(p.segments) if p is not None else None,
            "losses": r.losses[:n], "max_rel_loss_diff": diff,
            "measured_ms": 1e3 * statistics.median(r.times),
            "modeled_ms": 1e3 * p.time["total"] if p is not None else None,
            "modeled_ms_measured_host_link": (1e3 * r.reprice(dataclasses.replace(load_hardware(a.hardware),
                                                                                host_device_bandwidth=host_bw))
                                              if r.reprice is not None and host_bw else None),
            "memory": r.memory,
            "planned": ({k: p.memory[k] for k in ("params", "grads", "optimizer", "activations", "peak", "offloaded")
                         if k in p.memory} if p is not None else None),
        })
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "hardware": a.hardware,
            "host_link_bytes_per_s": host_bw,
            "profile_host_link_bytes_per_s": load_hardware(a.hardware).host_device_bandwidth,
            "model": {"preset": "gpt2", "layers": a.layers, "batch": a.batch, "seq": a.seq},
            "steps": a.steps, "rounds": a.rounds, "fraction": a.fraction,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine()}
    dist.destroy_process_group()
    return {"info": info, "rows": rows}


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.0f}"


def _err(modeled: float | None, measured: float | None) -> str:
    if modeled is None or not measured:
        return "-"
    return f"{100 * (modeled - measured) / measured:+.0f}%"


def report(data: dict) -> str:
    info = data["info"]
    lines = ["| configuration | decisions | loss diff (vs) | saved at end of fwd MiB: measured / planned | "
             "to host MiB: measured / planned | CUDA peak MiB: measured / planned | step ms: measured / modeled |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        mem, planned = r["memory"], r["planned"] or {}
        diff = "-" if r["max_rel_loss_diff"] is None else f"{r['max_rel_loss_diff']:.1e} ({r['reference']})"
        saved = f"{_mib(mem.get('saved_at_end_of_forward'))} / {_mib(planned.get('activations'))}"
        host = f"{_mib(mem.get('host_offload_bytes'))} / {_mib(planned.get('offloaded'))}"
        peak = (f"{_mib(mem.get('cuda_peak'))} / {_mib(planned.get('peak'))} "
                f"({_err(planned.get('peak'), mem.get('cuda_peak'))})")
        step = (f"{r['measured_ms']:.1f} / {'-' if r['modeled_ms'] is None else format(r['modeled_ms'], '.1f')} "
                f"({_err(r['modeled_ms'], r['measured_ms'])})")
        other = r.get("modeled_ms_measured_host_link")
        if other is not None:
            step += f"; {other:.1f} ({_err(other, r['measured_ms'])}) with this machine's host link"
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {name} | {r['decisions'] or '-'} | {diff} | {saved} | {host} | {peak} | {step} |")
    m = info["model"]
    lines += ["", f"Measured on {info['device']} (torch {info['torch']}, CUDA {info['cuda']}), {info['date']}; "
              f"GPT-2 preset, {m['layers']} layers of 124M's width, batch {m['batch']} x seq {m['seq']}, fp32 "
              f"unless named; planned under `{info['hardware']}` on a 1x1 mesh (one rank, NCCL). Loss diff: the "
              f"largest relative difference of {info['steps']} AdamW steps' losses to the named reference, from "
              f"the same weights. Saved at end of forward: what autograd holds for backward, parameters excluded "
              f"(SavedTensorMeter). CUDA peak: max_memory_allocated over one whole step (parameters, gradients, "
              f"optimizer state, activations, kernels' transient buffers), less what the other configurations, "
              f"alive in the same process, hold; planned: plan.memory['peak']. Step: "
              f"forward + backward + AdamW step, median of {info['rounds']} interleaved rounds; modeled: "
              f"plan.time['total']"
              + (f"; the profile's host link is {info['profile_host_link_bytes_per_s'] / 1e9:.1f} GB/s, this "
                 f"machine's (pinned copies, the slower direction, as `autoshard profile` times them) "
                 f"{info['host_link_bytes_per_s'] / 1e9:.1f} GB/s" if info.get("host_link_bytes_per_s") else "")
              + ". Errors are (planned - measured) / measured."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.4, help="activation share of the budget plan")
    ap.add_argument("--hardware", default="h100-nvlink")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="gpu_paths")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_paths needs a GPU (or --device cpu for a dry run of the script)")
    data = measure(a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(data, indent=1, default=str))
    md = report(data)
    (a.out / f"{a.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
