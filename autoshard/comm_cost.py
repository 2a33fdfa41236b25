"""Communication cost (seconds) of collectives on the 2D device mesh, from a hardware profile.

Each mesh axis ``a`` has ``n_a`` devices and an alpha-beta link ``(alpha_a, beta_a)``: a message of
``b`` bytes takes ``alpha_a + beta_a * b`` seconds.

Byte convention (``nbytes`` is always per device):

- all-gather: bytes of the gathered (output) buffer on one device;
- reduce-scatter: bytes of the full (input) buffer on one device, before scattering;
- all-reduce: bytes of the buffer on one device;
- all-to-all: bytes each device holds (sends out and receives back the same amount).

One axis, ring algorithms (``n`` devices, ``B`` = ``nbytes``)::

    all_gather(B)     = (n-1) * alpha + (n-1)/n * B * beta
    reduce_scatter(B) = (n-1) * alpha + (n-1)/n * B * beta
    all_reduce(B)     = 2 * ((n-1) * alpha + (n-1)/n * B * beta)      (reduce-scatter + all-gather)
    all_to_all(B)     = (n-1) * alpha + (n-1)/n * B * beta            (n-1 pairwise exchanges of B/n)

Both axes (``n = n0 * n1``): the runtime runs such a collective on one group of all devices. A
profile that measured that group (``HardwareProfile.world``, from ``autoshard profile``) prices it
as one ring of ``n`` devices over that link. Otherwise the cost is the minimum of three algorithms
(a topology-aware library such as NCCL picks its own):

- Hierarchical, one stage per axis, for either order of the axes (``x`` first, then ``y``):
  all-gather = all_gather_x(B / n_y) + all_gather_y(B);
  reduce-scatter = reduce_scatter_x(B) + reduce_scatter_y(B / n_x);
  all-reduce = reduce_scatter_x(B) + all_reduce_y(B / n_x) + all_gather_x(B);
  all-to-all = all_to_all_x(B) + all_to_all_y(B).
  The best order sends the least data over the slowest link (e.g. for all-reduce on a two-level
  cluster: reduce-scatter inside the node, all-reduce a 1/n1 slice across nodes, all-gather inside).
- Flat: one ring over all ``n`` devices, each step paced by the slowest link
  (``max(alpha_0, alpha_1)``, ``max(beta_0, beta_1)``), with the one-axis formulas above.
  For all-gather, reduce-scatter and all-reduce the hierarchical forms move the same bytes in fewer
  steps, so flat never wins; for all-to-all the two-stage form sends every byte twice and flat wins
  on large messages over links of similar speed.

Axes of size 1 take no part; an empty ``axes`` tuple is a no-op of cost 0.

An all-reduce no larger than the largest small size a measured profile timed on its group
(``HardwareProfile.small_all_reduce``: a loss, a count) takes the measured time instead: backends
run such messages differently (gloo's ring skips the segments they leave empty), which the
alpha-beta fit over larger messages does not say.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .hardware import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, KINDS, REDUCE_SCATTER, HardwareProfile, LinkModel

GRAD_BUCKET_BYTES = 25 * 2**20
"""Bytes per gradient all-reduce bucket: the runtime fills buckets up to this size
(:mod:`autoshard.runtime.grad_sync`) and the cost model prices the same buckets."""


Axes = tuple[int, ...]


@dataclass(frozen=True)
class Collective:
    """One collective: ``kind`` over mesh ``axes`` on ``nbytes`` per device (see module byte convention)."""

    kind: str
    axes: Axes
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def cost(self, mesh_shape: Sequence[int], hw: HardwareProfile) -> float:
        """Seconds this collective takes on ``mesh_shape`` under ``hw``."""
        return collective_cost(self.kind, self.nbytes, self.axes, mesh_shape, hw)


# -- one axis ------------------------------------------------------------------------------------
def _ring(n: int, link: LinkModel, nbytes: float) -> float:
    """(n-1) ring steps, each moving nbytes/n: the cost of all-gather, reduce-scatter, all-to-all."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha + (n - 1) / n * nbytes * link.beta


def _one_axis(kind: str, n: int, link: LinkModel, nbytes: float) -> float:
    return 2 * _ring(n, link, nbytes) if kind == ALL_REDUCE else _ring(n, link, nbytes)


# -- two axes ------------------------------------------------------------------------------------
def _hierarchical(kind: str, first: tuple[int, LinkModel], second: tuple[int, LinkModel],
                  nbytes: float) -> float:
    """Stage over axis ``first`` then over ``second``; each is (size, link). See module docstring."""
    (nx, lx), (ny, ly) = first, second
    if kind == ALL_GATHER:
        return _ring(nx, lx, nbytes / ny) + _ring(ny, ly, nbytes)
    if kind == REDUCE_SCATTER:
        return _ring(nx, lx, nbytes) + _ring(ny, ly, nbytes / nx)
    if kind == ALL_REDUCE:
        return _ring(nx, lx, nbytes) + 2 * _ring(ny, ly, nbytes / nx) + _ring(nx, lx, nbytes)
    return _ring(nx, lx, nbytes) + _ring(ny, ly, nbytes)  # all-to-all


