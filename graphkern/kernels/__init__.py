"""graphkern's kernel library: fused normalization, RoPE, attention prologue, norm-fed
projections (plain and affine-quantized weights), activation, softmax and mixture-of-experts
routing kernels.

Each kernel is a :class:`graphkern.Kernel` with a Metal body, a CUDA body and a pure-MLX reference,
for float32, float16 and bfloat16 (float32 arithmetic inside), and a layer function that picks the
launch and calls ``graphkern.runtime.launch``, so it works eagerly, in a graphkern trace and in a
compiled graph. ``LIBRARY`` maps names to :class:`LibraryEntry` objects (kernel, layer function,
stock MLX equivalent, ``make_inputs``) for :func:`graphkern.debugging.kernel_checks`.

>>> import graphkern.kernels as gkk
>>> y = gkk.rms_norm(mx.ones((2, 8)), mx.ones((8,)))
>>> sorted(gkk.LIBRARY)[:3]
['add_rms_norm', 'gelu', 'gelu_approx']
"""

from __future__ import annotations

import mlx.core as mx  # noqa: F401  (doctest namespace)

from graphkern.kernels.base import Case, LibraryEntry, Plan, apply_plan
from graphkern.kernels.ops.add_rms_norm import ADD_RMS_NORM, add_rms_norm
from graphkern.kernels.ops.gelu import GELU, gelu
from graphkern.kernels.ops.layer_norm import LAYER_NORM, layer_norm
from graphkern.kernels.ops.moe_route import MOE_ROUTE, moe_route
from graphkern.kernels.ops.projections import NORM_PROJECTIONS, NORM_SWIGLU, norm_projections, norm_swiglu
from graphkern.kernels.ops.quantized_projections import (
    QUANTIZED_NORM_PROJECTIONS,
    QUANTIZED_NORM_SWIGLU,
    quantized_norm_projections,
    quantized_norm_swiglu,
)
from graphkern.kernels.ops.quantized_rope_projections import (
    QUANTIZED_NORM_ROPE_PROJECTIONS,
    quantized_norm_rope_projections,
)
from graphkern.kernels.ops.rms_norm import RMS_NORM, rms_norm
from graphkern.kernels.ops.rope import ROPE, rope
from graphkern.kernels.ops.rope_qk import ROPE_QK, rope_qk
from graphkern.kernels.ops.softmax import SOFTMAX, softmax
from graphkern.kernels.ops.swiglu import SWIGLU, swiglu
from graphkern.kernels.registry import LIBRARY, entries_for

__all__ = [
    "ADD_RMS_NORM",
    "GELU",
    "LAYER_NORM",
    "LIBRARY",
    "MOE_ROUTE",
    "NORM_PROJECTIONS",
    "NORM_SWIGLU",
    "QUANTIZED_NORM_PROJECTIONS",
    "QUANTIZED_NORM_ROPE_PROJECTIONS",
    "QUANTIZED_NORM_SWIGLU",
    "RMS_NORM",
    "ROPE",
    "ROPE_QK",
    "SOFTMAX",
    "SWIGLU",
    "Case",
    "LibraryEntry",
    "Plan",
    "add_rms_norm",
    "apply_plan",
    "entries_for",
    "gelu",
    "layer_norm",
    "moe_route",
    "norm_projections",
    "norm_swiglu",
    "quantized_norm_projections",
    "quantized_norm_rope_projections",
    "quantized_norm_swiglu",
    "rms_norm",
    "rope",
    "rope_qk",
    "softmax",
    "swiglu",
]
