"""Every op registered with a generated family (pointwise, matmul): every strategy simulated.

The cases come from the registry, not from a list: each op's inputs are derived from its schema
(``target._schema``), so registering an op (adding it to ``POINTWISE_OPS``, or one ``register``
call in ``handlers/matmul.py``) is all it takes to have all of its strategies checked, forward and
gradients, against the unsharded op (:func:`handler_utils.check_all_strategies`).

How inputs are derived, per schema argument:

- ``Tensor``: a tensor whose shape and dtype are the first combination of the family's candidate
  shapes (:data:`SHAPES`, every dim divisible by 4, most dims first) and dtypes (float, else bool:
  masks and conditions) that the op accepts on real values; values ``+-uniform(0.1, 0.9)``, or
  ``uniform(0.1, 0.9)`` where the signed ones give a non-finite output or gradient (log, sqrt,
  pow of a negative base). Float tensors require grad unless autograd has no derivative for the
  op (``floor_divide``, ``copy``: then forward only);
- ``Scalar``: a small float (0.5, 0.3, 0.7 in turn);
- an argument with a default keeps it; an optional one without a default is ``None``.

An op whose inputs cannot be derived (a required ``int``/``float``/``bool``/``str`` argument,
integer-only operands, optional arguments that may not all be ``None``) needs an entry in
:data:`OVERRIDES` (argument name -> value, :data:`TENSOR` for a derived tensor) or in
:data:`TESTED_ELSEWHERE` (the test that covers it); without one its case FAILS, naming the op.
An op of a family priced by FLOPs (matmul) must also have a nonzero FLOP count, or it would
cost nothing. Broadcasting, 0-dim and special-shape cases stay hand-written (test_handlers_pointwise.py,
test_handlers_matmul.py).
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from autoshard.handlers import REGISTRY
from autoshard.hardware import COMPUTE_FAMILIES
from autoshard.mesh import MeshSpec
from autoshard.opinfo import OpInfo, op_name
from handler_utils import MESHES, Fn, check_all_strategies, export_nodes, find_node

aten = torch.ops.aten
TESTS = Path(__file__).resolve().parent

FAMILIES = ("pointwise", "matmul")

# Candidate operand shapes per family; sizes distinct where they mean different things, all
# divisible by 4 so that every dim can be sharded on each test mesh (S01 included).
B, M, K, N = 4, 8, 12, 16
SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "pointwise": ((4, 8, 12), ()),
    "matmul": ((B, M, K), (B, K, N), (B, M, N), (M, K), (K, N), (M, N), (N, K), (K,), (N,)),
}
DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "pointwise": (torch.float32, torch.bool),
    "matmul": (torch.float32,),
}
SCALARS = (0.5, 0.3, 0.7)


class _Tensor:
    """Override value: a tensor derived like any Tensor argument (for an optional Tensor)."""

    def __repr__(self) -> str:
        return "TENSOR"


TENSOR = _Tensor()

# op name -> {argument name: value}: arguments the schema cannot give a generic value.
OVERRIDES: dict[str, dict[str, Any]] = {
    "aten.clamp.default": {"min": -0.5, "max": 0.5},           # not both None
    "aten.clamp.Tensor": {"min": TENSOR, "max": TENSOR},
    # p = 0: a random mask is drawn per simulated thread; coordinated draws need equal RNG states
    # across ranks (tests/distributed). Eval-mode dropout is hand-written.
    "aten.dropout.default": {"p": 0.0, "train": True},
    "aten.native_dropout.default": {"p": 0.0, "train": True},
}

# op name -> (test file, test function) that checks its strategies where a generic case cannot.
TESTED_ELSEWHERE: dict[str, tuple[str, str]] = {
    # in-place add only on a one-element buffer (BatchNorm's step counter)
    "aten.add_.Tensor": ("test_handlers_pointwise.py",
                         "test_inplace_counter_add_is_replicated_and_updates_the_buffer"),
    # custom op of transformers, with an int32 offsets operand
    "transformers.grouped_mm_fallback.default": ("test_handlers_grouped_mm.py", "test_every_strategy_simulates"),
}


class Underivable(Exception):
    """The op's inputs cannot be derived from its schema (and it has no override)."""


