"""Parsing of human-written sizes such as ``40GiB``."""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: "int | float | str") -> int:
    """``40GiB`` -> 42949672960; ints and floats pass through as bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"a size must be a byte count or a string such as '40GiB', got {value!r} "
                         f"({type(value).__name__})")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"a size must be finite, got {value}; write e.g. '40GiB' or a byte count")
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {value!r}; write e.g. '40GiB', '512MiB' or a byte count")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size):
        raise ValueError(f"size {value!r} is not finite; write e.g. '40GiB' or a byte count")
    return int(size)


def format_bytes(n: float, round_up: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches, to 2 decimals (rounded up with
    ``round_up``: a smallest budget that works must not print as one that does not)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = math.ceil(n / scale * 100) / 100 if round_up else n / scale
            return f"{value:.2f} {unit}"
    return f"{math.ceil(n) if round_up else int(n)} B"
