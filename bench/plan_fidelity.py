"""Plan fidelity: is the cost model right, and does the plan it picks win when it runs?

In one run, on 4 gloo ranks (2x2 mesh) of this machine:

1. ``autoshard profile`` measures a hardware profile (one torchrun launch); every plan below is
   solved (or re-priced) under THAT profile.
2. One torchrun launch of 4 ranks measures everything else. Per model (GPT-2, Llama, BERT at two
   widths, 4 layers; the ``cnn`` preset at two widths with its cross-entropy loss computed inside
   the captured graph, planned ``batch_norm="per_rank"`` (each rank's share of the batch, as torch
   DDP normalises), and once more, ``cnnsync-16``, with the default global batch statistics; every
   model planned ``loss="per_rank"``, the mean loss torch DDP and FSDP2 compute: each rank's mean
   over its share, averaged), rank 0 makes the autoshard plans and broadcasts them:

   - the four baselines (``baseline="data_parallel" | "megatron" | "zero3" | "replicated"``) and the
     solved plan;
   - the plan solved under budgets of 80%, 60% and 40% of the solved plan's modeled peak (skipped,
     with the solver's message, where infeasible);
   - the plans solved under other profiles (``h100-nvlink`` and the stock ``cpu-gloo``), run as
     they are and re-priced under the measured profile: their strategies are looked up in the
     measured profile's strategy table and priced with ``autoshard.solver.fixed.fixed_solution``
     (``predict`` over that cost graph), with their memory decisions;
   - perturbed plans: every memory decision forced to recompute
     (``SolverOptions(fixed_decision="recompute")``, strategies re-solved), and the solved plan with
     5% and 15% of its cost-graph nodes (at least 3) moved to another strategy at random (seeds 0
     and 1), priced with ``fixed_solution``.

   A plan identical to an earlier one (same strategies, layouts and memory decisions: the solved
   plan is often the data-parallel baseline, or the plan solved under ``cpu-gloo``) is the same
   program: it is run once, listed with that measurement ("same plan as ..."), and counted once in
   the statistics, which are over the distinct plans (two timings of one program would only add
   measurement noise to the rank correlation).

   Every plan runs with ``autoshard.parallelize``; torch DDP and FSDP2 (``fully_shard`` per
   transformer block, then the root, over all 4 ranks) train the same model. A step is forward +
   backward + AdamW step (fp32, dropout 0), timed as a training loop runs it: back to back, a
   configuration's turn of ``--steps`` steps timed as one, the job's step while every rank was
   stepping (from the last rank's start to the first rank's end of the turn, over the mean of the
   steps the ranks made in it: where ranks share cores a rank that ends first leaves its core to the
   others; see ``runtime_speed._loop_turn``); medians of interleaved
   rounds (every configuration runs ``--settle`` untimed steps, then ``--steps`` timed ones, in turn:
   the first step after another configuration ran is slower, from caches and memory the other one
   left, which no training run that keeps one model sees). A model gets at least ``--rounds`` rounds,
   more (up to ``--max-rounds``) where its rounds are short, so that its timed steps last about
   ``--timed-seconds`` (the number of rounds from the last warm-up step of each configuration: a
   CNN's 20 ms steps get as many samples as the machine's noise needs, for the time of a few LM steps). Step 0's
   loss is the mean of the ranks' losses for every configuration (each rank returns its own).

   Right before and right after a model's timing, the middle point of eight of the profile's compute
   curves (matmul, attention, pointwise, norm, conv, conv_unaligned, batch_norm, and view: all dispatch,
   no data moved; ``autoshard.profile.compute.DRIFT_FAMILIES``) is timed again on all
   ranks, as the profile timed it (``autoshard.profile.compute.remeasure_drift``), and reported as time
   now over the profile's: the machine drift. On a shared VM an op's time moves by a third within
   minutes; a model error is one where the machine has not drifted. After the measurements, every plan
   that ran is priced once more under the profile with its compute scaled to that drift, family by
   family (``autoshard.profile.compute.drift_scaled``; the links as measured): what a profile measured
   while the model ran would have modeled. Spearman and errors are reported under both profiles; the
   targets are checked under the measured one.

Per model: Spearman rank correlation of modeled vs measured step time over the distinct autoshard
plans that ran, median and worst |modeled - measured| / measured, the solved plan's measured time over the
fastest measured configuration (DDP and FSDP2 included), checked head to head: the solved plan and
the fastest other configuration of the rounds run again alone, interleaved, for ``--confirm-seconds``
(at most ``--confirm-max-rounds`` rounds), with a 90% bootstrap interval of their ratio (on 4 ranks
sharing 2 cores a 40 ms step's ratio moves +-5% at 48 rounds). Targets: solved/fastest <= 1.05,
Spearman >= 0.9, median error <= 20%. Writes bench/results/plan_fidelity.{json,md,png} and the
measured profile bench/results/fidelity-measured.yaml.

Run: python bench/plan_fidelity.py [--rounds 4] [--max-rounds 24] [--timed-seconds 60] [--steps 3] [--settle 1]
                                    [--warmup 2] [--confirm-seconds 60] [--confirm-max-rounds 96] [--models gpt2-128,cnn-16,gpt2-160:16x64]
     (a model: one of MODELS, or <family>-<width>, either optionally :BATCH or :BATCHxSEQ, see model_sizes)
     python bench/plan_fidelity.py --quick      # smoke test: one model, one round
     python bench/plan_fidelity.py --reanalyse [--name NAME]   # re-price a finished run under its drift
(launches torchrun twice, 4 ranks each, OMP_NUM_THREADS=1 and glibc malloc keeping freed memory,
``_common.KEEP_FREED_MEMORY``: the profile, then all measurements).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import KEEP_FREED_MEMORY, RESULTS, init_gloo_ranks, rank_env, write  # noqa: E402
from runtime_speed import LOOP_TIMING, Config, run_rounds, stats, summary, timed_step  # noqa: E402

MESH = (2, 2)
OUTPUTS = "local"     # autoshard returns each rank's shard of the logits, as DDP does (plan(outputs=...))
WORLD = MESH[0] * MESH[1]
BATCH, SEQ = 8, 128
IMAGE = 64                    # CNN input side
MLP_CLASSES = 10
VOCAB = 2048
PROFILE_NAME = "fidelity-measured"
RESULT_NAME = "plan_fidelity"
OTHER_PROFILES = ("h100-nvlink", "cpu-gloo")
BUDGET_FRACTIONS = (0.8, 0.6, 0.4)
PERTURBATIONS = ((0.05, 0), (0.15, 1))     # (fraction of the cost-graph nodes moved, seed)
PERTURB_MIN = 3
DDP_SYNC_BN = "torch DDP, SyncBatchNorm"     # models with batch norm: statistics of the global batch
TARGETS = {"solved_over_fastest": 1.05, "spearman": 0.9, "median_err": 0.20}


def _gpt2(width: int, seq: int) -> tuple[str, dict]:
    return "gpt2-tiny", dict(n_embd=width, n_head=max(4, width // 64), num_layers=4, n_positions=seq,
                             vocab_size=VOCAB)


def _llama(width: int, seq: int) -> tuple[str, dict]:
    return "llama-tiny", dict(hidden_size=width, intermediate_size=4 * width, num_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=seq)


def _bert(width: int, seq: int) -> tuple[str, dict]:
    return "bert-tiny", dict(hidden_size=width, intermediate_size=4 * width, num_layers=4, num_attention_heads=4,
                             vocab_size=VOCAB, max_position_embeddings=seq)


def _cnn(width: int, seq: int) -> tuple[str, dict]:
    return "cnn", dict(channels=width)


def _mlp(width: int, seq: int) -> tuple[str, dict]:
    """4 linear layers, ``width`` features in, ``4 * width`` hidden, 10 classes: 36 width^2 parameters
    against a batch of 8 rows, a model whose gradients and optimizer outweigh its compute."""
    return "mlp", dict(features=width, hidden=4 * width, out_features=MLP_CLASSES, depth=4)


MODELS: dict[str, tuple[str, dict]] = {
    "gpt2-128": _gpt2(128, SEQ), "gpt2-384": _gpt2(384, SEQ),
    "llama-128": _llama(128, SEQ), "llama-256": _llama(256, SEQ),
    "bert-128": _bert(128, SEQ), "bert-256": _bert(256, SEQ),
    "cnn-16": _cnn(16, IMAGE), "cnn-64": _cnn(64, IMAGE), "cnnsync-16": _cnn(16, IMAGE),
}
QUICK_MODEL = "gpt2-128"
# family -> (its builder, its default second size: an LM's sequence, a CNN's image side; None: a batch only)
_FAMILIES = {"gpt2": (_gpt2, SEQ), "llama": (_llama, SEQ), "bert": (_bert, SEQ), "cnn": (_cnn, IMAGE),
             "cnnsync": (_cnn, IMAGE), "mlp": (_mlp, None)}


class Sizes(NamedTuple):
    """A model's input sizes: ``batch`` (the global batch), ``seq`` (an LM's sequence length, a CNN's
    image side; None for the MLP, which has none)."""

    batch: int
    seq: int | None


def model_sizes(key: str) -> Sizes:
    """The input sizes of ``key``: :data:`BATCH` x :data:`SEQ` for the LMs, :data:`BATCH` images of
    :data:`IMAGE` x :data:`IMAGE` for the CNNs, :data:`BATCH` rows for the MLP, unless the key ends in
    ``:BATCH`` or ``:BATCHxSEQ`` (``gpt2-160:16x64``, ``cnn-32:16x48`` for 48x48 images, ``mlp-256:32``)."""
    family, _ = _family_width(key)
    name, _, suffix = key.partition(":")
    seq = _FAMILIES[family][1]
    if not suffix:
        return Sizes(BATCH, seq)
    m = re.fullmatch(r"(\d+)(?:x(\d+))?", suffix)
    if m is None or int(m[1]) < 1 or (m[2] is not None and int(m[2]) < 1):
        raise ValueError(f"model {key!r}: the sizes after ':' are BATCH or BATCHxSEQ (positive integers), e.g. "
                         f"{name}:16x64")
    if m[2] is not None and seq is None:
        raise ValueError(f"model {key!r}: {family} takes a batch only ({name}:{m[1]})")
    if int(m[1]) % WORLD:
        raise ValueError(f"model {key!r}: batch {m[1]} does not split over the {WORLD} ranks torch DDP runs on")
    return Sizes(int(m[1]), int(m[2]) if m[2] is not None else seq)


def batch_norm_mode(key: str) -> str:
    """What the model's batch norm normalises with (``autoshard.plan(batch_norm=)``): ``cnn-*`` each
    rank's share of the batch, the function torch DDP and FSDP2 compute; every other model
    (``cnnsync-*``, and the LMs, which have no batch norm) autoshard's default, the whole batch's
    statistics (the single-device function, which torch computes with SyncBatchNorm)."""
    return "per_rank" if key.startswith("cnn-") else "global"


LOSS = "per_rank"     # a mean loss is each rank's share's mean, averaged, as DDP and FSDP2 compute it (plan(loss=...))


def function_options(key: str) -> dict[str, str]:
    """The ``autoshard.plan`` options that fix the function a model's plans compute: its batch norm's
    statistics (:func:`batch_norm_mode`) and its mean loss's (:data:`LOSS`)."""
    return {"batch_norm": batch_norm_mode(key), "loss": LOSS}