@dataclass(frozen=True)
class Case:
    """How to call one op: positional and keyword arguments, tensors as :class:`Slot`."""

    target: Any
    args: tuple
    kwargs: dict
    tensors: tuple[torch.Tensor, ...]
    grad: bool = True               # float operands require grad (False: the op has no derivative)

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The op on ``tensors`` in place of the slots."""

        def fill(v: Any) -> Any:
            return tensors[v.index] if isinstance(v, Slot) else v

        return self.target(*map(fill, self.args), **{k: fill(v) for k, v in self.kwargs.items()})


@dataclass(frozen=True)
class Slot:
    """The ``index``-th derived tensor."""

    index: int


def registered(families: Sequence[str] = FAMILIES) -> list[tuple[str, str]]:
    """(op name, family) of every registered target in ``families``, sorted."""
    return sorted((op_name(t), h.family) for t, h in REGISTRY.items() if h.family in families)


def _target(name: str) -> Any:
    return next(t for t in REGISTRY if op_name(t) == name)


def _values(shape: tuple[int, ...], dtype: torch.dtype, signed: bool, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    t = torch.rand(shape, generator=gen) * 0.8 + 0.1
    if signed:
        t = t * torch.where(torch.rand(shape, generator=gen) > 0.5, 1.0, -1.0)
    return t.to(dtype).requires_grad_()


def _probe(case: Case, tensors: Sequence[torch.Tensor]) -> str:
    """Run the op and its backward (ones cotangent): ``"ok"``, ``"non-finite"`` (an output or
    gradient is inf/NaN) or ``"no derivative"`` (autograd has none, as for ``floor_divide``)."""
    out = case.call(tensors)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    if not all(torch.isfinite(o).all() for o in outs if o.dtype.is_floating_point):
        return "non-finite"
    diff = [o for o in outs if o.requires_grad]
    need = [t for t in tensors if t.requires_grad]
    if not (diff and need):
        return "ok"
    try:
        grads = torch.autograd.grad(diff, need, [torch.ones_like(o) for o in diff], allow_unused=True)
    except RuntimeError as e:
        if "derivative for" in str(e) and "not implemented" in str(e):
            return "no derivative"
        raise
    return "ok" if all(g is None or torch.isfinite(g).all() for g in grads) else "non-finite"


def derive_case(target: Any, family: str, overrides: dict[str, Any] | None = None,
                seed: int = 0) -> Case:
    """Arguments for ``target`` from its schema (see the module docstring); raises
    :class:`Underivable` saying why not."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        raise Underivable("no schema (not an OpOverload)")
    overrides = dict(overrides or {})
    unknown = set(overrides) - {a.name for a in schema.arguments}
    if unknown:
        raise Underivable(f"overrides name no argument of {schema}: {sorted(unknown)}")
    args: list = []
    kwargs: dict = {}
    n_tensors = 0
    scalars = itertools.cycle(SCALARS)
    skipped_positional = False
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            raise Underivable(f"mutates its argument {a.name!r}")
        typ = a.type
        if a.name in overrides:
            value = overrides[a.name]
            if value is TENSOR:
                value, n_tensors = Slot(n_tensors), n_tensors + 1
        elif isinstance(typ, torch.TensorType):
            value, n_tensors = Slot(n_tensors), n_tensors + 1
        elif a.has_default_value():
            skipped_positional |= not a.kwarg_only
            continue
        elif isinstance(typ, torch.NumberType):
            value = next(scalars)
        elif isinstance(typ, torch.OptionalType):
            value = None
        else:
            raise Underivable(f"required argument {a.name!r} of type {typ} has no generic value")
        if a.kwarg_only or skipped_positional:
            kwargs[a.name] = value
        else:
            args.append(value)
    if n_tensors == 0:
        raise Underivable("no tensor argument")

    gen = torch.Generator().manual_seed(seed)
    kinds = list(itertools.product(SHAPES[family], DTYPES[family]))
    combos = sorted(itertools.product(kinds, repeat=n_tensors),
                    key=lambda c: (-sum(len(s) for s, _ in c),                  # most dims
                                   -len({n for s, _ in c for n in s}),          # fewest coinciding sizes
                                   sum(d == torch.bool for _, d in c)))         # float where accepted
    errors: list[str] = []
    for combo in combos:
        for signed in (True, False):
            tensors = tuple(_values(s, d, signed, gen) for s, d in combo)
            case = Case(target, tuple(args), kwargs, tensors)
            try:
                found = _probe(case, tensors)
                if found == "no derivative":       # checked forward only
                    tensors = tuple(t.detach() for t in tensors)
                    case = Case(target, tuple(args), kwargs, tensors, grad=False)
                    found = _probe(case, tensors)
                if found == "ok":
                    return case
            except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as e:
                errors.append(str(e).split("\n")[0])
                break                   # the op refuses these shapes/dtypes: try the next ones
    why = f"first error: {errors[0]}; last: {errors[-1]}" if errors else "non-finite values in both domains"
    raise Underivable(f"no operands among {family} shapes {SHAPES[family]} x dtypes "
                      f"{DTYPES[family]} work ({why})")


CASES = registered()


def test_the_generated_families_are_registered() -> None:
    families = {f for _, f in CASES}
    assert families == set(FAMILIES), families
    assert len([1 for _, f in CASES if f == "pointwise"]) > 50
    stale = (set(OVERRIDES) | set(TESTED_ELSEWHERE)) - {name for name, _ in CASES}
    assert not stale, f"overrides for ops not registered in {FAMILIES}: {sorted(stale)}"