def _two_axes(kind: str, a: tuple[int, LinkModel], b: tuple[int, LinkModel], nbytes: float,
              world: LinkModel | None = None) -> float:
    if world is not None:       # measured: the ring the runtime's all-device group runs on
        return _one_axis(kind, a[0] * b[0], world, nbytes)
    slowest = LinkModel(max(a[1].alpha, b[1].alpha), max(a[1].beta, b[1].beta))
    flat = _one_axis(kind, a[0] * b[0], slowest, nbytes)
    return min(_hierarchical(kind, a, b, nbytes), _hierarchical(kind, b, a, nbytes), flat)


# -- public ----------------------------------------------------------------------------------------
def _active_axes(axes: Sequence[int], mesh_shape: Sequence[int], hw: HardwareProfile) -> list[int]:
    """The distinct axes of ``axes`` with more than one device, validated against mesh and profile."""
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh axis repeated in {tuple(axes)}")
    for a in axes:
        if not 0 <= a < len(mesh_shape):
            raise ValueError(f"mesh axis {a} out of range for mesh {tuple(mesh_shape)}")
        if a >= len(hw.axes):
            raise ValueError(f"hardware profile {hw.name!r} describes {len(hw.axes)} axes, not axis {a}")
    return sorted(a for a in axes if mesh_shape[a] > 1)


def collective_group(axes: Sequence[int], mesh_shape: Sequence[int]) -> str | None:
    """The group a collective over mesh ``axes`` runs on, as a profile names it: ``"axis<k>"`` where
    one of them has more than one device, ``"world"`` where two do; None where none does (it runs on
    one device and moves nothing)."""
    live = sorted(a for a in axes if mesh_shape[a] > 1)
    if len(live) > 2:
        raise ValueError(f"collectives over more than two mesh axes are not modelled, got {tuple(axes)}")
    return None if not live else f"axis{live[0]}" if len(live) == 1 else "world"


def collective_cost(kind: str, nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int],
                    hw: HardwareProfile, *, measured_small: bool = True) -> float:
    """Seconds for collective ``kind`` on ``nbytes`` per device over mesh ``axes``;
    ``measured_small=False``: from the links alone, without the profile's small all-reduce times (a
    linear form fitted on large messages, such as the solver's price per gradient bucket)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    active = _active_axes(tuple(axes), mesh_shape, hw)
    if not active:
        return 0.0
    if kind == ALL_REDUCE and measured_small and (len(active) == 1 or hw.world is not None):
        small = hw.small_all_reduce_seconds(collective_group(active, mesh_shape), nbytes)
        if small is not None:
            return small
    if len(active) == 1:
        a = active[0]
        return _one_axis(kind, mesh_shape[a], hw.link(kind, f"axis{a}"), nbytes)
    if len(active) == 2:
        a, b = active
        return _two_axes(kind, (mesh_shape[a], hw.link(kind, f"axis{a}")), (mesh_shape[b], hw.link(kind, f"axis{b}")),
                         nbytes, hw.link(kind, "world"))
    raise ValueError(f"collectives over more than two mesh axes are not modelled, got {tuple(axes)}")


def all_gather_cost(nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int],
                    hw: HardwareProfile) -> float:
    """All-gather over ``axes``; ``nbytes`` = gathered (output) bytes per device."""
    return collective_cost(ALL_GATHER, nbytes, axes, mesh_shape, hw)


def reduce_scatter_cost(nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int],
                        hw: HardwareProfile) -> float:
    """Reduce-scatter over ``axes``; ``nbytes`` = full input bytes per device."""
    return collective_cost(REDUCE_SCATTER, nbytes, axes, mesh_shape, hw)


def all_reduce_cost(nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int],
                    hw: HardwareProfile) -> float:
    """All-reduce over ``axes``; ``nbytes`` = buffer bytes per device."""
    return collective_cost(ALL_REDUCE, nbytes, axes, mesh_shape, hw)


def all_to_all_cost(nbytes: float, axes: Sequence[int], mesh_shape: Sequence[int],
                    hw: HardwareProfile) -> float:
    """All-to-all over ``axes``; ``nbytes`` = bytes each device holds."""
    return collective_cost(ALL_TO_ALL, nbytes, axes, mesh_shape, hw)


def grad_buckets(items: Sequence[tuple[object, int]], bucket_bytes: int = GRAD_BUCKET_BYTES) -> list[list[int]]:
    """How gradient sync groups tensors into all-reduce buckets, shared by the runtime and the cost
    model so that both see the same buckets. ``items`` are ``(key, nbytes)`` in order of first use
    in forward; tensors of one key (mesh axes and dtype) share buckets. Buckets fill in reverse
    order (backward produces the last-used gradients first) up to ``bucket_bytes`` (a tensor larger
    than that gets a bucket of its own). Returns the buckets as lists of item indices, in launch
    order as backward fills them."""
    buckets: list[list[int]] = []
    open_by_key: dict[object, tuple[int, int]] = {}      # key -> (bucket index, bytes in it)
    for i in reversed(range(len(items))):
        key, nbytes = items[i]
        current = open_by_key.get(key)
        if current is None or current[1] + nbytes > bucket_bytes:
            current = (len(buckets), 0)
            buckets.append([])
        buckets[current[0]].append(i)
        open_by_key[key] = (current[0], current[1] + nbytes)
    return buckets
