"""The ``autoshard`` command line: ops, capture, enumerate, plan, explain, profile."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import typing
from collections import defaultdict
from typing import Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .progress import Progress

console = Console(stderr=False)
_plain = False        # set by _set_output: no colours, no box drawing, no wrapping


def _set_output(plain: bool) -> None:
    """``--plain``, or standard output not a terminal (a pipe, a file): plain text, no colours, no box
    drawing, lines as long as they need (rich would wrap them at 80 columns)."""
    global console, _plain
    _plain = plain or not sys.stdout.isatty()
    console = Console(color_system=None, highlight=False, width=100_000, soft_wrap=True) if _plain else Console()


def _print_table(table: Table) -> None:
    """Print a table; in plain mode without the padding rich puts after the last column."""
    if not _plain:
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def _table(*columns: str, title: str | None = None) -> Table:
    """A table in the current output mode (see :func:`_set_output`)."""
    return Table(*columns, title=title, box=None if _plain else box.HEAVY_HEAD, title_justify="left")


def _ops(args: argparse.Namespace) -> int:
    """List every supported op with its family and per-axis rules."""
    from .handlers import REGISTRY
    from .opinfo import op_name

    by_family: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for target, h in REGISTRY.items():
        rule = "replicate only" if h.replicate_only else h.doc
        by_family[h.family].append((op_name(target), rule))
    table = _table("family", "op", "per-axis rule", title=f"autoshard: {len(REGISTRY)} supported ops")
    for family in sorted(by_family):
        for name, rule in sorted(by_family[family]):
            table.add_row(family, name, escape(rule))
    _print_table(table)
    return 0


def _graph(args: argparse.Namespace):
    """Capture the model named on the command line on meta tensors (repeated layers folded)."""
    from .capture import capture_preset

    with contextlib.ExitStack() as stack:
        def before_capture(model_args: tuple, model_kwargs: dict) -> None:
            _check_factory_batch(args, model_args, model_kwargs)
            stack.enter_context(Progress().stage(f"capturing {args.model} on meta tensors"))

        return capture_preset(args.model, device="meta", batch=args.batch, seq=args.seq,
                              num_layers=getattr(args, "layers", None), before_capture=before_capture)


_MP_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _mp_policy(param: str, reduce: str):
    """FSDP2's MixedPrecisionPolicy of ``--mp`` / ``--mp-reduce``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, _MP_DTYPES[param]),
                                reduce_dtype=getattr(torch, _MP_DTYPES[reduce]))


def _check_factory_batch(args: argparse.Namespace, model_args: tuple, model_kwargs: dict) -> None:
    """For ``plan``, the planner's batch check on the example inputs a preset or factory built,
    before the capture (a model file's batch is known only once its factory has run)."""
    if not hasattr(args, "allow_indivisible_batch") or args.allow_indivisible_batch:
        return
    import torch

    from .api import _check_batch
    from .mesh import MeshSpec

    leaves = [(f"args[{i}]", a) for i, a in enumerate(model_args)] + \
        [(f"kwargs[{k!r}]", v) for k, v in model_kwargs.items()]
    _check_batch([(where, tuple(t.shape)) for where, t in leaves if isinstance(t, torch.Tensor)],
                 MeshSpec.of(args.mesh))


