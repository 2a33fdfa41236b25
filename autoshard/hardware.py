"""Hardware profiles: the numbers every cost in autoshard is computed from.

A profile lives in ``configs/hardware/<name>.yaml``. Communication on each mesh axis follows the
alpha-beta model: a message of ``b`` bytes takes ``alpha + beta * b`` seconds per ring step.
Axis 0 is the outer (possibly inter-node) axis; axis 1 the inner one.

``device_memory_separate`` says whether a device has memory of its own apart from host memory
(GPUs: true, the default). It is false for CPU ranks (``cpu-gloo``): there "device" memory IS host
memory, so offloading activations to the host frees nothing and is a plain copy on the critical
path (see :mod:`autoshard.solver.ilp`).

Compute time comes from measurement where a profile has it and from the roofline otherwise.
``compute`` (written by ``autoshard profile``) holds, per dtype name and op family, the measured
forward and backward seconds of one op against its forward *work*: FLOPs as
``torch.utils.flop_counter.FlopCounterMode`` counts them (the count :mod:`autoshard.opinfo` profiles
nodes with) for ``matmul`` (and ``matmul_unaligned``: a matmul whose tensors' rows are no whole
multiple of 16 bytes, which GPUs run on slower kernels), ``conv`` (and ``conv_unaligned``: a
convolution whose local input or output channels are no whole multiple of 16, which oneDNN runs
outside its blocked layouts, slower per FLOP on a CPU), ``attention`` and ``attention_narrow`` (the same
attention at head dim :data:`NARROW_HEAD_DIM`: the softmax over the score matrix does not shrink with
the head dim, so a narrow head costs more per FLOP; see :data:`NARROW_HEAD_DIM`), bytes of the op's tensor inputs plus outputs for
``matmul_rows1``, ``matmul_rows2``, ``matmul_rows4`` and ``matmul_rows8`` (a linear, addmm or mm on 1, 2-3,
4-7 or 8-15 local rows, see :data:`FEW_ROWS`), ``pointwise`` (arithmetic: add, mul), ``transcendental`` (tanh, exp, GELU, SiLU and the like, several
times an add's time per byte on a CPU; the median of four of them), one curve per function of
:data:`ELEMENTWISE_FUNCTIONS` (exp, log, tanh, sigmoid, SiLU, GELU exact and tanh-approximated: their
costs per byte are 10x apart on a CPU; other transcendental functions go by the median), ``norm``
(layer and RMS norms), ``batch_norm`` (training batch norm), ``sync_batch_norm`` (the runtime's
training batch norm with statistics synchronised over devices, its local compute), ``max_pool`` and ``avg_pool`` (windowed
pools: 40x and 15x an add per byte on a CPU), ``loss`` and ``copy_blocks`` (a copy in runs of
:data:`COPY_RUN` elements: what laying a shard out along an inner dim costs, see
:meth:`HardwareProfile.copy_seconds`), and ``view`` (an op that moves no data, a transpose or a
reshape, timed for what dispatching it and its backward's autograd node cost: 4 CPU ranks on 2 cores,
7 us forward and 11-13 backward, and a narrow Llama's graph has a view for every 1.5 other ops; see
:meth:`HardwareProfile.view_seconds`). Both curves are indexed by the forward
work; ``bwd`` is the time of the op's backward (the gradients of all its float inputs). :meth:`HardwareProfile.op_seconds`
interpolates them piecewise-linearly in log(work)-log(time); below the smallest measured work it
keeps the smallest point's time (the per-op floor: dispatch overhead), above the largest it scales
time with work at the largest point's rate. ``optimizer`` prices an AdamW step (torch's default
implementation for the device) as ``n_tensors * per_tensor + bytes * per_byte``; ``checkpoint``
prices what a region under ``torch.utils.checkpoint`` (non-reentrant, as the runtime runs a recomputed
segment) costs beyond running its forward again, ``per_region + saved tensors * per_saved_tensor``
(its hooks pack every tensor the forward saves, and backward unpacks them around the recomputation;
on 4 CPU ranks sharing 2 cores 0.19-0.26 ms per region and 24-33 us per saved tensor: about 1 ms
for a GPT-2 block of width 128, a quarter of its forward); ``overlap`` is the
measured fraction of an async all-reduce that hides behind compute (0: none, 1: all of it);
``small_all_reduce`` holds measured all-reduce times per group below the sizes the links are fitted
on (a step's loss and counts: a few bytes), where a backend may run another program (gloo's ring
all-reduce over 4 ranks: ~1.6 ms for a loss's float64 sum and count, ~5.5 ms from 64 bytes up,
which the fit says of 16 bytes too); ``sync_wait`` holds, per group, what a blocking collective
costs beyond its price after a stretch of compute longer than the one its price was timed after
(:class:`SyncWait`: ranks sharing cores drift apart while they compute, and the first collective
after waits for the last one of its group; 0 for a group without one; a single table without
groups, as profiles before per-group waits wrote it, is the world's).
Profiles without these fields (the shipped GPU profiles) use ``max(flops / peak_flops, bytes /
memory_bandwidth)``.

    compute:
      float32:
        matmul: {work: [1.3e5, ...], fwd: [2.1e-5, ...], bwd: [4.0e-5, ...]}   # FLOPs -> seconds
        pointwise: {work: [4096, ...], fwd: [...], bwd: [...]}                  # bytes -> seconds
    optimizer: {per_tensor: 2.0e-5, per_byte: 1.5e-10}
    checkpoint: {per_region: 2.0e-4, per_saved_tensor: 1.7e-5}
    overlap: 0.35
    small_all_reduce: {world: {bytes: [4, 16, 64, 256, 1024], seconds: [1.8e-3, 1.9e-3, 5.6e-3, ...]}, axis0: ...}
    sync_wait: {world: {gap: [2.6e-3, 5.2e-3, 1.0e-2, 2.1e-2, 4.2e-2], seconds: [0.0, 9.0e-4, 2.8e-3, ...]}, axis0: ...}
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from .phases import Phase
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
class SmallMessages:
    """Measured seconds of one collective at message sizes below a link's fitted range (``nbytes``
    increasing): where the backend runs small messages unlike its large ones (gloo's ring all-reduce
    skips the segments a message of fewer elements than twice the ranks leaves empty: over 4 CPU
    ranks the loss's all-reduce, a float64 sum and count, takes ~1.6 ms where 64 bytes and more take
    ~5.5)."""

    nbytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def seconds_at(self, nbytes: float) -> float | None:
        """Time at ``nbytes``: the first point's at or below it, piecewise-linear between points;
        None above the last point (the link's alpha-beta fit prices that)."""
        if nbytes > self.nbytes[-1]:
            return None
        if nbytes <= self.nbytes[0]:
            return self.seconds[0]
        i = bisect.bisect_right(self.nbytes, nbytes) - 1       # nbytes[i] <= nbytes < nbytes[i + 1]
        if i == len(self.nbytes) - 1:
            return self.seconds[-1]
        f = (nbytes - self.nbytes[i]) / (self.nbytes[i + 1] - self.nbytes[i])
        return self.seconds[i] + f * (self.seconds[i + 1] - self.seconds[i])


@dataclass(frozen=True)
class SyncWait:
    """What a blocking collective costs beyond its measured price when the ranks computed ``gap``
    seconds since their last collective (``gaps`` increasing, ``seconds`` each, the first 0: the
    gap the collectives were priced at). Ranks that share CPU cores drift apart while they compute
    (the scheduler gives each its slices unevenly), and the first collective after a long stretch
    waits for the last rank to arrive: on 4 gloo ranks on 2 cores about 3 ms after 8-30 ms of
    compute, against the 2.6 ms slices the collectives' prices were timed with."""

    gaps: tuple[float, ...]
    seconds: tuple[float, ...]

    def seconds_after(self, gap: float) -> float:
        """The extra wait after ``gap`` seconds of compute: 0 up to the first point, piecewise-linear
        between points, the last point's beyond it."""
        if gap <= self.gaps[0]:
            return 0.0
        if gap >= self.gaps[-1]:
            return self.seconds[-1]
        i = bisect.bisect_right(self.gaps, gap) - 1
        f = (gap - self.gaps[i]) / (self.gaps[i + 1] - self.gaps[i])
        return self.seconds[i] + f * (self.seconds[i + 1] - self.seconds[i])


ELEMENTWISE_FUNCTIONS = ("exp", "log", "tanh", "sigmoid", "silu", "gelu", "gelu_tanh")
"""Elementwise functions with a measured curve each: their cost per byte differs too much for one
curve (on a CPU exp and tanh take 2-4 ns per element, SiLU and exact GELU 0.3, an add 0.1)."""

FEW_ROWS = (1, 2, 4, 8)
"""Row counts below the ``matmul`` curve's with a curve of their own (``matmul_rows<r>``, by bytes): a
linear on a few rows (a batch of 8 split over devices) reads its whole weight for few FLOPs, on kernels
that differ with the rows (4 CPU ranks on 2 cores: 1-2 rows 4-6 GB/s of weight, 4-8 rows 2-3 GB/s,
16 rows at the FLOP rate of square matmuls)."""


def few_rows_family(rows: int) -> str | None:
    """The ``matmul_rows<r>`` family of a 2-D matmul on ``rows`` local rows: the largest of
    :data:`FEW_ROWS` not above them; None from twice the largest up (the ``matmul`` curves)."""
    if rows < 1 or rows >= 2 * FEW_ROWS[-1]:
        return None
    return f"matmul_rows{max(r for r in FEW_ROWS if r <= rows)}"


COPY_RUN = 16
"""Elements per contiguous run of the ``copy_blocks`` curve: a copy that reads or writes its tensor in
runs this short (laying a shard out along an inner dim) moves fewer bytes per second than a
contiguous one (one CPU core: 1.8x a contiguous copy's time at 4 MiB; runs of 64 1.4x, 256 1.2x)."""

CONTIGUOUS_RUN = 1024
"""Runs of at least this many elements copy at the contiguous rate (:meth:`HardwareProfile.copy_seconds`)."""


NARROW_HEAD_DIM = 16
"""Head dim of the ``attention_narrow`` curve. Attention's time has a part per FLOP (the two matmuls,
proportional to the head dim) and a part per score element (scale, mask, softmax: batch x heads x
query x key positions, whatever the head dim), so at equal FLOPs a narrow head has more score elements:
on one CPU core a causal attention of 2 x 4 heads x 128 positions took 0.64 ms forward + backward at
head dim 16, 0.98 at 32, 1.69 at 64 (from 16 up about 0.29 ms + 0.022 ms per unit of head dim) and
0.79 at 12, 0.98 at 8 (narrower than the kernel's vectors: the floor under-prices those). The ``attention``
curve is timed at head dims 32 to 64 (128 on CUDA), and an op of head dim ``e`` is priced never below
``attention_narrow`` at its FLOPs x ``NARROW_HEAD_DIM / e``: the same batch, heads and positions at
this head dim (:func:`autoshard.strategy.compute_seconds`)."""


COMPUTE_FAMILIES: Mapping[str, str] = {
    "matmul": "FLOPs", "matmul_unaligned": "FLOPs", **{f"matmul_rows{r}": "bytes" for r in FEW_ROWS},
    "conv": "FLOPs", "conv_unaligned": "FLOPs", "attention": "FLOPs", "attention_narrow": "FLOPs",
    "pointwise": "bytes", "transcendental": "bytes",
    **{name: "bytes" for name in ELEMENTWISE_FUNCTIONS},
    "norm": "bytes", "batch_norm": "bytes", "sync_batch_norm": "bytes", "max_pool": "bytes", "avg_pool": "bytes",
    "loss": "bytes", "copy_blocks": "bytes", "view": "bytes"}
"""Op families with measured compute curves, and the unit of their work."""

PHASES = (Phase.FWD, Phase.BWD)


@dataclass(frozen=True)
class ComputeCurve:
    """Measured seconds of one op of a family against its forward work (``work`` increasing)."""

    work: tuple[float, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]

    def seconds(self, work: float, phase: Phase) -> float:
        """Time at ``work``: log-log interpolation, the first point's time below (the per-op floor),
        the last point's rate (seconds per unit of work) above."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        if not (work >= 0 and math.isfinite(work)):
            raise ValueError(f"work must be a finite non-negative number, got {work!r}")
        times = self.fwd if phase == Phase.FWD else self.bwd
        xs = self.work
        if work <= xs[0]:
            return times[0]
        if work >= xs[-1]:
            return times[-1] * work / xs[-1]
        i = bisect.bisect_right(xs, work) - 1        # xs[i] <= work < xs[i + 1]
        f = math.log(work / xs[i]) / math.log(xs[i + 1] / xs[i])
        return math.exp(math.log(times[i]) + f * math.log(times[i + 1] / times[i]))


@dataclass(frozen=True)
class OptimizerModel:
    """Seconds of one optimizer step: ``n_tensors * per_tensor + nbytes * per_byte``."""

    per_tensor: float        # seconds per parameter tensor
    per_byte: float          # seconds per byte of parameters

    def seconds(self, n_tensors: int, nbytes: float) -> float:
        return n_tensors * self.per_tensor + nbytes * self.per_byte


@dataclass(frozen=True)
class CheckpointModel:
    """Seconds one checkpointed region adds beyond its recomputed forward:
    ``per_region + n_saved * per_saved_tensor`` (``n_saved``: tensors its forward saves for backward)."""

    per_region: float        # seconds per region (entering the checkpoint, starting its recomputation)
    per_saved_tensor: float  # seconds per saved tensor (packed in forward, unpacked in backward)

    def seconds(self, n_saved: int) -> float:
        return self.per_region + n_saved * self.per_saved_tensor


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
    compute: Mapping[str, Mapping[str, ComputeCurve]] = field(default_factory=dict)  # dtype -> family
    optimizer: OptimizerModel | None = None  # measured optimizer step, None: not measured
    checkpoint: CheckpointModel | None = None  # measured checkpoint overhead, None: not measured
    overlap: float | None = None             # fraction of an async all-reduce hidden by compute
    world: LinkModel | None = None           # measured ring over all devices at once (what a
                                             # collective over both mesh axes runs on); None: derived
    kinds: Mapping[str, Mapping[str, LinkModel]] = field(default_factory=dict)
    # measured links of collective kinds other than all-reduce (whose links are ``axes`` and
    # ``world``): kind -> group ("axis0", "axis1", "world") -> link; see :meth:`link`
    small_all_reduce: Mapping[str, SmallMessages] = field(default_factory=dict)
    # measured all-reduces below the fitted sizes (a step's loss and counts), group -> times;
    # see :meth:`small_all_reduce_seconds`
    sync_wait: Mapping[str, SyncWait] = field(default_factory=dict)
    # measured wait of a collective after long compute, group -> table; see :meth:`sync_wait_seconds`

    def sync_wait_seconds(self, group: str, gap: float) -> float:
        """What a blocking collective on ``group`` (``"axis0"``, ``"axis1"``, ``"world"``) waits beyond
        its price after ``gap`` seconds of compute since that group's ranks last met; 0 where this
        profile measured no wait for the group."""
        table = self.sync_wait.get(group)
        return 0.0 if table is None else table.seconds_after(gap)

    def small_all_reduce_seconds(self, group: str, nbytes: float) -> float | None:
        """Measured seconds of an all-reduce of ``nbytes`` on ``group`` (``"axis0"``, ``"axis1"``,
        ``"world"``) where it is at most the largest small size this profile measured; None otherwise
        (price it from the link)."""
        table = self.small_all_reduce.get(group)
        return None if table is None else table.seconds_at(nbytes)

    def link(self, kind: str, group: str) -> LinkModel | None:
        """The link a ``kind`` collective runs over on ``group`` (``"axis0"``, ``"axis1"`` or
        ``"world"``): its own measured link where the profile has one, else the all-reduce's."""
        own = self.kinds.get(kind, {}).get(group)
        if own is not None:
            return own
        return self.world if group == "world" else self.axes[int(group.removeprefix("axis"))]

    def flops_for(self, dtype_name: str) -> float:
        if dtype_name in self.peak_flops:
            return self.peak_flops[dtype_name]
        return self.peak_flops.get("float32", min(self.peak_flops.values()))

    def op_seconds(self, family: str, work: float, phase: Phase, dtype: str) -> float | None:
        """Measured seconds of one ``family`` op of forward ``work`` (FLOPs or bytes, see
        :data:`COMPUTE_FAMILIES`) in ``phase`` ('fwd' or 'bwd'); None when this profile has no
        measurement for ``dtype`` and ``family`` (use the roofline then)."""
        if family not in COMPUTE_FAMILIES:
            raise ValueError(f"unknown compute family {family!r}; known: {', '.join(COMPUTE_FAMILIES)}")
        curve = self.compute.get(dtype, {}).get(family)
        return None if curve is None else curve.seconds(work, phase)

    def optimizer_seconds(self, n_tensors: int, nbytes: float) -> float | None:
        """Measured seconds of an optimizer step over ``n_tensors`` parameters of ``nbytes`` in all;
        None when not measured."""
        return None if self.optimizer is None else self.optimizer.seconds(n_tensors, nbytes)

    def checkpoint_seconds(self, n_saved: int) -> float:
        """Measured seconds one checkpointed region whose forward saves ``n_saved`` tensors adds beyond
        its recomputed forward; 0 when not measured (the shipped GPU profiles)."""
        return 0.0 if self.checkpoint is None else self.checkpoint.seconds(n_saved)

    def dispatch_seconds(self) -> float:
        """Seconds of an op that moves no data (a split the runtime takes as a view, along a dim
        nothing is outside of) on ranks whose ops run on the host (CPU ranks): a view's forward
        (:meth:`view_seconds`), or in a profile measured before views were, the smallest time of a
        ``pointwise`` curve (an op that moves a few bytes; float32's where measured): what any op
        costs to dispatch whatever its dtype; 0 without a measurement. 0 on devices with memory of
        their own (GPUs): a view launches no kernel, and the host dispatches it while the device
        works through its queue."""
        view = self.view_seconds(Phase.FWD)
        if view is not None:
            return view
        pointwise = self._floor("pointwise", Phase.FWD)
        return 0.0 if pointwise is None or self.device_memory_separate else pointwise

    def view_seconds(self, phase: Phase) -> float | None:
        """Seconds of ``phase`` of a view op (a transpose, a reshape that copies nothing: its dispatch,
        and in backward its autograd node's) on ranks whose ops run on the host: the smallest time of
        the ``view`` curve (float32's where measured; a view's time does not depend on its dtype or
        size); 0 on devices with memory of their own (see :meth:`dispatch_seconds`); None where the
        profile has no ``view`` curve."""
        floor = self._floor("view", phase)
        return None if floor is None else 0.0 if self.device_memory_separate else floor

    def _floor(self, family: str, phase: Phase) -> float | None:
        """The smallest point of ``family``'s curve (float32's where measured, else any dtype's)."""
        curves = [c[family] for c in (self.compute.get("float32", {}), *self.compute.values()) if family in c]
        if not curves:
            return None
        return (curves[0].fwd if phase == Phase.FWD else curves[0].bwd)[0]

    def copy_pricing_key(self, dtype: str | None) -> tuple:
        """Everything :meth:`copy_seconds` (for ``dtype``) and :meth:`dispatch_seconds` read (a cache
        key for prices built on them)."""
        curves = self.compute.get(dtype.removeprefix("torch."), {}) if dtype is not None else {}
        return (self.memory_bandwidth, curves.get("pointwise"), curves.get("copy_blocks"), self.dispatch_seconds())

    def link_pricing_key(self) -> tuple:
        """Everything :meth:`link` and :meth:`small_all_reduce_seconds` read (a cache key for collective
        prices)."""
        return (tuple(self.axes), self.world,
                tuple(sorted((kind, tuple(sorted(groups.items()))) for kind, groups in self.kinds.items())),
                tuple(sorted(self.small_all_reduce.items())))

    def copy_seconds(self, nbytes: float, dtype: str | None, run: int | None = None) -> float:
        """One memory-bound pass that reads ``nbytes`` and writes as many (a local copy the runtime
        makes: flattening gradients into a bucket, laying a gathered shard out along its dim): the
        measured pointwise rate at that size (``dtype`` a dtype name, ``torch.`` prefix allowed),
        else (or with ``dtype`` None) read plus write over the memory bandwidth.

        ``run``: elements per contiguous run the copy reads or writes (None: one contiguous block).
        Below :data:`CONTIGUOUS_RUN`, where the profile has a ``copy_blocks`` curve (runs of
        :data:`COPY_RUN`), the price goes from that curve's (runs of ``COPY_RUN`` or fewer) to the
        contiguous one (``CONTIGUOUS_RUN``) geometrically in log(run), never below the contiguous
        price; runs shorter than ``COPY_RUN`` take its curve's (the runtime's copies run longer)."""
        if nbytes <= 0:
            return 0.0
        dtype = None if dtype is None else dtype.removeprefix("torch.")
        measured = None if dtype is None else self.op_seconds("pointwise", 2.0 * nbytes, Phase.FWD, dtype)
        contiguous = measured if measured is not None else 2.0 * nbytes / self.memory_bandwidth
        if run is None or run >= CONTIGUOUS_RUN or dtype is None:
            return contiguous
        blocks = self.op_seconds("copy_blocks", 2.0 * nbytes, Phase.FWD, dtype)
        if blocks is None:
            return contiguous
        w = math.log(max(run, COPY_RUN) / COPY_RUN) / math.log(CONTIGUOUS_RUN / COPY_RUN)
        return max(contiguous, blocks ** (1.0 - w) * contiguous ** w)

    # -- io ------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        """The schema every profile meets, however it was made (from YAML, by ``autoshard profile``
        or in Python): numbers finite and positive, each with its unit in the error."""
        where = {"name": self.name}
        if not isinstance(self.name, str) or not self.name:
            raise HardwareError(f"hardware profile name must be a non-empty string, got {self.name!r}")
        if len(self.axes) != 2 or not all(isinstance(a, LinkModel) for a in self.axes):
            raise HardwareError(f"hardware profile {self.name!r} must have exactly 2 mesh axes, each "
                                f"{{alpha: seconds, beta: seconds per byte}}, got {self.axes!r}")
        for i, a in enumerate(self.axes):
            _number(where, f"axes[{i}].alpha", a.alpha, "seconds of latency per ring step", zero=True)
            _number(where, f"axes[{i}].beta", a.beta, "seconds per byte, the inverse of the link bandwidth")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise HardwareError(f"hardware profile {self.name!r}: peak_flops must map dtype names to FLOP/s, "
                                f"e.g. {{float32: 6.7e13}}, got {self.peak_flops!r}")
        for dtype, flops in self.peak_flops.items():
            _number(where, f"peak_flops.{dtype}", flops, "FLOP/s")
        _number(where, "memory_bandwidth", self.memory_bandwidth, "bytes/s")
        _number(where, "memory_per_device", self.memory_per_device, "bytes")
        _number(where, "host_device_bandwidth", self.host_device_bandwidth, "bytes/s")
        if self.overlap is not None:
            _number(where, "overlap", self.overlap, "fraction of an all-reduce hidden behind compute",
                    high=1.0, zero=True)

    @staticmethod
    def from_dict(d: Mapping) -> "HardwareProfile":
        """A profile from its plain form (a YAML document); :class:`HardwareError` naming the field,
        what it must be and its unit otherwise."""
        if not isinstance(d, Mapping):
            raise HardwareError(f"a hardware profile must be a mapping of fields (name, axes, peak_flops, "
                                f"memory_bandwidth, memory_per_device, host_device_bandwidth), got "
                                f"{type(d).__name__}; see configs/hardware/h100-nvlink.yaml for the format")
        try:
            name = d["name"]
            if not isinstance(name, str) or not name:
                raise HardwareError(f"hardware profile name must be a non-empty string, got {name!r}")
            axes = d["axes"]
            if not isinstance(axes, Sequence) or isinstance(axes, str) or len(axes) != 2:
                raise HardwareError(f"hardware profile {name!r} must list exactly 2 mesh axes, each "
                                    f"{{alpha: seconds, beta: seconds per byte}}, got {axes!r}")
            links = []
            for i, a in enumerate(axes):
                link = _section(d, f"axes[{i}]", {"alpha": "seconds", "beta": "seconds per byte"}, value=a)
                if link is None:
                    raise HardwareError(f"hardware profile {name!r}: axes[{i}] must be {{alpha: seconds, beta: "
                                        f"seconds per byte}}, got null")
                links.append(LinkModel(_number(d, f"axes[{i}].alpha", link["alpha"], "seconds", zero=True),
                                       _number(d, f"axes[{i}].beta", link["beta"], "seconds per byte")))
            flops = d["peak_flops"]
            if not isinstance(flops, Mapping) or not flops:
                raise HardwareError(f"hardware profile {name!r}: peak_flops must map dtype names to FLOP/s, "
                                    f"e.g. {{float32: 6.7e13}}, got {flops!r}")
            extra = d.get("extra", {}) or {}
            if not isinstance(extra, Mapping):
                raise HardwareError(f"hardware profile {name!r}: extra must be a mapping, got {extra!r}")
            return HardwareProfile(
                name=name,
                axes=tuple(links),  # type: ignore[arg-type]
                peak_flops={str(k): _number(d, f"peak_flops.{k}", v, "FLOP/s") for k, v in flops.items()},
                memory_bandwidth=_number(d, "memory_bandwidth", d["memory_bandwidth"], "bytes/s"),
                memory_per_device=_size(d, "memory_per_device", d["memory_per_device"]),
                host_device_bandwidth=_number(d, "host_device_bandwidth", d["host_device_bandwidth"], "bytes/s"),
                description=str(d.get("description", "") or ""),
                device_memory_separate=_flag(d, "device_memory_separate", True),
                extra=dict(extra),
                compute=_compute(d),
                optimizer=_optimizer(d),
                checkpoint=_checkpoint(d),
                overlap=_overlap(d),
                world=_world(d),
                kinds=_kinds(d),
                small_all_reduce=_small_all_reduce(d),
                sync_wait=_sync_wait(d),
            )
        except KeyError as e:
            raise HardwareError(f"hardware profile {d.get('name', '?')!r} lacks field {e.args[0]!r}; see "
                                f"configs/hardware/h100-nvlink.yaml for the format") from None

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
            **({"compute": {dt: {fam: {"work": list(c.work), "fwd": list(c.fwd), "bwd": list(c.bwd)}
                                 for fam, c in fams.items()} for dt, fams in self.compute.items()}}
               if self.compute else {}),
            **({"optimizer": {"per_tensor": self.optimizer.per_tensor, "per_byte": self.optimizer.per_byte}}
               if self.optimizer is not None else {}),
            **({"checkpoint": {"per_region": self.checkpoint.per_region,
                               "per_saved_tensor": self.checkpoint.per_saved_tensor}}
               if self.checkpoint is not None else {}),
            **({"overlap": self.overlap} if self.overlap is not None else {}),
            **({"world": {"alpha": self.world.alpha, "beta": self.world.beta}} if self.world is not None else {}),
            **({"kinds": {kind: {g: {"alpha": link.alpha, "beta": link.beta} for g, link in groups.items()}
                          for kind, groups in self.kinds.items()}} if self.kinds else {}),
            **({"small_all_reduce": {g: {"bytes": list(t.nbytes), "seconds": list(t.seconds)}
                                     for g, t in self.small_all_reduce.items()}} if self.small_all_reduce else {}),
            **({"sync_wait": {g: {"gap": list(t.gaps), "seconds": list(t.seconds)} for g, t in self.sync_wait.items()}}
               if self.sync_wait else {}),
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


# -- validation of the measured fields --------------------------------------------------------------
def _section(d: Mapping, key: str, units: Mapping[str, str], *, value: Any = None) -> Mapping | None:
    """The optional mapping ``d[key]`` (or ``value``) with exactly the keys of ``units`` (key -> unit),
    or None."""
    value = d.get(key) if value is None else value
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != set(units):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {key} must have exactly the keys "
                            + " and ".join(f"{k} ({u})" for k, u in units.items()))
    return value


def _world(d: Mapping) -> LinkModel | None:
    """The measured all-device link, ``world: {alpha: s, beta: s/byte}``, or None."""
    value = _section(d, "world", {"alpha": "seconds", "beta": "seconds per byte"})
    if value is None:
        return None
    return LinkModel(_number(d, "world.alpha", value["alpha"], "seconds", zero=True),
                     _number(d, "world.beta", value["beta"], "seconds per byte"))


ALL_GATHER = "all_gather"
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
KINDS = (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL)
"""The collective kinds: a profile may give measured links per kind, and :mod:`autoshard.comm_cost` prices
each kind (re-exported there)."""

KIND_GROUPS = ("axis0", "axis1", "world")
"""The groups a collective kind's measured link may be given for (``kinds`` in a profile)."""


