"""Float32 constants computed on the host the way MLX's C++ computes them: with the C library's
float functions (``logf``, ``log2f``), so a kernel handed such a constant sees MLX's exact bits.

>>> host_float("log2f", 10000.0)
13.287712097167969
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import numpy as np

__all__ = ["host_float"]

#: numpy's float32 functions, where the C library cannot be loaded (they may differ by an ulp).
_NUMPY: dict[str, Callable[[np.float32], np.floating]] = {"logf": np.log, "log2f": np.log2}


@functools.cache
def _libm(name: str) -> Callable[[float], float] | None:
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("m")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn  # type: ignore[no-any-return]


def host_float(name: str, value: float) -> float:
    """``name`` (``"logf"`` or ``"log2f"``) of ``value`` rounded to float32, as the C library's
    float function computes it; the result is a float32 value."""
    x = np.float32(value)
    fn = _libm(name)
    return float(np.float32(fn(float(x)))) if fn is not None else float(_NUMPY[name](x))