def model_spec(key: str) -> tuple[str, dict]:
    """The preset and overrides of ``key``: one of :data:`MODELS`, or ``<family>-<width>`` for a width
    the default set does not run (``gpt2-256``, ``llama-192``, ``cnn-32``, ``mlp-512``; width: hidden
    size, the CNN's channels, or the MLP's input features), either optionally with other input sizes
    (``:BATCH`` or ``:BATCHxSEQ``, see :func:`model_sizes`)."""
    if key in MODELS:
        return MODELS[key]
    family, width = _family_width(key)
    return _FAMILIES[family][0](width, model_sizes(key).seq)


def _family_width(key: str) -> tuple[str, int]:
    family, _, width = key.partition(":")[0].rpartition("-")
    if family not in _FAMILIES or not width.isdigit() or int(width) < 1:
        raise ValueError(f"unknown model {key!r}: one of {', '.join(MODELS)}, or <family>-<width> with family "
                         f"one of {', '.join(_FAMILIES)}, either optionally followed by :BATCH or :BATCHxSEQ")
    return family, int(width)


def log(msg: str) -> None:
    print(f"[plan_fidelity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- models (built identically on every rank: same preset, same seed) -------------------------------------

class WithLoss(nn.Module):
    """A model that returns logits (the cnn/mlp presets) with its cross-entropy loss computed inside
    the forward, so that the captured graph, the plan and every configuration include the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), labels)


class LossView(nn.Module):
    """Calls ``inner`` and gives ``.loss`` whether it returns an output with ``.loss`` (the HF LMs)
    or the loss tensor itself (``WithLoss``), as :class:`runtime_speed.Config` expects."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs: Any) -> Any:
        out = self.inner(**inputs)
        return out if hasattr(out, "loss") else SimpleNamespace(loss=out)


def build(key: str) -> tuple[nn.Module, dict]:
    from autoshard.models import build_model

    preset, overrides = model_spec(key)
    sizes = model_sizes(key)
    if preset in ("cnn", "mlp"):
        net, args, _ = build_model(preset, device="cpu", batch=sizes.batch,
                                   **({"seq": sizes.seq} if preset == "cnn" else {}), **overrides)
        classes = net.head[-1].out_features if preset == "cnn" else net.net[-1].out_features
        labels = torch.randint(0, classes, (sizes.batch,), generator=torch.Generator().manual_seed(1))
        return WithLoss(net), {"x": args[0], "labels": labels}
    model, _, kwargs = build_model(preset, device="cpu", batch=sizes.batch, seq=sizes.seq, dropout=0.0, **overrides)
    return model, kwargs


def capture(key: str) -> tuple[Any, int]:
    """The model's aten graph on meta tensors (what every plan of it is made from) and its parameter count."""
    from autoshard.runtime import capture_meta

    model, kwargs = build(key)
    return capture_meta(model, (), kwargs, name=key), n_params(model)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the elements of every ModuleList) for FSDP2's per-block wrapping."""
    return [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- planning (rank 0) ------------------------------------------------------------------------------------

def plan_entry(name: str, kind: str, make: Callable[[], tuple[Any, float | None, dict]]) -> dict:
    """Run ``make`` -> (plan, modeled seconds under the measured profile or None for plan.time, extra)."""
    from autoshard.solver.ilp import InfeasibleBudgetError

    log(f"  planning {name}")
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"name": name, "kind": kind}
    try:
        plan, modeled, extra = make()
        breakdown, peak = extra.pop("_breakdown", None), extra.pop("_peak", None)
        entry.update(extra)
        entry["plan"] = plan.to_dict()
        entry["modeled_s"] = float(plan.time["total"] if modeled is None else modeled)
        entry["modeled_breakdown_ms"] = {k: 1e3 * v for k, v in (breakdown or plan.time).items()}
        entry["modeled_peak_bytes"] = float(plan.memory["peak"] if peak is None else peak)
        entry["decisions"] = _decision_counts(plan.segments)
        entry["reshardings"] = len(plan.reshards)
    except InfeasibleBudgetError as e:
        entry["skipped"] = f"infeasible: {e}"
        log(f"  {name}: skipped ({entry['skipped'][:160]})")
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        entry["error"] = f"planning failed: {type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()
        log(f"  {name}: {entry['error']}")
    entry["plan_s"] = time.perf_counter() - t0
    return entry


def _decision_counts(segments: dict[str, str]) -> str:
    from collections import Counter

    c = Counter(segments.values())
    return " ".join(f"{n}{k[0].upper()}" for k, n in sorted(c.items())) or "-"


def _table_index(table, node) -> int:
    """Index in ``table`` of the strategy a plan's node runs (matched by name and specs)."""
    strategies = table[node.name].strategies
    if len(strategies) == 1:       # e.g. the graph output, whose plan entry records the producers' layouts
        return 0
    for i, s in enumerate(strategies):
        if (s.name == node.strategy and [str(x) for x in s.input_specs] == list(node.inputs)
                and [None if x is None else str(x) for x in s.output_specs] == list(node.outputs)):
            return i
    raise LookupError(f"node {node.name}: strategy {node.strategy} {node.inputs} -> {node.outputs} is not in the "
                      "measured profile's strategy table")


