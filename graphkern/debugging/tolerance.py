"""The one tolerance rule: how far an array may be from the one it is checked against.

``actual`` is within tolerance of ``expected`` where ``|actual - expected| <= atol + rtol * |expected|``
(numpy's ``allclose``, keyword-only so the two are never swapped); equal values agree, NaN agrees
with NaN and an Inf with the same Inf, while NaN against a number or an Inf against anything else
is beyond. The relative error divides by ``max(|expected|, atol)``, so values near zero do not blow
it up. ``gk.check``, ``check_model``, ``gk.compare`` and ``gk.inspect``'s kernel checks all use it.

A check of outputs against expected outputs (``gk.check``, ``check_model``: ``checked_errors``)
asks more: a NaN or Inf on either side fails it, even where both sides agree on it (all-NaN
logits equal all-NaN logits, and are still broken), and the failure names the outputs.

The per-dtype defaults are ``(atol, rtol)`` pairs: ``TOLERANCES`` for a kernel against its
reference, ``MODEL_TOLERANCES`` for a patched model's logits against the stock model's.

>>> import mlx.core as mx
>>> within(mx.array([1.0, float("inf")]), mx.array([1.0, float("inf")]), rtol=0.0, atol=0.0)
True
>>> worst_errors([mx.array([1.0, 2.001])], [mx.array([1.0, 2.0])], rtol=1e-3, atol=1e-5)
(0.0009999275207519531, 0.0004999637603759766, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

__all__ = ["MODEL_TOLERANCES", "TOLERANCES", "checked_errors", "errors", "non_finite", "within",
           "worst_errors"]

#: (atol, rtol) per dtype for a kernel against its reference. Kernel and reference both compute in
#: float32 and round once, so they differ by at most an ulp of the dtype (float16: 2**-10,
#: bfloat16: 2**-7), plus float32 reassociation in reductions.
TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-5, 1e-5),
    mx.float16: (2e-3, 1e-3),
    mx.bfloat16: (2e-2, 1e-2),
}

#: (atol, rtol) per dtype for a patched model's logits against the stock model's. Looser than the
#: kernel tolerances: rounding differences of each layer (the kernels round once, in float32; stock
#: MLX rounds between ops in the dtype) compound through the network. float32 allows 1e-3: MLX's
#: CUDA backend runs float32 matmuls in TF32 (10-bit mantissa), so a 1e-7 difference in a norm's
#: output can flip a rounding and reach ~4e-4 in the logits.
MODEL_TOLERANCES: dict[mx.Dtype, tuple[float, float]] = {
    mx.float32: (1e-3, 1e-3),
    mx.float16: (3e-2, 1e-2),
    mx.bfloat16: (2e-1, 5e-2),
}


def errors(actual: mx.array, expected: mx.array, *, rtol: float, atol: float) -> mx.array:
    """``[max abs error, max relative error, elements beyond tolerance]`` of ``actual`` against
    ``expected`` (same shape), lazily, in float32.

    >>> errors(mx.array([1.0, 2.1]), mx.array([1.0, 2.0]), rtol=1e-3, atol=1e-5).tolist()
    [0.09999990463256836, 0.04999995231628418, 1.0]
    """
    if not expected.size:
        return mx.zeros((3,))
    a, e = actual.astype(mx.float32), expected.astype(mx.float32)
    same = mx.logical_or(a == e, mx.logical_and(mx.isnan(a), mx.isnan(e)))
    diff = mx.where(same, 0.0, mx.abs(a - e))
    diff = mx.where(mx.isnan(diff), mx.inf, diff)  # NaN against a number, Inf against -Inf
    scale = mx.where(mx.isfinite(e), mx.abs(e), 0.0)
    beyond = mx.sum(diff > atol + rtol * scale).astype(mx.float32)
    relative = mx.where(diff == 0, 0.0, diff / mx.maximum(scale, atol))
    return mx.stack([mx.max(diff), mx.max(relative), beyond])


def within(actual: mx.array, expected: mx.array, *, rtol: float, atol: float) -> bool:
    """Whether ``actual`` has ``expected``'s shape and every element is within tolerance of it."""
    return actual.shape == expected.shape and errors(actual, expected, rtol=rtol, atol=atol)[2].item() == 0


def worst_errors(actual: Sequence[mx.array], expected: Sequence[mx.array], *, rtol: float,
                 atol: float) -> tuple[float, float, bool]:
    """``(max abs error, max relative error, passed)`` over outputs and their expected values:
    passed when there are as many, of the same shapes, every element within tolerance."""
    if len(actual) != len(expected) or any(a.shape != e.shape for a, e in zip(actual, expected)):
        return float("inf"), float("inf"), False
    if not actual:
        return 0.0, 0.0, True
    rows = mx.stack([errors(a, e, rtol=rtol, atol=atol) for a, e in zip(actual, expected)])
    worst = mx.concatenate([mx.max(rows[:, :2], axis=0), mx.sum(rows[:, 2:])[None]])
    max_abs, max_rel, beyond = (float(v) for v in np.asarray(worst))
    return max_abs, max_rel, beyond == 0


def non_finite(outputs: Sequence[mx.array], side: str) -> list[str]:
    """One line for each output holding NaN or Inf values, naming it, empty when all are finite.

    >>> non_finite([mx.array([1.0, float("nan"), float("inf")]), mx.ones(2)], "patched")
    ['patched output 0: 1 NaN and 1 Inf of 3 values']
    """
    floating = [(i, o) for i, o in enumerate(outputs) if mx.issubdtype(o.dtype, mx.floating) and o.size]
    if not floating:
        return []
    counts = np.asarray(mx.stack([mx.stack([mx.isnan(o).sum(), mx.isinf(o).sum()]) for _, o in floating]))
    return [f"{side} output {i}: {int(nan)} NaN and {int(inf)} Inf of {o.size} values"
            for (i, o), (nan, inf) in zip(floating, counts) if nan or inf]


def checked_errors(actual: Sequence[mx.array], expected: Sequence[mx.array], *, rtol: float, atol: float,
                   sides: tuple[str, str] = ("actual", "expected")) -> tuple[float, float, bool, str | None]:
    """``worst_errors`` and why the check failed beyond tolerance: a NaN or Inf in any output of
    either side (named by ``sides``) fails it, with NaN errors and the outputs that hold them.

    >>> nan = mx.array([float("nan")])
    >>> max_abs, _, passed, why = checked_errors([nan], [nan], rtol=0.0, atol=0.0, sides=("patched", "stock"))
    >>> max_abs, passed
    (nan, False)
    >>> for part in why.split("; "):
    ...     print(part)
    non-finite values: stock output 0: 1 NaN and 0 Inf of 1 values
    patched output 0: 1 NaN and 0 Inf of 1 values
    """
    found = non_finite(expected, sides[1]) + non_finite(actual, sides[0])
    if found:
        return float("nan"), float("nan"), False, "non-finite values: " + "; ".join(found)
    max_abs, max_rel, passed = worst_errors(actual, expected, rtol=rtol, atol=atol)
    return max_abs, max_rel, passed, None
