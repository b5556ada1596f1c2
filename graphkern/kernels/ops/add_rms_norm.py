"""Fused residual add + RMSNorm: ``h = x + residual`` and ``rms_norm(h, weight, eps)`` in one pass.

The pattern between a transformer block's sub-layers (``h = x + attn(x); y = norm(h)``): one read
of ``x`` and ``residual``, one write of ``h`` and of ``y``, instead of two kernels and a re-read.
``h`` is rounded to the dtype before the norm, exactly as the unfused MLX code does.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import Case, Plan, check_dtype, output_spec
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import CUDA_NORM_ROW_START, METAL_NORM_ROW_START, dual_header
from graphkern.kernels.ops.rms_norm import RMS_CUDA, RMS_METAL, rms_launch, rms_norm_reference
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

__all__ = ["ADD_RMS_NORM", "add_rms_norm", "add_rms_norm_reference", "plan_add_rms_norm"]

_CUDA = r"""
namespace gk {

template <typename T, int NT, int V, int CH, bool HAS_W>
__device__ __forceinline__ void add_rms_norm_row(const T* x, const T* r, const T* w, T* h, T* out,
                                                 float eps, int n) {
  __shared__ float smem[32];
  Row<T, NT, V, CH> row(h, n);  // a streamed row re-reads h, which this thread wrote
  float ss = 0.0f;
  row.produce([&](float (&v)[V], long long i) {
    float rv[V];
    load<T, V>(x, i, v);
    load<T, V>(r, i, rv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = round_to<T>(v[j] + rv[j]);
      ss += v[j] * v[j];
    }
    store<T, V>(h, i, v);
  });
  rms_finish<T, NT, V, CH, HAS_W>(row, ss, w, out, eps, n, smem);
}

}  // namespace gk
"""

_CUDA_BODY = CUDA_NORM_ROW_START + r"""
  if (gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(h) && gk::aligned<V>(out) &&
      (!HAS_W || gk::aligned<V>(w))) {
    gk::add_rms_norm_row<T, NT, V, CH, HAS_W>(x + off, residual + off, w, h + off, out + off, eps, n);
  } else {
    gk::add_rms_norm_row<T, NT, 1, 0, HAS_W>(x + off, residual + off, w, h + off, out + off, eps, n);
  }
"""

_METAL_BODY = METAL_NORM_ROW_START + r"""
  const uint tid = thread_position_in_threadgroup.x;
  for (int i = tid; i < n; i += NT) {
    h[off + i] = static_cast<T>(static_cast<float>(x[off + i]) + static_cast<float>(residual[off + i]));
  }
  // each thread reads back only the elements it wrote, so no barrier is needed
  gk::rms_norm_row<T, NT, HAS_W>(h + off, w, out + off, eps, n, tid, thread_index_in_simdgroup,
                                    simdgroup_index_in_threadgroup, smem);
"""


def add_rms_norm_reference(x: mx.array, residual: mx.array, w: mx.array, *, EPS: int,
                           HAS_W: bool = True) -> list[mx.array]:
    """Pure-MLX ``h = x + residual`` (in x's dtype) and ``rms_norm(h)``."""
    h = x + residual
    return [h, rms_norm_reference(h, w, EPS=EPS, HAS_W=HAS_W)[0]]


ADD_RMS_NORM = Kernel(
    "gk_add_rms_norm",
    input_names=["x", "residual", "w"],
    output_names=["h", "out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(RMS_CUDA + _CUDA, RMS_METAL),
    reference=add_rms_norm_reference,
)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    kx, kr, kw = mx.random.split(key, 3)
    x = mx.random.normal(tuple(shape), key=kx).astype(dtype)
    r = mx.random.normal(tuple(shape), key=kr).astype(dtype)
    w = (1.0 + 0.5 * mx.random.normal((shape[-1],), key=kw)).astype(dtype)
    return Case((x, r, w), {"eps": 1e-5})


def _stock(x: mx.array, residual: mx.array, weight: mx.array | None = None,
           eps: float = 1e-5) -> tuple[mx.array, mx.array]:
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


@declare(ADD_RMS_NORM, stock=_stock, make_inputs=_make_inputs,
         shapes=((4, 64), (2, 3, 100), (7, 1000), (2, 4097)),
         description="residual add + RMSNorm, returns (sum, normed)")
def plan_add_rms_norm(x: mx.array, residual: mx.array, weight: mx.array | None = None,
                      eps: float = 1e-5) -> Plan:
    """The launch :func:`add_rms_norm` makes (validated)."""
    op = "add_rms_norm"
    check_dtype(op, x)
    check_dtype(op, residual, "residual")
    if residual.shape != x.shape:
        raise KernelError(op, f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}",
                          Status.INVALID_INPUT)
    if residual.dtype != x.dtype:
        raise KernelError(op, f"dtype mismatch: residual is {dtype_name(residual.dtype)} but x is "
                          f"{dtype_name(x.dtype)}", Status.INVALID_INPUT)
    grid, group, w, template = rms_launch(op, x, weight, eps)
    spec = output_spec(x.shape, x.dtype)
    return Plan(ADD_RMS_NORM, (x, residual, w), (spec, spec), grid, group, template)


@plan_add_rms_norm.layer
def add_rms_norm(x: mx.array, residual: mx.array, weight: mx.array | None = None,
                 eps: float = 1e-5) -> tuple[mx.array, mx.array]:
    """``h = x + residual`` and ``rms_norm(h, weight, eps)`` in one kernel; returns ``(h, normed)``.

    >>> h, y = add_rms_norm(mx.array([[1.0, 2.0]]), mx.array([[2.0, 2.0]]), eps=0.0)
    >>> h.tolist(), [round(v, 4) for v in y[0].tolist()]
    ([[3.0, 4.0]], [0.8485, 1.1314])
    """
    h, out = plan_add_rms_norm.launch(x, residual, weight, eps)
    return h, out