def _capture(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    graph = _graph(args)
    seconds = time.perf_counter() - t0
    inputs = ", ".join(f"{where} {tuple(graph.tensor_meta(name).shape)}" for name, where in graph.user_input_specs.items())
    console.print(f"captured {escape(args.model)}: {len(list(graph.graph.nodes))} nodes in {seconds:.2f} s, "
                  f"fingerprint {graph.fingerprint()[:16]} (of the ops, shapes and dtypes for inputs {escape(inputs)}: "
                  "a plan for other input shapes has another)", highlight=False)
    table = _table("op", "count")
    for op, n in sorted(graph.summary().items(), key=lambda kv: -kv[1]):
        table.add_row(op, str(n))
    _print_table(table)
    return 0


def _enumerate(args: argparse.Namespace) -> int:
    from .enumerate import enumerate_strategies

    _preflight(args)
    graph = _graph(args)
    with Progress().stage(f"enumerating strategies on mesh {args.mesh}"):
        table = enumerate_strategies(graph, mesh_shape=args.mesh, hardware=args.hardware, fallback=args.fallback)
    console.print(f"{len(table)} nodes, {table.total_strategies()} strategies, {table.seconds:.2f} s")
    for fb in table.fallbacks:
        console.print(f"[yellow]replicated (no handler): {fb}")
    if args.json:
        data = {ns.node: {"op": ns.op, "module": ns.module_path,
                          "strategies": [s.to_dict() for s in ns.strategies]} for ns in table}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        console.print(f"wrote {args.json}")
    if args.node:
        ns = _node(table, args.node)
        t = _table("strategy", "fwd s", "bwd s", "comm s", "saved B")
        for s in ns.strategies:
            t.add_row(escape(s.name), f"{s.compute_fwd:.3g}", f"{s.compute_bwd:.3g}", f"{s.comm_time():.3g}",
                      str(s.memory.saved))
        _print_table(t)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Plan a model (with progress on stderr), print the explanation, optionally save the plan."""
    from .api import DEFAULT_GAP, plan
    from .solver.baselines import DATA_PARALLEL_MARGIN

    _preflight(args)
    options = dict(mesh=args.mesh, hardware=args.hardware, memory_budget=args.budget,
                   optimizer_bytes_per_param=args.optimizer_bytes, fallback=args.fallback,
                   merge_followers=not args.no_merge, alias_blocks=not args.no_alias, solver=args.solver,
                   time_limit=args.time_limit, gap_rel=DEFAULT_GAP if args.gap is None else args.gap,
                   progress=True, name=args.model,
                   check_batch=not args.allow_indivisible_batch, outputs=args.outputs,
                   batch_norm=args.batch_norm, loss=args.loss,
                   prefer_data_parallel_within=(DATA_PARALLEL_MARGIN if args.prefer_data_parallel_within is None
                                                else args.prefer_data_parallel_within))
    if args.mp is not None:      # plan() captures the model itself, with its parameters in the working dtype
        from .models import build_model

        built = build_model(args.model, device="meta", batch=args.batch, seq=args.seq,
                            **({"num_layers": args.layers} if getattr(args, "layers", None) else {}))
        model, model_args, model_kwargs = built
        result = plan(model, model_args, model_kwargs, mp_policy=_mp_policy(args.mp, args.mp_reduce), **options)
    else:
        t0 = time.perf_counter()
        graph = _graph(args)
        capture_s = time.perf_counter() - t0
        result = plan(graph, **options)
        result.timings["capture_s"] = capture_s      # captured above (folded), before plan() ran
    _print_plan(result, full=args.full, plain=args.plain)
    if args.out:
        result.save(args.out)
        console.print(f"wrote {escape(str(args.out))}", highlight=False)
    else:
        console.print("(not saved: pass --out plan.json to save the plan)", highlight=False)
    return 0


def _preflight(args: argparse.Namespace) -> None:
    """Every check of the command's arguments that needs no model, run before the capture (which can
    take minutes): mesh, hardware profile, budget against the profile, writable output files. Each
    uses the library's own validator, so the command line and the API give the same errors."""
    from .api import resolve_budget
    from .hardware import load_hardware
    from .mesh import MeshSpec

    mesh = MeshSpec.of(args.mesh)
    hw = load_hardware(args.hardware)
    if getattr(args, "budget", None) is not None:
        resolve_budget(args.budget, hw)
    _check_preset_batch(args, mesh)
    for flag in ("out", "json"):
        if getattr(args, flag, None):
            _check_writable(getattr(args, flag), f"--{flag}")


def _check_preset_batch(args: argparse.Namespace, mesh) -> None:
    """For ``plan`` of a preset, the batch check the planner makes after the capture, made before it
    (a model file's batch is known only once its factory has run)."""
    from .api import _check_batch
    from .models import PRESETS

    if not hasattr(args, "allow_indivisible_batch") or args.allow_indivisible_batch or args.model not in PRESETS:
        return
    batch = args.batch if args.batch is not None else PRESETS[args.model].batch
    _check_batch([(f"'{args.model}' at --batch {batch}", (batch,))], mesh)