def _kinds(d: Mapping) -> dict[str, dict[str, LinkModel]]:
    """``kinds: {all_gather: {world: {alpha, beta}, axis0: ...}, reduce_scatter: ...}``, or {}."""
    value = d.get("kinds") or {}
    if not isinstance(value, Mapping):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: kinds must map a collective kind to "
                            f"its measured links, e.g. {{all_gather: {{world: {{alpha: 1e-3, beta: 1e-9}}}}}}")
    out: dict[str, dict[str, LinkModel]] = {}
    for kind, groups in value.items():
        if kind not in KINDS or kind == "all_reduce":
            raise HardwareError(f"hardware profile {d.get('name', '?')!r}: kinds.{kind} is not a collective kind "
                                f"with its own link; use one of {', '.join(k for k in KINDS if k != 'all_reduce')} "
                                "(all-reduce's links are axes and world)")
        if not isinstance(groups, Mapping) or not set(groups) <= set(KIND_GROUPS):
            raise HardwareError(f"hardware profile {d.get('name', '?')!r}: kinds.{kind} must map groups "
                                f"({', '.join(KIND_GROUPS)}) to {{alpha, beta}}, got {groups!r}")
        out[str(kind)] = {}
        for group in groups:
            where = f"kinds.{kind}.{group}"
            link = _section(d, where, {"alpha": "seconds", "beta": "seconds per byte"}, value=groups[group])
            out[str(kind)][str(group)] = LinkModel(_number(d, f"{where}.alpha", link["alpha"], "seconds", zero=True),
                                                   _number(d, f"{where}.beta", link["beta"], "seconds per byte"))
    return out