@pytest.mark.parametrize("name,family", CASES, ids=[name for name, _ in CASES])
def test_every_strategy_of_every_registered_op_simulates(name: str, family: str) -> None:
    if name in TESTED_ELSEWHERE:
        path, test = TESTED_ELSEWHERE[name]
        assert f"def {test}(" in (TESTS / path).read_text(), f"{name}: {path}::{test} is gone"
        return
    target = _target(name)
    try:
        case = derive_case(target, family, OVERRIDES.get(name), seed=zlib.crc32(name.encode()))
    except Underivable as e:
        pytest.fail(f"{name} ({family}): cannot derive its inputs from the schema: {e}. Add it to "
                    f"OVERRIDES or TESTED_ELSEWHERE in {Path(__file__).name}")
    tensors = tuple(t.detach().requires_grad_(case.grad and t.dtype.is_floating_point) for t in case.tensors)
    graph, values = export_nodes(Fn(lambda _, *ts: case.call(ts)), tensors)
    try:
        node = find_node(graph, target)
    except LookupError:
        pytest.fail(f"{name}: capture does not keep it as one node: "
                    f"{sorted({str(n.target) for n in graph.graph.nodes if n.op == 'call_function'})}")
    if COMPUTE_FAMILIES.get(family) == "FLOPs":
        # priced by FLOPs: torch's FLOP counter must know the op (else register a formula with
        # torch.utils.flop_counter.register_flop_formula next to the handler), or it costs nothing
        profile = OpInfo(node, graph, MeshSpec(MESHES[0])).profile()
        assert profile.fwd_flops > 0 and (profile.bwd_flops > 0 or not case.grad), \
            f"{name}: the FLOP counter gives {profile.fwd_flops} forward, {profile.bwd_flops} backward"
    for mesh in MESHES:
        strategies = check_all_strategies(graph, node, values, mesh)
        out = strategies[0].output_specs[0]
        assert out is not None
        # every dim divides the mesh: each output dim is sharded by some strategy
        sharded = {d for s in strategies for d in range(out.ndim) if s.output_specs[0].dims[d]}
        assert sharded == set(range(out.ndim)), f"{name} on {mesh}: sharded output dims {sharded}"
        assert len(strategies) > 1 or out.ndim == 0


def test_registering_an_op_is_all_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op added to the registry gets a case and passes with no other edit; one whose inputs
    the schema cannot give fails, naming itself."""
    monkeypatch.setitem(REGISTRY, aten.acos.default, REGISTRY[aten.sin.default])
    monkeypatch.setitem(REGISTRY, aten.gcd.default, REGISTRY[aten.sin.default])
    assert {("aten.acos.default", "pointwise"), ("aten.gcd.default", "pointwise")} <= set(registered())
    test_every_strategy_of_every_registered_op_simulates("aten.acos.default", "pointwise")
    with pytest.raises(pytest.fail.Exception, match=r"aten\.gcd\.default \(pointwise\): cannot derive"):
        test_every_strategy_of_every_registered_op_simulates("aten.gcd.default", "pointwise")


# -- the derivation itself -------------------------------------------------------------------------

def test_required_non_tensor_arguments_are_not_guessed() -> None:
    with pytest.raises(Underivable, match="'p'"):
        derive_case(aten.dropout.default, "pointwise")


def test_integer_only_ops_are_not_derived() -> None:
    with pytest.raises(Underivable, match="gcd"):
        derive_case(aten.gcd.default, "pointwise")


def test_masks_are_bool_and_domains_follow_the_op() -> None:
    where = derive_case(aten.where.self, "pointwise")
    assert [t.dtype for t in where.tensors] == [torch.bool, torch.float32, torch.float32]
    assert (derive_case(aten.log.default, "pointwise").tensors[0] > 0).all()
    assert (derive_case(aten.neg.default, "pointwise").tensors[0] < 0).any()
    fill = derive_case(aten.fill.Tensor, "pointwise")
    assert [t.shape for t in fill.tensors] == [(4, 8, 12), ()]


def test_matmul_shapes_keep_every_logical_dim_distinct() -> None:
    """m, k, n (and the batch) get different sizes, so a rule that confuses two dims fails."""
    for op, sizes in [(aten.mm.default, 3), (aten.addmm.default, 3), (aten.linear.default, 4),
                      (aten.bmm.default, 4), (aten.baddbmm.default, 4), (aten.matmul.default, 4)]:
        shapes = [tuple(t.shape) for t in derive_case(op, "matmul").tensors]
        assert len({n for s in shapes for n in s}) == sizes, (op, shapes)
    assert [tuple(t.shape) for t in derive_case(aten.linear.default, "matmul").tensors] == [(B, M, K), (N, K)]
