"""The phases of a training step that costs and collectives are counted in: the shared vocabulary of
the handlers (which price each phase), the plan (which records them) and the runtime (which counts
the collectives it issues by phase).

``fwd``: the forward pass; ``bwd``: the backward pass; ``recompute``: a recomputed region's forward
run again inside backward (its collectives are counted apart from the first forward's).
"""
from __future__ import annotations

import enum
import sys

__all__ = ["Phase", "StrEnum"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:                                   # pragma: no cover - Python 3.10
    class StrEnum(str, enum.Enum):
        """:class:`enum.StrEnum` of Python 3.11: members are their string values (``str()``, format,
        JSON and comparisons with plain strings all see the value)."""

        __str__ = str.__str__
        __format__ = str.__format__


class Phase(StrEnum):
    """Phase of a step; a member equals its string (``Phase.FWD == "fwd"``), so plans keep plain
    strings in JSON."""

    FWD = "fwd"
    BWD = "bwd"
    RECOMPUTE = "recompute"
