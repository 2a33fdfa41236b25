"""``with`` blocks in FX code: how generated graphs hold ``with checkpoint/offload ...:`` statements.

FX graphs cannot hold ``with`` blocks, so a regenerated graph carries them as node metadata
(``node.meta[WITH_BLOCK_META]``, one :class:`WithBlock` per block) and a small
:class:`torch.fx.graph.CodeGen` subclass writes them into ``.code``. Graph passes that rebuild nodes
(DCE, ``node.replace_all_uses_with``...) do not know about the blocks: run them before the graph is
regenerated, not after. Pickling a regenerated module re-traces the code and loses the blocks.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Sequence

from torch.fx.graph import CodeGen
from torch.fx.node import Node

__all__ = ["WITH_BLOCK_META", "WithBlock", "WithBlockCodeGen", "new_block", "with_block_codegen"]

# Set on nodes of the regenerated graph that must be emitted inside a `with` block.
WITH_BLOCK_META = "autoshard_with_block"


@dataclass(frozen=True)
class WithBlock:
    """Consecutive nodes sharing one ``WithBlock`` are emitted under one ``with header:``."""

    block_id: int
    header: str
    needs_node: str | None = None  # node the header reads; it must survive until the block


# Unique per process, so blocks of graphs regenerated from regenerated graphs never merge.
_BLOCK_IDS = itertools.count()


def new_block(header: str, needs_node: str | None = None) -> WithBlock:
    """A fresh block (one ``with header:``) that no other block merges with."""
    return WithBlock(next(_BLOCK_IDS), header, needs_node)
_COUNTER_LINE = re.compile(r"# COUNTER: (\d+)\n")


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line.strip() else line for line in text.split("\n"))


def _split_trailer(text: str) -> tuple[str, str]:
    """Split a node's code from the comment lines FX appends after it for the next node."""
    lines = text.split("\n")
    end = len(lines)
    while end > 0 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
        end -= 1
    if end == len(lines):
        return text, ""
    return "\n".join(lines[:end]) + "\n", "\n".join(lines[end:])


def _wrap_with_blocks(body: list[str], blocks: Sequence[WithBlock | None]) -> list[str]:
    """Insert ``with`` headers and indent the code of the nodes inside them.

    FX marks the start of each node's code with a ``# COUNTER: <node index>`` line (removed after
    the body transformer runs), which is how the code of a node is told apart from its neighbours'.
    """
    chunks: list[tuple[int | None, list[str]]] = [(None, [])]
    for piece in body:
        match = _COUNTER_LINE.fullmatch(piece)
        if match:
            chunks.append((int(match.group(1)), [piece]))
        else:
            chunks[-1][1].append(piece)
    block_of = [blocks[i] if i is not None else None for i, _ in chunks]
    out: list[str] = []
    for position, (_, pieces) in enumerate(chunks):
        block = block_of[position]
        if block is None:
            out.extend(pieces)
            continue
        marker, text = pieces[0], "".join(pieces[1:])
        out.append(marker)
        if block_of[position - 1] != block:
            out.append(f"{block.header}\n")
        code, trailer = _split_trailer(text)
        out.append(_indent(code))
        # Comments after the code belong to the next node: indent them only if it is in the block.
        stays_inside = position + 1 < len(chunks) and block_of[position + 1] == block
        out.append(_indent(trailer) if stays_inside else trailer)
    return out


class WithBlockMixin:
    """Makes any ``CodeGen`` honour ``node.meta[WITH_BLOCK_META]``."""

    def _gen_python_code(self, nodes: Any, *args: Any, **kwargs: Any) -> Any:
        node_list = list(nodes)
        blocks = [n.meta.get(WITH_BLOCK_META) for n in node_list]
        if not any(blocks):
            return super()._gen_python_code(nodes, *args, **kwargs)
        _check_block_dependencies(node_list, blocks)
        previous = self._body_transformer

        def transform(body: list[str]) -> list[str]:
            wrapped = _wrap_with_blocks(body, blocks)
            return previous(wrapped) if previous else wrapped

        self._body_transformer = transform
        try:
            return super()._gen_python_code(nodes, *args, **kwargs)
        finally:
            self._body_transformer = previous


def _check_block_dependencies(nodes: list[Node], blocks: list[WithBlock | None]) -> None:
    by_name = {n.name: n for n in nodes}
    for block in {b for b in blocks if b is not None and b.needs_node}:
        node = by_name.get(block.needs_node)
        # FX sets a value to None right after its last use; with no later user the header would
        # read None.
        if node is None or not node.users:
            raise RuntimeError(
                f"The `with` block '{block.header}' reads node {block.needs_node!r}, which was "
                "removed from the graph or lost its users after apply_memory_annotations. "
                "Run graph passes before apply_memory_annotations, not on its result."
            )


class WithBlockCodeGen(WithBlockMixin, CodeGen):
    """Plain FX codegen plus ``with`` blocks."""


_CODEGEN_CLASSES: dict[type, type] = {CodeGen: WithBlockCodeGen}


def with_block_codegen(base: CodeGen) -> CodeGen:
    """A copy of ``base`` (e.g. torch.export's pytree codegen) that also emits ``with`` blocks."""
    base_cls = type(base)
    if not issubclass(base_cls, WithBlockMixin) and base_cls not in _CODEGEN_CLASSES:
        # Subclass rather than wrap: FX checks isinstance(codegen, _PyTreeCodeGen) in places.
        _CODEGEN_CLASSES[base_cls] = type(f"WithBlock{base_cls.__name__}", (WithBlockMixin, base_cls), {})
    cls = base_cls if issubclass(base_cls, WithBlockMixin) else _CODEGEN_CLASSES[base_cls]
    codegen = cls.__new__(cls)
    codegen.__dict__.update(base.__dict__)  # shallow: pytree specs are immutable
    return codegen
