"""Op coverage: every op in the graphs of the supported models and of the model zoo's transformers
families (bench/model_zoo.py), with its strategy count on 2x2.

Run: python bench/op_coverage.py   (writes bench/results/op_coverage.{json,md}, used in the README)
"""
from __future__ import annotations

from collections import defaultdict

from _common import write

from autoshard import capture, enumerate_strategies
from autoshard.handlers import handler_for
from autoshard.models import build_model

MODELS = ["mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny"]


def main() -> None:
    counts: dict[str, list[int]] = defaultdict(list)
    models: dict[str, set[str]] = defaultdict(set)
    family: dict[str, str] = {}
    from model_zoo import FAMILIES

    from autoshard.runtime import capture_meta

    graphs = ((name, lambda name=name: capture(*build_model(name, device="meta"), name=name)) for name in MODELS)
    zoo = ((name, lambda name=name: capture_meta(*_zoo_model(FAMILIES[name][1]), name=name)) for name in FAMILIES)
    for name, build in [*graphs, *zoo]:
        graph = build()
        table = enumerate_strategies(graph, mesh_shape=(2, 2), hardware="h100-nvlink", fallback="replicate")
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            ns = table[node.name]
            counts[ns.op].append(len(ns))
            models[ns.op].add(name)
            h = handler_for(node.target)
            family[ns.op] = ("NO HANDLER (runs replicated only under fallback='replicate')" if h is None
                             else h.family + (" (replicate only)" if h.replicate_only else ""))
    rows = []
    for op in sorted(counts):
        c = counts[op]
        span = str(c[0]) if min(c) == max(c) else f"{min(c)}-{max(c)}"
        rows.append([f"`{op}`", family[op], span, len(c), ", ".join(sorted(models[op]))])
    data = {op: {"strategies": counts[op], "models": sorted(models[op]), "family": family[op]} for op in counts}
    write("op_coverage", data, ["op", "family", "strategies per node (2x2)", "nodes", "models"], rows,
          note="Strategy counts on a 2x2 mesh for the nodes of the tiny test models and the model zoo's "
               "families (range over nodes: shapes decide what divides).")


def _zoo_model(build):
    model, kwargs = build()
    return model.train(), (), kwargs


if __name__ == "__main__":
    main()
