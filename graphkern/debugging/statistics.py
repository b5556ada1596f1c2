"""Summary statistics of node outputs: ``{"min", "max", "mean", "absmax", "nan", "inf"}``, min,
max, mean and absmax over the finite elements (``None`` when there are none), NaN and Inf counted.
Many arrays are summarised in one evaluation (:class:`StatsBatch`): by numpy in place where MLX
computes on the CPU, by MLX's reductions on a GPU.

>>> import mlx.core as mx
>>> array_stats(mx.array([2.0, float("inf")]))
{'min': 2.0, 'max': 2.0, 'mean': 2.0, 'absmax': 2.0, 'nan': 0, 'inf': 1}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["FLOATS", "StatsBatch", "array_stats", "host_stats", "is_finite_stats", "merge_stats"]

FLOATS = (mx.float16, mx.bfloat16, mx.float32, mx.float64)
_INF = float("inf")


def _summary(x: mx.array) -> mx.array:
    """``[min, max, sum]`` of ``x`` in float32, lazily: 3 reductions. Non-finite elements make
    the sum non-finite (so does a sum that overflows), which sends the array to
    ``_finite_summary``."""
    if x.dtype == mx.complex64:
        x = mx.abs(x)
    wide = x if x.dtype in (mx.float32, mx.float64) else x.astype(mx.float32)
    return mx.stack([mx.min(wide), mx.max(wide), mx.sum(wide)]).astype(mx.float32)


def _finite_summary(x: mx.array) -> tuple[mx.array, mx.array]:
    """``[min, max, mean]`` over the finite elements (the mean summed after scaling by the
    largest magnitude, so a mask of -3.4e38s does not overflow to -inf), and ``[nan, inf]``."""
    wide = x.astype(mx.float32) if x.dtype != mx.float32 else x
    finite = mx.isfinite(wide)
    count = mx.sum(finite)
    lo = mx.min(mx.where(finite, wide, _INF))
    hi = mx.max(mx.where(finite, wide, -_INF))
    count = mx.maximum(count, 1)
    total = mx.sum(mx.where(finite, wide, 0))
    scale = mx.maximum(mx.maximum(mx.abs(lo), mx.abs(hi)), 1e-30)
    scaled = mx.sum(mx.where(finite, wide / scale, 0)) / count * scale
    mean = mx.where(mx.isfinite(total), total / count, scaled)
    return mx.stack([lo, hi, mean]), mx.stack([mx.sum(mx.isnan(wide)), mx.sum(mx.isinf(wide))])


def _stats_from(summary: list[float], size: int, counts: Sequence[int] | None = None) -> dict[str, Any]:
    """``stats`` from ``[min, max, sum]`` (all finite), or from ``_finite_summary``'s ``[min, max,
    mean]`` and its counts."""
    nan, inf = (int(counts[0]), int(counts[1])) if counts is not None else (0, 0)
    finite = size - nan - inf
    if finite <= 0:
        return {"min": None, "max": None, "mean": None, "absmax": None, "nan": nan, "inf": inf}
    lo, hi, third = (float(v) for v in summary)
    mean = third if counts is not None else third / finite
    return {"min": lo, "max": hi, "mean": mean, "absmax": max(abs(lo), abs(hi)), "nan": nan, "inf": inf}


_HOST_PIECE = 1 << 22  # elements summarised at once: a large bfloat16 array is widened a piece at a time


def _host_pieces(x: mx.array) -> Iterator[np.ndarray]:
    """An evaluated array as numpy sees it, flat, in pieces, without a copy where MLX's memory is
    the host's (bfloat16, which numpy lacks, through its bits, widened a piece at a time)."""
    bf16 = x.dtype == mx.bfloat16
    flat = np.asarray(x.view(mx.uint16) if bf16 else x).reshape(-1)
    if np.iscomplexobj(flat):
        flat = np.abs(flat)
    elif flat.dtype.kind == "b":
        flat = flat.view(np.uint8)
    for start in range(0, flat.size, _HOST_PIECE):
        piece = flat[start:start + _HOST_PIECE]
        yield (piece.astype(np.uint32) << 16).view(np.float32) if bf16 else piece


