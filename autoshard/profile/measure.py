"""The measurement: every measurement run on all ranks, each value agreed as its maximum over
ranks, the models fitted, and the whole assembled into a HardwareProfile (with a description of
how it was measured).
"""
from __future__ import annotations

import datetime
import os
import platform
from typing import Sequence

import torch
import torch.distributed as dist

from ..hardware import COPY_RUN, HardwareProfile, LinkModel, SmallMessages
from ..mesh import MeshError, MeshSpec
from ..progress import Progress
from ..units import format_bytes
from .collectives import _ISSUED_RUN_S, MEASURED_KINDS, SYNC_WAIT_SLICES, _measure_overlap, _measure_sync_wait, _time_collective
from .compute import (_CHAIN_S, _COPY_BYTES, _MAX_CHAIN, _MAX_COLD_CHAIN, _MAX_COLD_CHAIN_S, CHECKPOINT_CHAINS,
                      COMPUTE_OPS, RECHECK_FASTER, REMEASURED, _compute_curve,
                      _compute_sizes, _measure_checkpoint, _measure_compute, _measure_local, _measure_optimizer,
                      optimizer_params)
from .fitting import fit_alpha_beta, fit_checkpoint, fit_optimizer, fit_sync_wait, overlap_fraction
from .timing import ProfileError, _device, _dtypes, _ensure_initialised, _max_over_ranks, _ranks_over_cores

__all__ = ["DEFAULT_SIZES", "SMALL_ALL_REDUCE_BYTES", "measure_profile"]

DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB

_SYNC_WAIT_MIN_ITERS = 15
"""Rounds of the sync-wait measurement at least: a difference of two noisy loops of ranks sharing
cores, it needs more than the compute curves' default 10."""

SMALL_ALL_REDUCE_BYTES = (4, 16, 64, 256, 1024)
"""All-reduce sizes timed besides the fitted ones, kept as measured (``small_all_reduce``), each of as
few elements as make it (float64 from 8 bytes): one float32, a loss's float64 sum and count, up to
where the fit holds again. Below twice the ranks' number of elements gloo's ring costs by the
elements (4 CPU ranks: 1.2 ms for one, 1.6 for two float64, 3.9 for four float32, 5.5+ from eight)."""


def _physical_memory_per_rank() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def measure_profile(mesh_shape: "MeshSpec | Sequence[int] | str", *, name: str = "measured",
                    sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 30, warmup: int = 5,
                    base: HardwareProfile | None = None, compute_iters: int = 10,
                    compute_points: int | None = None, progress: bool = False) -> HardwareProfile:
    """Measure this cluster as a HardwareProfile; collective, so call it on every rank.

    ``base`` supplies what is not measured: the link of a size-1 axis (without ``base`` it copies
    the other axis) and FLOP/s of dtypes other than those timed. ``compute_iters`` bounds the timed
    runs of each compute, optimizer and overlap measurement (fewer where they would exceed about a
    second, at least 3); ``compute_points`` keeps only the that many smallest sizes of each compute
    family (a quick measurement; None: all). ``progress``: report each stage on stderr (rank 0 only).
    """
    mesh = MeshSpec.of(mesh_shape)
    if len(sizes) < 2 or min(sizes) < 4:
        raise ProfileError(f"need two or more message sizes of at least 4 bytes, got {list(sizes)}")
    if compute_iters < 1 or (compute_points is not None and compute_points < 1):
        raise ProfileError(f"compute_iters and compute_points must be at least 1, got {compute_iters} "
                           f"and {compute_points}")
    created = _ensure_initialised()
    try:
        if dist.get_world_size() != mesh.size:
            raise MeshError(f"mesh {mesh} needs {mesh.size} ranks but torchrun started {dist.get_world_size()}; "
                            f"pass --nproc_per_node={mesh.size} or another --mesh")
        return _measure(mesh, name, sorted(int(s) for s in sizes), iters, warmup, base,
                        compute_iters, compute_points, Progress(progress and dist.get_rank() == 0))
    finally:
        if created:
            dist.destroy_process_group()


