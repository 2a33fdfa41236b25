"""Logical device mesh: a 2D shape (a 1D mesh of n devices is the (1, n) case)."""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Sequence


class MeshError(ValueError):
    """A mesh shape that is malformed or does not match the world."""


def _size(value: object, mesh: object) -> int:
    """One mesh size: an integer (int, numpy integer) >= 1; never a bool or a float."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)      # type: ignore[arg-type]
    except TypeError:
        raise MeshError(f"mesh {tuple(mesh)!r}: every size must be an int >= 1, got {value!r} "  # type: ignore[arg-type]
                        f"({type(value).__name__}); write it as (2, 4), '2x4' or 8") from None
    if n < 1:
        raise MeshError(f"mesh {tuple(mesh)!r}: every size must be an int >= 1, got {n}; "  # type: ignore[arg-type]
                        f"write it as (2, 4), '2x4' or 8")
    return n


@dataclass(frozen=True)
class MeshSpec:
    """Shape of the logical mesh. Axis 0 is the outer (possibly slow, inter-node) axis."""

    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.shape):
            raise MeshError(f"mesh shape must be two positive ints, got {self.shape!r}; write it as (2, 4), "
                            f"'2x4' or 8")

    @staticmethod
    def of(mesh: "MeshSpec | Sequence[int] | str | int") -> "MeshSpec":
        """Accept a MeshSpec, ``(2, 4)``, ``[8]`` (as (1, 8)), ``8``, or ``"2x4"``."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, bool):
            raise MeshError(f"mesh {mesh!r} is a bool, not a device count; write it as (2, 4), '2x4' or 8")
        if isinstance(mesh, int):
            return MeshSpec((1, mesh))
        if isinstance(mesh, str):
            if not re.fullmatch(r"\d+(x\d+)?", mesh.strip()):
                raise MeshError(f"mesh {mesh!r} must look like '8' or '2x4'")
            parts = [int(p) for p in mesh.strip().split("x")]
            return MeshSpec.of(parts)
        if not isinstance(mesh, (tuple, list)):
            raise MeshError(f"mesh {mesh!r} ({type(mesh).__name__}) is not a mesh shape; write it as (2, 4), "
                            f"'2x4' or 8")
        shape = tuple(_size(s, mesh) for s in mesh)
        if len(shape) == 1:
            return MeshSpec((1, shape[0]))
        if len(shape) != 2:
            raise MeshError(f"only 1D and 2D meshes are supported, got shape {shape}; fold the axes into two, e.g. (2, 4)")
        return MeshSpec(shape)  # type: ignore[arg-type]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return 2

    def __str__(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"
