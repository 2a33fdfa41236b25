"""The models ``autoshard profile`` fits to its timings: alpha-beta links (ring model), the
optimizer step's per-tensor and per-byte cost, and the overlap of communication with compute.
"""
from __future__ import annotations

import statistics
from typing import Sequence

from ..hardware import CheckpointModel, LinkModel, OptimizerModel, SyncWait
from .timing import ProfileError

__all__ = ["fit_alpha_beta", "fit_checkpoint", "fit_optimizer", "fit_sync_wait", "overlap_fraction"]


def _fit_affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(c0, c1)`` minimising sum(((c0 + c1*x - y) / y)^2), with ``c0 >= 0``."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swy = sum(wi * y for wi, y in zip(w, ys))
    swxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * swxx - swx * swx
    c0 = (swy * swxx - swx * swxy) / det
    if c0 < 0:  # latency below the noise: fit the bandwidth term alone
        return 0.0, swxy / swxx
    return c0, (sw * swxy - swx * swy) / det


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], n: int, kind: str = "all_reduce",
                   fallback: LinkModel | None = None) -> LinkModel:
    """Alpha-beta link from timings of a ``kind`` collective on a group of ``n`` devices (ring model
    of comm_cost.py: an all-reduce is two rings, the other kinds one). Where the time does not grow with
    the size (a backend that runs the collective as something else), ``fallback``'s beta is kept
    and alpha fitted to the times."""
    if n < 2:
        raise ProfileError(f"an axis of {n} device(s) has no communication to fit")
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ProfileError("need timings at two or more distinct message sizes to fit alpha and beta")
    if min(seconds) <= 0:
        raise ProfileError(f"non-positive timing in {list(seconds)}")
    rings = 2 if kind == "all_reduce" else 1
    c0, c1 = _fit_affine(nbytes, seconds)
    if c1 <= 0 and fallback is not None:
        c1 = fallback.beta * rings * (n - 1) / n
        c0 = statistics.median(t - c1 * b for b, t in zip(nbytes, seconds))
    if c1 <= 0:
        raise ProfileError(f"{kind} time does not grow with message size ({list(seconds)} s for "
                           f"{list(nbytes)} B); measure larger messages (--sizes) or more --iters")
    return LinkModel(alpha=max(c0, 0.0) / (rings * (n - 1)), beta=c1 / (rings * (n - 1) / n))


def fit_optimizer(n_tensors: Sequence[int], nbytes: Sequence[float], seconds: Sequence[float]) -> OptimizerModel:
    """``t = n * per_tensor + bytes * per_byte`` by least squares on relative error, both >= 0."""
    if not len(n_tensors) == len(nbytes) == len(seconds) or len(seconds) < 2 or min(seconds) <= 0:
        raise ProfileError(f"need two or more positive optimizer timings, got {list(seconds)}")
    return OptimizerModel(*_nonnegative_fit(n_tensors, nbytes, seconds))


def fit_checkpoint(saved: Sequence[float], seconds: Sequence[float]) -> CheckpointModel:
    """``t = per_region + saved * per_saved_tensor`` by least squares on relative error, both >= 0
    (a chain whose overhead measured 0 weighs as if it had measured the smallest positive one)."""
    positive = [t for t in seconds if t > 0]
    if len(saved) != len(seconds) or len(seconds) < 2 or not positive:
        raise ProfileError(f"need two or more checkpoint timings, some positive, got {list(seconds)}")
    floor = min(positive)
    return CheckpointModel(*_nonnegative_fit([1.0] * len(saved), saved, [max(t, floor) for t in seconds]))


def _nonnegative_fit(x1: Sequence[float], x2: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(c1, c2) >= 0`` minimising the relative error of ``c1 * x1 + c2 * x2`` against ``seconds``."""
    w = [1.0 / (t * t) for t in seconds]
    a11 = sum(wi * a * a for wi, a in zip(w, x1))
    a12 = sum(wi * a * b for wi, a, b in zip(w, x1, x2))
    a22 = sum(wi * b * b for wi, b in zip(w, x2))
    r1 = sum(wi * a * t for wi, a, t in zip(w, x1, seconds))
    r2 = sum(wi * b * t for wi, b, t in zip(w, x2, seconds))
    det = a11 * a22 - a12 * a12

    def error(c1: float, c2: float) -> float:
        return sum(wi * (c1 * a + c2 * b - t) ** 2 for wi, a, b, t in zip(w, x1, x2, seconds))

    candidates = [(r1 / a11, 0.0), (0.0, r2 / a22)]       # one coefficient at its bound
    if det > 0:
        c1, c2 = (r1 * a22 - r2 * a12) / det, (r2 * a11 - r1 * a12) / det
        if c1 >= 0 and c2 >= 0:
            candidates.append((c1, c2))
    return min(candidates, key=lambda c: error(*c))


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of compute and communication hidden when both run at once, in [0, 1]."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


def fit_sync_wait(gaps: Sequence[float], added: Sequence[float]) -> SyncWait:
    """The extra wait of a collective after ``gaps[i]`` seconds of compute, from what it added to a
    loop of that compute (``added[i]``; ``gaps[0]`` the slices its price was timed after): beyond
    ``added[0]``, never below 0 and never falling with the gap (a longer stretch of compute cannot
    leave the ranks closer together; a fall is noise)."""
    if len(gaps) < 2 or len(gaps) != len(added) or any(a >= b for a, b in zip(gaps, gaps[1:])):
        raise ProfileError(f"sync wait: need two or more increasing gaps with a time each, got {list(gaps)} "
                           f"and {list(added)}")
    seconds, highest = [], 0.0
    for extra in added:
        highest = max(highest, extra - added[0])
        seconds.append(highest)
    return SyncWait(tuple(float(g) for g in gaps), tuple(seconds))
