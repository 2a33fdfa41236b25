"""Logical device mesh: a 2D shape (a 1D mesh of n devices is the (1, n) case)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence


class MeshError(ValueError):
    """A mesh shape that is malformed or does not match the world."""


@dataclass(frozen=True)
class MeshSpec:
    """Shape of the logical mesh. Axis 0 is the outer (possibly slow, inter-node) axis."""

    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or any((not isinstance(s, int)) or s < 1 for s in self.shape):
            raise MeshError(f"mesh shape must be two positive ints, got {self.shape!r}")

    @staticmethod
    def of(mesh: "MeshSpec | Sequence[int] | str | int") -> "MeshSpec":
        """Accept a MeshSpec, ``(2, 4)``, ``[8]`` (as (1, 8)), ``8``, or ``"2x4"``."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, int):
            return MeshSpec((1, mesh))
        if isinstance(mesh, str):
            if not re.fullmatch(r"\d+(x\d+)?", mesh.strip()):
                raise MeshError(f"mesh {mesh!r} must look like '8' or '2x4'")
            parts = [int(p) for p in mesh.strip().split("x")]
            return MeshSpec.of(parts)
        shape = tuple(int(s) for s in mesh)
        if len(shape) == 1:
            return MeshSpec((1, shape[0]))
        if len(shape) != 2:
            raise MeshError(f"only 1D and 2D meshes are supported, got shape {shape}")
        return MeshSpec(shape)  # type: ignore[arg-type]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return 2

    def __str__(self) -> str:
        return f"{self.shape[0]}x{self.shape[1]}"
