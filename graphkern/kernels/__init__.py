"""graphkern's kernel library: fused normalization, RoPE, attention prologue, norm-fed
projections (plain and affine-quantized weights), activation, softmax and mixture-of-experts
routing kernels.

Each kernel is a :class:`graphkern.Kernel` with a Metal body, a CUDA body and a pure-MLX reference,
for float32, float16 and bfloat16 (float32 arithmetic inside), and a layer function that runs its
launch plan with ``graphkern.runtime.launch``, so it works eagerly, in a graphkern trace and in a
compiled graph. Each is declared once (:func:`declare`, in ``graphkern.kernels.ops``): ``LIBRARY``
maps names to :class:`LibraryEntry` objects (kernel, layer function, stock MLX equivalent,
``make_inputs``) for :func:`graphkern.debugging.kernel_checks`, and this package exports every
declared kernel (``RMS_NORM``) and layer function (``rms_norm``).

>>> import graphkern.kernels as gkk
>>> y = gkk.rms_norm(mx.ones((2, 8)), mx.ones((8,)))
>>> sorted(gkk.LIBRARY)[:3]
['add_rms_norm', 'gelu', 'gelu_approx']
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx  # noqa: F401  (doctest namespace)

from graphkern.kernels.base import Case, LibraryEntry, Plan, apply_plan
from graphkern.kernels.declaration import LibraryKernel, declare
from graphkern.kernels.registry import EXPORTS, LIBRARY, entries_for, load_library

load_library()
globals().update(EXPORTS)

__all__ = ["Case", "LIBRARY", "LibraryEntry", "LibraryKernel", "Plan", "apply_plan", "declare", "entries_for"]
__all__ = sorted(__all__ + list(EXPORTS))


def __getattr__(name: str) -> Any:
    """A kernel declared after this package was imported (by a test, a notebook): from ``EXPORTS``."""
    try:
        return EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
