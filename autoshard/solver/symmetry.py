"""Symmetry-breaking rows for identical blocks that do not share variables (aliasing off).

Without aliasing, each of k identical transformer blocks has its own strategy and decision
variables. Two such blocks can swap their whole configuration (every node's strategy and the memory
decision) without changing any cost or memory term, as long as their *boundary* agrees: the
positions whose nodes have edges leaving the block that differ from block to block (the residual
stream in and out), the positions some segment reads from outside its own block (a checkpointed
input), and the groups outside the block a segment reads (its checkpoint source). So one plan
appears many times over, and branch-and-bound has to refute each copy separately: GPT-2's unaliased
solve under a tight budget did not close its last 0.05% in 300 s.

The rows: for consecutive blocks t, t+1 of a class,
``rank(t) >= rank(t+1) - R * sum(d)``, with rank the memory decision's position in
``READOUT_ORDER`` counted from the end (recompute highest, keep lowest) and ``d`` continuous in
[0, 1] with ``d <= a + b`` and ``d <= 2 - a - b`` for each boundary pair and strategy (a, b the
two blocks' indicators of that strategy, or of that class of equal-cost strategies): every d is
0 when the boundaries agree, so the ranks must then not increase. Valid because bubble-sorting any
plan by rank, swapping only neighbours whose boundaries agree (swaps leave boundaries as they
are), reaches a plan with the same cost that meets every row. The order is also the one the
readout wants: the largest rebuilds on the earliest blocks.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pulp

from .costgraph import CostGraph


def order_identical_blocks(m, segment_forms: dict, counts_of: dict[str, dict],
                           rank: dict[str, int]) -> int:
    """Add the rows for every class of identical unaliased blocks of ``m.cg``; returns how many.

    ``segment_forms``: segment name -> its _SegmentForms; ``counts_of``: segment name -> decision
    counts of a class of that one segment; ``rank``: decision -> its rank."""
    cg: CostGraph = m.cg
    referenced = _referenced_from_outside(m, segment_forms)
    rows = 0
    for blocks in cg.identical_blocks:
        segs = [_segment_of(cg, block) for block in blocks]
        groups = [[m.group_of[n] for n in block] for block in blocks]
        if any(s is None or s not in counts_of for s in segs) or len({g[0] for g in groups}) < len(groups):
            continue     # a block split over segments, or aliased (shared variables): nothing to break
        boundary = _boundary_positions(cg, blocks, groups, referenced)
        for t in range(len(blocks) - 1):
            pairs = _external_pairs(m, segment_forms[segs[t]], segment_forms[segs[t + 1]],
                                    groups[t], groups[t + 1])
            if pairs is None:
                continue
            diffs = [d for p in boundary for d in _disagreement(m, groups[t][p], groups[t + 1][p])]
            for a, b, classes in pairs:
                diffs += _class_disagreement(m, a, b, classes)
            key = [pulp.lpSum(rank[k] * v for k, v in counts_of[s].items()) for s in (segs[t], segs[t + 1])]
            m.prob += key[0] - key[1] >= -max(rank.values()) * pulp.lpSum(diffs)
            rows += 1
    return rows


def _segment_of(cg: CostGraph, block: list[str]) -> str | None:
    """The one memory segment holding every compute node of ``block`` and nothing else."""
    segs = {cg.nodes[n].segment for n in block if cg.nodes[n].kind == "call_function"}
    if len(segs) != 1 or None in segs:
        return None
    (seg,) = segs
    inside = set(block)
    if any(n.segment == seg and n.name not in inside for n in cg.nodes.values()):
        return None
    return seg


def _referenced_from_outside(m, segment_forms: dict) -> set[str]:
    """Groups some segment's terms read although they are not among the segment's own nodes."""
    own: dict[str, set[str]] = {}
    for node in m.cg.nodes.values():
        if node.segment is not None:
            own.setdefault(node.segment, set()).add(m.group_of[node.name])
    return {g for name, f in segment_forms.items() for form in _forms(f) for g in form.coef
            if g not in own.get(name, set())}


def _boundary_positions(cg: CostGraph, blocks: list[list[str]], groups: list[list[str]],
                        referenced: set[str]) -> list[int]:
    """Positions whose strategy a swap of two blocks must not change: their edges leaving the block
    differ between blocks, or a segment reads them from outside."""
    members = [set(b) for b in blocks]
    outside: list[list[set]] = [[set() for _ in b] for b in blocks]
    where = {n: (t, k) for t, b in enumerate(blocks) for k, n in enumerate(b)}
    for e in cg.edges:
        for here, there, side in ((e.dst, e.src, "in"), (e.src, e.dst, "out")):
            if here in where:
                t, k = where[here]
                if there not in members[t]:
                    outside[t][k].add((there, side, e.src_member if side == "in" else e.dst_member,
                                       e.operand, e.src_output))
    return [k for k in range(len(blocks[0]))
            if any(outside[t][k] != outside[0][k] for t in range(len(blocks)))
            or any(g[k] in referenced for g in groups)]


def _forms(f) -> list:
    """Every form of a _SegmentForms, by its dataclass fields (a field added there is compared too)."""
    out = []
    for fld in dataclasses.fields(f):
        value = getattr(f, fld.name)
        out += value if isinstance(value, list) else [value]
    return out


def _external_pairs(m, fa, fb, own_a: list[str], own_b: list[str]):
    """The groups two segments read from outside their blocks, paired in order, each pair with
    its strategy classes (strategies of equal coefficients in every form); None when the segments
    differ in anything else (then they are not interchangeable)."""
    forms_a, forms_b = _forms(fa), _forms(fb)
    if len(forms_a) != len(forms_b):
        return None
    pos_a, pos_b = {g: k for k, g in enumerate(own_a)}, {g: k for k, g in enumerate(own_b)}
    ext_a, ext_b = [], []
    for x, y in zip(forms_a, forms_b):
        if not np.isclose(x.constant, y.constant, rtol=1e-9, atol=1e-12):
            return None
        inner_a = {pos_a[g]: v for g, v in x.coef.items() if g in pos_a}
        inner_b = {pos_b[g]: v for g, v in y.coef.items() if g in pos_b}
        if inner_a.keys() != inner_b.keys() or any(not np.allclose(inner_a[k], inner_b[k]) for k in inner_a):
            return None
        ext_a += [g for g in x.coef if g not in pos_a and g not in ext_a]
        ext_b += [g for g in y.coef if g not in pos_b and g not in ext_b]
    if len(ext_a) != len(ext_b):
        return None

    def signature(g: str, forms: list, s: int) -> tuple:
        return tuple(round(float(f.coef[g][s]), 12) if g in f.coef else 0.0 for f in forms)

    return [(a, b, ({s: signature(a, forms_a, s) for s in range(len(m.x[a]))},
                    {s: signature(b, forms_b, s) for s in range(len(m.x[b]))}))
            for a, b in zip(ext_a, ext_b) if a != b]


def _disagreement(m, a: str, b: str) -> list:
    """d per strategy: 0 unless exactly one of the groups ``a``, ``b`` (same strategy list) picks it."""
    xa, xb = m.x[a], m.x[b]
    if len(xa) < 2:
        return []
    return [_xor(m, u, v) for u, v in zip(xa, xb)]


def _class_disagreement(m, a: str, b: str, classes: tuple[dict, dict]) -> list:
    """As :func:`_disagreement` over classes of equal-cost strategies of two different groups."""
    sig_a, sig_b = classes
    out = []
    for sig in set(sig_a.values()) | set(sig_b.values()):
        u = pulp.lpSum(m.x[a][s] for s, v in sig_a.items() if v == sig)
        v = pulp.lpSum(m.x[b][s] for s, w in sig_b.items() if w == sig)
        out.append(_xor(m, u, v))
    return out


def _xor(m, u, v):
    d = m.var(0, 1, name="sym")
    m.prob += d <= u + v
    m.prob += d <= 2 - u - v
    return d
