"""The layout's contracts, checked from the source: the runtime reads plans without the planner,
and no two autoshard modules import each other (directly or around a cycle)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoshard"
PLANNING = ("pulp", "highspy", "autoshard.solver", "autoshard.api", "autoshard.plans.build")


# -- the runtime loads no planning module ------------------------------------------------------------

_LOAD_PLAN = """
import json, sys
import autoshard.runtime
from autoshard import Plan
plan = Plan.load(sys.argv[1])
assert plan.nodes, "the plan has no nodes"
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    import torch
    from torch import nn

    import autoshard

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = autoshard.plan(model, (torch.randn(4, 8),), mesh=(2, 2), hardware="cpu-gloo")
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def test_runtime_and_plan_load_import_no_planner(plan_file: Path) -> None:
    """``import autoshard.runtime`` and ``autoshard.Plan.load`` (what every torchrun rank does) import
    neither PuLP, HiGHS nor any solver module (a fresh interpreter, so sys.modules is clean)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _LOAD_PLAN, str(plan_file)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "autoshard.runtime" in modules and "autoshard.plans.schema" in modules
    loaded = [m for m in modules if any(m == p or m.startswith(p + ".") for p in PLANNING)]
    assert not loaded, f"importing the runtime and loading a plan imported planning modules: {loaded}"


def test_public_api_still_reaches_the_planner() -> None:
    import autoshard

    assert callable(autoshard.plan) and "plan" in dir(autoshard)
    assert autoshard.InfeasibleBudgetError.__name__ == "InfeasibleBudgetError"
    with pytest.raises(AttributeError):
        autoshard.no_such_name  # noqa: B018


# -- no import cycles ---------------------------------------------------------------------------------

def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported autoshard module: line}: every ``import``/``from ... import`` of an
    autoshard module, at module level or inside functions, relative or absolute (those under
    ``if TYPE_CHECKING:`` excepted: they never run). ``from pkg import name`` counts as importing
    the submodule ``pkg.name`` when there is one, else ``pkg``."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str | None, line: int) -> None:
            if target and target != module:
                edges.setdefault(target, line)

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    visit(child)
                return
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "autoshard":
                        add(resolve(alias.name), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                if full.split(".")[0] == "autoshard":
                    for alias in node.names:
                        sub = f"{full}.{alias.name}"
                        add(sub if sub in modules else resolve(full), node.lineno)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text(), str(path)))
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}       # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = dfs(start)
            if found:
                return found
    return None


def test_import_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    assert "autoshard.plans.schema" in graph["autoshard.plans"]
    assert "autoshard.solver.costgraph_build" in graph["autoshard.api"]
    assert "autoshard.handlers" in graph["autoshard.enumerate"]            # a function-level import
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("autoshard modules import each other around a cycle:\n  " + "\n  ".join(steps))


def test_the_runtime_imports_no_strategy_enumeration() -> None:
    """The runtime lowers each node from the plan's stored decision (Strategy.from_plan): no runtime
    module imports the enumerator (the behaviour is tests/test_plan_contract.py)."""
    graph = import_graph()
    runtime = [m for m in graph if m == "autoshard.runtime" or m.startswith("autoshard.runtime.")]
    assert "autoshard.runtime.lower" in runtime
    importing = {m: graph[m]["autoshard.enumerate"] for m in runtime if "autoshard.enumerate" in graph[m]}
    assert not importing, f"runtime modules that import autoshard.enumerate (module: line): {importing}"
