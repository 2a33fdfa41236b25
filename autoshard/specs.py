"""Sharding specs: how a tensor is laid out over a 2D device mesh.

A spec has one entry per tensor dim. Each entry is the tuple of mesh axes that shard that dim,
outer axis first: ``()`` is replicated (``R``), ``(0,)`` is ``S0``, ``(1,)`` is ``S1`` and
``(0, 1)`` is ``S01`` (sharded over both axes, axis 0 outer). A spec may also be *partial* over
mesh axes: every device holds a summand and the true value is the sum over those axes.

Specs are written ``[S0, R, S1]`` or compactly ``S0RS1``; partial axes follow a ``+``:
``S0R+P1`` is partial over axis 1, ``RR+P01`` over both.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

DimSharding = tuple[int, ...]

MESH_AXES = 2
"""Every mesh is 2D (a 1D mesh of n devices is (1, n)): specs name mesh axes 0 and 1 only."""

_TOKEN = re.compile(r"R|S(\d+)")


class SpecError(ValueError):
    """A spec that cannot be parsed or does not fit a shape or mesh."""


@dataclass(frozen=True, order=True)
class ShardSpec:
    """Per-dim mesh-axis assignment plus the axes over which the tensor is a pending sum."""

    dims: tuple[DimSharding, ...]
    partial: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        used = [a for d in self.dims for a in d] + list(self.partial)
        bad = [a for a in used if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < MESH_AXES]
        if bad:
            raise SpecError(f"spec {self._fmt_compact()} names mesh axis {bad[0]!r}, but the mesh has axes 0 and 1 "
                            f"only (a 1D mesh is (1, n)); write each dim as R, S0, S1 or S01 and partial axes as "
                            f"+P0, +P1 or +P01")
        if len(used) != len(set(used)):
            raise SpecError(f"mesh axis used twice in spec {self._fmt_compact()}")
        for d in self.dims:
            if list(d) != sorted(d):
                raise SpecError(f"axes of a dim must be outer-first ascending, got {d}")
        if list(self.partial) != sorted(self.partial):
            object.__setattr__(self, "partial", tuple(sorted(self.partial)))

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def replicate(ndim: int) -> "ShardSpec":
        return ShardSpec(((),) * ndim)

    @staticmethod
    def parse(text: str) -> "ShardSpec":
        """Parse ``[S0, R, S1]``, ``S0RS1`` or either followed by ``+P<axes>``."""
        if not isinstance(text, str):
            raise SpecError(f"a spec is a string such as 'S0R' or '[S0, R]', got {text!r} ({type(text).__name__})")
        body, _, part = text.strip().partition("+")
        partial: tuple[int, ...] = ()
        if part:
            if not re.fullmatch(r"P\d+", part.strip()):
                raise SpecError(f"bad partial suffix {part!r} in {text!r}; expected e.g. '+P1'")
            partial = tuple(int(c) for c in part.strip()[1:])
        body = body.strip()
        if body.startswith("["):
            if not body.endswith("]"):
                raise SpecError(f"unbalanced brackets in spec {text!r}")
            items = [t.strip() for t in body[1:-1].split(",") if t.strip()]
        else:
            items = [m.group(0) for m in _TOKEN.finditer(body)]
            if "".join(items) != body:
                raise SpecError(f"cannot parse spec {text!r}; expected tokens R, S0, S1, S01")
        dims = []
        for item in items:
            if item == "R":
                dims.append(())
            elif re.fullmatch(r"S\d+", item):
                dims.append(tuple(int(c) for c in item[1:]))
            else:
                raise SpecError(f"bad dim entry {item!r} in spec {text!r}")
        return ShardSpec(tuple(dims), partial)

    # -- formatting -----------------------------------------------------------------------------
    @staticmethod
    def _dim_str(d: DimSharding) -> str:
        return "R" if not d else "S" + "".join(str(a) for a in d)

    def _fmt_compact(self) -> str:
        s = "".join(self._dim_str(d) for d in self.dims)
        if self.partial:
            s += "+P" + "".join(str(a) for a in self.partial)
        return s

    def __str__(self) -> str:
        return self._fmt_compact()

    def __repr__(self) -> str:
        return f"ShardSpec({self._fmt_compact()!r})"

    def to_list_str(self) -> str:
        s = "[" + ", ".join(self._dim_str(d) for d in self.dims) + "]"
        if self.partial:
            s += "+P" + "".join(str(a) for a in self.partial)
        return s

    # -- queries ----------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    def used_axes(self) -> set[int]:
        return {a for d in self.dims for a in d} | set(self.partial)

    def axis_dim(self, axis: int) -> int | None:
        """The tensor dim sharded over ``axis``, or None."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def is_replicated(self) -> bool:
        return not self.used_axes()

    def shard_factor(self, dim: int, mesh_shape: Sequence[int]) -> int:
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def local_shape(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one device's shard; raises SpecError when a dim does not divide."""
        self.check(shape, mesh_shape)
        return tuple(s // self.shard_factor(i, mesh_shape) for i, s in enumerate(shape))

    def fits(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        if len(shape) != len(self.dims):
            return False
        if any(a >= len(mesh_shape) for a in self.used_axes()):
            return False
        return all(s % self.shard_factor(i, mesh_shape) == 0 for i, s in enumerate(shape))

    def check(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> None:
        if len(shape) != len(self.dims):
            raise SpecError(f"spec {self} has {len(self.dims)} dims but the tensor has shape {tuple(shape)}")
        bad = [a for a in self.used_axes() if a >= len(mesh_shape)]
        if bad:
            raise SpecError(f"spec {self} uses mesh axis {bad[0]} but the mesh is {tuple(mesh_shape)}")
        for i, s in enumerate(shape):
            f = self.shard_factor(i, mesh_shape)
            if s % f:
                raise SpecError(
                    f"dim {i} of size {s} cannot be sharded {f} ways by {self._dim_str(self.dims[i])} "
                    f"on mesh {tuple(mesh_shape)}; pick a size divisible by {f} or another spec")

    def local_numel(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
        return math.prod(self.local_shape(shape, mesh_shape))

    # -- edits ----------------------------------------------------------------------------------------
    def with_dim(self, dim: int, axes: DimSharding) -> "ShardSpec":
        dims = list(self.dims)
        dims[dim] = tuple(axes)
        return ShardSpec(tuple(dims), self.partial)

    def with_partial(self, axes: Iterable[int]) -> "ShardSpec":
        return ShardSpec(self.dims, tuple(sorted(axes)))

    # -- DTensor ----------------------------------------------------------------------------------------
    def to_placements(self, mesh_ndim: int) -> tuple:
        """DTensor placements, one per mesh axis (S01 becomes Shard(d) on both axes, axis 0 outer)."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        out = []
        for axis in range(mesh_ndim):
            if axis in self.partial:
                out.append(Partial())
            else:
                d = self.axis_dim(axis)
                out.append(Replicate() if d is None else Shard(d))
        return tuple(out)

    @staticmethod
    def from_placements(placements: Sequence, ndim: int) -> "ShardSpec":
        from torch.distributed.tensor import Partial, Replicate, Shard

        dims: list[list[int]] = [[] for _ in range(ndim)]
        partial = []
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                dims[p.dim % ndim].append(axis)
            elif isinstance(p, Partial):
                if p.reduce_op != "sum":
                    raise SpecError(f"only sum-partial placements are supported, got {p}")
                partial.append(axis)
            elif not isinstance(p, Replicate):
                raise SpecError(f"unsupported DTensor placement {p!r}")
        return ShardSpec(tuple(tuple(d) for d in dims), tuple(partial))


def all_specs(ndim: int, mesh_ndim: int, *, with_partial: bool = False) -> list[ShardSpec]:
    """Every spec of a rank-``ndim`` tensor on a mesh with ``mesh_ndim`` axes (shape not checked).

    Each axis goes to one dim (None = unused, or 'P' = partial); axes sharing a dim are ordered
    ascending, so S10 is not produced: it is not an expressible layout here.
    """
    choices: list = [None] + list(range(ndim)) + (["P"] if with_partial else [])
    out = []

    def rec(axis: int, assign: list) -> None:
        if axis == mesh_ndim:
            dims: list[list[int]] = [[] for _ in range(ndim)]
            partial = []
            for a, c in enumerate(assign):
                if c == "P":
                    partial.append(a)
                elif c is not None:
                    dims[c].append(a)
            out.append(ShardSpec(tuple(tuple(d) for d in dims), tuple(partial)))
            return
        for c in choices:
            rec(axis + 1, assign + [c])

    rec(0, [])
    return out


def replicated_axes(spec: ShardSpec, mesh_shape) -> tuple[int, ...]:
    """Mesh axes (of size > 1) over which a tensor in ``spec`` has full copies."""
    return tuple(a for a in range(len(mesh_shape)) if a not in spec.used_axes() and mesh_shape[a] > 1)
