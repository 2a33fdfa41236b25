"""Consumers of one value that each need its gradient all-reduced share one all-reduce at run time
(autograd sums their partial gradients first, see ``runtime.lower``); the step-time model prices one
too (``evaluate.gradient_sync``). The plan's communication is built from the same analysis
(``gradient_sync(...).skipped``), and the distributed tests check the bytes the runtime moves
against it (tests/distributed/test_runtime_models.py, megatron plans included)."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from autoshard.solver.evaluate import gradient_sync
from autoshard.solver.shared_sync import shared_sync_credit
from autoshard.strategy import BWD
from test_baselines import baseline, graph

pytest.importorskip("transformers")


def _bwd_all_reduces(cg, choice):
    """(graph node, operand index, axes, seconds) of every strategy's inline backward gradient
    all-reduce on an operand (as the strategies price them, before the runtime's sharing)."""
    out = []
    for node in cg.nodes.values():
        for member in node.members:
            for a in node.member_strategy(member, choice[node.name]).comm:
                if a.phase == BWD and a.operand.startswith("in") and a.kind == "all_reduce" and not a.bucketed:
                    out.append((member, int(a.operand[2:]), tuple(a.axes), a.cost))
    return out


def test_tensor_parallel_attention_shares_the_input_gradient_all_reduce():
    cg = graph("llama-tiny")
    sol = baseline("llama-tiny", "megatron").solution
    sync = gradient_sync(cg, sol.choice)
    entries = _bwd_all_reduces(cg, sol.choice)
    fqn = {m: cg.graph.module_path(m) for m, *_ in entries}
    running = Counter(re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", fqn[m]))
                      for m, j, _, _ in entries if (m, j) not in sync.skipped)
    priced = Counter(re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", fqn[m]))
                     for m, *_ in entries)
    layers = [k for k in priced if k.endswith(".qkv")]
    assert len(layers) == 2
    for qkv in layers:                    # three priced, one runs: they read one normalized value
        assert priced[qkv] == 3 and running[qkv] == 1, (priced, running)
        gate_up = qkv.replace("self_attn.qkv", "mlp.gate_up")
        assert priced[gate_up] == 2 and running[gate_up] == 1, (priced, running)
    assert sync.shared == pytest.approx(sum(c for m, j, _, c in entries if (m, j) in sync.skipped) - sync.deferred)
    assert sync.shared > 0


def test_the_ilp_prices_the_same_sharing_where_every_consumer_reads_the_value_as_produced():
    """Megatron's shared all-reduces all read their value as produced and run inline: the ILP's
    credit (one all-reduce per value and axes) is the exact model's."""
    cg = graph("llama-tiny")
    sol = baseline("llama-tiny", "megatron").solution
    assert shared_sync_credit(cg, sol.choice) == pytest.approx(gradient_sync(cg, sol.choice).shared, rel=1e-12)
    assert shared_sync_credit(cg, sol.choice) > 0