def _small_all_reduce(d: Mapping) -> dict[str, SmallMessages]:
    """``small_all_reduce: {world: {bytes: [4, 16, ...], seconds: [...]}, axis0: ...}``, or {}."""
    value = d.get("small_all_reduce") or {}
    name = d.get("name", "?")
    if not isinstance(value, Mapping) or not set(value) <= set(KIND_GROUPS):
        raise HardwareError(f"hardware profile {name!r}: small_all_reduce must map groups ({', '.join(KIND_GROUPS)}) "
                            f"to {{bytes: [...], seconds: [...]}}, got {value!r}")
    out: dict[str, SmallMessages] = {}
    for group, table in value.items():
        where = f"small_all_reduce.{group}"
        table = _section(d, where, {"bytes": "message sizes, increasing", "seconds": "seconds each"}, value=table)
        sizes, times = table["bytes"], table["seconds"]
        if (not isinstance(sizes, Sequence) or not isinstance(times, Sequence) or isinstance(sizes, str)
                or not sizes or len(sizes) != len(times)):
            raise HardwareError(f"hardware profile {name!r}: {where} needs equally long, non-empty lists bytes and "
                                f"seconds, got {len(sizes) if isinstance(sizes, Sequence) else sizes!r} and "
                                f"{len(times) if isinstance(times, Sequence) else times!r}")
        nbytes = tuple(_number(d, f"{where}.bytes[{i}]", b, "bytes") for i, b in enumerate(sizes))
        if any(b >= c for b, c in zip(nbytes, nbytes[1:])):
            raise HardwareError(f"hardware profile {name!r}: {where}.bytes must increase, got {list(sizes)}")
        out[str(group)] = SmallMessages(nbytes, tuple(_number(d, f"{where}.seconds[{i}]", t, "seconds")
                                                      for i, t in enumerate(times)))
    return out


