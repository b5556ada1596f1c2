"""An affine-quantized product of the few token rows of a decoding step, without a norm before it:
``x @ dequantize(W).T`` for up to ``MAX_ROWS`` rows, what ``nn.QuantizedLinear`` computes (the
weights as ``graphkern.kernels.ops.quantized_projections`` describes them). A block's output and
down projections take their rows as attention and the gated feed-forward leave them.

CUDA: the product half of ``quantized_norm_projections``: each block copies the rows into shared
memory as float32 values with each group's sum, then each warp reduces a weight row at a time (one,
or several where the rows outnumber ``MAX_WARPS``), its lanes reading 16 bytes of packed weights at a
time. Metal: the rows in threadgroup memory, a simdgroup a weight row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from graphkern.kernels.base import Case, Plan, check_dtype, output_spec, runs_on_cuda, template_arg
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.norm_rows import norm_rows
from graphkern.kernels.ops.projections import DECODING_SHAPES
from graphkern.kernels.ops.quantized_projections import (
    BLOCK,
    QUANTIZED_CUDA,
    QUANTIZED_METAL,
    QUANTIZED_ROW_BYTES,
    WIDE_BLOCK,
    QuantizedWeight,
    check_quantization,
    check_quantized_weight,
    quantized_prefetch,
    quantized_product,
    random_quantized,
    shared_parts,
    with_row_memory,
)
from graphkern.nodes import Kernel

__all__ = ["MAX_WARPS", "QUANTIZED_MATVEC", "matvec_case", "plan_quantized_matvec", "quantized_matvec"]

_CUDA_COPY_ROWS = r"""
namespace gk {

// The M rows of x into xs as floats, placed as norm_rows_float places normalized ones, and each
// group of GS values' sum into xsum. VEC: four values a load (x aligned to 4 elements).
template <typename T, int M, int K, int NT, int GS, bool VEC>
__device__ __forceinline__ void copy_rows_float(const T* x, float* xs, float* xsum) {
  constexpr int G = K / GS;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    for (int c0 = threadIdx.x & ~31; c0 < K / 4; c0 += NT) {
      const int c = c0 + lane;
      float s = 0.0f;
      if (c < K / 4) {
        float v[4];
        if constexpr (VEC) {
          load<T, 4>(x + m * K, c * 4, v);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            v[j] = static_cast<float>(x[m * K + c * 4 + j]);
          }
        }
        s = v[0] + v[1] + v[2] + v[3];
        reinterpret_cast<float4*>(xs + m * K)[chunk_at(c)] = make_float4(v[0], v[1], v[2], v[3]);
      }
      store_group_sum<GS>(s, c < K / 4, lane, xsum + m * G + c * 4 / GS);
    }
  }
  __syncthreads();
}

}  // namespace gk
"""

_CUDA_MATVEC = r"""
  extern __shared__ __align__(16) float gk_quantized_rows[];
  float* xs = gk_quantized_rows;
  float* xsum = gk_quantized_rows + M * K;
  const int row = blockIdx.x * (NT / 32) + threadIdx.x / 32;
  const int n = w_shape[0];""" + QUANTIZED_ROW_BYTES + r"""
  if (row < n) {""" + quantized_prefetch("w", "scales", "biases", "row") + r"""
  }
  if (gk::aligned<4>(x)) {
    gk::copy_rows_float<T, M, K, NT, GS, true>(x, xs, xsum);
  } else {
    gk::copy_rows_float<T, M, K, NT, GS, false>(x, xs, xsum);
  }
  // a warp every gridDim.x * NT / 32 rows: a grid of at most MAX_WARPS warps copies the rows fewer times
  const bool wide = gk::aligned<4>(w);
  for (int r = row; r < n; r += gridDim.x * (NT / 32)) {
    if (wide) {
      gk::quantized_project_row<T, M, K, BITS, GS, 4>(w, scales, biases, y, r, n, xs, xsum);
    } else {
      gk::quantized_project_row<T, M, K, BITS, GS, 1>(w, scales, biases, y, r, n, xs, xsum);
    }
  }