def host_stats(x: mx.array) -> dict[str, Any]:
    """``stats`` of an evaluated array with numpy (summed in float64)."""
    if not x.size:
        return _stats_from([0.0, 0.0, 0.0], 0)
    lo, hi, total, nan, inf = math.inf, -math.inf, 0.0, 0, 0
    for a in _host_pieces(x):
        if a.dtype.kind == "b":
            a = a.view(np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf is NaN: counted below, not warned
            piece_total = float(a.sum(dtype=np.float64))
        if not math.isfinite(piece_total) and a.dtype.kind in "fc":
            finite = np.isfinite(a)
            nans = int(np.isnan(a).sum())
            nan, inf = nan + nans, inf + a.size - nans - int(finite.sum())
            a = a[finite]
            if not a.size:
                continue
            piece_total = float(a.sum(dtype=np.float64))
        lo, hi, total = min(lo, float(a.min())), max(hi, float(a.max())), total + piece_total
    if not nan and not inf:
        return _stats_from([lo, hi, total], x.size)
    finite = x.size - nan - inf
    return _stats_from([lo, hi, total / finite if finite else 0.0], x.size, (nan, inf))


def array_stats(x: mx.array) -> dict[str, Any]:
    """The ``stats`` of one array (evaluates it).

    >>> array_stats(mx.array([1.0, -3.0, float("nan")]))
    {'min': -3.0, 'max': 1.0, 'mean': -1.0, 'absmax': 3.0, 'nan': 1, 'inf': 0}
    """
    batch = StatsBatch()
    batch.add(x, lambda stats: None)
    return batch.flush()[0]


def is_finite_stats(stats: dict[str, Any] | None) -> bool:
    """No NaN and no Inf in these ``stats`` (unknown stats count as finite)."""
    return stats is None or (stats["nan"] == 0 and stats["inf"] == 0)


def merge_stats(parts: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """One ``stats`` for several outputs of a node."""
    if len(parts) == 1:
        return parts[0]
    known = [(p, n - p["nan"] - p["inf"]) for p, n in zip(parts, sizes) if p["min"] is not None]
    nan, inf = sum(p["nan"] for p in parts), sum(p["inf"] for p in parts)
    if not known:
        return {"min": None, "max": None, "mean": None, "absmax": None, "nan": nan, "inf": inf}
    total = sum(p["mean"] * finite for p, finite in known)
    count = sum(finite for _, finite in known)
    return {"min": min(p["min"] for p, _ in known), "max": max(p["max"] for p, _ in known),
            "mean": total / count if count else None,
            "absmax": max(p["absmax"] for p, _ in known), "nan": nan, "inf": inf}


class StatsBatch:
    """Pending statistics: evaluated together, each handed to its callback.

    Where MLX computes on the CPU the arrays are summarised by numpy, in place (a reduction
    dispatched by MLX costs more than numpy's whole pass over a small array); on a GPU by
    MLX's reductions, on the device, and only the summaries come back.
    """

    def __init__(self, host: bool | None = None) -> None:
        self.arrays: list[mx.array] = []
        self.summaries: list[mx.array] = []
        self.done: list[Callable[[dict[str, Any]], None]] = []
        self.bytes = 0
        self.host = mx.default_device().type == mx.DeviceType.cpu if host is None else host

    def add(self, x: mx.array, done: Callable[[dict[str, Any]], None]) -> None:
        self.arrays.append(x)
        if not self.host:
            self.summaries.append(_summary(x) if x.size else mx.zeros((3,)))
        self.done.append(done)
        self.bytes += x.nbytes

    def __len__(self) -> int:
        return len(self.arrays)

    def flush(self, also: Sequence[mx.array] = ()) -> list[dict[str, Any]]:
        """Evaluate the pending statistics (and ``also``); returns them in order."""
        if not self.arrays:
            mx.eval(list(also))
            return []
        if self.host:
            mx.eval(self.arrays, *also)
            out = [host_stats(x) for x in self.arrays]
            for stats, done in zip(out, self.done):
                done(stats)
            self.arrays, self.done, self.bytes = [], [], 0
            return out
        stacked = mx.stack(self.summaries)
        mx.eval(stacked, *also)
        summaries: list[list[float]] = stacked.tolist()  # type: ignore[assignment]
        counts: dict[int, list[int]] = {}
        redo = [i for i, s in enumerate(summaries) if not all(map(math.isfinite, s))
                and self.arrays[i].dtype in FLOATS + (mx.complex64,)]
        if redo:  # some NaN or Inf (or a sum that overflowed): count them, summarise the rest
            pairs = [_finite_summary(self.arrays[i]) for i in redo]
            finite = mx.stack([p[0] for p in pairs])
            count = mx.stack([p[1] for p in pairs])
            mx.eval(finite, count)
            for i, s, c in zip(redo, finite.tolist(), count.tolist()):  # type: ignore[arg-type]
                summaries[i], counts[i] = s, c  # type: ignore[assignment]
        out = []
        for i, (x, done) in enumerate(zip(self.arrays, self.done)):
            stats = _stats_from(summaries[i], x.size, counts.get(i))
            done(stats)
            out.append(stats)
        self.arrays, self.summaries, self.done, self.bytes = [], [], [], 0
        return out