class Repricer:
    """Prices any plan of one graph under the measured profile: the plan's strategies looked up in the
    measured profile's strategy table, priced by ``fixed_solution`` (``ilp.predict``) with the plan's
    memory decisions. Merged cost-graph nodes may not offer a combination a plan made under another
    profile picked (follower merging keeps one follower strategy per producer strategy, chosen by
    cost); then the unmerged cost graph prices it."""

    def __init__(self, graph, hw, options, functions: dict[str, str]) -> None:
        import autoshard
        from autoshard.solver import build_cost_graph

        self.options = options
        self.table = autoshard.enumerate_strategies(graph, mesh_shape=MESH, hardware=hw, outputs=OUTPUTS,
                                                    **functions)
        self.cg = build_cost_graph(self.table)
        self._unmerged = None

    def unmerged(self):
        from autoshard.solver import build_cost_graph

        if self._unmerged is None:
            self._unmerged = build_cost_graph(self.table, merge_followers=False)
        return self._unmerged

    def price(self, plan) -> tuple[Any, str]:
        from autoshard.solver.fixed import fixed_solution

        strategy_of = {name: _table_index(self.table, node) for name, node in plan.nodes.items()}
        try:
            return fixed_solution(self.cg, strategy_of, self.options, plan.segments), "merged"
        except ValueError:
            return fixed_solution(self.unmerged(), strategy_of, self.options, plan.segments), "unmerged"


def budget_points(peak: float, floor: float, fractions: Sequence[float]) -> list[tuple[str, int]]:
    """The budgets the ``budget`` plans are solved under: each fraction of the solved plan's peak
    that the smallest feasible budget (``floor``, the ILP's) allows, and in place of
    each one it does not, a budget spread evenly between the floor and the lowest allowed one (a model
    whose activations dominate its memory has little room below its peak, and would otherwise run
    fewer plans)."""
    allowed = [f for f in fractions if f * peak >= floor]
    points = [(f"budget {round(100 * f)}% of solved peak", int(f * peak)) for f in allowed]
    missing = len(fractions) - len(allowed)
    top = min((f * peak for f in allowed), default=peak)
    for k in range(1, missing + 1):
        budget = floor + (top - floor) * (missing + 1 - k) / (missing + 1)
        points.append((f"budget {100 * budget / peak:.1f}% of solved peak (above the smallest feasible)",
                       int(math.ceil(budget))))
    return points


def make_plans(key: str, graph, hw_path: str) -> list[dict]:
    """Every autoshard plan of one model (rank 0)."""
    import autoshard
    from autoshard.plans import Plan
    from autoshard.plans.build import plan_from_solution
    from autoshard.solver import SolverOptions, solve
    from autoshard.solver.baselines import BASELINES
    from autoshard.solver.fixed import fixed_solution
    from autoshard.solver.ilp import minimum_budget

    hw = autoshard.load_hardware(hw_path)
    options = SolverOptions(memory_budget=int(hw.memory_per_device))    # what autoshard.plan uses by default
    plans: list[dict] = []
    common = dict(mesh=MESH, hardware=hw_path, name=key, outputs=OUTPUTS, **function_options(key))

    def plain(**kw):
        return lambda: (autoshard.plan(graph, **common, **kw), None, {})

    for b in BASELINES:
        plans.append(plan_entry(b, "baseline", plain(baseline=b)))
    plans.append(plan_entry("solved", "solved", plain()))
    solved = plans[-1]
    log("  building the measured profile's cost graph (re-pricing, perturbations)")
    repricer = Repricer(graph, hw, options, function_options(key))
    if "plan" in solved:
        # Self-check: re-pricing the solved plan must give its own modeled time.
        sol, how = repricer.price(Plan.from_dict(solved["plan"]))
        solved["reprice_selfcheck_s"] = sol.time.total
        solved["reprice_selfcheck_rel_err"] = abs(sol.time.total - solved["modeled_s"]) / solved["modeled_s"]
        peak = solved["plan"]["memory"]["peak"]
        floor, _ = minimum_budget(repricer.cg, options)
        for name, budget in budget_points(peak, floor, BUDGET_FRACTIONS):
            plans.append(plan_entry(name, "budget",
                                    lambda b=budget: (autoshard.plan(graph, **common, memory_budget=b), None,
                                                      {"budget_bytes": b})))
    else:
        for f in BUDGET_FRACTIONS:
            plans.append({"name": f"budget {round(100 * f)}% of solved peak", "kind": "budget",
                          "skipped": "the solved plan failed, so there is no peak to scale"})

    for prof in OTHER_PROFILES:
        def other(prof=prof):
            p = autoshard.plan(graph, mesh=MESH, hardware=prof, name=key, outputs=OUTPUTS, **function_options(key))
            sol, how = repricer.price(p)
            return p, sol.time.total, {"solved_under": prof, "modeled_own_profile_s": p.time["total"],
                                       "repriced_on": f"{how} cost graph", "_breakdown": sol.time.to_dict(),
                                       "_peak": sol.memory.peak}
        plans.append(plan_entry(f"solved under {prof}, re-priced", "other_profile", other))

    def all_recompute():
        opts = SolverOptions(memory_budget=options.memory_budget, fixed_decision="recompute")
        sol = solve(repricer.cg, opts)
        return plan_from_solution(repricer.cg, sol, model_name=key, options=opts, budget=opts.memory_budget), None, {}
    plans.append(plan_entry("every segment recomputed (re-solved)", "perturbed", all_recompute))

    def random_strategies(fraction: float, seed: int):
        if "plan" not in solved:
            raise RuntimeError("the solved plan failed; nothing to perturb")
        cg = repricer.cg
        base = Plan.from_dict(solved["plan"])
        graph_choice = {name: _table_index(repricer.table, node) for name, node in base.nodes.items()}
        choice = {}
        for n in cg.nodes.values():     # the CGNode index whose members run the solved strategies
            choice[n.name] = next(c for c in range(len(n))
                                  if all(int(n.member_index[m][c]) == graph_choice[m] for m in n.members))
        movable = sorted(n.name for n in cg.nodes.values() if n.kind == "call_function" and len(n) > 1)
        rng = random.Random(seed)
        k = min(len(movable), max(PERTURB_MIN, round(fraction * len(movable))))
        moved = rng.sample(movable, k)
        for name in moved:
            choice[name] = rng.choice([c for c in range(len(cg.nodes[name])) if c != choice[name]])
        strategy_of = cg.graph_choice(choice)
        sol = fixed_solution(cg, strategy_of, options, base.segments)
        plan = plan_from_solution(cg, sol, model_name=key, options=options, budget=options.memory_budget)
        rep = {n: cg.nodes[n].members[0] for n in moved}      # each moved node's representative graph node
        return plan, None, {"moved_nodes": {n: cg.table[g].strategies[strategy_of[g]].name for n, g in rep.items()}}
    for fraction, seed in PERTURBATIONS:
        plans.append(plan_entry(f"solved, {round(100 * fraction)}% of nodes moved at random", "perturbed",
                                lambda f=fraction, s=seed: random_strategies(f, s)))
    _mark_duplicates(plans)
    return plans


def _mark_duplicates(plans: list[dict]) -> None:
    """``same_as``: an earlier plan with the same strategies and decisions (run once: see the module
    docstring)."""
    seen: dict[str, str] = {}
    for p in plans:
        if "plan" not in p:
            continue
        d = p["plan"]
        key = json.dumps([{n: (v["strategy"], v["inputs"], v["outputs"]) for n, v in d["nodes"].items()},
                          d["segments"]], sort_keys=True)
        if key in seen:
            p["same_as"] = seen[key]
        else:
            seen[key] = p["name"]


# -- configurations (every rank) --------------------------------------------------------------------------

def agree(error: tuple[str, str] | None) -> tuple[str, str] | None:
    """All ranks agree whether a guarded step worked: None, or (the first failing rank's error, its
    traceback)."""
    import torch.distributed as dist

    flags = torch.tensor([0 if error is None else 1])
    dist.all_reduce(flags)
    if int(flags) == 0:
        return None
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e[0]}", e[1]) for r, e in enumerate(errors) if e is not None)


