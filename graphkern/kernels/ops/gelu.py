"""GELU, exact (erf) as ``nn.gelu`` or the tanh approximation as ``nn.gelu_approx``; float32 inside."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from graphkern.kernels.base import Case, Plan, check_dtype, template_arg
from graphkern.kernels.declaration import declare
from graphkern.kernels.elementwise import cuda_map_body, metal_map_body, plan_elementwise
from graphkern.kernels.headers import dual_header
from graphkern.nodes import Kernel

__all__ = ["GELU", "GELU_CUDA", "GELU_METAL", "gelu", "gelu_float32", "gelu_reference", "plan_gelu"]

# The formulas of mlx.nn.gelu / gelu_approx; x / sqrt(2) as x * (1 / sqrt(2)): an IEEE float
# division costs more than the erf in a 16-bit kernel, and moves the argument by at most an ulp.
# ``gk::gelu<APPROX, ...>(float)`` of each backend, for any kernel's header (the gated projection
# kernels' GeGLU takes it too).
GELU_CUDA = r"""
namespace gk {
// erf for 16-bit outputs: Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7 (far under an ulp of any
// 16-bit result), one exp and no branch: erff makes a 16-bit GELU compute-bound.
__device__ __forceinline__ float erf_16bit(float z) {
  const float a = fabsf(z);
  const float t = __fdividef(1.0f, fmaf(0.3275911f, a, 1.0f));
  const float p = fmaf(fmaf(fmaf(fmaf(1.061405429f, t, -1.453152027f), t, 1.421413741f), t,
                            -0.284496736f), t, 0.254829592f) * t;
  return copysignf(1.0f - p * __expf(-a * a), z);
}
template <bool APPROX, bool SIXTEEN_BIT>
__device__ __forceinline__ float gelu(float x) {
  if constexpr (APPROX) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * (x * x * x))));
  } else if constexpr (SIXTEEN_BIT) {
    return x * (1.0f + erf_16bit(x * 0.7071067811865476f)) * 0.5f;
  } else {
    return x * (1.0f + erff(x * 0.7071067811865476f)) * 0.5f;
  }
}
}  // namespace gk
"""

GELU_METAL = r"""
namespace gk {
template <bool APPROX>
inline float gelu(float x) {
  if (APPROX) {
    return 0.5f * x * (1.0f + metal::precise::tanh(0.7978845608028654f * (x + 0.044715f * (x * x * x))));
  }
  return x * (1.0f + gk::erf(x * 0.7071067811865476f)) * 0.5f;
}
}  // namespace gk
"""


def gelu_float32(x: mx.array, approx: bool = False) -> mx.array:
    """GELU of ``x`` computed in float32 (exact, or the tanh form with ``approx``), left in float32.

    >>> [round(v, 4) for v in gelu_float32(mx.array([-1.0, 2.0]), approx=True).tolist()]
    [-0.1588, 1.9546]
    """
    xf = x.astype(mx.float32)
    if approx:
        return 0.5 * xf * (1 + mx.tanh(math.sqrt(2 / math.pi) * (xf + 0.044715 * xf * xf * xf)))
    return xf * (1 + mx.erf(xf / math.sqrt(2))) / 2


def gelu_reference(x: mx.array, *, APPROX: bool = False) -> list[mx.array]:
    """Pure-MLX GELU in float32, cast back to x's dtype."""
    return [gelu_float32(x, APPROX).astype(x.dtype)]


GELU = Kernel(
    "gk_gelu",
    input_names=["x"],
    output_names=["out"],
    metal=metal_map_body(["x"], "gk::gelu<APPROX>(x)"),
    cuda=(_BODY := cuda_map_body(["x"], "gk::gelu<APPROX, (sizeof(T) < 4)>(x)")),
    header=dual_header(GELU_CUDA, GELU_METAL, body=_BODY),
    reference=gelu_reference,
)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, approx: bool) -> Case:
    return Case(((3.0 * mx.random.normal(tuple(shape), key=key)).astype(dtype),), {"approx": approx})


@declare(GELU, stock=lambda x, approx=False: nn.gelu(x), shapes=((4, 64), (2, 3, 100), (7, 1001), (3, 4096)),
         make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, False),
         description="GELU, exact erf form (nn.gelu)")
def plan_gelu(x: mx.array, approx: bool = False) -> Plan:
    """The launch :func:`gelu` makes (validated)."""
    op = "gelu"
    if isinstance(x, mx.array) and x.ndim == 0:
        x = x.reshape(1)
    check_dtype(op, x)
    return plan_elementwise(op, GELU, [x], [template_arg("APPROX", bool(approx))])


@plan_gelu.layer
def gelu(x: mx.array, approx: bool = False) -> mx.array:
    """GELU: exact ``x * Phi(x)`` like ``nn.gelu``, or with ``approx=True`` ``nn.gelu_approx``.

    >>> [round(v, 4) for v in gelu(mx.array([-1.0, 0.0, 2.0])).tolist()]
    [-0.1587, 0.0, 1.9545]
    """
    out = plan_gelu.launch(x, approx)[0]
    return out if x.ndim else out.reshape(())  # a scalar runs as one element


plan_gelu.variant("gelu_approx", make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, True),
                  stock=lambda x, approx=True: nn.gelu_approx(x),
                  description="GELU, tanh approximation (nn.gelu_approx)")
