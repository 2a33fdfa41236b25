"""Cost graph: edges, resharding matrices, follower merging, block aliasing and evaluation."""
from __future__ import annotations

import functools
import operator
import random
import re

import numpy as np
import pytest
import torch
from torch import nn

from autoshard.capture import capture
from autoshard.enumerate import StrategyTable, enumerate_strategies
from autoshard.models import build_model
from autoshard.reshard import reshard_cost, reshard_plan
from autoshard.solver import CostGraph, block_of, build_cost_graph
from autoshard.solver.reference import reference_costs

MESH = (2, 2)
N_LAYERS = 4


# -- fixtures --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def table_of(name: str, num_layers: int | None = None) -> StrategyTable:
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    model, args, kwargs = build_model(name, **overrides)
    return enumerate_strategies(capture(model, args, kwargs), mesh_shape=MESH, fallback="replicate")


@functools.lru_cache(maxsize=None)
def graph_of(name: str, merge: bool, alias: bool, num_layers: int | None = N_LAYERS) -> CostGraph:
    num_layers = None if name == "mlp" else num_layers
    return build_cost_graph(table_of(name, num_layers), merge_followers=merge, alias_blocks=alias)


MODELS = ["mlp", "gpt2-tiny", "llama-tiny"]
LLMS = ["gpt2-tiny", "llama-tiny"]


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """A ModuleList of residual MLP blocks; ``hidden[i]`` is block i's inner width."""

    def __init__(self, hidden: list[int], width: int = 16, project: bool = True) -> None:
        super().__init__()
        # the input projection makes block 0's input require grad, like the other blocks'
        self.proj = nn.Linear(width, width) if project else nn.Identity()
        self.layers = nn.ModuleList(Block(width, h) for h in hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def stack_graph(hidden: list[int], project: bool = True) -> CostGraph:
    model = Stack(hidden, project=project).to("meta")
    x = torch.empty(8, 4, 16, device="meta")
    table = enumerate_strategies(capture(model, (x,)), mesh_shape=MESH, fallback="replicate")
    return build_cost_graph(table)


def random_choice(cg: CostGraph, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    return {name: rng.randrange(len(node)) for name, node in cg.nodes.items()}


def data_dependencies(table: StrategyTable) -> set[tuple[str, str, int]]:
    """(producer, consumer, operand) for every tensor a node reads, from the fx graph itself."""
    graph = table.graph
    deps = set()
    for node in graph.graph.nodes:
        j = 0
        for arg in _node_leaves((node.args, node.kwargs)):
            meta = graph.tensor_meta(arg)
            if node.target is operator.getitem and isinstance(meta, tuple):
                meta = meta[node.args[1]]
            if meta is None or isinstance(meta, tuple):
                continue
            deps.add((arg.name, node.name, j))
            j += 1
    return deps


def _node_leaves(x):
    if isinstance(x, torch.fx.Node):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _node_leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _node_leaves(v)


# -- structure -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_unmerged_graph_is_the_table(name):
    cg = graph_of(name, merge=False, alias=False)
    table = cg.table
    assert list(cg.nodes) == list(table.nodes)
    for node in cg.nodes.values():
        assert node.members == [node.name]
        assert node.strategies == table[node.name].strategies
        assert node.alias is None


@pytest.mark.parametrize("name", MODELS)
def test_edges_match_data_dependencies(name):
    cg = graph_of(name, merge=False, alias=False)
    edges = {(e.src_member, e.dst_member, e.operand) for e in cg.edges}
    assert edges == data_dependencies(cg.table)
    for e in cg.edges:
        assert (e.src, e.dst) == (e.src_member, e.dst_member)


@pytest.mark.parametrize("name", LLMS)
def test_merged_edges_plus_merge_edges_cover_dependencies(name):
    cg = graph_of(name, merge=True, alias=False)
    deps = data_dependencies(cg.table)
    edges = {(e.src_member, e.dst_member, e.operand) for e in cg.edges}
    internal = {d for d in deps if cg.node_of[d[0]] == cg.node_of[d[1]]}
    assert edges | internal == deps and not edges & internal
    # one internal (merge) edge per follower: followers have a single operand
    followers = [m for n in cg.nodes.values() for m in n.members[1:]]
    assert sorted(d[1] for d in internal) == sorted(followers)


@pytest.mark.parametrize("name", LLMS)
def test_edge_matrices_are_reshard_costs(name):
    cg = graph_of(name, merge=True, alias=False)
    table = cg.table
    mesh, hw = table.mesh.shape, table.hardware
    rng = random.Random(0)
    checked = 0
    for e in cg.edges:
        shape, item, dt = e.tensor.shape, e.tensor.dtype.itemsize, str(e.tensor.dtype)
        # index maps point at the spec each strategy really uses
        src, dst = cg.nodes[e.src], cg.nodes[e.dst]
        for c in range(len(src)):
            assert e.src_specs[e.src_index[c]] == src.output_spec(e.src_member, c, e.src_output)
        for c in range(len(dst)):
            assert e.dst_specs[e.dst_index[c]] == dst.member_strategy(e.dst_member, c).input_specs[e.operand]
        assert len(set(e.src_specs)) == len(e.src_specs) and len(set(e.dst_specs)) == len(e.dst_specs)
        for _ in range(3):
            a, b = rng.randrange(len(e.src_specs)), rng.randrange(len(e.dst_specs))
            s, d = e.src_specs[a], e.dst_specs[b]
            assert e.fwd[a, b] == reshard_cost(s, d, shape, item, mesh, hw, dt)
            plan = reshard_plan(s, d, shape, item, mesh, hw, dt)
            assert e.nbytes_fwd[a, b] == sum(c.nbytes for c in plan.collectives())
            if e.grad:
                assert e.bwd[a, b] == reshard_cost(d, s, shape, item, mesh, hw, dt)
                back = reshard_plan(d, s, shape, item, mesh, hw, dt)
                assert e.nbytes_bwd[a, b] == sum(c.nbytes for c in back.collectives())
            else:
                assert e.bwd[a, b] == 0 and e.nbytes_bwd[a, b] == 0
            checked += 1
    assert checked > 100
    assert any(e.grad for e in cg.edges) and any(not e.grad for e in cg.edges)
    assert any(e.fwd.max() > 0 for e in cg.edges)


def test_getitem_edges_read_the_selected_element():
    cg = graph_of("gpt2-tiny", merge=False, alias=False)
    getitems = [e for e in cg.edges if cg.table[e.dst_member].op == "getitem"]
    assert getitems
    fx_nodes = {n.name: n for n in cg.table.graph.graph.nodes}
    for e in getitems:
        assert e.src_output == fx_nodes[e.dst_member].args[1]
        assert e.tensor == cg.table.graph.tensor_meta(e.src_member)[e.src_output]


# -- follower merging ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LLMS)
def test_followers_merge_into_call_functions_of_their_segment(name):
    cg = graph_of(name, merge=True, alias=False)
    table = cg.table
    merged = [n for n in cg.nodes.values() if len(n.members) > 1]
    assert merged and max(len(n.members) for n in merged) >= 3      # chains merge transitively
    for node in merged:
        assert node.kind == "call_function"
        for m in node.members[1:]:
            assert len(table[m].operand_nodes) == 1
            assert cg.node_of[table[m].operand_nodes[0]] == node.name
            assert block_of(table.graph, table.graph.node(m)) == block_of(table.graph, table.graph.node(node.name))
        assert len(node) == len(table[node.name])                    # one per producer strategy
    assert all(len(n.members) == 1 for n in cg.nodes.values() if n.kind != "call_function")


@pytest.mark.parametrize("name", LLMS)
def test_merged_follower_choice_is_the_cheapest(name):
    """The heuristic's contract: per producer strategy, the follower strategy minimising
    resharding (fwd + bwd) plus its own time, up to one collective step's latency (the slack
    within which the producer's layout is preferred, see costgraph_build._tie_break)."""
    cg = graph_of(name, merge=True, alias=False)
    mesh, hw = cg.table.mesh.shape, cg.table.hardware
    slack = _merge_slack(cg)
    for node, m, c, spec, edge in _merged_followers(cg, graph_of(name, merge=False, alias=False)):
        shape, item, dt = edge.tensor.shape, edge.tensor.dtype.itemsize, str(edge.tensor.dtype)

        def cost(f):
            d = f.input_specs[0]
            back = reshard_cost(d, spec, shape, item, mesh, hw, dt) if edge.grad else 0.0
            return reshard_cost(spec, d, shape, item, mesh, hw, dt) + back + f.total_time
        best = min(cost(f) for f in cg.table[m].strategies)
        assert best - 1e-15 <= cost(node.member_strategy(m, c)) <= best + slack + 1e-15


def _merge_slack(cg) -> float:
    mesh, hw = cg.table.mesh.shape, cg.table.hardware
    return min(hw.axes[a].alpha for a in range(len(mesh)) if mesh[a] > 1)


def _merged_followers(cg, unmerged):
    """(node, follower, node strategy, producer output spec under it, the unmerged edge) of every
    merged follower of ``cg``."""
    for node in cg.nodes.values():
        for m in node.members[1:]:
            producer = cg.table[m].operand_nodes[0]
            edge = next(e for e in unmerged.edges if e.dst_member == m)
            for c in range(len(node)):
                yield node, m, c, node.output_spec(producer, c, edge.src_output), edge


@pytest.mark.parametrize("name", LLMS)
def test_merged_follower_ties_keep_the_producers_layout(name):
    """Among follower strategies as cheap as the cheapest up to one collective step's latency, the
    merge takes the one that needs no resharding, else the fewest resharding steps, then the fewest
    sharded axes (not the first index): a free local split ties with no resharding, but consumers
    wanting the producer's layout then gather."""
    cg = graph_of(name, merge=True, alias=False)
    mesh, hw = cg.table.mesh.shape, cg.table.hardware
    slack = _merge_slack(cg)
    checked = 0
    for node, m, c, spec, edge in _merged_followers(cg, graph_of(name, merge=False, alias=False)):
        shape, item, dt = edge.tensor.shape, edge.tensor.dtype.itemsize, str(edge.tensor.dtype)

        def key(f):
            d = f.input_specs[0]
            cost = reshard_cost(spec, d, shape, item, mesh, hw, dt) + f.total_time
            steps = len(reshard_plan(spec, d, shape, item, mesh, hw, dt).steps)
            if edge.grad:
                cost += reshard_cost(d, spec, shape, item, mesh, hw, dt)
                steps += len(reshard_plan(d, spec, shape, item, mesh, hw, dt).steps)
            return cost, d != spec, steps, len(d.used_axes())
        keys = [key(f) for f in cg.table[m].strategies]
        best = min(k[0] for k in keys)
        tied = [k[1:] for k in keys if k[0] <= best + max(best * 1e-9, 1e-15, slack)]
        chosen = key(node.member_strategy(m, c))
        assert chosen[1:] == min(tied), (node.name, m, c, str(spec))
        checked += len(tied) > 1
    assert checked          # the models do have ties


def test_llama_rotary_tables_are_not_split_and_gathered_back():
    """Llama's rotary cos/sin (getitem -> cast after ``wrap_with_set_grad_enabled``) merge
    without a free split that every layer would then all-gather back."""
    import autoshard
    graph = capture(*build_model("llama-tiny", batch=8))
    hosts = [n for n in graph.graph.nodes if n.name.startswith("wrap_with_set_grad_enabled")]
    if hosts:                                   # transformers < 5: cos/sin come out of a HOP
        rotary = {hosts[0].name} | {u.name for g in hosts[0].users for u in (g, *g.users)}
    else:                                       # transformers >= 5: plain cos/sin ops
        tables = [n for n in graph.graph.nodes if n.name in ("cos", "sin")]
        rotary = {n.name for n in tables} | {u.name for n in tables for u in n.users}
    assert len(rotary) >= 3, rotary             # the tables and their casts
    for baseline in ("megatron", "data_parallel", None):
        plan = autoshard.plan(graph, mesh=MESH, hardware="cpu-gloo", baseline=baseline)
        moved = [f"{e.src} -> {e.dst} {e.src_spec} -> {e.dst_spec}" for e in plan.reshards if e.src in rotary]
        assert not moved, (baseline, moved)


@pytest.mark.parametrize("name", LLMS)
def test_merged_and_unmerged_graphs_cost_the_same_choice(name):
    merged = graph_of(name, merge=True, alias=False)
    exact = graph_of(name, merge=False, alias=False)
    for seed in range(5):
        choice = random_choice(merged, seed)
        a = reference_costs(merged, choice)
        b = reference_costs(exact, merged.graph_choice(choice))
        for f in ("compute_fwd", "compute_bwd", "comm_fwd", "comm_bwd", "reshard_fwd", "reshard_bwd"):
            assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-9, abs=1e-15), f
        assert a.total == pytest.approx(b.total, rel=1e-9)
        assert (a.params, a.grads, a.saved, a.outputs) == (b.params, b.grads, b.saved, b.outputs)
        assert a.saved_by_segment == b.saved_by_segment
        assert a.reshard > 0


def test_merged_strategy_matches_its_costs():
    cg = graph_of("llama-tiny", merge=True, alias=False)
    for node in cg.nodes.values():
        time = node.costs.time()
        for c, s in enumerate(node.strategies):
            assert s.total_time == pytest.approx(time[c] - node.costs.optimizer[c], rel=1e-9, abs=1e-15)
            assert s.memory.saved == node.costs.saved[c]


# -- aliasing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LLMS)
@pytest.mark.parametrize("merge", [False, True])
def test_identical_layers_alias(name, merge):
    cg = graph_of(name, merge=merge, alias=True)
    classes = cg.alias_classes()
    assert classes
    for key, names in classes.items():
        assert len(names) == N_LAYERS                                # n_layers - 1 aliased copies
        segments = [cg.nodes[n].segment for n in names]
        assert len(set(segments)) == N_LAYERS
        assert len({len(cg.nodes[n]) for n in names}) == 1
        assert re.fullmatch(r"(transformer\.h|model\.layers)\.\*/\d+", key)
    # every node inside a layer is aliased, nothing outside is
    in_layers = {n.name for n in cg.nodes.values() if n.segment is not None}
    assert in_layers == {n for names in classes.values() for n in names}
    groups = cg.variable_groups()
    assert sum(g.count for g in groups) == len(cg.nodes)
    assert len(groups) == len(cg.nodes) - len(in_layers) * (N_LAYERS - 1) // N_LAYERS


@pytest.mark.parametrize("name", LLMS)
def test_edges_into_every_layer_form_one_group(name):
    cg = graph_of(name, merge=True, alias=True)
    groups = cg.edge_groups()
    assert sum(g.count for g in groups) == len(cg.edges)
    broadcast = [g for g in groups if cg.nodes[g.edge.src].alias is None and cg.nodes[g.edge.dst].alias]
    shared = [g for g in broadcast if g.count == N_LAYERS]
    assert shared, "a mask / rotary tensor consumed by every layer"
    for g in groups:
        for e in g.edges:
            assert np.array_equal(e.fwd, g.edge.fwd) and np.array_equal(e.bwd, g.edge.bwd)


@pytest.mark.parametrize("name", LLMS)
def test_grouped_cost_equals_evaluate(name):
    """What the ILP sums (groups x multiplicity) equals evaluate() of the expanded choice, and
    aliasing does not change the cost of a choice."""
    cg = graph_of(name, merge=True, alias=True)
    plain = graph_of(name, merge=True, alias=False)
    rng = random.Random(1)
    for _ in range(5):
        gchoice = {g.key: rng.randrange(g.n_strategies) for g in cg.variable_groups()}
        choice = cg.expand_groups(gchoice)
        ref = reference_costs(cg, choice)
        assert reference_costs(plain, choice).total == pytest.approx(ref.total, rel=1e-12)
        nodes = sum(g.count * cg.nodes[g.nodes[0]].costs.time()[gchoice[g.key]] for g in cg.variable_groups())
        edges = sum(g.count * g.edge.cost_of(gchoice[g.src_group], gchoice[g.dst_group])
                    for g in cg.edge_groups())
        assert nodes + edges == pytest.approx(ref.total, rel=1e-9)


def test_layers_that_differ_do_not_alias():
    assert stack_graph([32, 48]).alias_classes() == {}
    cg = stack_graph([32, 32, 48, 32])
    classes = cg.alias_classes()
    assert classes
    for names in classes.values():
        assert [cg.nodes[n].segment for n in names] == ["layers.0", "layers.1", "layers.3"]
    wide = [n for n in cg.nodes.values() if n.segment == "layers.2"]
    assert wide and all(n.alias is None for n in wide)


def test_identical_stack_aliases_all_layers():
    cg = stack_graph([32] * 3)
    classes = cg.alias_classes()
    assert classes and all(len(v) == 3 for v in classes.values())
    assert all(re.fullmatch(r"layers\.\*/\d+", k) for k in classes)


def test_a_block_whose_input_needs_no_grad_does_not_alias():
    """Block 0 reading the user input (no grad) has no input-gradient all-reduce: its costs
    differ, so it keeps its own variables; the identical later blocks alias among themselves."""
    cg = stack_graph([32] * 3, project=False)
    classes = cg.alias_classes()
    assert classes
    for key, names in classes.items():
        assert key.startswith("layers.*1/")
        assert [cg.nodes[n].segment for n in names] == ["layers.1", "layers.2"]
    assert all(n.alias is None for n in cg.nodes.values() if n.segment == "layers.0")


def test_aliasing_off_gives_no_groups():
    cg = graph_of("gpt2-tiny", merge=True, alias=False)
    assert cg.alias_classes() == {}
    assert len(cg.variable_groups()) == len(cg.nodes)
    assert len(cg.edge_groups()) == len(cg.edges)


# -- segments --------------------------------------------------------------------------------------

def test_segments_are_layer_instances():
    cg = graph_of("llama-tiny", merge=False, alias=False)
    segments = {n.segment for n in cg.nodes.values()}
    assert segments == {None} | {f"model.layers.{i}" for i in range(N_LAYERS)}
    graph = cg.table.graph
    for placeholder, fqn in graph.param_fqn.items():
        seg = cg.nodes[placeholder].segment
        if fqn.startswith("model.layers."):
            assert fqn.startswith(seg + ".")
        else:
            assert seg is None
    gpt2 = graph_of("gpt2-tiny", merge=False, alias=False)
    assert {n.segment for n in gpt2.nodes.values()} == {None} | {f"transformer.h.{i}" for i in range(N_LAYERS)}


# -- evaluation ------------------------------------------------------------------------------------

def _replicated(strategy) -> bool:
    return all(s.is_replicated() for s in strategy.input_specs) and all(
        s is None or s.is_replicated() for s in strategy.output_specs)


@pytest.mark.parametrize("name", MODELS)
def test_all_replicated_costs_only_compute(name):
    cg = graph_of(name, merge=False, alias=False)
    choice = {n: next(i for i, s in enumerate(node.strategies) if _replicated(s))
              for n, node in cg.nodes.items()}
    out = reference_costs(cg, choice)
    strategies = [cg.nodes[n].strategies[c] for n, c in choice.items()]
    assert out.compute_fwd == pytest.approx(sum(s.compute_fwd for s in strategies), rel=1e-12)
    assert out.compute_bwd == pytest.approx(sum(s.compute_bwd for s in strategies), rel=1e-12)
    assert out.comm == 0 and out.reshard == 0 and out.sync_bytes == 0
    assert out.optimizer > 0
    assert out.total == pytest.approx(out.compute + out.optimizer, rel=1e-12) and out.total > 0
    assert out.params == sum(p.numel() * p.element_size() for p in _params(cg))
    assert out.grads == out.params
    assert sum(out.saved_by_segment.values()) == out.saved > 0


def _params(cg: CostGraph):
    graph = cg.table.graph
    return [torch.empty(graph.tensor_meta(p).shape, dtype=graph.tensor_meta(p).dtype, device="meta")
            for p in graph.param_fqn]


def test_sharding_costs_communication():
    cg = graph_of("gpt2-tiny", merge=False, alias=False)
    choice = random_choice(cg, 3)
    out = reference_costs(cg, choice)
    assert out.comm + out.reshard > 0
    expected = sum(e.cost_of(choice[e.src], choice[e.dst]) for e in cg.edges)
    assert out.reshard == pytest.approx(expected, rel=1e-12)


def test_evaluate_rejects_bad_choices():
    cg = graph_of("mlp", merge=True, alias=True)
    choice = random_choice(cg, 0)
    name = next(iter(choice))
    with pytest.raises(KeyError, match="no strategy"):
        reference_costs(cg, {k: v for k, v in choice.items() if k != name})
    with pytest.raises(IndexError, match="strategies"):
        reference_costs(cg, {**choice, name: len(cg.nodes[name])})
    with pytest.raises(KeyError, match="not a node"):
        reference_costs(cg, {**choice, "nope": 0})


def test_graph_choice_covers_every_graph_node():
    cg = graph_of("llama-tiny", merge=True, alias=True)
    choice = random_choice(cg, 2)
    full = cg.graph_choice(choice)
    assert set(full) == set(cg.table.nodes)
    for name, k in full.items():
        assert 0 <= k < len(cg.table[name])


# -- stats -----------------------------------------------------------------------------------------

def test_stats_count_the_ilp():
    full = graph_of("llama-tiny", merge=False, alias=False).stats()
    small = graph_of("llama-tiny", merge=True, alias=True).stats()
    assert full["nodes"] == full["graph_nodes"] == full["variable_groups"]
    assert full["edge_variables"] == sum(e.fwd.size for e in graph_of("llama-tiny", False, False).edges)
    assert small["nodes"] < full["nodes"] and small["merged_followers"] > 0
    assert small["variable_groups"] < small["nodes"]
    assert small["edge_variables"] < full["edge_variables"] / 4
    assert small["build_seconds"] > 0 and small["segments"] == N_LAYERS


def test_block_of_parses_module_paths():
    cg = graph_of("gpt2-tiny", merge=False, alias=False)
    graph = cg.table.graph
    blocks = {block_of(graph, n) for n in graph.graph.nodes}
    assert blocks == {None} | {("transformer.h", i) for i in range(N_LAYERS)}
