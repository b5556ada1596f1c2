"""Half precision: which dtype a model computes in, and how far apart two half-precision runs
may be from rounding alone.

Two models that compute the same function in bfloat16 still differ wherever they round
differently (a kernel rounding once where stock MLX rounds after each op). What rounding alone
explains at a node is measured, not guessed: each model also runs in float32 (its parameters
and inputs cast as they are read), and ``|a - a32| + |b - b32|`` is how far each half-precision
value is from its own float32 value. Since
``|a - b| <= |a - a32| + |b - b32| + |a32 - b32|``, an element is beyond rounding when
``|a - b| > margin * (|a - a32| + |b - b32|) + atol + rtol * |a32|``: the float32 runs differ
there, beyond the float32 tolerance, by more than the half-precision noise. A NaN or Inf in one
side where the other holds a number is always beyond.

>>> import mlx.core as mx
>>> main_float_dtype([mx.zeros((4,), mx.bfloat16), mx.zeros((2,), mx.float32)])
mlx.core.bfloat16
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from ..tracing.state import Flat
from ..tracing.traceable import Traceable

__all__ = ["HALF_DTYPES", "ROUNDING_MARGIN", "beyond_rounding", "float32_state", "is_half",
           "main_float_dtype"]

HALF_DTYPES = (mx.float16, mx.bfloat16)
_FLOATS = (mx.float16, mx.bfloat16, mx.float32, mx.float64)
#: How many times what rounding explains a difference must exceed to count as a divergence.
ROUNDING_MARGIN = 2.0


def main_float_dtype(arrays: Iterable[mx.array]) -> mx.Dtype | None:
    """The floating dtype holding the most elements of ``arrays`` (None: no floats). For a
    quantized model: its scales' dtype, the dtype it computes in."""
    counts: dict[mx.Dtype, int] = {}
    for array in arrays:
        if array.dtype in _FLOATS:
            counts[array.dtype] = counts.get(array.dtype, 0) + array.size
    return max(counts, key=counts.__getitem__) if counts else None


def is_half(dtype: mx.Dtype | None) -> bool:
    return dtype in HALF_DTYPES


def _to_float32(x: mx.array) -> mx.array:
    return x.astype(mx.float32) if x.dtype in HALF_DTYPES else x


@contextmanager
def float32_state(traceable: Traceable, flat: Flat) -> Iterator[Flat]:
    """For the duration: ``traceable``'s half-precision state cast to float32 (lazily, nothing is
    made until read); yields ``flat`` with its half-precision arrays cast too."""
    state = [_to_float32(x) for x in traceable.state.arrays()]
    with traceable.state.swapped(state):
        yield dataclasses.replace(flat, arrays=[_to_float32(x) for x in flat.arrays])


def beyond_rounding(a: mx.array, b: mx.array, a32: mx.array, b32: mx.array, rtol: float, atol: float,
                    margin: float = ROUNDING_MARGIN) -> mx.array:
    """``[max abs, max rel, elements beyond, max rounding, excess]`` of ``b`` against the
    reference ``a``, both half precision, with ``a32``/``b32`` their float32 runs (see the
    module), lazily, in float32. ``max rounding``: the largest ``|a - a32| + |b - b32|``;
    ``excess``: the largest ``|a - b|`` over what is allowed there (beyond when over 1).

    >>> a32 = mx.array([1.0, 2.0]); a = a32.astype(mx.bfloat16)
    >>> [round(v, 3) for v in beyond_rounding(a, a * 1.01, a32, a32 * 1.01, 1e-4, 1e-5).tolist()]
    [0.016, 0.008, 2.0, 0.004, 1.744]
    """
    if not a.size:
        return mx.zeros((5,))
    x, y, xr, yr = (v.astype(mx.float32) for v in (a, b, a32, b32))
    same = mx.logical_or(x == y, mx.logical_and(mx.isnan(x), mx.isnan(y)))
    diff = mx.where(same, 0.0, mx.abs(x - y))
    diff = mx.where(mx.isnan(diff), mx.inf, diff)
    noise = mx.abs(x - xr) + mx.abs(y - yr)
    noise = mx.where(mx.isfinite(noise), noise, 0.0)  # an overflow is never rounding
    ref = mx.where(mx.isfinite(xr), mx.abs(xr), 0.0)
    allowed = margin * noise + atol + rtol * ref
    over = diff / allowed
    beyond = mx.sum(over > 1).astype(mx.float32)
    return mx.stack([mx.max(diff), mx.max(diff / mx.maximum(mx.abs(mx.where(mx.isfinite(x), x, 0.0)), atol)),
                     beyond, mx.max(noise), mx.max(over)])