def _sync_wait(d: Mapping) -> dict[str, SyncWait]:
    """``sync_wait: {world: {gap: [seconds of compute, increasing], seconds: [extra wait each, the
    first 0]}, axis0: ...}``, or {}. A single ``{gap, seconds}`` (profiles measured before waits were
    timed per group, on all ranks) is the world's."""
    value = d.get("sync_wait")
    if value is None:
        return {}
    if isinstance(value, Mapping) and "gap" in value:
        value = {"world": value}
    if not isinstance(value, Mapping) or not set(value) <= set(KIND_GROUPS):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: sync_wait must map groups "
                            f"({', '.join(KIND_GROUPS)}) to {{gap: [...], seconds: [...]}}, got {value!r}")
    return {str(group): _sync_wait_table(d, f"sync_wait.{group}", table) for group, table in value.items()}


def _sync_wait_table(d: Mapping, where: str, value: Any) -> SyncWait:
    table = _section(d, where, {"gap": "seconds of compute since the group's last collective, increasing",
                                "seconds": "extra seconds of wait each"}, value=value)
    gaps = _points(d, f"{where}.gap", table["gap"], "seconds")
    raw = table["seconds"]
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where}.seconds must be a list of "
                            f"seconds, got {raw!r}")
    seconds = tuple(_number(d, f"{where}.seconds[{i}]", t, "seconds", zero=True) for i, t in enumerate(raw))
    if len(seconds) != len(gaps) or any(a >= b for a, b in zip(gaps, gaps[1:])):
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where} needs as many seconds as gaps, "
                            f"gaps increasing, got gap {list(table['gap'])} and seconds {table['seconds']!r}")
    return SyncWait(gaps, seconds)


