"""Plan files as JSON: reading one safely (a regular UTF-8 file of bounded size, never a pickle),
plain data to and from dataclasses with every field checked against its type hint, and Python values
made JSON-able. Nothing here knows the plan's fields: :mod:`.schema` declares them."""
from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Union

from ..units import format_bytes
from .errors import REPLAN as _REPLAN
from .errors import PlanError

__all__ = ["MAX_PLAN_BYTES", "jsonable", "load_dataclass", "parse_constant", "read_plan_text", "type_name"]

MAX_PLAN_BYTES = 1 << 30
"""The largest plan file :meth:`~autoshard.plans.Plan.load` reads (a 70B model's plan is a few MiB)."""

_PICKLE = (b"\x80",)           # pickle protocols 2+ start with PROTO (0x80)


def read_plan_text(path: Path) -> str:
    """The text of a plan file: a regular file (not a device such as /dev/zero, a directory or a
    pipe), at most :data:`MAX_PLAN_BYTES`, UTF-8; never unpickled or executed."""
    import stat

    try:
        st = path.stat()
    except OSError as e:
        raise PlanError(f"cannot read plan file '{path}': {e.strerror or e}; pass the JSON file "
                        f"`autoshard plan --out` or Plan.save wrote") from None
    if not stat.S_ISREG(st.st_mode):
        raise PlanError(f"plan path '{path}' is not a regular file (a directory, device or pipe); pass the JSON "
                        f"file `autoshard plan --out` or Plan.save wrote")
    if st.st_size > MAX_PLAN_BYTES:
        raise PlanError(f"plan file '{path}' is {format_bytes(st.st_size)}, more than a plan can be "
                        f"({format_bytes(MAX_PLAN_BYTES)}); pass the JSON file `autoshard plan --out` wrote")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise PlanError(f"cannot read plan file '{path}': {e.strerror or e}") from None
    if raw.startswith(_PICKLE):
        raise PlanError(f"plan file '{path}' is a Python pickle, not a JSON plan; autoshard never unpickles plans. "
                        f"{_REPLAN} (`autoshard plan ... --out {path}`).")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError(f"plan file '{path}' is binary, not a JSON plan (not UTF-8 text); it is corrupt or another "
                        f"kind of file. {_REPLAN} (`autoshard plan ... --out {path}`).") from None


def parse_constant(name: str) -> Any:
    """JSON's non-standard constants: Infinity is a number a plan may hold (an unbounded solver gap),
    NaN is not."""
    if name == "Infinity":
        return math.inf
    if name == "-Infinity":
        return -math.inf
    raise ValueError(f"{name} is not a number a plan can hold")



def jsonable(x: Any) -> Any:
    """Tuples to lists, numpy scalars to Python numbers, enum members to their values, recursively
    (JSON round-trips equal)."""
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


# -- loading (typed validation of plain data) ------------------------------------------------------

def type_name(x: Any) -> str:
    return "null" if x is None else {dict: "an object", list: "a list", str: "a string",
                                     bool: "a boolean", int: "a number", float: "a number"}.get(type(x), type(x).__name__)


def load_dataclass(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, checking every field against its type hint."""
    if not isinstance(data, dict):
        raise PlanError(f"{where} should be an object, got {type_name(data)}. {_REPLAN}.")
    hints = typing.get_type_hints(cls)
    def required(f: dataclasses.Field) -> bool:
        return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING

    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and required(f)]
    if missing:
        raise PlanError(f"{where} lacks field(s) {', '.join(repr(m) for m in missing)}; the file is "
                        f"incomplete or not an autoshard plan. {_REPLAN}.")
    values = {f.name: _convert(data[f.name], hints[f.name], f"{where}: field '{f.name}'")
              for f in dataclasses.fields(cls) if f.name in data}
    return cls(**values)


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against ``hint`` (dataclasses, list[X], dict[str, X], unions, scalars)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return load_dataclass(hint, value, where)
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                return _convert(value, option, where)
            except PlanError:
                continue
        raise _wrong_type(value, " or ".join(_hint_name(a) for a in args), where)
    if origin is list:
        if not isinstance(value, list):
            raise _wrong_type(value, "a list", where)
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(value, "an object", where)
        return {k: _convert(v, args[1], f"{where}['{k}']") for k, v in value.items()}
    return _scalar(value, hint, where)


def _scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is type(None):
        if value is not None:
            raise _wrong_type(value, "null", where)
        return None
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and type(value) is hint:
        return value
    raise _wrong_type(value, _hint_name(hint), where)


def _hint_name(hint: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _wrong_type(value: Any, expected: str, where: str) -> PlanError:
    return PlanError(f"{where} should be {expected}, got {type_name(value)} ({str(value)[:40]!r}); the "
                     f"file is corrupt or not an autoshard plan. {_REPLAN}.")
