"""Hardware profiles: the numbers every cost in autoshard is computed from.

A profile lives in ``configs/hardware/<name>.yaml``. Communication on each mesh axis follows the
alpha-beta model: a message of ``b`` bytes takes ``alpha + beta * b`` seconds per ring step.
Axis 0 is the outer (possibly inter-node) axis; axis 1 the inner one.

``device_memory_separate`` says whether a device has memory of its own apart from host memory
(GPUs: true, the default). It is false for CPU ranks (``cpu-gloo``): there "device" memory IS host
memory, so offloading activations to the host frees nothing and is a plain copy on the critical
path (see :mod:`autoshard.solver.ilp`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

from .units import parse_bytes

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"
# Installed copies (wheel) carry the profiles inside the package.
PACKAGED_DIR = Path(__file__).resolve().parent / "_configs" / "hardware"


class HardwareError(ValueError):
    """Unknown or malformed hardware profile."""


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of one mesh axis: latency ``alpha`` (s), inverse bandwidth ``beta`` (s/byte)."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    axes: tuple[LinkModel, LinkModel]
    peak_flops: Mapping[str, float]          # dtype name (e.g. 'float32') -> FLOP/s
    memory_bandwidth: float                  # bytes/s, device memory
    memory_per_device: int                   # bytes
    host_device_bandwidth: float             # bytes/s, one direction
    description: str = ""
    device_memory_separate: bool = True      # False: device memory is host memory (CPU ranks)
    extra: Mapping[str, object] = field(default_factory=dict)

    def flops_for(self, dtype_name: str) -> float:
        if dtype_name in self.peak_flops:
            return self.peak_flops[dtype_name]
        return self.peak_flops.get("float32", min(self.peak_flops.values()))

    # -- io ------------------------------------------------------------------------------------------
    @staticmethod
    def from_dict(d: Mapping) -> "HardwareProfile":
        try:
            axes = d["axes"]
            if len(axes) != 2:
                raise HardwareError(f"profile {d.get('name')!r} must list exactly 2 mesh axes, got {len(axes)}")
            return HardwareProfile(
                name=str(d["name"]),
                axes=tuple(LinkModel(float(a["alpha"]), float(a["beta"])) for a in axes),  # type: ignore[arg-type]
                peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
                memory_bandwidth=float(d["memory_bandwidth"]),
                memory_per_device=parse_bytes(d["memory_per_device"]),
                host_device_bandwidth=float(d["host_device_bandwidth"]),
                description=str(d.get("description", "")),
                device_memory_separate=_flag(d, "device_memory_separate", True),
                extra=dict(d.get("extra", {})),
            )
        except KeyError as e:
            raise HardwareError(f"hardware profile {d.get('name', '?')!r} lacks field {e.args[0]!r}") from None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "axes": [{"alpha": a.alpha, "beta": a.beta} for a in self.axes],
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "memory_per_device": self.memory_per_device,
            "host_device_bandwidth": self.host_device_bandwidth,
            "device_memory_separate": self.device_memory_separate,
            "extra": dict(self.extra),
        }

    def save(self, path: "str | Path") -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _flag(d: Mapping, key: str, default: bool) -> bool:
    """A boolean field; YAML ``true``/``false`` only (a string such as ``"false"`` would be truthy)."""
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {key} must be true or false, "
                            f"got {value!r}")
    return value


def available_profiles() -> list[str]:
    names = set()
    for d in (CONFIG_DIR, PACKAGED_DIR):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_hardware(spec: "str | Path | HardwareProfile | Mapping") -> HardwareProfile:
    """A profile by name (``h100-nvlink``), by YAML path, or passed through."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, Mapping):
        return HardwareProfile.from_dict(spec)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return HardwareProfile.from_dict(yaml.safe_load(path.read_text()))
    for d in (CONFIG_DIR, PACKAGED_DIR):
        candidate = d / f"{spec}.yaml"
        if candidate.is_file():
            return HardwareProfile.from_dict(yaml.safe_load(candidate.read_text()))
    raise HardwareError(
        f"unknown hardware profile {str(spec)!r}; known profiles: {', '.join(available_profiles()) or 'none'}. "
        "Pass a name from configs/hardware/, a path to a YAML profile, or measure one with `autoshard profile`.")