def warm_up_and_count_rounds(configs: list[Config], args: argparse.Namespace) -> int:
    """Run every configuration's warm-up steps (the last one timed) and return the number of rounds
    whose timed steps last about ``args.timed_seconds``, within ``[args.rounds, args.max_rounds]``;
    the same on every rank (from the slowest rank's estimate)."""
    import torch.distributed as dist

    last = []
    for cfg in configs:
        times: list[float] = []
        for _ in range(max(args.warmup, 1)):
            timed_step(cfg, dist.barrier, into=times)
        last.append(times[-1])
    estimate = torch.tensor([args.steps * sum(last)], dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    wanted = math.ceil(args.timed_seconds / max(float(estimate), 1e-9))
    return max(args.rounds, min(args.max_rounds, wanted))


def same_function(loss: float | None, other: float | None) -> bool:
    """Whether two configurations compute the same function, judged by their step-0 losses on the same
    batch (within 1e-5 relative): torch DDP/FSDP2 with per-rank batch-norm statistics do not compute
    a global-statistics plan's function."""
    if loss is None or other is None or loss != loss or other != other:
        return False
    return abs(other - loss) <= 1e-5 * abs(loss)


def solved_config(configs: list[Config], plans: list[dict]) -> Config | None:
    """The configuration that runs the solved plan (None where it did not run)."""
    entry = next((e for e in plans if e["name"] == "solved" and "plan" in e), None)
    by_name = {c.name: c for c in configs}
    return None if entry is None else by_name.get(entry.get("same_as", entry["name"]))


def head_to_head(solved: Config, rivals: list[Config], args: argparse.Namespace) -> dict | None:
    """The solved plan against the fastest of ``rivals`` in the rounds just run, in fresh interleaved
    rounds of those two only (about ``args.confirm_seconds`` of timed steps).

    The fastest of a dozen configurations' medians is biased low (it is the one whose noise ran
    lowest), and more so where several of them are the same program or nearly (the data-parallel
    plan, DDP): a ratio to it overstates the solved plan's loss. Picking the rival on the first
    rounds and measuring the ratio on new ones takes the selection out of the estimate. None where
    there is no rival."""
    import torch.distributed as dist

    if not rivals:
        return None
    pick = [min(range(len(rivals)), key=lambda i: statistics.median(rivals[i].times))]
    dist.broadcast_object_list(pick, 0)           # rank 0's medians decide, as they are reported
    rival = rivals[pick[0]]
    pair = [solved, rival]
    saved = [(c.times, c.phases, c.settle_times) for c in pair]
    for c in pair:
        c.times, c.phases, c.settle_times = [], [], []
    estimate = torch.tensor([args.steps * sum(statistics.median(t) for t, _, _ in saved)], dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    rounds = max(args.rounds, min(args.confirm_max_rounds, math.ceil(args.confirm_seconds / float(estimate))))
    run_rounds(pair, 0, rounds, args.steps, dist.barrier, settle=args.settle, back_to_back=True)
    out = {"solved": solved.name, "rival": rival.name, "rounds": rounds,
           "solved_measured": stats(solved.times), "rival_measured": stats(rival.times)}
    for c, (times, phases, settle) in zip(pair, saved):
        c.times, c.phases, c.settle_times = times, phases, settle
    return out


def confirm_solved(configs: list[Config], plans: list[dict], args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """Head to head of the solved plan against its fastest rival of the rounds, and, where that rival
    computes another function (torch DDP's per-rank batch-norm statistics against a global-statistics
    plan), a second one against the fastest configuration computing the solved plan's function.
    Rank 0's step-0 losses decide which configurations compute that function."""
    import torch.distributed as dist

    solved = solved_config(configs, plans)
    if solved is None:
        return None, None
    others = [c for c in configs if c is not solved]
    overall = head_to_head(solved, others, args)
    if overall is None:
        return None, None
    mine = [[c.name for c in others if same_function(solved.first_loss, c.first_loss)]]
    dist.broadcast_object_list(mine, 0)
    if overall["rival"] in mine[0]:
        return overall, None
    return overall, head_to_head(solved, [c for c in others if c.name in mine[0]], args)


def guarded(make: Callable[[], Config], name: str, rank: int) -> tuple[Config | None, tuple[str, str] | None]:
    """Build a configuration and run its step 0 (the loss check) on every rank, recording any error."""
    cfg, error = None, None
    try:
        cfg = make()
    except Exception as e:  # noqa: BLE001 - recorded in the results, not hidden
        cfg, error = None, (f"{type(e).__name__}: {e}", traceback.format_exc())
    error = agree(error)
    if error:
        if rank == 0:
            log(f"  {name}: FAILED {error[0][:300]}")
        return None, error
    return cfg, None


def autoshard_config(name: str, key: str, plan_dict: dict, graph, mesh) -> Config:
    import torch.distributed as dist

    import autoshard
    from autoshard.plans import Plan

    model, kwargs = build(key)
    plan = Plan.from_dict(plan_dict)
    pm = autoshard.parallelize(model, plan, mesh, graph=graph)
    per_rank = plan.outputs == "local" and plan.loss == "per_rank"       # each rank returns its own loss
    cfg = Config(name, key, LossView(pm), kwargs, pm.parameters(), loss_group=dist.group.WORLD if per_rank else None)
    with pm.comm.counter.recording() as counter:      # step 0: the loss check and the collectives of a step
        cfg.step()
    totals = counter.totals()
    cfg.extra["collectives_per_step"] = sum(n for _, n in totals.values())
    cfg.extra["comm_bytes_per_step"] = sum(b for b, _ in totals.values())
    return cfg


def _local(kwargs: dict, rank: int) -> dict:
    return {k: v.chunk(WORLD, 0)[rank].contiguous() for k, v in kwargs.items()}


def ddp_config(key: str, rank: int) -> Config:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, kwargs = build(key)
    ddp = DDP(model)
    cfg = Config("torch DDP", key, LossView(ddp), _local(kwargs, rank), ddp.parameters(), loss_group=dist.group.WORLD)
    cfg.step()
    return cfg


def has_batch_norm(key: str) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in build(key)[0].modules())


def ddp_sync_bn_config(key: str, rank: int) -> Config:
    """torch DDP with batch norm over the global batch (what ``nn.SyncBatchNorm`` computes on GPUs;
    here its CPU port, bench/cpu_sync_batchnorm.py): the same function autoshard's plans compute."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpu_sync_batchnorm import convert_sync_batchnorm

    model, kwargs = build(key)
    ddp = DDP(convert_sync_batchnorm(model))
    cfg = Config(DDP_SYNC_BN, key, LossView(ddp), _local(kwargs, rank), ddp.parameters(), loss_group=dist.group.WORLD)
    cfg.step()
    return cfg


def fsdp2_config(key: str, rank: int, mesh1d) -> Config:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model, kwargs = build(key)
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh1d)
    fully_shard(model, mesh=mesh1d)
    cfg = Config("torch FSDP2", key, LossView(model), _local(kwargs, rank), model.parameters(),
                 extra={"fsdp_units": len(blocks) + 1}, loss_group=dist.group.WORLD)
    cfg.step()
    return cfg


def drift_record(hw) -> list[dict]:
    """The profile's compute points timed again now (collective), as JSON: see
    :func:`autoshard.profile.compute.remeasure_drift`."""
    from autoshard.profile.compute import remeasure_drift

    return [{"family": p.family, "work": p.work, "now_ms": 1e3 * p.now_s, "profile_ms": 1e3 * p.profile_s,
             "ratio": p.ratio} for p in remeasure_drift(hw)]


def drift_points(model: dict, when: str) -> list[dict]:
    """The model's drift points timed ``when`` ("before" or "after" its timing); none where not timed."""
    return (model.get("drift") or {}).get(when, [])


def reprice_under_drift(model: dict, graph, hw) -> None:
    """``modeled_drift_s`` on each distinct plan of ``model`` that ran: the plan priced (as
    :class:`Repricer` prices) under ``hw`` with its compute scaled to the machine drift timed around the
    model's timing (:func:`autoshard.profile.compute.drift_scaled`, before and after together): what a
    profile measured then would have modeled. ``drift_reprice_error`` where the plan cannot be priced."""
    from autoshard.plans import Plan
    from autoshard.profile.compute import DriftPoint, drift_scaled
    from autoshard.solver import SolverOptions

    points = [DriftPoint(p["family"], p["work"], p["now_ms"] / 1e3, p["profile_ms"] / 1e3)
              for when in ("before", "after") for p in drift_points(model, when)]
    if not points:
        return
    log(f"  {model['model']}: re-pricing the plans that ran under the profile scaled to the machine drift")
    repricer = Repricer(graph, drift_scaled(hw, points), SolverOptions(memory_budget=int(hw.memory_per_device)),
                        function_options(model["model"]))
    for p in model["plans"]:
        if "plan" in p and "measured" in p and "same_as" not in p:
            try:
                p["modeled_drift_s"] = repricer.price(Plan.from_dict(p["plan"]))[0].time.total
            except LookupError as e:
                p["drift_reprice_error"] = str(e)


def drift_median(points: list[dict]) -> float | None:
    return statistics.median(p["ratio"] for p in points) if points else None


def _drift_cell(drift: dict | None) -> str:
    """Median over families of time now / the profile's, before and after the model's timing."""
    if not drift:
        return "-"
    return " / ".join(_ms(drift_median(drift[when]), 2) + "x" for when in ("before", "after"))


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard

    # init_gloo_ranks gives the default group a long timeout: the other ranks wait in a broadcast while
    # rank 0 plans.
    mesh, rank = init_gloo_ranks(MESH)
    mesh1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    hw = autoshard.load_hardware(args.hardware)
    results = []
    t_all = time.perf_counter()
    for i, key in enumerate(args.models.split(",")):
        t_model = time.perf_counter()
        if rank == 0:
            log(f"model {i + 1}/{len(args.models.split(','))}: {key} {model_spec(key)}")
        graph, params = capture(key)
        box: list[Any] = [None]
        if rank == 0:
            t0 = time.perf_counter()
            box = [{"plans": make_plans(key, graph, args.hardware), "seconds": time.perf_counter() - t0}]
        dist.broadcast_object_list(box, 0)
        plans, plan_seconds = box[0]["plans"], box[0]["seconds"]

        configs: list[Config] = []
        for entry in plans:
            if "plan" not in entry or "same_as" in entry:
                continue
            if rank == 0:
                log(f"  building + step 0: {entry['name']}")
            cfg, err = guarded(lambda e=entry: autoshard_config(e["name"], key, e["plan"], graph, mesh),
                               entry["name"], rank)
            if err:
                entry["error"], entry["traceback"] = f"run failed: {err[0]}", err[1]
            else:
                cfg.extra["entry"] = entry["name"]
                configs.append(cfg)
        refs = {}
        references = [("torch DDP", lambda: ddp_config(key, rank)),
                      ("torch FSDP2", lambda: fsdp2_config(key, rank, mesh1d))]
        if has_batch_norm(key) and batch_norm_mode(key) == "global":
            references.append((DDP_SYNC_BN, lambda: ddp_sync_bn_config(key, rank)))
        for name, make in references:
            if rank == 0:
                log(f"  building + step 0: {name}")
            cfg, err = guarded(make, name, rank)
            refs[name] = {"name": name, "error": f"run failed: {err[0]}", "traceback": err[1]} if err else None
            if cfg is not None:
                configs.append(cfg)
        if rank == 0:
            log("  timing the profile's compute points again (machine drift)")
        drift_before = drift_record(hw)
        t0 = time.perf_counter()
        rounds = warm_up_and_count_rounds(configs, args)
        if rank == 0:
            log(f"  timing {len(configs)} configurations: {args.warmup} warm-up + {rounds} rounds x "
                f"{args.steps} steps each")
        run_rounds(configs, 0, rounds, args.steps, dist.barrier, settle=args.settle, back_to_back=True)
        measured = {c.name: summary(c) for c in configs}
        confirm, confirm_same = confirm_solved(configs, plans, args) if args.confirm_seconds > 0 else (None, None)
        for h2h in (confirm, confirm_same):
            if rank == 0 and h2h:
                log(f"  head to head: {h2h['solved']} {h2h['solved_measured']['median_ms']:.1f} ms, "
                    f"{h2h['rival']} {h2h['rival_measured']['median_ms']:.1f} ms ({h2h['rounds']} rounds)")
        timing_s = time.perf_counter() - t0
        drift = {"before": drift_before, "after": drift_record(hw)}
        if rank == 0:
            log(f"  machine now / profile: {_drift_cell(drift)}")
        for entry in plans:
            if entry.get("same_as", entry["name"]) in measured:
                entry["measured"] = measured[entry.get("same_as", entry["name"])]
        for name, err in refs.items():
            refs[name] = measured.get(name) or err
        results.append({"model": key, "preset": model_spec(key)[0], "overrides": model_spec(key)[1],
                        "sizes": model_sizes(key)._asdict(), "params": params,
                        "rounds": rounds,
                        "graph_nodes": len(graph.graph.nodes),
                        "plans": plans, "references": refs, "head_to_head": confirm,
                        "head_to_head_same_function": confirm_same, "drift": drift,
                        "plan_s": plan_seconds, "timing_s": timing_s,
                        "model_s": time.perf_counter() - t_model})
        if rank == 0:
            log(f"  {key} done in {time.perf_counter() - t_model:.0f} s (planning {plan_seconds:.0f} s, "
                f"timing {timing_s:.0f} s)")
        configs = cfg = graph = None      # free this model's modules before the next one
        gc.collect()
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"models": results, "worker_s": time.perf_counter() - t_all,
                                              "torch_threads": torch.get_num_threads(),
                                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, default=str))
    dist.barrier()
    dist.destroy_process_group()


