"""Python source for a chunked graph: straight-line aten calls, with each region as a ``for`` loop.

The code is one function ``forward(self, <user inputs>)``. Every value is deleted right after its
last use (``del``), at the top level and inside loop bodies, so the memory the code holds matches
the estimate of :mod:`.memory`. Inside a loop, ``<name>_c`` is the current chunk of
``<name>``; region outputs are allocated before the loop and filled with ``narrow(...).copy_``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from .flow import tensors_of
from .regions import GraphInfo, Region

INDENT = "    "


@dataclass
class Stmt:
    """Source lines that define ``defines`` and read ``uses`` (names at the same nesting level)."""

    lines: list[str]
    defines: set[str] = field(default_factory=set)
    uses: set[str] = field(default_factory=set)


class _Raw(str):
    """A piece of source inserted as is (a loop variable inside a shape list)."""


class Emitter:
    """Formats arguments and callables as source; anything unprintable becomes a global."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {"torch": torch}
        self._ids: dict[int, str] = {}

    def constant(self, value: Any, hint: str) -> str:
        if id(value) not in self._ids:
            name = f"_{hint}{len(self._ids)}"
            self._ids[id(value)] = name
            self.globals[name] = value
        return self._ids[id(value)]

    def arg(self, a: Any, env: dict[fx.Node, str]) -> str:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, _Raw):
            return str(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x, env) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, float) and not math.isfinite(a):
            return f"float('{a}')"
        if a is None or isinstance(a, (bool, int, float, str)):
            return repr(a)
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            return str(a)
        if isinstance(a, torch.device):
            return f"torch.device({str(a)!r})"
        return self.constant(a, "const")

    def call(self, node: fx.Node, env: dict[fx.Node, str], args: tuple | None = None) -> str:
        args = node.args if args is None else args
        if node.target is operator.getitem:
            return f"{self.arg(args[0], env)}[{self.arg(args[1], env)}]"
        parts = [self.arg(a, env) for a in args]
        parts += [f"{k}={self.arg(v, env)}" for k, v in node.kwargs.items()]
        return f"{self.callable(node.target)}({', '.join(parts)})"

    def callable(self, target: Any) -> str:
        if isinstance(target, torch._ops.OpOverload):
            return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
        return self.constant(target, "fn_" + getattr(target, "__name__", "op").strip("_"))


def insert_dels(stmts: list[Stmt], keep: set[str], indent: str) -> list[str]:
    """Lines of ``stmts`` with ``del`` after each name's last use (names in ``keep`` stay)."""
    last: dict[str, int] = {}
    for i, s in enumerate(stmts):
        for name in s.defines | s.uses:
            last[name] = i
    defined = {n for s in stmts for n in s.defines}
    out: list[str] = []
    for i, s in enumerate(stmts):
        out.extend(indent + line for line in s.lines)
        dead = sorted(n for n, j in last.items() if j == i and n in defined and n not in keep)
        if dead:
            out.append(f"{indent}del {', '.join(dead)}")
    return out


