"""RMSNorm over the last axis: ``x * rsqrt(mean(x**2) + eps) * weight``, as ``mx.fast.rms_norm``.

One block per row; the row stays in registers between the sum of squares and the output, so ``x``
is read once. Rounding follows MLX: the normalized value is cast to the dtype, then multiplied by
the weight in that dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import (
    Case,
    Plan,
    check_dtype,
    check_vector,
    eps_template,
    float_from_bits,
    output_spec,
    row_config,
    row_launch,
    template_arg,
    unused_input,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import CUDA_NORM_ROW_START, METAL_NORM_ROW_START, dual_header
from graphkern.nodes import Kernel, TemplateArg

__all__ = ["RMS_CUDA", "RMS_NORM", "RMS_SCALE_CUDA", "plan_rms_norm", "rms_launch", "rms_norm",
           "rms_norm_reference"]

#: RMSNorm's output rounding, shared with every kernel that normalizes rows: ``v * inv`` rounds to
#: the dtype, then the weight multiplies it (as ``mx.fast.rms_norm`` does).
RMS_SCALE_CUDA = r"""
namespace gk {

template <typename T, int V, bool HAS_W>
__device__ __forceinline__ void rms_scale(float (&v)[V], const T* w, long long i, float inv) {
  float wv[V];
  if constexpr (HAS_W) {
    load<T, V>(w, i, wv);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    v[j] = round_to<T>(v[j] * inv);
    if constexpr (HAS_W) {
      v[j] *= wv[j];
    }
  }
}

}  // namespace gk
"""

#: The second half of an RMSNorm row, shared with the fused residual-add kernel.
RMS_CUDA = RMS_SCALE_CUDA + r"""
namespace gk {

// Given this thread's row (filled by produce) and its partial sum of squares, write the output.
template <typename T, int NT, int V, int CH, bool HAS_W>
__device__ __forceinline__ void rms_finish(Row<T, NT, V, CH>& row, float ss, const T* w, T* out, float eps,
                                           int n, float* smem) {
  const float inv = rsqrtf(block_sum<NT>(ss, smem) / n + eps);
  row.visit([&](float (&v)[V], long long i) {
    float o[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      o[j] = v[j];
    }
    rms_scale<T, V, HAS_W>(o, w, i, inv);
    store<T, V>(out, i, o);
  });
}

template <typename T, int NT, int V, int CH, bool HAS_W>
__device__ __forceinline__ void rms_norm_row(const T* x, const T* w, T* out, float eps, int n) {
  __shared__ float smem[32];
  Row<T, NT, V, CH> row(x, n);
  float ss = 0.0f;
  row.read([&](float (&v)[V], long long) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      ss += v[j] * v[j];
    }
  });
  rms_finish<T, NT, V, CH, HAS_W>(row, ss, w, out, eps, n, smem);
}

}  // namespace gk
"""

_CUDA_BODY = CUDA_NORM_ROW_START + r"""
  if (gk::aligned<V>(x) && gk::aligned<V>(out) && (!HAS_W || gk::aligned<V>(w))) {
    gk::rms_norm_row<T, NT, V, CH, HAS_W>(x + off, w, out + off, eps, n);
  } else {
    gk::rms_norm_row<T, NT, 1, 0, HAS_W>(x + off, w, out + off, eps, n);
  }
"""

#: Metal: sum of squares, then the output; shared with the fused residual-add kernel.
RMS_METAL = r"""
namespace gk {

template <typename T, int NT, bool HAS_W, typename PX, typename PW, typename PO>
inline void rms_norm_row(PX x, PW w, PO out, float eps, int n, uint tid, uint lane, uint sg,
                         threadgroup float* smem) {
  float ss = 0.0f;
  for (int i = tid; i < n; i += NT) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = metal::precise::rsqrt(block_reduce<NT>(ss, smem, lane, sg, Sum()) / n + eps);
  for (int i = tid; i < n; i += NT) {
    float o = round_to<T>(static_cast<float>(x[i]) * inv);
    if (HAS_W) {
      o *= static_cast<float>(w[i]);
    }
    out[i] = static_cast<T>(o);
  }
}

}  // namespace gk
"""

_METAL_BODY = METAL_NORM_ROW_START + r"""
  gk::rms_norm_row<T, NT, HAS_W>(x + off, w, out + off, eps, n, thread_position_in_threadgroup.x,
                                    thread_index_in_simdgroup, simdgroup_index_in_threadgroup, smem);
"""


def rms_norm_reference(x: mx.array, w: mx.array, *, EPS: int, HAS_W: bool = True) -> list[mx.array]:
    """Pure-MLX RMSNorm with the rounding of ``mx.fast.rms_norm``'s fallback (EPS: eps's float32 bits)."""
    eps = float_from_bits(EPS)
    xf = x.astype(mx.float32)
    y = (xf * mx.rsqrt(mx.mean(mx.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return [y * w if HAS_W else y]


RMS_NORM = Kernel(
    "gk_rms_norm",
    input_names=["x", "w"],
    output_names=["out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(RMS_CUDA, RMS_METAL),
    reference=rms_norm_reference,
)


Dim3 = tuple[int, int, int]


def rms_launch(op: str, x: mx.array, weight: mx.array | None,
               eps: float) -> tuple[Dim3, Dim3, mx.array, tuple[TemplateArg, ...]]:
    """Grid, threadgroup, weight input and template of an RMSNorm row kernel over ``x`` (checked
    ``weight``; an absent one becomes the unused stand-in)."""
    if weight is not None:
        check_vector(op, weight, x, "weight")
    cfg = row_config(x.shape[-1], x.dtype)
    grid, group = row_launch(op, x, cfg)
    w = weight if weight is not None else unused_input(x.dtype)
    template = (template_arg("T", x.dtype), *cfg.template(), eps_template(eps, op),
                template_arg("HAS_W", weight is not None))
    return grid, group, w, template


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    kx, kw = mx.random.split(key)
    x = mx.random.normal(tuple(shape), key=kx).astype(dtype)
    w = (1.0 + 0.5 * mx.random.normal((shape[-1],), key=kw)).astype(dtype)
    return Case((x, w), {"eps": 1e-5})


@declare(RMS_NORM, stock=lambda x, weight=None, eps=1e-5: mx.fast.rms_norm(x, weight, eps),
         make_inputs=_make_inputs, shapes=((4, 64), (2, 3, 100), (7, 1000), (2, 4097)),
         description="RMSNorm over the last axis (mx.fast.rms_norm)")
def plan_rms_norm(x: mx.array, weight: mx.array | None = None, eps: float = 1e-5) -> Plan:
    """The launch :func:`rms_norm` makes (validated)."""
    op = "rms_norm"
    check_dtype(op, x)
    grid, group, w, template = rms_launch(op, x, weight, eps)
    return Plan(RMS_NORM, (x, w), (output_spec(x.shape, x.dtype),), grid, group, template)


@plan_rms_norm.layer
def rms_norm(x: mx.array, weight: mx.array | None = None, eps: float = 1e-5) -> mx.array:
    """RMS-normalize ``x`` over its last axis and scale by ``weight``, like ``mx.fast.rms_norm``.

    ``weight`` is 1-D of size ``x.shape[-1]`` and of x's dtype (or None); float32, float16 and
    bfloat16, any leading dimensions.

    >>> x = mx.array([[3.0, 4.0]])
    >>> rms_norm(x, mx.array([1.0, 2.0]), eps=0.0).tolist()   # rms = sqrt(12.5)
    [[0.8485281467437744, 2.262741804122925]]
    """
    return plan_rms_norm.launch(x, weight, eps)[0]