def _check_writable(path_text: str, flag: str) -> None:
    """ArgumentError unless ``path_text`` names a file that can be created in an existing folder."""
    import os
    from pathlib import Path

    from .api import ArgumentError

    path = Path(path_text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ArgumentError(f"{flag} {path_text} is a directory; name a file, e.g. {path / 'plan.json'}")
    if not folder.is_dir():
        raise ArgumentError(f"{flag} {path_text}: folder '{folder}' does not exist; create it first "
                            f"(mkdir -p {folder}) or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise ArgumentError(f"{flag} {path_text}: folder '{folder}' is not writable; write elsewhere")


def _node(table, name: str):
    """The strategies of node ``name``; ArgumentError with the closest names otherwise."""
    import difflib

    from .api import ArgumentError

    names = [ns.node for ns in table]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"the graph's nodes start {', '.join(names[:5])}"
        raise ArgumentError(f"--node {name!r} is not a node of the graph; {hint} (`autoshard enumerate ... --json "
                            f"out.json` lists them all)")
    return table[name]


def _explain(args: argparse.Namespace) -> int:
    """Print the explanation of a saved plan."""
    from .plans import Plan

    _print_plan(Plan.load(args.plan), full=args.full, plain=args.plain)
    return 0


def _print_plan(result, *, full: bool, plain: bool) -> None:
    """The plan's summary; with ``full`` also its per-node table, every node listed."""
    if not full:
        sys.stdout.write("\n".join(result.summary_lines()) + f"\nper-node decisions of the {len(result.nodes)} "
                         "graph nodes: add --full\n")
    elif plain or _plain:
        sys.stdout.write(result.explain(plain=True, full=True))
    else:
        console.print(result.renderable(full=True))


def _profile(args: argparse.Namespace) -> int:
    from .profile import run_profile

    return run_profile(args) or 0


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit status 2, as for every user error)."""

    def error(self, message: str) -> "typing.NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least_1(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), e.g. 0.01, got {text}")
    return value


def _float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except where there is none to show (None, a flag that is
    off, a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or action.required:
            return action.help
        return super()._get_help_string(action)


_FALLBACK_HELP = "an op with no sharding handler: error, or replicate (run whole on every device, reported)"


def build_parser() -> argparse.ArgumentParser:
    from .batch_norm_modes import BATCH_NORM_MODES, LOSS_MODES
    from .enumerate import OUTPUT_MODES

    p = _Parser(prog="autoshard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        if name != "profile":
            sp.add_argument("--plain", action="store_true",
                            help="plain text: no colours, no box drawing, no wrapping (also when output is not a "
                                 "terminal)")
        return sp

    ops = command("ops", "list supported ops and their per-axis sharding rules")
    ops.set_defaults(fn=_ops)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("model", help="preset (see autoshard.models.list_models()) or path/to/file.py:factory")
        sp.add_argument("--batch", type=_int_at_least_1, default=None,
                        help="batch size of the example inputs (default: the preset's, or the factory's own)")
        sp.add_argument("--seq", type=_int_at_least_1, default=None,
                        help="sequence length, the image side for the cnn preset (default: the preset's own)")
        sp.add_argument("--layers", type=_int_at_least_1, default=None, help="override the number of layers")

    def explain_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--full", action="store_true",
                        help="after the summary, the per-node table: every node's strategy, collectives and memory")

    cap = command("capture", "capture a model on meta tensors and summarise its graph")
    model_args(cap)
    cap.set_defaults(fn=_capture)

    en = command("enumerate", "enumerate the sharding strategies of every node")
    model_args(en)
    en.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x4 or 8")
    en.add_argument("--hardware", default="h100-nvlink", help="profile name or YAML path")
    en.add_argument("--fallback", choices=["error", "replicate"], default="error", help=_FALLBACK_HELP)
    en.add_argument("--node", help="print the strategies of this node")
    en.add_argument("--json", help="write all strategies to this JSON file")
    en.set_defaults(fn=_enumerate)

    pl = command("plan", "plan sharding + memory decisions for a model and save the plan")
    model_args(pl)
    pl.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x4 or 8")
    pl.add_argument("--hardware", default="h100-nvlink", help="profile name or YAML path")
    pl.add_argument("--budget", default=None,
                    help="memory budget per device, e.g. 40GiB (default: the profile's memory per device)")
    pl.add_argument("--out", default=None, help="write the plan to this JSON file")
    pl.add_argument("--optimizer-bytes", type=_non_negative, default=8.0,
                    help="optimizer state bytes per parameter element (AdamW fp32: 8)")
    pl.add_argument("--solver", choices=["highs", "cbc"], default="highs", help="ILP solver (PuLP backend)")
    pl.add_argument("--time-limit", type=_seconds, default=60.0, help="ILP time limit in seconds")
    pl.add_argument("--gap", type=_fraction, default=None,
                    help="relative optimality gap the ILP may stop at (default: autoshard.api.DEFAULT_GAP, 2%%; "
                         "0 proves the optimum)")
    pl.add_argument("--prefer-data-parallel-within", type=_fraction, default=None, metavar="FRACTION",
                    help="keep the data-parallel plan (where no ZeRO-3 or replicated plan is modeled faster) unless "
                         "the ILP's plan is modeled faster by more than this fraction of its step (default: autoshard.solver.baselines.DATA_PARALLEL_MARGIN, 5%%; 0 takes the "
                         "fastest plan as modeled)")
    pl.add_argument("--no-alias", action="store_true", help="do not share decisions between identical blocks")
    pl.add_argument("--no-merge", action="store_true", help="do not merge followers into their producers")
    pl.add_argument("--fallback", choices=["error", "replicate"], default="error", help=_FALLBACK_HELP)
    pl.add_argument("--outputs", choices=list(OUTPUT_MODES), default="global",
                    help="how the parallelized model returns its outputs: global (whole on every rank) or "
                         "local (tensors of rank >= 1 as each rank's shard, no collective; 0-dim ones global)")
    pl.add_argument("--batch-norm", choices=list(BATCH_NORM_MODES), default="global",
                    help="the statistics training batch norm normalises with: global (the whole batch's, as on "
                         "one device) or per_rank (each device's equal share of the batch, as torch DDP does)")
    pl.add_argument("--loss", choices=list(LOSS_MODES), default="global",
                    help="what a mean cross-entropy / nll loss divides by: global (the whole batch's target count, "
                         "as on one device) or per_rank (the mean of each device's equal share's mean, as torch "
                         "DDP computes it: no collective for the loss)")
    pl.add_argument("--mp", choices=["bf16", "fp16"], default=None,
                    help="mixed precision as FSDP2's MixedPrecisionPolicy: parameters cast to this dtype for "
                         "compute (the model's fp32 parameters are the master weights); default: none")
    pl.add_argument("--mp-reduce", choices=list(_MP_DTYPES), default="fp32",
                    help="with --mp: the dtype parameter gradients are reduced in (default fp32)")
    explain_args(pl)
    pl.add_argument("--allow-indivisible-batch", action="store_true",
                    help="plan even if the mesh size does not divide the batch (e.g. pure tensor parallelism)")
    pl.set_defaults(fn=_plan)

    ex = command("explain", "explain a saved plan: summary and per-node decisions")
    ex.add_argument("plan", help="plan JSON file written by `autoshard plan --out`")
    explain_args(ex)
    ex.set_defaults(fn=_explain)

    from .profile import add_profile_arguments

    prof = command("profile", "measure a hardware profile (run under torchrun)")
    add_profile_arguments(prof)
    prof.set_defaults(fn=_profile)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input: reported in one line, exit code 2, no traceback."""
    from .api import ArgumentError, BudgetError
    from .capture import CaptureError
    from .enumerate import UnsupportedOpError
    from .hardware import HardwareError
    from .mesh import MeshError
    from .models import ModelZooError
    from .plans import PlanError
    from .solver.ilp import InfeasibleBudgetError
    from .specs import SpecError

    return (ArgumentError, BudgetError, CaptureError, HardwareError, InfeasibleBudgetError, MeshError,
            ModelZooError, PlanError, SpecError, UnsupportedOpError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for every user error, reported in one line)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:          # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    _set_output(getattr(args, "plain", False))
    try:
        return args.fn(args)
    except _user_errors() as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        message = message.replace("fallback='replicate'", "--fallback replicate")   # the flag, not the keyword
        print(f"autoshard {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
