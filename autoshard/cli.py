"""The ``autoshard`` command line: ops, capture, enumerate, profile."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(stderr=False)


def _ops(args: argparse.Namespace) -> int:
    """List every supported op with its family and per-axis rules."""
    from .handlers import REGISTRY
    from .opinfo import op_name

    by_family: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for target, h in REGISTRY.items():
        rule = "replicate only" if h.replicate_only else h.doc
        by_family[h.family].append((op_name(target), rule))
    table = Table(title=f"autoshard: {len(REGISTRY)} supported ops")
    table.add_column("family")
    table.add_column("op")
    table.add_column("per-axis rule")
    for family in sorted(by_family):
        for name, rule in sorted(by_family[family]):
            table.add_row(family, name, escape(rule))
    console.print(table)
    return 0


def _build(args: argparse.Namespace):
    from .models import build_model

    overrides = {}
    if getattr(args, "layers", None):
        overrides["num_layers"] = args.layers
    return build_model(args.model, device="meta", batch=args.batch, seq=args.seq, **overrides)


def _capture(args: argparse.Namespace) -> int:
    from .capture import capture

    with console.status(f"capturing {args.model} on meta tensors..."):
        t0 = time.perf_counter()
        model, margs, mkwargs = _build(args)
        graph = capture(model, margs, mkwargs, name=args.model)
        seconds = time.perf_counter() - t0
    console.print(f"captured {args.model}: {len(list(graph.graph.nodes))} nodes in {seconds:.2f} s, "
                  f"fingerprint {graph.fingerprint()[:16]}")
    table = Table("op", "count")
    for op, n in sorted(graph.summary().items(), key=lambda kv: -kv[1]):
        table.add_row(op, str(n))
    console.print(table)
    return 0


def _enumerate(args: argparse.Namespace) -> int:
    from .capture import capture
    from .enumerate import enumerate_strategies

    with console.status(f"capturing {args.model} on meta tensors..."):
        model, margs, mkwargs = _build(args)
        graph = capture(model, margs, mkwargs, name=args.model)
    with console.status(f"enumerating strategies on mesh {args.mesh}..."):
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
        ns = table[args.node]
        t = Table("strategy", "fwd s", "bwd s", "comm s", "saved B")
        for s in ns.strategies:
            t.add_row(escape(s.name), f"{s.compute_fwd:.3g}", f"{s.compute_bwd:.3g}", f"{s.comm_time():.3g}",
                      str(s.memory.saved))
        console.print(t)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .profile import run_profile

    return run_profile(args) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoshard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    ops = sub.add_parser("ops", help="list supported ops and their per-axis sharding rules")
    ops.set_defaults(fn=_ops)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("model", help="preset (see autoshard.models.list_models()) or path/to/file.py:factory")
        sp.add_argument("--batch", type=int, default=None)
        sp.add_argument("--seq", type=int, default=None)
        sp.add_argument("--layers", type=int, default=None, help="override the number of layers")

    cap = sub.add_parser("capture", help="capture a model on meta tensors and summarise its graph")
    model_args(cap)
    cap.set_defaults(fn=_capture)

    en = sub.add_parser("enumerate", help="enumerate the sharding strategies of every node")
    model_args(en)
    en.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x4 or 8")
    en.add_argument("--hardware", default="h100-nvlink", help="profile name or YAML path")
    en.add_argument("--fallback", choices=["error", "replicate"], default="error")
    en.add_argument("--node", help="print the strategies of this node")
    en.add_argument("--json", help="write all strategies to this JSON file")
    en.set_defaults(fn=_enumerate)

    from .profile import add_profile_arguments

    prof = sub.add_parser("profile", help="measure a hardware profile (run under torchrun)")
    add_profile_arguments(prof)
    prof.set_defaults(fn=_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
