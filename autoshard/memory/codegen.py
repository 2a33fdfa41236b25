"""Activation checkpoint / offload annotations on FX nodes -> regenerated, readable code.

:func:`apply_memory_annotations` reads the annotations of :mod:`.annotations`, finds their regions
(:mod:`.regions`) and copies the graph into a new one in which each checkpoint region is a
submodule (``self.checkpoint_0``, nested ones ``self.checkpoint_0.checkpoint_0_1``) called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or the runtime's
``partitioned_checkpoint``), and each plain offload region runs under the hooks of
:mod:`.host_offload`, written as ``with`` blocks (:mod:`.with_blocks`). The returned module shares
parameters and submodules with the input; its state-dict keys for weights used inside checkpoint
regions gain the region prefix (``checkpoint_0.linear1.weight``). Run graph passes that rebuild nodes
before this function, not on its result.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint
from torch import fx, nn
from torch.fx.node import Node

from .annotations import (CHECKPOINT_META, OFFLOAD_META, PARTITION_AXES_META, PARTITION_META, PlainOffload,
                          offload_annotation, validate_annotations)
from .host_offload import HostOffloadRegion
from .module_state import STATE_META, state_of, state_ref
from .regions import Region, checkpoint_regions, plain_offload_regions
from .with_blocks import WITH_BLOCK_META, WithBlock, new_block, with_block_codegen

__all__ = ["apply_memory_annotations"]


def _fetch_attr(root: nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), root)


def _clean_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in (CHECKPOINT_META, OFFLOAD_META, PARTITION_META)}


class _GraphBuilder:
    """Copies nodes of the annotated graph into a new graph, replacing regions as it goes.

    ``root`` is the annotated GraphModule: every get_attr / call_module target refers to it.
    """

    def __init__(self, root: nn.Module, graph: fx.Graph, pin_memory: bool) -> None:
        self.root = root
        self.graph = graph
        self.pin_memory = pin_memory
        self.env: dict[Node, Node] = {}
        self.attrs: dict[str, Any] = {}
        self._attr_nodes: dict[str, Node] = {}

    # -- basic copying ------------------------------------------------------------------------

    def lookup(self, old: Node) -> Node:
        if old.op == "get_attr":
            return self._get_attr(old)
        return self.env[old]

    def _get_attr(self, old: Node) -> Node:
        target = str(old.target)
        if target not in self._attr_nodes:
            self.attrs[target] = _fetch_attr(self.root, target)
            self._attr_nodes[target] = self.copy(old)
        return self._attr_nodes[target]

    def copy(self, old: Node, block: WithBlock | None = None) -> Node:
        """Copy ``old``; ``block`` puts it in a `with` block (an existing block is kept otherwise)."""
        new = self.graph.node_copy(old, self.lookup)
        new.meta = _clean_meta(new.meta)
        if block is not None:
            new.meta[WITH_BLOCK_META] = block
        if old.op == "call_module":
            self.attrs[str(old.target)] = self.root.get_submodule(str(old.target))
        if old.op != "get_attr":
            self.env[old] = new
        return new

    def fresh_attr(self, base: str, value: Any) -> str:
        name, suffix = base, 0
        while hasattr(self.root, name) or any(t.split(".")[0] == name for t in self.attrs):
            suffix += 1
            name = f"{base}_{suffix}"
        self.attrs[name] = value
        return name

    def module(self, class_name: str) -> fx.GraphModule:
        gm = fx.GraphModule(self.attrs, self.graph, class_name=class_name)
        gm.training = self.root.training
        return gm

    # -- regions ------------------------------------------------------------------------------

    def emit(self, nodes: Sequence[Node], level: int) -> None:
        """Copy ``nodes`` (one level of nesting) into the graph."""
        starts: dict[Node, Callable[[], None]] = {}
        skip: set[Node] = set()
        for region in checkpoint_regions(nodes, level):
            starts[region.nodes[0]] = functools.partial(self._emit_checkpoint, region, level)
            skip.update(region.nodes)
        if level == 0:
            for region, spec in plain_offload_regions(nodes):
                starts[region.nodes[0]] = functools.partial(self._emit_plain_offload, region, spec)
                skip.update(region.nodes)
        for node in nodes:
            if node in starts:
                starts[node]()
            elif node not in skip and node.op != "get_attr":
                self.copy(node)

    def _region_module(self, region: Region, level: int) -> fx.GraphModule:
        sub = _GraphBuilder(self.root, fx.Graph(), self.pin_memory)
        for inp in region.inputs:
            placeholder = sub.graph.placeholder(inp.name)
            placeholder.meta = _clean_meta(inp.meta)
            if inp.meta.get(STATE_META):
                placeholder = sub.graph.call_function(state_of, (placeholder,), name=f"{inp.name}_state")
                placeholder.meta = _clean_meta(inp.meta)
            sub.env[inp] = placeholder
        sub.emit(region.nodes, level + 1)
        outputs = [sub.env[o] for o in region.outputs]
        sub.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        return sub.module("CheckpointRegion")

    def _bind_outputs(self, region: Region, call: Node) -> None:
        if len(region.outputs) == 1:
            self.env[region.outputs[0]] = call
            call.meta = _clean_meta(region.outputs[0].meta)
            return
        for index, out in enumerate(region.outputs):
            item = self.graph.create_node("call_function", operator.getitem, (call, index), name=out.name)
            item.meta = _clean_meta(out.meta)
            self.env[out] = item

    def _emit_checkpoint(self, region: Region, level: int) -> None:
        label = "_".join(str(k) for k in region.key)
        name = self.fresh_attr(f"checkpoint_{label}", self._region_module(region, level))
        fn = self.graph.get_attr(name)
        args = (fn, *(self.graph.call_function(state_ref, (self.lookup(i),)) if i.meta.get(STATE_META)
                      else self.lookup(i) for i in region.inputs))
        # Offloading applies to the outermost region: inner regions' inputs are not kept anyway.
        offload = level == 0 and any(offload_annotation(n) is True for n in region.nodes)
        call_name = region.outputs[0].name if len(region.outputs) == 1 else f"{name}_out"
        if level == 0 and any(n.meta.get(PARTITION_META) for n in region.nodes):
            from ..runtime.partition import partitioned_checkpoint

            self.attrs["comm"] = self.root.comm
            axes = tuple(tuple(i.meta.get(PARTITION_AXES_META, ())) for i in region.inputs)
            call = self.graph.create_node(
                "call_function", partitioned_checkpoint, (fn, self.graph.get_attr("comm"), axes, *args[1:]),
                name=call_name)
        else:
            call = self.graph.create_node(
                "call_function", torch.utils.checkpoint.checkpoint, args, {"use_reentrant": False},
                name=call_name,
            )
        self._bind_outputs(region, call)
        if offload:
            header = f"with torch.autograd.graph.save_on_cpu(pin_memory={self.pin_memory}):"
            call.meta[WITH_BLOCK_META] = new_block(header)

    def _emit_plain_offload(self, region: Region, spec: PlainOffload) -> None:
        name = self.fresh_attr(f"offload_{spec.region_id}",
                               HostOffloadRegion(spec.region_id, spec.offload_inputs, spec.offload_rest))
        # Load attributes first so the `with` block holds only the region's own nodes.
        for node in region.nodes:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    self.lookup(arg)
        inputs = tuple(self.lookup(i) for i in region.inputs)
        hooks = self.graph.create_node("call_module", name, inputs, name=f"{name}_hooks")
        block = new_block(
            f"with torch.autograd.graph.saved_tensors_hooks({hooks.name}.pack, {hooks.name}.unpack):",
            needs_node=hooks.name,
        )
        for node in region.nodes:
            self.copy(node, block)
        outputs = tuple(self.env[o] for o in region.outputs)
        self.graph.create_node("call_method", "prefetch_on_backward", (hooks, *outputs),
                               name=f"{name}_prefetch")


def apply_memory_annotations(gm: fx.GraphModule, *, pin_memory: bool = True) -> fx.GraphModule:
    """Regenerate ``gm`` with its checkpoint / offload annotations turned into code.

    Works on ``torch.fx.symbolic_trace`` graphs and on ``torch.export(...).module()`` graphs
    (the pytree calling convention is kept). ``gm`` itself is not modified; the result shares its
    parameters, buffers and submodules. ``pin_memory`` is passed to ``save_on_cpu`` for offloaded
    checkpoint inputs (it only pins when CUDA is available). Raises
    :class:`MemoryAnnotationError`, naming the node, for malformed annotations.
    """
    validate_annotations(gm.graph)
    graph = fx.Graph()
    graph.set_codegen(with_block_codegen(gm.graph._codegen))
    builder = _GraphBuilder(gm, graph, pin_memory)
    builder.emit(list(gm.graph.nodes), level=0)
    result = builder.module("GraphModule")
    result.meta = dict(getattr(gm, "meta", {}))
    return result