def _agree(local: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Every value replaced by its maximum over ranks (every rank has the same keys, in order)."""
    flat = _max_over_ranks([v for values in local.values() for v in values], device)
    out, i = {}, 0
    for key, values in local.items():
        out[key] = flat[i:i + len(values)]
        i += len(values)
    return out


def _measure(mesh: MeshSpec, name: str, sizes: list[int], iters: int, warmup: int,
             base: HardwareProfile | None, compute_iters: int, compute_points: int | None,
             progress: Progress) -> HardwareProfile:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device()
    dmesh = init_device_mesh(device.type, mesh.shape, mesh_dim_names=("a0", "a1"))
    measured_axes = [a for a in range(2) if mesh.shape[a] > 1]
    local: dict[str, list[float]] = {}
    both_axes = len(measured_axes) == 2          # collectives over both axes run on the world group
    groups = {str(a): dmesh.get_group(a) for a in measured_axes} | ({"world": dist.group.WORLD} if both_axes else {})
    for kind in ("all_reduce", *MEASURED_KINDS):
        for key, group in groups.items():
            where = _group_label(key)
            with progress.stage(f"timing {kind} on {where} ({len(sizes)} sizes x {iters} runs)"):
                local[f"{kind}.{key}"] = _time_collective(kind, group, sizes, device, iters, warmup)
    small = [b for b in SMALL_ALL_REDUCE_BYTES if b < sizes[0]]
    if small:
        for key, group in groups.items():
            where = _group_label(key)
            with progress.stage(f"timing small all_reduce on {where} ({len(small)} sizes x {iters} runs)"):
                local[f"small_all_reduce.{key}"] = _time_collective("all_reduce", group, small, device, iters, warmup,
                                                                    fewest_elements=True)
    with progress.stage("timing matmul peak and memory copies"):
        roof = _measure_local(device, iters, warmup)
    local["matmul"] = list(roof.matmul_s.values())
    local["copy"] = [roof.copy_s] + ([roof.host_copy_s] if roof.host_copy_s is not None else [])
    local.update(_measure_compute(device, compute_iters, compute_points, progress))
    with progress.stage("timing the optimizer step (AdamW)"):
        local.update(_measure_optimizer(device, compute_iters))
    with progress.stage(f"timing activation checkpointing ({len(CHECKPOINT_CHAINS)} chains)"):
        local.update(_measure_checkpoint(device, compute_iters))
    if dist.get_world_size() > 1:              # one rank has no communication to hide
        with progress.stage("timing all-reduce overlap with compute"):
            local.update(_measure_overlap(device, compute_iters))
        for key, group in groups.items():
            where = _group_label(key)
            with progress.stage(f"timing the wait of a collective on {where} after {len(SYNC_WAIT_SLICES)} "
                                "lengths of compute"):
                waits = _measure_sync_wait(device, max(compute_iters, _SYNC_WAIT_MIN_ITERS), group)
                local.update({f"sync_wait.{key}.{k}": v for k, v in waits.items()})
    agreed = _agree(local, device)

    nbytes = [4 * (s // 4) for s in sizes]
    ar_times = {a: agreed[f"all_reduce.{a}"] for a in measured_axes}
    links = {a: fit_alpha_beta(nbytes, ar_times[a], mesh.shape[a]) for a in measured_axes}
    world = fit_alpha_beta(nbytes, agreed["all_reduce.world"], mesh.size) if both_axes else None
    all_reduce_links = {str(a): links[a] for a in measured_axes} | ({"world": world} if both_axes else {})
    kinds = {kind: {_group_name(key): fit_alpha_beta(
                        nbytes, agreed[f"{kind}.{key}"], mesh.size if key == "world" else mesh.shape[int(key)],
                        kind=kind, fallback=all_reduce_links[key])
                    for key in groups} for kind in MEASURED_KINDS}
    flops = {k: 2 * roof.matmul_n**3 / t for k, t in zip(roof.matmul_s, agreed["matmul"])}
    mem_bw = 2 * _COPY_BYTES / agreed["copy"][0]
    host_bw = _COPY_BYTES / agreed["copy"][1] if roof.host_copy_s is not None else mem_bw
    compute = {dname: {family: _compute_curve(agreed, f"{dname}.{family}") for family in COMPUTE_OPS}
               for dname in _dtypes(device)}
    optimizer = fit_optimizer(agreed["optimizer.n_tensors"], agreed["optimizer.bytes"], agreed["optimizer.seconds"])
    checkpoint = fit_checkpoint(agreed["checkpoint.saved"], agreed["checkpoint.seconds"])
    overlap = overlap_fraction(*agreed["overlap.seconds"]) if "overlap.seconds" in agreed else None
    sync_wait = {_group_name(key): fit_sync_wait(agreed[f"sync_wait.{key}.gap"], agreed[f"sync_wait.{key}.added"])
                 for key in groups if f"sync_wait.{key}.gap" in agreed}
    small_all_reduce = {_group_name(key):
                        SmallMessages(tuple(float(b) for b in small), tuple(agreed[f"small_all_reduce.{key}"]))
                        for key in groups} if small else {}
    return HardwareProfile(
        name=name,
        axes=_complete_axes(links, base),
        peak_flops={**(dict(base.peak_flops) if base else {}), **flops},
        memory_bandwidth=mem_bw,
        memory_per_device=(torch.cuda.get_device_properties(device).total_memory
                           if device.type == "cuda" else _physical_memory_per_rank()),
        host_device_bandwidth=host_bw,
        device_memory_separate=device.type == "cuda",     # CPU ranks: "device" memory is host memory
        description=_describe(mesh, device, sizes, iters, roof.matmul_n, links, base, compute_iters),
        compute=compute,
        optimizer=optimizer,
        checkpoint=checkpoint,
        overlap=overlap,
        world=world,
        kinds=kinds,
        small_all_reduce=small_all_reduce,
        sync_wait=sync_wait,
        extra={"measured": {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": str(torch.__version__),
                            "all_reduce_bytes": nbytes,
                            **{f"all_reduce_seconds_axis{a}": ar_times[a] for a in measured_axes},
                            **({"all_reduce_seconds_world": agreed["all_reduce.world"]} if both_axes else {}),
                            **{f"{kind}_seconds_{_group_name(key)}": agreed[f"{kind}.{key}"]
                               for kind in MEASURED_KINDS for key in groups},
                            "compute_sizes": {f: [list(s) if isinstance(s, tuple) else s
                                                  for s in _compute_sizes(f, device, compute_points)]
                                              for f in COMPUTE_OPS},
                            "compute_remeasured": {dname: [f for f, again in zip(COMPUTE_OPS, agreed[f"{dname}.{REMEASURED}"])
                                                           if again] for dname in _dtypes(device)},
                            "optimizer_params": [list(p) for p in optimizer_params(device)],
                            "optimizer_seconds": agreed["optimizer.seconds"],
                            "checkpoint_saved_tensors": agreed["checkpoint.saved"],
                            "checkpoint_seconds": agreed["checkpoint.seconds"],
                            **({"overlap_bytes": agreed["overlap.bytes"][0],
                                "overlap_seconds": dict(zip(("compute", "all_reduce", "both"),
                                                            agreed["overlap.seconds"]))}
                               if overlap is not None else {}),
                            **({"sync_wait_added_seconds": {_group_name(key): agreed[f"sync_wait.{key}.added"]
                                                            for key in groups}} if sync_wait else {})}},
    )


def _group_label(key: str) -> str:
    """A measured group as progress lines name it: ``"all devices"`` or ``"mesh axis <k>"``."""
    return "all devices" if key == "world" else f"mesh axis {key}"


def _group_name(key: str) -> str:
    """A measured group's name in a profile: ``"world"``, or ``"axis<k>"`` for mesh axis ``k``."""
    return key if key == "world" else f"axis{key}"


def _complete_axes(links: dict[int, LinkModel], base: HardwareProfile | None) -> tuple[LinkModel, LinkModel]:
    """Both axes: measured ones, else ``base``'s, else a copy of the other measured axis."""
    if not links and base is None:
        raise ProfileError("a 1x1 mesh has no communication to measure; use a mesh with 2+ ranks or pass a base")
    out = []
    for a in range(2):
        if a in links:
            out.append(links[a])
        elif base is not None:
            out.append(base.axes[a])
        else:
            out.append(next(iter(links.values())))
    return out[0], out[1]


def _describe(mesh: MeshSpec, device: torch.device, sizes: list[int], iters: int, matmul_n: int,
              links: dict[int, LinkModel], base: HardwareProfile | None, compute_iters: int) -> str:
    world, cores = dist.get_world_size(), os.cpu_count()
    unmeasured = [a for a in range(2) if a not in links]
    lines = [
        f"Measured by `autoshard profile` on {platform.node()} at "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}: mesh {mesh}, backend {dist.get_backend()}, "
        f"{world} ranks on {cores} CPU cores ({torch.get_num_threads()} torch threads per rank), "
        f"torch {torch.__version__}.",
        (f"Axes: all-reduce of {format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}, median of {iters} "
         f"runs of {_ISSUED_RUN_S * 1e3:.0f} ms of (compute slice, all-reduce) less the compute alone (as a "
         f"step issues them), max over ranks, fitted to 2(n-1)*alpha + 2(n-1)/n*bytes*beta by "
         f"least squares on relative error. All-gather and reduce-scatter (kinds) timed the same way on "
         f"each axis and the all-device group, fitted to one ring, (n-1)*alpha + (n-1)/n*bytes*beta (where "
         f"the time does not grow with size, the all-reduce's beta and alpha to the times). All-reduces of "
         f"{', '.join(str(b) for b in SMALL_ALL_REDUCE_BYTES if b < sizes[0])} bytes (as few elements as make "
         f"each, float64 from 8 bytes, as a loss's sum and count) timed the same way on each group and kept as "
         f"measured (small_all_reduce)." if links else
         "No axis has more than one device: no link measured."),
        f"Roofline fallback: FLOP/s from {matmul_n}^3 matmuls, memory bandwidth from a "
        f"{format_bytes(_COPY_BYTES)} copy (read + write), all ranks at once, slowest rank kept.",
        f"Compute curves ({', '.join(_dtypes(device))}): forward and backward seconds per op of F.linear "
        f"(matmul; and with rows of no whole multiple of 16 bytes, matmul_unaligned; on 1, 2, 4 and 8 rows, "
        f"matmul_rows1 to matmul_rows8, by bytes), 3x3 F.conv2d (conv; and with channels of no whole multiple of 16, conv_unaligned), causal F.scaled_dot_product_attention (attention), the median of add and mul "
        f"(pointwise), of tanh-GELU, SiLU, tanh and sigmoid (transcendental), each of exp, log, tanh, sigmoid, "
        f"SiLU, GELU and tanh-GELU (their own curves), F.layer_norm (norm), training "
        f"F.batch_norm (batch_norm), the runtime's sync-BN kernel's local compute (sync_batch_norm), 2x2 F.max_pool2d (max_pool) and F.avg_pool2d (avg_pool), F.cross_entropy (loss), a copy in runs of {COPY_RUN} elements (copy_blocks), "
        f"the median of a transpose and a reshape that copy nothing (view) "
        f"against forward FLOPs "
        f"(FlopCounterMode) or bytes in + out; each op timed in a chain of identical ops, long enough for "
        f"2e8 FLOPs or 1.6e7 bytes and {_CHAIN_S * 1e3:g} ms of forward + backward, at most {_MAX_CHAIN} "
        f"(per-op time = chain time / length; the forward over up to {_MAX_COLD_CHAIN}, every output held, "
        f"until it writes twice the last-level cache or takes {_MAX_COLD_CHAIN_S:g} s with its backward), "
        f"median of up to {compute_iters} barrier-synchronised "
        f"runs, all ranks at once, max over ranks; sizes in extra.measured.compute_sizes. Each curve's "
        f"middle point timed again after all curves; a curve whose point then took {100 * RECHECK_FASTER:.0f}% "
        f"less was measured while the machine was loaded, timed again whole, and keeps the faster of its two "
        f"times per size (families in extra.measured.compute_remeasured).",
        "Optimizer: torch.optim.AdamW step (default implementation) over the parameter lists in "
        "extra.measured.optimizer_params (tensors, elements; float32), fitted to n*per_tensor + "
        "bytes*per_byte. Checkpoint: chains of (linear, tanh) pairs in one torch.utils.checkpoint region "
        "(non-reentrant), forward + backward less the plain chain's less one more forward, against the "
        "tensors the chain's forward saves (extra.measured.checkpoint_saved_tensors), fitted to "
        "per_region + saved*per_saved_tensor. Overlap: (C + A - T) / min(C, A) for a matmul loop (C), an all-reduce over all "
        "ranks of about the same time (A) and both at once with async_op=True (T). Sync wait: loops of "
        f"compute slices of {', '.join(str(k) for k in SYNC_WAIT_SLICES)} times the slice the collectives "
        "follow above, with and without an all-reduce of 8 float64 after each, on each group the "
        "collectives are timed on (every group of a mesh axis at once), timed in the same rounds, each round's "
        "seconds the slowest rank's; what the all-reduce adds beyond what it adds after the shortest slice, "
        "never falling with the slice, "
        "against the slice's seconds (extra.measured.sync_wait_added_seconds: the raw additions per group).",
    ]
    if unmeasured:
        src = f"profile {base.name!r}" if base else "the measured axis"
        which = f"Axis {unmeasured[0]} has" if len(unmeasured) == 1 else "Both axes have"
        lines.append(f"{which} size 1 here and {'was' if len(unmeasured) == 1 else 'were'} copied from {src}"
                     + (f", which says: {base.description.strip()}" if base and base.description.strip() else "")
                     + ".")
    if world == 1:
        lines.append("One rank: no all-reduce overlap measured (overlap left unset).")
    if device.type == "cpu":
        lines.append("CPU devices: host_device_bandwidth is set equal to memory_bandwidth (no separate "
                     "device memory); memory_per_device is physical RAM divided by the local ranks. A timed "
                     "run of a compute curve, the optimizer or a checkpointed chain counts as at least the "
                     f"ranks' mean process CPU time x local ranks / cores ({_ranks_over_cores():g} here): ranks sharing cores are bound "
                     "by the CPU they all need, as in a training step.")
    return " ".join(lines)