class CodeGen:
    """Builds the source of ``forward`` for ``info`` with ``regions`` turned into loops."""

    def __init__(self, info: GraphInfo, regions: list[Region], inputs: list[fx.Node],
                 state: dict[fx.Node, str]) -> None:
        self.info, self.regions, self.inputs, self.state = info, regions, inputs, state
        self.emit = Emitter()
        self.env: dict[fx.Node, str] = {n: n.name for n in info.graph.nodes}
        taken = set(self.env.values())
        self.chunk_name: dict[fx.Node, str] = {}
        for n in info.graph.nodes:
            name = f"{n.name}_c"
            while name in taken:
                name += "_"
            taken.add(name)
            self.chunk_name[n] = name
        self.start_var = self._fresh("chunk_start", taken)
        self.len_var = self._fresh("chunk_len", taken)

    @staticmethod
    def _fresh(base: str, taken: set[str]) -> str:
        name = base
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    def source(self) -> str:
        params = ", ".join(["self"] + [self.env[p] for p in self.inputs])
        stmts = [Stmt([f"{self.env[p]} = {expr}"], {self.env[p]}) for p, expr in self.state.items()]
        starts = {r.start: r for r in self.regions}
        covered = {j for r in self.regions for j in range(r.start, r.end + 1)}
        for i, n in enumerate(self.info.nodes):
            if i in starts:
                stmts.extend(self._node_stmt(h) for h in starts[i].hoisted)
                stmts.append(self._loop_stmt(self.regions.index(starts[i]), starts[i]))
            if i not in covered:
                stmts.append(self._node_stmt(n))
        out = self.info.output
        result = self.emit.arg(out.args[0], self.env)
        stmts.append(Stmt([f"return {result}"], set(), {self.env[n] for n in out.all_input_nodes}))
        keep = {self.env[p] for p in self.state}
        body = insert_dels(stmts, keep | {self.env[n] for n in out.all_input_nodes}, INDENT)
        return f"def forward({params}):\n" + "\n".join(body) + "\n"

    def _node_stmt(self, n: fx.Node, env: dict[fx.Node, str] | None = None,
                   args: tuple | None = None, name: str | None = None) -> Stmt:
        env = self.env if env is None else env
        name = self.env[n] if name is None else name
        uses = {env[a] for a in n.all_input_nodes}
        return Stmt([f"{name} = {self.emit.call(n, env, args)}"], {name}, uses)

    def _loop_stmt(self, ri: int, r: Region) -> Stmt:
        env = dict(self.env)
        body: list[Stmt] = []
        for a, d in r.sliced.items():
            env[a] = self.chunk_name[a]
            body.append(Stmt([f"{env[a]} = {self.env[a]}.narrow({d}, {self.start_var}, {self.len_var})"],
                             {env[a]}, {self.env[a]}))
        for n in r.chunked:
            env[n] = self.chunk_name[n]
        outputs = set(r.outputs)
        for n in r.chunked:
            body.append(self._node_stmt(n, env, self._chunk_args(n, r), env[n]))
            if n in outputs:
                body.append(Stmt([f"{self.env[n]}.narrow({r.dims[n]}, {self.start_var}, {self.len_var})"
                                  f".copy_({env[n]})"], set(), {env[n]}))
        external = {self.env[a] for a in list(r.sliced) + list(r.whole)}
        lines = [f"# chunk loop {ri}: {r.describe()}"]
        lines += [self._alloc(o, r) for o in r.outputs]
        lines.append(f"for {self.start_var} in range(0, {r.size}, {r.chunk}):")
        lines.append(f"{INDENT}{self.len_var} = min({r.chunk}, {r.size} - {self.start_var})")
        lines += insert_dels(body, external, INDENT)
        return Stmt(lines, {self.env[o] for o in r.outputs}, external)

    def _chunk_args(self, n: fx.Node, r: Region) -> tuple:
        if n not in r.size_args:
            return n.args
        idx, d = r.size_args[n], r.dims[n]
        args = list(n.args)
        shape = list(args[idx])
        if shape[d] != -1:
            shape[d] = _Raw(self.len_var)
        args[idx] = shape
        return tuple(args)

    def _alloc(self, o: fx.Node, r: Region) -> str:
        t = tensors_of(o)[0]
        ref = next(iter(list(r.sliced) + list(r.whole)), None)
        device = f"{self.env[ref]}.device" if ref is not None else f"torch.device({str(t.device)!r})"
        return f"{self.env[o]} = torch.empty({list(t.shape)}, dtype={t.dtype}, device={device})"


def compile_source(source: str, globals_: dict[str, Any], filename: str) -> Callable[..., Any]:
    """Compile generated source into a function, keeping it visible to tracebacks."""
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(globals_)
    exec(compile(source, filename, "exec"), namespace)
    return namespace["forward"]


def generate(info: GraphInfo, regions: list[Region], inputs: list[fx.Node],
             state: dict[fx.Node, str]) -> tuple[str, dict[str, Any]]:
    """Source of ``forward`` and the globals it needs."""
    gen = CodeGen(info, regions, inputs, state)
    src = gen.source()
    return src, gen.emit.globals
