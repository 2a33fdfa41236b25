"""GPU compute: what a hardware profile predicts for ops and whole models against what one GPU measures.

The measurement needs a GPU; the prediction does not. So two steps:

1. On a machine with one GPU (``DIR`` is any folder; each command under ``torchrun``, one rank)::

       torchrun --nproc_per_node=1 -m autoshard.profile --mesh 1x1 --base h100-nvlink --name h100-nvlink \\
           --out DIR/gpu-profile.yaml
       torchrun --nproc_per_node=1 bench/gpu_op_compute.py measure --out DIR/gpu_measured.json

   The first is ``autoshard profile``: every compute family's curve in float32 and bfloat16 (the
   profile's own sizes, CUDA's larger ones included), the optimizer step and the roofline numbers,
   the links kept from the base profile (one GPU has none to measure). The second measures what the
   profile did not see: the ``matmul``, ``matmul_unaligned``, ``attention``, ``norm`` and ``pointwise`` families at
   held-out sizes off the profile's grid (timed exactly as the profile times them, see
   :func:`autoshard.profile.compute._time_family`), and whole models (GPT-2, BERT, Llama; float32
   and bfloat16): forward, backward and AdamW step, CUDA-synchronised, median of ``--steps``.

2. Anywhere (CPU)::

       python bench/gpu_op_compute.py report --profile DIR/gpu-profile.yaml --measured DIR/gpu_measured.json
       python bench/gpu_op_compute.py fold --measured DIR/gpu-profile.yaml --into configs/hardware/h100-nvlink.yaml

   Prices every measured op and model with the ``--before`` profile (default: ``h100-nvlink`` as
   shipped before its compute was measured, a roofline of datasheet FLOP/s and bandwidth) and with
   the measured profile, exactly as the planner does (the op or model captured on meta tensors, its
   strategies enumerated on a 1x1 mesh, each node's ``compute_fwd`` / ``compute_bwd``; the optimizer
   from ``plan.time``), and writes
   ``bench/results/gpu_op_compute.{json,md}``: per op, dtype and size the measured forward and
   backward times and the error of each profile; per model the same for forward, backward and
   the optimizer step. ``fold`` writes a profile's compute (curves, optimizer step, FLOP/s of the
   measured dtypes) from such a measurement and keeps its links, memory and host link.

The shipped results came from one H100 (``bench/results/gpu_op_compute-profile.yaml`` and
``gpu_op_compute-measured.json``, both written on the GPU as above; ``gpu_op_compute-roofline.yaml`` is
``h100-nvlink`` as shipped before its compute was folded in), reproduced anywhere with::

    python bench/gpu_op_compute.py report --profile bench/results/gpu_op_compute-profile.yaml \\
        --measured bench/results/gpu_op_compute-measured.json --before bench/results/gpu_op_compute-roofline.yaml
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

RESULT_NAME = "gpu_op_compute"
FAMILIES = ("matmul", "matmul_unaligned", "attention", "norm", "pointwise")    # the families the report compares
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Sizes off the profile's grid (autoshard.profile.compute: MATMUL_SHAPES, ... and CUDA_SIZES).
HELDOUT_SIZES: dict[str, tuple] = {
    "matmul": ((128, 4096, 4096), (256, 1024, 1024), (4096, 1024, 4096), (8192, 4096, 4096),
               (16384, 4096, 11008)),                                           # tokens, in, out
    "matmul_unaligned": ((2048, 1024, 1023), (8192, 768, 30522), (4096, 4096, 32001)),   # odd vocabularies
    "attention": ((4, 8, 512, 64), (16, 12, 1024, 64), (2, 32, 4096, 128)),    # batch, heads, seq, head dim
    "norm": ((256, 768), (2048, 1024), (8192, 4096), (32768, 8192)),            # tokens, hidden
    "pointwise": (16384, 2097152, 16777216, 67108864),                          # units (binary ops: 2x elements)
}
QUICK_HELDOUT_SIZES = {"matmul": ((16, 32, 48),), "matmul_unaligned": ((16, 32, 47),), "attention": ((1, 2, 16, 8),),
                       "norm": ((8, 96),), "pointwise": (3000,)}

# name -> (preset of autoshard.models, batch, seq, overrides): a launch-bound model and compute-bound ones.
MODELS: dict[str, tuple[str, int, int, dict]] = {
    "gpt2-mini": ("gpt2-mini", 8, 128, {}),
    "gpt2-124m": ("gpt2", 8, 1024, {}),
    "bert-base": ("bert-base", 8, 512, {}),
    "llama-0.5b": ("llama-7b", 4, 2048, dict(hidden_size=2048, intermediate_size=5632, num_layers=8,
                                             num_attention_heads=16, num_key_value_heads=16)),
}
QUICK_MODELS = {"gpt2-tiny": ("gpt2-tiny", 2, 16, {})}


def log(msg: str) -> None:
    print(f"[gpu_op_compute {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- measure (on the GPU, under torchrun) -----------------------------------------------------------------

def measure_ops(device: torch.device, sizes: dict[str, tuple], dtypes: dict[str, torch.dtype],
                iters: int) -> list[dict]:
    """Forward and backward seconds of each family at each size, timed as ``autoshard profile`` times
    its curves (the family's ops, their median)."""
    from autoshard.profile.compute import COMPUTE_OPS, _time_family

    rows = []
    for dname, dtype in dtypes.items():
        for family, family_sizes in sizes.items():
            builders = COMPUTE_OPS[family][1]
            timed = _time_family(family, builders, family_sizes, dtype, device, iters)
            for size, (work, fwd, bwd) in zip(family_sizes, timed):
                rows.append({"family": family, "dtype": dname, "size": list(size) if isinstance(size, tuple) else size,
                             "work": work, "fwd_s": fwd, "bwd_s": bwd})
            log(f"{dname} {family}: {len(family_sizes)} held-out sizes timed")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def measure_model(name: str, spec: tuple[str, int, int, dict], dtype: torch.dtype, device: torch.device,
                  steps: int, warmup: int) -> dict:
    """Median forward (to the loss), backward and AdamW step seconds of one training step."""
    from autoshard.models import build_model
    from autoshard.profile.timing import _sync

    preset, batch, seq, overrides = spec
    model, _, kwargs = build_model(preset, device=device, batch=batch, seq=seq, dtype=dtype, dropout=0.0,
                                   **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times: dict[str, list[float]] = {"fwd_s": [], "bwd_s": [], "optimizer_s": []}
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(**kwargs).loss
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t3 = time.perf_counter()
        if i >= warmup:
            for key, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key].append(t)
    unlabelled = {k: v for k, v in kwargs.items() if k != "labels"}
    no_loss = []
    for i in range(warmup + steps):            # the forward without the loss (logits only), as trained
        _sync(device)
        t0 = time.perf_counter()
        logits = model(**unlabelled).logits
        _sync(device)
        if i >= warmup:
            no_loss.append(time.perf_counter() - t0)
        del logits
    out = {"model": name, "preset": preset, "batch": batch, "seq": seq, "overrides": overrides,
           "dtype": str(dtype).removeprefix("torch."), "params": sum(p.numel() for p in model.parameters()),
           "steps": steps, **{k: statistics.median(v) for k, v in times.items()},
           "fwd_no_loss_s": statistics.median(no_loss),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    del model, opt, kwargs, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def measure(args: argparse.Namespace) -> int:
    from autoshard.profile.timing import _device, _ensure_initialised

    _ensure_initialised()
    device = _device()
    if device.type != "cuda" and not args.quick:
        raise SystemExit("measure needs a GPU (or --quick, a smoke test of the script on CPU)")
    dtypes = DTYPES if device.type == "cuda" else {"float32": torch.float32}
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "ops": [], "models": []}
    out = Path(args.out)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    result["ops"] = measure_ops(device, QUICK_HELDOUT_SIZES if args.quick else HELDOUT_SIZES, dtypes, args.iters)
    save()
    for name, spec in (QUICK_MODELS if args.quick else MODELS).items():
        for dname, dtype in dtypes.items():
            try:
                row = measure_model(name, spec, dtype, device, args.steps, args.warmup)
            except torch.OutOfMemoryError as e:       # recorded, not hidden: the report says which ran
                row = {"model": name, "dtype": dname, "error": f"OutOfMemoryError: {e}".splitlines()[0]}
                torch.cuda.empty_cache()
            result["models"].append(row)
            log(f"{name} {dname}: " + ", ".join(f"{k} {1e3 * row[k]:.2f} ms" for k in ("fwd_s", "bwd_s", "optimizer_s")
                                                  if k in row))
            save()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    torch.distributed.destroy_process_group()
    return 0


# -- report (anywhere: the predictions need no GPU) -------------------------------------------------------

class OneOp(nn.Module):
    """One op of a profile family with every operand a parameter, so that the captured graph has the
    op alone and its backward takes the gradient of every operand, as the profile times it."""

    def __init__(self, fn: Callable[..., torch.Tensor], operands: list[torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.operands = nn.ParameterList([nn.Parameter(t.detach()) for t in operands])

    def forward(self) -> torch.Tensor:
        return self.fn(*self.operands)


def op_graph(family: str, size: Any, dtype: torch.dtype):
    """The family's first op at ``size`` captured on meta tensors."""
    import autoshard
    from autoshard.profile.compute import COMPUTE_OPS

    op = COMPUTE_OPS[family][1][0](tuple(size) if isinstance(size, list) else size, dtype, torch.device("meta"))
    return autoshard.capture(OneOp(op.fn, [op.x, *op.params(0)]), (), name=f"{family}{size}")


def graph_compute(graph, hw) -> tuple[float, float]:
    """Forward and backward compute seconds of a graph on one device, as the planner prices them: each
    node's cheapest strategy on a 1x1 mesh (they all compute the whole node there)."""
    from autoshard import enumerate_strategies

    table = enumerate_strategies(graph, mesh_shape=(1, 1), hardware=hw, fallback="replicate")
    fwd = bwd = 0.0
    for ns in table.nodes.values():
        if ns.strategies:
            best = min(ns.strategies, key=lambda s: s.compute_fwd + s.compute_bwd)
            fwd, bwd = fwd + best.compute_fwd, bwd + best.compute_bwd
    return fwd, bwd


def _err(modeled: float, measured: float) -> float:
    return (modeled - measured) / measured


def profile_points(profile, families: tuple[str, ...]) -> list[dict]:
    """The measured points of the profile's own curves (its sizes from extra.measured)."""
    sizes = profile.extra.get("measured", {}).get("compute_sizes", {})
    rows = []
    for dname, curves in profile.compute.items():
        for family in families:
            curve = curves[family]
            for size, work, fwd, bwd in zip(sizes[family], curve.work, curve.fwd, curve.bwd):
                rows.append({"family": family, "dtype": dname, "size": size, "work": work, "fwd_s": fwd, "bwd_s": bwd})
    return rows


def price_ops(rows: list[dict], profiles: dict[str, Any], source: str) -> list[dict]:
    out = []
    for row in rows:
        graph = op_graph(row["family"], row["size"], DTYPES[row["dtype"]])
        entry = {**row, "source": source}
        for label, hw in profiles.items():
            fwd, bwd = graph_compute(graph, hw)
            entry[label] = {"fwd_s": fwd, "bwd_s": bwd, "fwd_err": _err(fwd, row["fwd_s"]),
                            "bwd_err": _err(bwd, row["bwd_s"])}
        out.append(entry)
    return out


def price_models(rows: list[dict], profiles: dict[str, Any]) -> list[dict]:
    import autoshard
    from autoshard.models import build_model

    out = []
    for row in rows:
        if "error" in row:
            out.append(row)
            continue
        model, args, kwargs = build_model(row["preset"], batch=row["batch"], seq=row["seq"], dtype=DTYPES[row["dtype"]],
                                          dropout=0.0, **row["overrides"])
        graph = autoshard.capture(model, args, kwargs, name=row["model"])
        no_loss = autoshard.capture(model, args, {k: v for k, v in kwargs.items() if k != "labels"},
                                    name=f"{row['model']} (no loss)") if "fwd_no_loss_s" in row else None
        entry = dict(row)
        for label, hw in profiles.items():
            fwd, bwd = graph_compute(graph, hw)
            if no_loss is not None:
                fwd_no_loss = graph_compute(no_loss, hw)[0]
                entry.setdefault(f"{label}_no_loss", {"fwd_s": fwd_no_loss,
                                                      "fwd_err": _err(fwd_no_loss, row["fwd_no_loss_s"])})
            opt = autoshard.plan(graph, mesh=(1, 1), hardware=hw).time["optimizer"]
            measured_step = row["fwd_s"] + row["bwd_s"] + row["optimizer_s"]
            entry[label] = {"fwd_s": fwd, "bwd_s": bwd, "optimizer_s": opt,
                            "fwd_err": _err(fwd, row["fwd_s"]), "bwd_err": _err(bwd, row["bwd_s"]),
                            "optimizer_err": _err(opt, row["optimizer_s"]),
                            "step_err": _err(fwd + bwd + opt, measured_step)}
        out.append(entry)
        log(f"priced {row['model']} {row['dtype']}")
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def summarise(ops: list[dict], labels: list[str]) -> list[dict]:
    """Median and worst |error| per family, dtype, source and profile."""
    out = []
    keys = sorted({(o["family"], o["dtype"], o["source"]) for o in ops},
                  key=lambda k: (FAMILIES.index(k[0]), k[1], k[2]))
    for family, dname, source in keys:
        group = [o for o in ops if (o["family"], o["dtype"], o["source"]) == (family, dname, source)]
        row = {"family": family, "dtype": dname, "source": source, "points": len(group)}
        for label in labels:
            for phase in ("fwd", "bwd"):
                errs = [abs(o[label][f"{phase}_err"]) for o in group]
                row[f"{label}.{phase}.median"] = statistics.median(errs)
                row[f"{label}.{phase}.worst"] = max(errs)
        out.append(row)
    return out


def report(args: argparse.Namespace) -> int:
    from _common import write
    from autoshard import load_hardware

    measured_profile = load_hardware(args.profile)
    before = load_hardware(args.before)
    profiles = {"before": before, "measured": measured_profile}
    measured = json.loads(Path(args.measured).read_text())
    log("pricing the profile's own points and the held-out ops")
    ops = (price_ops(profile_points(measured_profile, FAMILIES), profiles, "profile grid")
           + price_ops([r for r in measured["ops"] if r["family"] in FAMILIES], profiles, "held out"))
    models = price_models(measured["models"], profiles)
    summary = summarise(ops, list(profiles))
    data = {"device": measured["device"], "torch": measured["torch"], "before_profile": before.name,
            "measured_profile": args.profile, "summary": summary, "ops": ops, "models": models}
    rows = [[s["family"], s["dtype"], s["source"], s["points"],
             *[f"{100 * s[f'{lab}.{ph}.median']:.0f}% / {100 * s[f'{lab}.{ph}.worst']:.0f}%"
               for lab in profiles for ph in ("fwd", "bwd")]] for s in summary]
    header = ["family", "dtype", "sizes", "points", "before fwd |err| median / worst", "before bwd",
              "measured-profile fwd", "measured-profile bwd"]
    model_rows = []
    for m in models:
        if "error" in m:
            model_rows.append([m["model"], m["dtype"], m["error"], "", "", "", ""])
            continue
        cells = [f"{1e3 * m[k]:.2f}" for k in ("fwd_s", "bwd_s", "optimizer_s")]
        for lab in profiles:
            p = m[lab]
            cells.append(" / ".join(f"{1e3 * p[k]:.2f} ({_pct(p[k.replace('_s', '_err')])})"
                                    for k in ("fwd_s", "bwd_s", "optimizer_s")))
        model_rows.append([m["model"], m["dtype"], *cells])
    note = "\n".join([
        f"Measured on one {measured['device']} (torch {measured['torch']}, CUDA {measured['cuda']}, TF32 matmul "
        f"{'on' if measured['tf32_matmul'] else 'off'}), {measured['started']}. Errors are (modeled - measured) / "
        f"measured. 'before': `{before.name}` (roofline: datasheet FLOP/s and "
        f"bandwidth); 'measured-profile': `{Path(args.profile).name}`, measured by `autoshard profile` on the same "
        "GPU. Ops priced as the planner prices them (captured on meta tensors, 1x1 mesh, each node's "
        "compute_fwd / compute_bwd). 'profile grid': the profile's own sizes (the measured profile "
        "reproduces them by construction, up to its monotone clipping); 'held out': sizes off its grid.",
        "",
        "Whole models, one training step on one GPU (batch x seq in the JSON; dropout 0; AdamW): measured "
        "ms and modeled ms (error), forward / backward / optimizer step.",
        "",
        "| model | dtype | fwd ms | bwd ms | AdamW ms | before: fwd / bwd / AdamW "
        "| measured-profile: fwd / bwd / AdamW |",
        "|---|---|---|---|---|---|---|",
        *["| " + " | ".join(str(c) for c in r) + " |" for r in model_rows],
    ])
    write(args.name, data, header, rows, note)
    return 0


# -- fold (anywhere): one device's measurements into a profile whose links come from elsewhere -------------

DEVICE_FIELDS = ("compute", "optimizer")


def fold(args: argparse.Namespace) -> int:
    """Write ``--into`` with the compute measurements of ``--measured`` (compute curves, optimizer
    step, FLOP/s of the measured dtypes), keeping its links, memory size and bandwidths, name and the
    FLOP/s of dtypes not measured. (Memory size and the host link belong to the machine the profile
    describes, not to the one measured on; the roofline's memory bandwidth only prices ops without a
    curve.)"""
    import dataclasses

    from autoshard import load_hardware

    measured = load_hardware(args.measured)
    into = load_hardware(args.into)
    info = measured.extra.get("measured", {})
    own = into.description.split(" Compute measured:")[0].strip()      # folding again replaces the last fold
    timed = sorted(measured.compute)
    note = (f" Compute measured: the curves ({', '.join(timed)}), the AdamW step and the FLOP/s of "
            f"{', '.join(d for d in timed if d in measured.peak_flops)} come from `{Path(args.measured).name}`, "
            f"measured by `autoshard profile --mesh 1x1` on one GPU ({args.device or 'see extra.measured'}, "
            f"torch {info.get('torch', '?')}); links, memory and host link are the figures above. That "
            f"measurement: {measured.description.strip()}")
    folded = dataclasses.replace(
        into, description=own + note, peak_flops={**into.peak_flops, **{d: measured.peak_flops[d] for d in timed}},
        **{f: getattr(measured, f) for f in DEVICE_FIELDS}, extra={**into.extra, "measured": info})
    folded.save(args.into)
    log(f"wrote {args.into}: {into.name} with the per-device measurements of {args.measured}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="on one GPU, under torchrun: held-out ops and whole models")
    m.add_argument("--out", required=True, help="JSON file to write")
    m.add_argument("--iters", type=int, default=10, help="timed runs per op timing, at most (as autoshard profile)")
    m.add_argument("--steps", type=int, default=10, help="timed training steps per model")
    m.add_argument("--warmup", type=int, default=3, help="untimed training steps per model first")
    m.add_argument("--quick", action="store_true", help="tiny sizes and one tiny model (a smoke test; runs on CPU)")
    m.set_defaults(run=measure)
    r = sub.add_parser("report", help="price what was measured with two profiles; write bench/results")
    r.add_argument("--profile", required=True, help="the profile `autoshard profile` measured on the GPU (YAML)")
    r.add_argument("--measured", required=True, help="the JSON `measure` wrote")
    r.add_argument("--before", default=str(HERE / "results" / "gpu_op_compute-roofline.yaml"),
                   help="the profile to compare with (name or YAML; default: h100-nvlink's roofline as shipped before)")
    r.add_argument("--name", default=RESULT_NAME, help=f"results name (default {RESULT_NAME})")
    r.set_defaults(run=report)
    f = sub.add_parser("fold", help="write a profile's compute from a one-GPU measurement, keeping its links "
                                    "and memory")
    f.add_argument("--measured", required=True, help="the profile `autoshard profile --mesh 1x1` measured (YAML)")
    f.add_argument("--into", required=True,
                   help="the profile YAML to update in place (e.g. configs/hardware/h100-nvlink.yaml)")
    f.add_argument("--device", help="the GPU's name, for the description")
    f.set_defaults(run=fold)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