"""

_METAL_MATVEC = r"""
  threadgroup T xs[M * K];
  const uint lane = thread_index_in_simdgroup;
  for (int i = thread_position_in_threadgroup.x; i < M * K; i += NT) {
    xs[i] = static_cast<T>(x[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int row = threadgroup_position_in_grid.x * (NT / 32) + simdgroup_index_in_threadgroup;
  const int n = w_shape[0];
  constexpr int WORDS = K * BITS / 32;
  constexpr int G = K / GS;
  float acc[M];
  for (int r = row; r < n; r += threadgroups_per_grid.x * (NT / 32)) {
    gk::quantized_row_dot<T, M, K, BITS, GS>(w + size_t(r) * WORDS, scales + size_t(r) * G,
                                             biases + size_t(r) * G, xs, lane, acc);
    if (lane == 0) {
      for (int m = 0; m < M; ++m) {
        y[size_t(m) * n + r] = static_cast<T>(acc[m]);
      }
    }
  }
"""


def quantized_matvec_reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, BITS: int,
                               GS: int, **_: Any) -> list[mx.array]:
    """Stock MLX: ``mx.quantized_matmul(x, w, scales, biases, transpose=True)``."""
    return [quantized_product(x, (w, scales, biases), GS, BITS)]


QUANTIZED_MATVEC = Kernel(
    "gk_quantized_matvec",
    input_names=["x", "w", "scales", "biases"],
    output_names=["y"],
    metal=_METAL_MATVEC,
    cuda=_CUDA_MATVEC,
    header=dual_header(QUANTIZED_CUDA + _CUDA_COPY_ROWS, QUANTIZED_METAL, body=_CUDA_MATVEC),
    reference=quantized_matvec_reference,
)


def matvec_case(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, *, group_size: int = 64,
                bits: int = 4) -> Case:
    """Arguments for one call: rows ``x`` of ``shape`` and a weight of 96 rows."""
    kx, kw = mx.random.split(key)
    x = mx.random.normal(tuple(shape), key=kx).astype(dtype)
    weight = random_quantized(96, shape[-1], dtype, kw, group_size, bits)
    return Case((x, weight), {"group_size": group_size, "bits": bits})


def _stock_matvec(x: mx.array, weight: Any, *, group_size: int = 64, bits: int = 4) -> mx.array:
    return quantized_product(x, weight, group_size, bits)


#: Inputs wider than this copy more of the rows into each block than its 8 warps' weight rows are
#: worth: those launches take 16 warps a block.
_WIDE_INPUT = 4096
#: The most warps a launch takes (about what an H100's SMs hold at once). Each block copies the
#: token rows before its products, so past this (a vocabulary of 128K rows) a warp takes several
#: weight rows instead of the grid copying the rows for every 8 of them.
MAX_WARPS = 8192


@declare(QUANTIZED_MATVEC, stock=_stock_matvec, make_inputs=matvec_case, shapes=DECODING_SHAPES,
         last_dim_multiple=64,
         description="an affine-quantized product (4-bit, group 64), for up to 8 rows (decoding)")
def plan_quantized_matvec(x: mx.array, weight: QuantizedWeight | Sequence[mx.array], *, group_size: int = 64,
                          bits: int = 4) -> Plan:
    """The launch :func:`quantized_matvec` makes (validated)."""
    op = "quantized_matvec"
    check_dtype(op, x)
    check_quantization(op, group_size, bits, x.shape[-1])
    rows = norm_rows(op, x, None, None, lambda m, k: shared_parts(m, k, group_size, x.dtype))
    checked = check_quantized_weight(op, "weight", weight, x, group_size, bits)
    m, k, n = rows.rows, rows.k, checked.weight.shape[0]
    block = WIDE_BLOCK if m > 2 or k > _WIDE_INPUT else BLOCK
    template = (template_arg("T", x.dtype), template_arg("M", m), template_arg("K", k),
                template_arg("NT", block), template_arg("BITS", bits), template_arg("GS", group_size))
    kernel = with_row_memory(QUANTIZED_MATVEC, m, k, group_size) if runs_on_cuda() else QUANTIZED_MATVEC
    warps = block // 32
    blocks = min(-(-n // warps), max(MAX_WARPS // warps, 1))
    return Plan(kernel, (x, *checked), (output_spec((*x.shape[:-1], n), x.dtype),), (blocks * block, 1, 1),
                (block, 1, 1), template)


@plan_quantized_matvec.layer
def quantized_matvec(x: mx.array, weight: QuantizedWeight | Sequence[mx.array], *, group_size: int = 64,
                     bits: int = 4) -> mx.array:
    """``x @ dequantize(weight).T`` for an affine-quantized ``weight`` (``(weight, scales,
    biases)`` as ``nn.QuantizedLinear`` holds them), for up to ``MAX_ROWS`` rows of ``x``
    (``(..., K)``): ``mx.quantized_matmul(x, ..., transpose=True, group_size, bits)`` in one launch.

    >>> w, scales, biases = mx.quantize(mx.ones((2, 64)), group_size=64, bits=4)
    >>> quantized_matvec(mx.full((1, 64), 0.5), (w, scales, biases)).tolist()
    [[32.0, 32.0]]
    """
    return plan_quantized_matvec.launch(x, weight, group_size, bits)[0]

