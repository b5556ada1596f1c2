"""LayerNorm over the last axis, with or without weight and bias, as ``mx.fast.layer_norm``.

One block per row, the row in registers: the mean, then the variance of the centred row (two
reductions, no ``E[x^2] - E[x]^2`` cancellation), then the output. Rounding follows MLX's fallback:
the normalized value is cast to the dtype, multiplied by the weight and added to the bias in it.
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
from graphkern.nodes import Kernel

__all__ = ["LAYER_NORM", "layer_norm", "layer_norm_reference", "plan_layer_norm"]

_CUDA = r"""
namespace gk {

template <typename T, int NT, int V, int CH, bool HAS_W, bool HAS_B>
__device__ __forceinline__ void layer_norm_row(const T* x, const T* w, const T* b, T* out, float eps, int n) {
  __shared__ float smem[32];
  Row<T, NT, V, CH> row(x, n);
  float s = 0.0f;
  row.read([&](float (&v)[V], long long) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s += v[j];
    }
  });
  const float mean = block_sum<NT>(s, smem) / n;
  float ss = 0.0f;
  row.visit([&](float (&v)[V], long long i) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = v[j] - mean;
      ss += d * d;
    }
  });
  const float inv = rsqrtf(block_sum<NT>(ss, smem) / n + eps);
  row.visit([&](float (&v)[V], long long i) {
    float o[V];
    float wv[V];
    float bv[V];
    if constexpr (HAS_W) {
      load<T, V>(w, i, wv);
    }
    if constexpr (HAS_B) {
      load<T, V>(b, i, bv);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      o[j] = round_to<T>((v[j] - mean) * inv);
      if constexpr (HAS_W) {
        o[j] = round_to<T>(o[j] * wv[j]);
      }
      if constexpr (HAS_B) {
        o[j] += bv[j];
      }
    }
    store<T, V>(out, i, o);
  });
}

}  // namespace gk
"""

_CUDA_BODY = CUDA_NORM_ROW_START + r"""
  if (gk::aligned<V>(x) && gk::aligned<V>(out) && (!HAS_W || gk::aligned<V>(w)) &&
      (!HAS_B || gk::aligned<V>(b))) {
    gk::layer_norm_row<T, NT, V, CH, HAS_W, HAS_B>(x + off, w, b, out + off, eps, n);
  } else {
    gk::layer_norm_row<T, NT, 1, 0, HAS_W, HAS_B>(x + off, w, b, out + off, eps, n);
  }
"""

_METAL = r"""
namespace gk {

template <typename T, int NT, bool HAS_W, bool HAS_B, typename PX, typename PW, typename PB,
          typename PO>
inline void layer_norm_row(PX x, PW w, PB b, PO out, float eps, int n, uint tid, uint lane, uint sg,
                           threadgroup float* smem) {
  float s = 0.0f;
  for (int i = tid; i < n; i += NT) {
    s += static_cast<float>(x[i]);
  }
  const float mean = block_reduce<NT>(s, smem, lane, sg, Sum()) / n;
  float ss = 0.0f;
  for (int i = tid; i < n; i += NT) {
    const float d = static_cast<float>(x[i]) - mean;
    ss += d * d;
  }
  const float inv = metal::precise::rsqrt(block_reduce<NT>(ss, smem, lane, sg, Sum()) / n + eps);
  for (int i = tid; i < n; i += NT) {
    float o = round_to<T>((static_cast<float>(x[i]) - mean) * inv);
    if (HAS_W) {
      o = round_to<T>(o * static_cast<float>(w[i]));
    }
    if (HAS_B) {
      o += static_cast<float>(b[i]);
    }
    out[i] = static_cast<T>(o);
  }
}

}  // namespace gk
"""

_METAL_BODY = METAL_NORM_ROW_START + r"""
  gk::layer_norm_row<T, NT, HAS_W, HAS_B>(x + off, w, b, out + off, eps, n, thread_position_in_threadgroup.x,
                                             thread_index_in_simdgroup, simdgroup_index_in_threadgroup, smem);
"""


def layer_norm_reference(x: mx.array, w: mx.array, b: mx.array, *, EPS: int, HAS_W: bool = True,
                         HAS_B: bool = True) -> list[mx.array]:
    """Pure-MLX LayerNorm with the rounding of ``mx.fast.layer_norm``'s fallback (EPS: eps's bits)."""
    eps = float_from_bits(EPS)
    xf = x.astype(mx.float32)
    xc = xf - mx.mean(xf, axis=-1, keepdims=True)
    y = (xc * mx.rsqrt(mx.mean(mx.square(xc), axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    return [y]


LAYER_NORM = Kernel(
    "gk_layer_norm",
    input_names=["x", "w", "b"],
    output_names=["out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(_CUDA, _METAL),
    reference=layer_norm_reference,
)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, *, bias: bool) -> Case:
    kx, kw, kb = mx.random.split(key, 3)
    x = (2.0 + 3.0 * mx.random.normal(tuple(shape), key=kx)).astype(dtype)  # an offset mean
    w = (1.0 + 0.5 * mx.random.normal((shape[-1],), key=kw)).astype(dtype)
    b = (0.5 * mx.random.normal((shape[-1],), key=kb)).astype(dtype) if bias else None
    return Case((x, w, b), {"eps": 1e-5})


def _stock(x: mx.array, weight: mx.array | None = None, bias: mx.array | None = None,
           eps: float = 1e-5) -> mx.array:
    return mx.fast.layer_norm(x, weight, bias, eps)


@declare(LAYER_NORM, stock=_stock,
         make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, bias=True),
         shapes=((4, 64), (2, 3, 100), (7, 1000), (2, 4097)),
         description="LayerNorm with weight and bias (mx.fast.layer_norm)")
def plan_layer_norm(x: mx.array, weight: mx.array | None = None, bias: mx.array | None = None,
                    eps: float = 1e-5) -> Plan:
    """The launch :func:`layer_norm` makes (validated)."""
    op = "layer_norm"
    check_dtype(op, x)
    if weight is not None:
        check_vector(op, weight, x, "weight")
    if bias is not None:
        check_vector(op, bias, x, "bias")
    n = x.shape[-1]
    cfg = row_config(n, x.dtype, items=32)  # two reductions a row: fewer, fuller threads win
    grid, group = row_launch(op, x, cfg)
    unused = unused_input(x.dtype)
    template = [template_arg("T", x.dtype), *cfg.template(), eps_template(eps, op),
                template_arg("HAS_W", weight is not None), template_arg("HAS_B", bias is not None)]
    inputs = (x, weight if weight is not None else unused, bias if bias is not None else unused)
    return Plan(LAYER_NORM, inputs, (output_spec(x.shape, x.dtype),), grid, group, tuple(template))


@plan_layer_norm.layer
def layer_norm(x: mx.array, weight: mx.array | None = None, bias: mx.array | None = None,
               eps: float = 1e-5) -> mx.array:
    """Layer-normalize ``x`` over its last axis, then ``* weight + bias``, like ``mx.fast.layer_norm``.

    ``weight`` and ``bias`` are optional, 1-D of size ``x.shape[-1]`` and of x's dtype.

    >>> layer_norm(mx.array([[1.0, 3.0]]), mx.array([2.0, 2.0]), mx.array([0.5, 0.5]), eps=0.0).tolist()
    [[-1.5, 2.5]]
    """
    return plan_layer_norm.launch(x, weight, bias, eps)[0]


plan_layer_norm.variant("layer_norm_no_bias",
                        make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, bias=False),
                        description="LayerNorm with weight, no bias (mx.fast.layer_norm)")
