"""The driver code of parameter offload: one generated ``forward`` that loads, runs and releases
each slice in turn (and prefetches the next), with every value a list over microbatches."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from ..units import format_bytes
from .slicing import SlicePlan

__all__ = ["driver_code"]


def driver_code(plans: list[SlicePlan], user_inputs: list[fx.Node], out_node: fx.Node, prefetch: bool,
                 checkpoint: bool, m: int, device: torch.device) -> tuple[str, Callable]:
    total = sum(p.nbytes for p in plans)
    lines = [f"def forward(rt, {', '.join(n.name for n in user_inputs)}):",
             f"    # {len(plans)} slices streaming {format_bytes(total)} of parameters from host to {device}; "
             f"{'checkpointed' if checkpoint else 'autograd-tracked'} slices, {m} microbatch(es).",
             "    # Every value is a list with one entry per microbatch."]
    for p in plans:
        lines.append(f"    # slice {p.index}/{len(plans)}: {p.describe()}")
        lines.append(f"    rt.load({p.index})  # host -> {device} copies of this slice's parameters")
        if prefetch and p.index + 1 < len(plans):
            lines.append(f"    rt.prefetch({p.index + 1}, 'forward')  # side-stream copy overlaps slice {p.index}")
        call = f"rt.run({p.index}{''.join(', ' + x for x in p.inputs)})"
        if p.outputs:
            lines.append(f"    {', '.join(p.outputs)}, = {call}")
        else:
            lines.append(f"    {call}")
        lines.append(f"    rt.release({p.index}, 'forward')  # drop the device copies")
    outs = []
    for a in out_node.args[0]:
        outs.append(a.name if isinstance(a, fx.Node) else f"rt.same({a!r})")
    lines.append(f"    return rt.combine({', '.join(outs)})")
    src = "\n".join(lines) + "\n"
    glb: dict[str, Any] = {"torch": torch}
    exec(compile(src, "<param_offload driver>", "exec"), glb)
    return src, glb["forward"]