def _number(d: Mapping, where: str, value: Any, unit: str, *, low: float = 0.0, high: float = math.inf,
            zero: bool = False) -> float:
    """``value`` as a float, finite, above ``low`` (or equal to it with ``zero``) and at most ``high``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and (x > low or (zero and x == low)) and x <= high):
        bound = (f"in [{low:g}, {high:g}]" if high < math.inf
                 else "a finite non-negative number" if zero else "a finite positive number")
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where} must be {bound} "
                            f"({unit}), got {value!r}")
    return x


def _size(d: Mapping, where: str, value: Any) -> int:
    """A byte count or a size such as ``80GiB``, positive."""
    try:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is a bool")
        n = parse_bytes(value)
    except (TypeError, ValueError) as e:
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where} must be a size in bytes such as "
                            f"80GiB or 85899345920 ({e})") from None
    if n <= 0:
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where} must be a positive size in bytes "
                            f"such as 80GiB, got {value!r}")
    return n


def _points(d: Mapping, where: str, value: Any, unit: str) -> tuple[float, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: {where} must be a non-empty list "
                            f"of {unit}, got {value!r}")
    return tuple(_number(d, f"{where}[{i}]", v, unit) for i, v in enumerate(value))


def _compute(d: Mapping) -> dict[str, dict[str, ComputeCurve]]:
    import torch

    name = d.get("name", "?")
    table = d.get("compute") or {}
    if not isinstance(table, Mapping):
        raise HardwareError(f"hardware profile {name!r}: compute must map dtype names to op families")
    out: dict[str, dict[str, ComputeCurve]] = {}
    for dtype, families in table.items():
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise HardwareError(f"hardware profile {name!r}: compute.{dtype} is not a torch dtype name "
                                f"(e.g. float32, bfloat16)")
        if not isinstance(families, Mapping):
            raise HardwareError(f"hardware profile {name!r}: compute.{dtype} must map op families to curves")
        out[str(dtype)] = {}
        for family, curve in families.items():
            where = f"compute.{dtype}.{family}"
            if family not in COMPUTE_FAMILIES:
                raise HardwareError(f"hardware profile {name!r}: {where}: unknown op family; known: "
                                    f"{', '.join(COMPUTE_FAMILIES)}")
            if not isinstance(curve, Mapping) or set(curve) != {"work", "fwd", "bwd"}:
                raise HardwareError(f"hardware profile {name!r}: {where} must have exactly the keys work "
                                    f"({COMPUTE_FAMILIES[family]}), fwd and bwd (seconds)")
            work = _points(d, f"{where}.work", curve["work"], COMPUTE_FAMILIES[family])
            fwd = _points(d, f"{where}.fwd", curve["fwd"], "seconds")
            bwd = _points(d, f"{where}.bwd", curve["bwd"], "seconds")
            if not len(work) == len(fwd) == len(bwd):
                raise HardwareError(f"hardware profile {name!r}: {where}: work, fwd and bwd must have the same "
                                    f"number of points, got {len(work)}, {len(fwd)} and {len(bwd)}")
            if any(b <= a for a, b in zip(work, work[1:])):
                raise HardwareError(f"hardware profile {name!r}: {where}.work must be strictly increasing "
                                    f"({COMPUTE_FAMILIES[family]}), got {list(work)}")
            out[str(dtype)][str(family)] = ComputeCurve(work, fwd, bwd)
    return out


def _optimizer(d: Mapping) -> OptimizerModel | None:
    opt = _section(d, "optimizer", {"per_tensor": "seconds per tensor", "per_byte": "seconds per byte"})
    if opt is None:
        return None
    # a least-squares fit may put one coefficient at zero, so zero is allowed (not both)
    model = OptimizerModel(_number(d, "optimizer.per_tensor", opt["per_tensor"], "seconds per tensor", zero=True),
                           _number(d, "optimizer.per_byte", opt["per_byte"], "seconds per byte", zero=True))
    if model.per_tensor == model.per_byte == 0:
        raise HardwareError(f"hardware profile {d.get('name', '?')!r}: optimizer.per_tensor and "
                            f"optimizer.per_byte are both 0 (an optimizer step would cost nothing)")
    return model


def _checkpoint(d: Mapping) -> CheckpointModel | None:
    ck = _section(d, "checkpoint", {"per_region": "seconds per region", "per_saved_tensor": "seconds per saved tensor"})
    if ck is None:
        return None
    return CheckpointModel(_number(d, "checkpoint.per_region", ck["per_region"], "seconds per region", zero=True),
                           _number(d, "checkpoint.per_saved_tensor", ck["per_saved_tensor"],
                                   "seconds per saved tensor", zero=True))


def _overlap(d: Mapping) -> float | None:
    value = d.get("overlap")
    if value is None:
        return None
    return _number(d, "overlap", value, "fraction of an all-reduce hidden behind compute", high=1.0, zero=True)


def available_profiles() -> list[str]:
    names = set()
    for d in (CONFIG_DIR, PACKAGED_DIR):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_hardware(spec: "str | Path | HardwareProfile | Mapping") -> HardwareProfile:
    """A profile by name (``h100-nvlink``), by YAML path, or passed through (a profile or a mapping).

    Raises :class:`HardwareError` for anything else, an unknown name, a file that is not a readable
    YAML mapping, or a profile that breaks the schema (see :meth:`HardwareProfile.from_dict`)."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, Mapping):
        return HardwareProfile.from_dict(spec)
    if not isinstance(spec, (str, Path)) or (isinstance(spec, str) and not spec.strip()):
        raise HardwareError(
            f"hardware must be a profile name ({', '.join(available_profiles())}), a path to a YAML profile, a "
            f"HardwareProfile or a mapping, got {spec!r} ({type(spec).__name__})")
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return _read_profile(path)
    for d in (CONFIG_DIR, PACKAGED_DIR):
        candidate = d / f"{spec}.yaml"
        if candidate.is_file():
            return _read_profile(candidate)
    raise HardwareError(
        f"unknown hardware profile {str(spec)!r}; known profiles: {', '.join(available_profiles()) or 'none'}. "
        "Pass a name from configs/hardware/, a path to a YAML profile, or measure one with `autoshard profile`.")


_MAX_PROFILE_BYTES = 16 * 2**20


def _read_profile(path: Path) -> HardwareProfile:
    """A profile from a YAML file: a regular file of bounded size holding one YAML mapping (read with
    ``yaml.safe_load``: no code runs)."""
    if not path.is_file():
        raise HardwareError(f"hardware profile file '{path}' does not exist or is not a regular file; pass a "
                            f"profile name ({', '.join(available_profiles())}) or the path of a YAML profile")
    size = path.stat().st_size
    if size > _MAX_PROFILE_BYTES:
        raise HardwareError(f"hardware profile file '{path}' is {size} bytes, more than a profile can be "
                            f"({_MAX_PROFILE_BYTES} bytes); pass the YAML file `autoshard profile` wrote")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = " ".join(str(e).split())
        raise HardwareError(f"hardware profile file '{path}' is not readable YAML ({reason}); fix the file or "
                            f"re-measure it with `autoshard profile`") from None
    if not isinstance(data, Mapping):
        raise HardwareError(f"hardware profile file '{path}' holds {type(data).__name__}, not a mapping of "
                            f"profile fields; see configs/hardware/h100-nvlink.yaml for the format")
    return HardwareProfile.from_dict(data)