# -- analysis ---------------------------------------------------------------------------------------------
def _head_to_head_summary(h2h: dict | None) -> dict | None:
    if not h2h:
        return None
    mine, theirs = h2h["solved_measured"]["median_ms"], h2h["rival_measured"]["median_ms"]
    return {"rival": h2h["rival"], "rounds": h2h["rounds"], "solved_ms": mine, "rival_ms": theirs,
            "solved_over_rival": mine / theirs,
            "interval": ratio_interval(h2h["solved_measured"]["all_ms"], h2h["rival_measured"]["all_ms"])}


RATIO_INTERVAL = 0.90
"""Coverage of the bootstrap interval reported beside a head-to-head ratio."""


def ratio_interval(a: Sequence[float], b: Sequence[float], resamples: int = 2000) -> tuple[float, float] | None:
    """A bootstrap :data:`RATIO_INTERVAL` interval of ``median(a) / median(b)`` (each sample resampled
    on its own, seeded: the same run gives the same interval): how far the ratio could move on
    another run of as many rounds on this machine. None with fewer than 2 times either side."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(resamples))
    tail = (1 - RATIO_INTERVAL) / 2
    return ratios[int(tail * resamples)], ratios[int((1 - tail) * resamples) - 1]


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given the average of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho: Pearson correlation of the (average) ranks; None when undefined."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def relative_errors(modeled: list[float], measured: list[float]) -> list[float]:
    """|modeled - measured| / measured, plan by plan."""
    return [abs(m - t) / t for m, t in zip(modeled, measured)]


def fit(modeled: list[float], measured: list[float]) -> tuple[float | None, float, float]:
    """Spearman's rho of modeled and measured times, median and worst relative error."""
    errs = relative_errors(modeled, measured)
    return spearman(modeled, measured), statistics.median(errs), max(errs)


