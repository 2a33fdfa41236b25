"""Megatron's tensor-parallel roles: which linears are column- and which row-parallel, and which
embeddings are vocab-parallel (what :func:`autoshard.solver.baselines.megatron` shards how).

Known module names decide first (:data:`COLUMN_NAMES`, :data:`ROW_NAMES`, matched as a suffix of
the module path); any other linear follows the alternation rule described in
:mod:`autoshard.solver.baselines`."""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from .costgraph import CostGraph, block_of

__all__ = ["COLUMN", "COLUMN_NAMES", "ROW", "ROW_NAMES", "is_embedding_weight", "is_token_embedding",
           "linear_roles", "matmul_slot"]

aten = torch.ops.aten

COLUMN_NAMES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_attn", "c_fc",
    "query", "key", "value", "query_key_value", "intermediate.dense", "dense_h_to_4h", "fc1", "w1", "w3",
    "lm_head",
)
"""Module names (path suffixes) of column-parallel linears: shard the output features."""

ROW_NAMES: tuple[str, ...] = (
    "o_proj", "down_proj", "c_proj", "attention.output.dense", "output.dense", "out_proj",
    "dense_4h_to_h", "fc2", "w2",
)
"""Module names (path suffixes) of row-parallel linears: shard the input features."""

COLUMN, ROW = "column", "row"


_MATMULS = {aten.linear.default: (0, 1, 2), aten.addmm.default: (1, 2, 0), aten.mm.default: (0, 1, None)}
"""op -> (activation arg, weight arg, bias arg) positions."""


def matmul_slot(user: fx.Node, p: fx.Node) -> str | None:
    """'weight' / 'bias' when ``p`` is that argument of the matmul ``user``, else None."""
    pos = _MATMULS.get(user.target)
    if pos is None:
        return None
    args = user.args
    if len(args) > pos[1] and args[pos[1]] is p:
        return "weight"
    if pos[2] is not None and len(args) > pos[2] and args[pos[2]] is p:
        return "bias"
    return None


def _name_role(module_path: str) -> str | None:
    """COLUMN / ROW from the known-name tables (longest matching suffix wins), else None."""
    best: tuple[int, str] | None = None
    for names, role in ((COLUMN_NAMES, COLUMN), (ROW_NAMES, ROW)):
        for name in names:
            if module_path == name or module_path.endswith("." + name):
                if best is None or len(name) > best[0]:
                    best = (len(name), role)
    return None if best is None else best[1]


def _activation(user: fx.Node) -> fx.Node | None:
    arg = user.args[_MATMULS[user.target][0]]
    return arg if isinstance(arg, fx.Node) else None


def linear_roles(cg: CostGraph, use_names: bool = True) -> dict[str, str]:
    """Matmul node name -> COLUMN / ROW for every matmul that reads a parameter weight (not an
    embedding's). ``use_names=False`` applies the alternation rule to every matmul (the rule
    for unknown names; exposed so tests can check it against the name table)."""
    graph = cg.graph
    embedding_weights = {p for p in graph.param_fqn if is_embedding_weight(graph.node(p))}
    by_block: dict[tuple[str, int] | None, list[fx.Node]] = {}
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        w = node.args[_MATMULS[node.target][1]]
        if isinstance(w, fx.Node) and graph.is_param(w) and w.name not in embedding_weights:
            by_block.setdefault(block_of(graph, node), []).append(node)
    roles: dict[str, str] = {}
    for matmuls in by_block.values():
        run, previous = -1, object()
        for mm in matmuls:
            act = _activation(mm)
            if act is None or act is not previous:
                run += 1
            previous = act
            named = _name_role(graph.module_path(mm)) if use_names else None
            roles[mm.name] = named or (COLUMN if run % 2 == 0 else ROW)
    return roles


def is_embedding_weight(p: fx.Node) -> bool:
    return any(u.target is aten.embedding.default and u.args[0] is p for u in p.users)


_POSITION_NAMES = re.compile(r"(^|\.)(wpe|position_embeddings|embed_positions|token_type_embeddings)$")


def is_token_embedding(graph, p: fx.Node) -> bool:
    """An embedding weight looked up with indices computed from a user input (token ids), and
    not named like a position/token-type table: Megatron makes it vocab-parallel. Position
    tables (indexed by an ``arange``) stay replicated, as in Megatron-LM."""
    fqn = graph.param_fqn.get(p.name, "")
    if _POSITION_NAMES.search(fqn.rsplit(".", 1)[0]):
        return False
    lookups = [u for u in p.users if u.target is aten.embedding.default and u.args[0] is p]
    return any(_reads_user_input(graph, u.args[1]) for u in lookups)


def _reads_user_input(graph, node: object) -> bool:
    """Whether ``node`` is, or is computed from, a tensor user input."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if graph.is_user_input(n):
            return True
        stack.extend(n.all_input_nodes)
    return False