def analyse(model: dict) -> dict:
    ran = [p for p in model["plans"] if "measured" in p and "same_as" not in p]
    modeled = [p["modeled_s"] for p in ran]
    measured = [p["measured"]["median_ms"] / 1e3 for p in ran]
    errs = relative_errors(modeled, measured)
    for p, e in zip(ran, errs):
        p["rel_err"] = e
    everything = {p["name"]: p["measured"] for p in model["plans"] if "measured" in p}
    everything.update({k: v for k, v in model["references"].items() if v and "median_ms" in v})
    fastest = min(everything, key=lambda k: everything[k]["median_ms"]) if everything else None
    solved = everything.get("solved")
    losses = {k: v["first_loss"] for k, v in everything.items() if v.get("first_loss") is not None}
    auto_losses = [v for k, v in losses.items() if k in {p["name"] for p in ran}]
    out = {
        "n_plans_measured": len(ran),
        "spearman": spearman(modeled, measured),
        "median_err": statistics.median(errs) if errs else None,
        "worst_err": max(errs) if errs else None,
        "worst_err_plan": ran[errs.index(max(errs))]["name"] if errs else None,
        "solved_ms": solved["median_ms"] if solved else None,
        "ddp_ms": (model["references"].get("torch DDP") or {}).get("median_ms"),
        "fsdp2_ms": (model["references"].get("torch FSDP2") or {}).get("median_ms"),
        "fastest": fastest,
        "fastest_ms": everything[fastest]["median_ms"] if fastest else None,
        "solved_over_fastest": solved["median_ms"] / everything[fastest]["median_ms"] if solved and fastest else None,
        "sync_bn_ms": (model["references"].get(DDP_SYNC_BN) or {}).get("median_ms"),
        "loss_max_diff": (max(losses.values()) - min(losses.values())) if len(losses) > 1 else None,
        "loss_max_diff_autoshard": (max(auto_losses) - min(auto_losses)) if len(auto_losses) > 1 else None,
        "failed": [p["name"] for p in model["plans"] if "error" in p]
                  + [k for k, v in model["references"].items() if v and "error" in v],
        "skipped": [p["name"] for p in model["plans"] if "skipped" in p],
        "drift_before": drift_median(drift_points(model, "before")),
        "drift_after": drift_median(drift_points(model, "after")),
    }
    # The ratio the target is checked on: measured again head to head (see head_to_head), where that ran.
    out["solved_over_fastest_screen"] = out["solved_over_fastest"]
    h2h = _head_to_head_summary(model.get("head_to_head"))
    if h2h:
        out["head_to_head"] = h2h
        out["solved_over_fastest"] = max(1.0, h2h["solved_over_rival"])
    # The fastest configuration that computes the solved plan's function (see same_function): torch
    # DDP/FSDP2 with per-rank batch-norm statistics do not compute a global-statistics plan's. Its
    # ratio is the second head to head's where that ran (the overall rival computed another function).
    if solved and solved.get("first_loss") is not None:
        same = {k: v for k, v in everything.items() if same_function(solved["first_loss"], v.get("first_loss"))}
        best = min(same, key=lambda k: same[k]["median_ms"])
        out["fastest_same_function"] = best
        out["solved_over_fastest_same_function_screen"] = solved["median_ms"] / same[best]["median_ms"]
        out["solved_over_fastest_same_function"] = out["solved_over_fastest_same_function_screen"]
        same_h2h = (_head_to_head_summary(model.get("head_to_head_same_function"))
                    or (h2h if h2h and h2h["rival"] in same else None))
        if same_h2h:
            out["head_to_head_same_function"] = same_h2h
            out["solved_over_fastest_same_function"] = max(1.0, same_h2h["solved_over_rival"])
    # The same statistics with every plan priced under the profile scaled to the machine drift (see
    # reprice_under_drift): the model's error on the machine as it was when the steps ran.
    # A run re-analysed after the fact may not re-price every plan (see reanalyse): then the figures are
    # over those it did, beside the unscaled profile's over the same plans.
    priced = [i for i, p in enumerate(ran) if "modeled_drift_s" in p]
    if priced:
        out["drift_repriced"] = len(priced), len(ran)
        now = fit([ran[i]["modeled_drift_s"] for i in priced], [measured[i] for i in priced])
        out.update({"spearman_drift": now[0], "median_err_drift": now[1], "worst_err_drift": now[2]})
        if len(priced) < len(ran):
            same = fit([modeled[i] for i in priced], [measured[i] for i in priced])
            out.update({"spearman_same_plans": same[0], "median_err_same_plans": same[1]})
    out["pass"] = {
        "solved_over_fastest": None if out["solved_over_fastest"] is None
        else out["solved_over_fastest"] <= TARGETS["solved_over_fastest"],
        "spearman": None if out["spearman"] is None else out["spearman"] >= TARGETS["spearman"],
        "median_err": None if out["median_err"] is None else out["median_err"] <= TARGETS["median_err"],
    }
    return out


def plot(models: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    lo, hi = math.inf, 0.0
    cmap = plt.get_cmap("tab10")
    markers = {"baseline": "o", "solved": "*", "budget": "s", "other_profile": "^", "perturbed": "X"}
    for i, m in enumerate(models):
        ran = [p for p in m["plans"] if "measured" in p]
        for j, p in enumerate(ran):
            x, y = 1e3 * p["modeled_s"], p["measured"]["median_ms"]
            ax.scatter([x], [y], color=cmap(i % 10), marker=markers.get(p["kind"], "o"),
                       s=110 if p["kind"] == "solved" else 30, alpha=0.85, label=m["model"] if j == 0 else None)
            lo, hi = min(lo, x, y), max(hi, x, y)
    for kind, mk in markers.items():
        ax.scatter([], [], color="gray", marker=mk, label=kind.replace("_", " "))
    if hi > 0:
        lim = (lo / 1.3, hi * 1.3)
        ax.plot(lim, lim, "k--", lw=1, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lim)
        ax.set_ylim(lim)
    ax.set_xlabel("modeled step time (ms, measured profile)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title("autoshard plans on 4 gloo ranks (2x2): modeled vs measured")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver -----------------------------------------------------------------------------------------------

def torchrun(argv: list[str], env: dict) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", *argv]
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)


def driver(args) -> int:
    import autoshard

    env = rank_env(ROOT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    hw_path = RESULTS / (f"{PROFILE_NAME}.yaml" if args.name == RESULT_NAME else f"{args.name}-profile.yaml")
    log(f"measuring the hardware profile -> {hw_path}")
    t0 = time.perf_counter()
    torchrun(["-m", "autoshard.profile", "--mesh", "x".join(map(str, MESH)), "--name", PROFILE_NAME,
              "--out", str(hw_path), "--iters", str(args.profile_iters)], env)
    profile_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        torchrun([str(Path(__file__).resolve()), "--worker", "--out", str(out), "--hardware", str(hw_path),
                  "--models", args.models, "--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds),
                  "--timed-seconds", str(args.timed_seconds), "--confirm-seconds", str(args.confirm_seconds),
                  "--confirm-max-rounds", str(args.confirm_max_rounds),
                  "--steps", str(args.steps),
                  "--settle", str(args.settle), "--warmup", str(args.warmup)], env)
        data = json.loads(out.read_text())
    hw = autoshard.load_hardware(str(hw_path))
    for m in data["models"]:
        reprice_under_drift(m, capture(m["model"])[0], hw)
    wall_s = time.perf_counter() - t_start
    report(args, data, hw_path, profile_s, wall_s)
    return 0


def reanalyse(args) -> int:
    """Re-price a finished run's plans under its profile scaled to the drift it timed, and write its
    report again. The JSON keeps no full plan, so each is solved again from the run's profile; one that
    comes out other than the run's (modeled time or memory decisions) is left out of the drift figures."""
    import autoshard

    data = json.loads((RESULTS / f"{args.name}.json").read_text())
    hw_path = ROOT / data["profile"]["path"]
    hw = autoshard.load_hardware(str(hw_path))
    for m in data["models"]:
        log(f"{m['model']}: solving its plans again from {hw_path.name}")
        graph, _ = capture(m["model"])
        again = {p["name"]: p for p in make_plans(m["model"], graph, str(hw_path))}
        for p in m["plans"]:
            if "plan_summary" not in p:
                continue
            twin = again.get(p["name"], {})
            if ("plan" in twin and math.isclose(twin["modeled_s"], p["modeled_s"], rel_tol=1e-6)
                    and twin["plan"]["segments"] == p["plan_summary"]["segments"]):
                p["plan"] = twin["plan"]
            else:
                p["drift_reprice_error"] = (f"solved again, the plan differs from the run's (modeled "
                                            f"{_ms(1e3 * twin.get('modeled_s', math.nan), 2)} ms, the run's "
                                            f"{_ms(1e3 * p['modeled_s'], 2)} ms)")
        reprice_under_drift(m, graph, hw)
    settings = data["settings"]
    for k in ("rounds", "max_rounds", "timed_seconds", "confirm_seconds", "steps", "settle", "warmup", "quick"):
        setattr(args, k, settings[k])
    args.confirm_max_rounds = settings.get("confirm_max_rounds", 2 * settings["max_rounds"])   # runs before the option
    args.models = ",".join(m["model"] for m in data["models"])
    report(args, data, hw_path, data["profile"]["seconds"], data["wall_s"], loadavg=data.get("loadavg_at_end"))
    return 0


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _flag(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def _head_to_head_cell(h2h: dict | None) -> str:
    if not h2h:
        return "-"
    ci = h2h.get("interval")
    spread = f", ratio {h2h['solved_over_rival']:.2f}x, {100 * RATIO_INTERVAL:.0f}% CI {ci[0]:.2f}-{ci[1]:.2f}" if ci else ""
    return f"{h2h['solved_ms']:.1f} / {h2h['rival_ms']:.1f} ({h2h['rival']}, {h2h['rounds']} rounds{spread})"


def _same_function_cell(model: str, s: dict) -> str:
    """The solved plan over the fastest configuration computing its function: head to head where that
    ran, with the rounds' ratio beside it."""
    h2h = s.get("head_to_head_same_function")
    screen = f"{s['solved_over_fastest_same_function_screen']:.2f}x in the rounds ({s['fastest_same_function']})"
    if not h2h:
        return f"{model} {screen}"
    return (f"{model} {s['solved_over_fastest_same_function']:.2f}x head to head "
            f"({h2h['solved_ms']:.1f} / {h2h['rival_ms']:.1f} ms, {h2h['rival']}, {h2h['rounds']} rounds), {screen}")


def _drift_fidelity_cell(s: dict) -> str:
    if "drift_repriced" not in s:
        return "-"
    cell = f"{_ms(s['spearman_drift'], 2)} / {_pct(s['median_err_drift'])} / {_pct(s['worst_err_drift'])}"
    priced, ran = s["drift_repriced"]
    if priced < ran:
        cell += (f" (over the {priced} of {ran} plans re-priced; unscaled over them: {_ms(s['spearman_same_plans'], 2)}"
                 f" / {_pct(s['median_err_same_plans'])})")
    return cell


def _measured_cell(meas: dict | None) -> str:
    return "-" if not meas else f"{meas['median_ms']:.1f} ({meas['min_ms']:.0f}-{meas['max_ms']:.0f})"


def compact_plans(model: dict, keep: int = 40) -> None:
    """Replace each full plan by what identifies and prices it (the full plans run to megabytes): its
    memory decisions, modeled memory/time/communication, solver report, and the graph nodes whose
    strategy differs from the solved plan's (the first ``keep`` of them, and their count)."""
    solved = next((p["plan"] for p in model["plans"] if p["name"] == "solved" and "plan" in p), None)
    for p in model["plans"]:
        d = p.pop("plan", None)
        if d is None:
            continue
        strategies = {n: v["strategy"] for n, v in d["nodes"].items()}
        diff = {} if solved is None else {n: s for n, s in strategies.items()
                                          if solved["nodes"].get(n, {}).get("strategy") != s}
        p["plan_summary"] = {
            "hardware": d["hardware"].get("name"), "memory_budget": d["memory_budget"], "segments": d["segments"],
            "memory": d["memory"], "time": d["time"], "comm": d["comm"], "solver": d["solver"],
            "reshardings": len(d["reshards"]), "nodes": len(strategies),
            "strategies_differing_from_solved": len(diff), "differing": dict(list(diff.items())[:keep])}


def drift_detail(models: list[dict]) -> str:
    """Per family, the time of the profile's middle compute point now over the profile's, before and
    after each model's timing."""
    families = sorted({p["family"] for m in models for when in ("before", "after") for p in drift_points(m, when)})
    if not families:
        return ""
    lines = ["", "", "Machine drift: each family's middle profile point (forward + backward of one op) timed again "
             "on all ranks, as the profile times it, right before and right after each model's timing; time now over "
             "the profile's (above 1: the machine is slower than when profiled, and the model's compute with it):", "",
             "| model | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]
    for m in models:
        cells = []
        for family in families:
            ratio = {when: next((p["ratio"] for p in drift_points(m, when) if p["family"] == family), None)
                     for when in ("before", "after")}
            cells.append(" / ".join(_ms(r, 2) for r in ratio.values()))
        lines.append(f"| {m['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args, data: dict, hw_path: Path, profile_s: float, wall_s: float,
           loadavg: Sequence[float] | None = None) -> None:
    import autoshard

    models = data["models"]
    for m in models:
        compact_plans(m)
    summaries = []
    rows = []
    for m in models:
        s = analyse(m)
        m["summary"] = s
        summaries.append(s)
        rows.append([m["model"], s["n_plans_measured"], _ms(s["spearman"], 2), _pct(s["median_err"]),
                     f"{_pct(s['worst_err'])} ({s['worst_err_plan']})" if s["worst_err"] is not None else "-",
                     _ms(s["solved_ms"]), _ms(s["ddp_ms"]), _ms(s["fsdp2_ms"]), s["fastest"] or "-",
                     _ms(s["solved_over_fastest_screen"], 2) + ("x" if s["solved_over_fastest_screen"] is not None else ""),
                     _head_to_head_cell(s.get("head_to_head")),
                     _ms(s["solved_over_fastest"], 2) + ("x" if s["solved_over_fastest"] is not None else ""),
                     _flag(s["pass"]["solved_over_fastest"]), _flag(s["pass"]["spearman"]),
                     _flag(s["pass"]["median_err"]), _drift_cell(m.get("drift")), _drift_fidelity_cell(s),
                     f"{_sci(s['loss_max_diff_autoshard'])} / {_sci(s['loss_max_diff'])}"])
    detail = ["", "Every configuration (modeled: plan.time['total'] under the measured profile; plans made under "
              "another profile are re-priced; measured: median (min-max) over the timed turns of steps "
              f"{LOOP_TIMING}):", "",
              "| model | config | decisions | modeled ms | modeled ms, profile scaled to the drift | measured ms | "
              "error % | step-0 loss | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for p in m["plans"]:
            meas = p.get("measured")
            note = []
            if "same_as" in p:
                note.append(f"same plan as {p['same_as']}")
            if "modeled_own_profile_s" in p:
                note.append(f"{p['solved_under']} modeled {1e3 * p['modeled_own_profile_s']:.3g} ms")
            if "skipped" in p:
                note.append(p["skipped"].split(". Raise")[0])
            if "error" in p:
                note.append("ERROR " + p["error"].replace("|", "/").replace("\n", " ")[:300])
            if "drift_reprice_error" in p:
                note.append("not re-priced under the drift: " + p["drift_reprice_error"].replace("|", "/")[:200])
            err = None if not meas else 100 * (p["modeled_s"] - meas["median_ms"] / 1e3) / (meas["median_ms"] / 1e3)
            loss = None if not meas else meas.get("first_loss")
            detail.append(
                f"| {m['model']} | {p['name']} | {p.get('decisions', '-')} | "
                f"{_ms(1e3 * p['modeled_s'], 2) if 'modeled_s' in p else '-'} | "
                f"{_ms(1e3 * p['modeled_drift_s'], 2) if 'modeled_drift_s' in p else '-'} | {_measured_cell(meas)} | "
                f"{_ms(err, 0)} | {'-' if loss is None else format(loss, '.6f')} | {'; '.join(note)} |")
        for name, r in m["references"].items():
            if r is None:
                continue
            if "median_ms" in r:
                detail.append(f"| {m['model']} | {name} | - | - | - | {_measured_cell(r)} | - | {r['first_loss']:.6f} | |")
            else:
                detail.append(f"| {m['model']} | {name} | - | - | - | - | - | - | ERROR "
                              f"{r.get('error', '').replace('|', '/')[:300]} |")
    hw = autoshard.load_hardware(str(hw_path))
    prof_line = (f"Measured profile ({hw_path.name}, {profile_s:.0f} s): axis 0 alpha "
                 f"{1e6 * hw.axes[0].alpha:.0f} us, {1 / hw.axes[0].beta / 1e9:.2f} GB/s; axis 1 alpha "
                 f"{1e6 * hw.axes[1].alpha:.0f} us, {1 / hw.axes[1].beta / 1e9:.2f} GB/s; "
                 f"{hw.peak_flops.get('float32', 0) / 1e9:.1f} GFLOP/s fp32; memory "
                 f"{hw.memory_bandwidth / 1e9:.1f} GB/s.")
    cnn_note = ""
    if any(model_spec(m["model"])[0] == "cnn" for m in models):
        exact = [m for m in models if model_spec(m["model"])[0] == "cnn" and batch_norm_mode(m["model"]) == "global"]
        same = "; ".join(_same_function_cell(m["model"], m["summary"]) for m in exact
                         if "solved_over_fastest_same_function" in m["summary"])
        cnn_note = (" CNN: cnn-<channels> is planned with batch_norm='per_rank' (each rank normalises its quarter of "
                    "the batch, the function torch DDP and FSDP2 compute); cnnsync-<channels> with the default "
                    "batch_norm='global' (the whole batch's statistics), against which torch DDP/FSDP2 compute "
                    f"another function: '{DDP_SYNC_BN}' is torch DDP with bench/cpu_sync_batchnorm.py, a CPU port of "
                    "SyncBatchNorm (torch's runs on GPUs only; one all-reduce forward and one backward per batch "
                    "norm), computing that function. Where the solved plan's rival computes another function, a "
                    "second head to head runs it against the fastest configuration of the rounds computing its own. "
                    f"cnnsync solved over the fastest configuration computing the same function: {same or '-'}.")
    rounds_by_model = {m["model"]: m.get("rounds", args.rounds) for m in models}
    measured_all = [e["measured"] for m in models for e in m["plans"] if "measured" in e]
    measured_all += [r for m in models for r in m["references"].values() if r and "median_ms" in r]
    ratios = [r["settle_median_ms"] / r["median_ms"] for r in measured_all if "settle_median_ms" in r]
    settle_note = (f" The untimed first step of a turn took {statistics.median(ratios):.2f}x the timed steps' median "
                   f"(median over configurations; {min(ratios):.2f}-{max(ratios):.2f}x)." if ratios else "")
    quick = " QUICK SMOKE RUN (--quick): one model, one round; not a measurement." if args.quick else ""
    note = (f"4 gloo ranks on a 2x2 mesh, {os.cpu_count()} CPU cores, OMP_NUM_THREADS=1, GLIBC_TUNABLES="
            f"{KEEP_FREED_MEMORY} (malloc keeps freed memory, as a GPU's caching allocator does). Step = forward + backward "
            f"+ AdamW step, fp32, dropout 0; autoshard plans made with outputs={OUTPUTS!r} (each rank keeps its "
            f"shard of the logits, as DDP does) and loss={LOSS!r} (each rank's mean loss over its share, as DDP and FSDP2 compute and return it); LMs batch {BATCH} x seq {SEQ}, 4 layers, "
            f"vocab {VOCAB}; CNN batch {BATCH}, "
            f"{IMAGE}x{IMAGE} images, 10 classes (2 conv blocks, cross-entropy inside the graph); MLP (mlp-<features>) "
            f"batch {BATCH}, 4 linear layers, hidden 4 x features, {MLP_CLASSES} classes; a model key ending in :BATCH or :BATCHxSEQ (SEQ: an LM's sequence, a CNN's image side) "
            f"sets its own sizes. Steps {LOOP_TIMING}; medians of "
            f"interleaved rounds of one turn of {args.steps} step(s) each (each turn after {args.settle} untimed step(s); rounds per model: "
            f"{', '.join(f'{m}: {m_rounds}' for m, m_rounds in rounds_by_model.items())}: at least {args.rounds}, more "
            f"where that gives about {args.timed_seconds:.0f} s of timed steps, at most {args.max_rounds}), "
            f"after {args.warmup} warm-up step(s) + step 0. "
            f"Spearman and errors over the autoshard plans that ran (modeled under the measured profile); "
            f"fastest over every configuration incl. torch DDP and FSDP2 (fully_shard per block, then the root). "
            f"Solved/fastest is checked head to head: after the rounds, the solved plan and the fastest other "
            f"configuration of those rounds (its rival) run again, interleaved, alone, about {args.confirm_seconds:.0f} s "
            f"of timed steps (at least {args.rounds} rounds, at most {args.confirm_max_rounds}), and the ratio is the solved "
            f"plan's median over the faster of the two there (1.00x where the solved plan is; beside it the ratio "
            f"itself and its {100 * RATIO_INTERVAL:.0f}% bootstrap interval); the rounds' own ratio, "
            f"solved over the lowest of a dozen noisy medians, is biased against the solved plan and shown beside it. "
            f"Targets: solved/fastest <= {TARGETS['solved_over_fastest']}, Spearman >= {TARGETS['spearman']}, "
            f"median error <= {100 * TARGETS['median_err']:.0f}%. Step-0 loss diff: max - min step-0 loss (global "
            f"batch) over the autoshard plans / over all configurations. {prof_line} "
            f"Whole run {wall_s / 60:.1f} min.{settle_note}{cnn_note}{quick}")
    data.update({"settings": {"mesh": MESH, "batch": BATCH, "seq": SEQ, "image": IMAGE, "vocab": VOCAB,
                              "models": {k: model_spec(k) for k in args.models.split(",")},
                              "sizes": {k: model_sizes(k)._asdict() for k in args.models.split(",")}, "rounds": args.rounds,
                              "max_rounds": args.max_rounds, "timed_seconds": args.timed_seconds,
                              "confirm_seconds": args.confirm_seconds, "confirm_max_rounds": args.confirm_max_rounds, "steps": args.steps, "settle": args.settle, "warmup": args.warmup, "quick": args.quick, "outputs": OUTPUTS, "loss": LOSS,
                              "other_profiles": OTHER_PROFILES, "budget_fractions": BUDGET_FRACTIONS,
                              "perturb": {"fractions_seeds": PERTURBATIONS, "min": PERTURB_MIN},
                              "targets": TARGETS,
                              "timing": f"forward+backward+AdamW step+zero_grad per step, {LOOP_TIMING}"},
                 "profile": {"path": str(hw_path.relative_to(ROOT)), "seconds": profile_s, "hardware": hw.to_dict()},
                 "summary": [{"model": m["model"], **s} for m, s in zip(models, summaries)],
                 "wall_s": wall_s, "loadavg_at_end": loadavg or os.getloadavg()})
    png = RESULTS / f"{args.name}.png"
    plot(models, png)
    write(args.name, data,
          ["model", "distinct plans run", "spearman", "median err", "worst err (plan)", "solved ms", "DDP ms", "FSDP2 ms",
           "fastest", "solved/fastest (rounds)", "head to head: solved / rival ms", "solved/fastest", "<= 1.05x",
           "rho >= 0.9", "err <= 20%", "machine now / profile (before / after)",
           "profile scaled to the drift: spearman / median err / worst err",
           "step-0 loss diff (autoshard / all)"],
          rows, note + "\n" + "\n".join(detail) + drift_detail(models) + f"\n\nPlot: {png.relative_to(ROOT)}.")
    log(f"wrote {RESULTS / (args.name + '.md')} and {png} in {wall_s / 60:.1f} min")


TIMING_OPTIONS = ("rounds", "max_rounds", "timed_seconds", "steps", "warmup", "settle")


def add_timing_options(ap: argparse.ArgumentParser) -> None:
    """How a model's configurations are timed (``TIMING_OPTIONS``): this bench's, and bench/plan_retime.py's,
    which times a run's plans again the same way."""
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per model, at least")
    ap.add_argument("--max-rounds", type=int, default=24, help="interleaved rounds per model, at most")
    ap.add_argument("--timed-seconds", type=float, default=60.0,
                    help="timed steps per model last about this long (more rounds where steps are short)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration after step 0")
    ap.add_argument("--settle", type=int, default=1, help="untimed steps at the start of each configuration's turn")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_options(ap)
    ap.add_argument("--confirm-seconds", type=float, default=60.0,
                    help="head to head of the solved plan and its fastest rival lasts about this long (0: skip)")
    ap.add_argument("--confirm-max-rounds", type=int, default=96,
                    help="at most this many rounds in the head to head (a 40 ms step's 90%% interval of the ratio "
                         "is about +-5%% at 48)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK_MODEL} only, 1 round, 1 step, "
                    "1 warm-up step, a shorter profile")
    ap.add_argument("--profile-iters", type=int, default=30, help="autoshard profile --iters")
    ap.add_argument("--name", default=RESULT_NAME, help="results as bench/results/NAME.{json,md,png}, the profile "
                    f"as NAME-profile.yaml (default: {RESULT_NAME}, profile {PROFILE_NAME}.yaml)")
    ap.add_argument("--reanalyse", action="store_true",
                    help="measure nothing: re-price bench/results/NAME.json's plans under its profile scaled to the "
                         "drift it timed (each plan solved again from that profile), and write its report again")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--hardware", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.models = QUICK_MODEL if args.models == ",".join(MODELS) else args.models.split(",")[0]
        args.rounds, args.steps, args.settle, args.warmup, args.profile_iters = 1, 1, 1, 1, min(args.profile_iters, 10)
        args.max_rounds, args.confirm_max_rounds = 1, 2
    for key in args.models.split(","):
        try:
            model_spec(key)
        except ValueError as e:
            ap.error(str(e))
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name):
        ap.error(f"--name {args.name!r}: letters, digits, '_' and '-' only (it names files in bench/results/)")
    return reanalyse(args) if args.reanalyse else driver(args)


if __name__ == "__main__":
    sys.exit(main())
