"""The rows a norm-fed projection kernel starts from, written once for the plain and the quantized
projections (``graphkern.kernels.ops.projections``, ``quantized_projections`` and
``quantized_rope_projections``): the checks of ``x``, its residual and its norm weight, the first
three inputs and the output ``h``, the template values every such launch takes, the Metal device
code that normalizes the rows into threadgroup memory, and what ``check()`` and the stock
equivalents share.

A launch takes ``M = x.size / K`` token rows of ``K`` features, 1 to :data:`MAX_ROWS`: each block
normalizes all of them (``rms_norm(x + residual)``, the sum ``h`` written by block 0), then its
warps reduce weight rows against them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import mlx.core as mx

from graphkern.kernels.base import (
    check_dtype,
    check_threadgroup_memory,
    check_vector,
    eps_template,
    output_spec,
    template_arg,
    unused_input,
    vector_width,
)
from graphkern.nodes import KernelError, OutputSpec, Status, TemplateArg, dtype_name

__all__ = ["CUDA_PREFETCH", "CUDA_TOKEN_ROW", "MAX_ROWS", "METAL_NORM_ROWS", "METAL_STAGE_ROW", "NormRows",
           "norm_rows", "norm_rows_template", "random_rows", "row_output_specs", "stock_normed"]

#: Most token rows a launch takes (each warp keeps one float sum per row in registers).
MAX_ROWS = 8

#: CUDA: a warp asks L2 for its weight row before its block normalizes the token rows, so the row
#: streams in from memory while that prologue (loads, a reduction, two barriers) runs instead of
#: after it; the products then read it from L2. A hint: no registers, no effect on results.
CUDA_PREFETCH = r"""
namespace gk {

// The first PREFETCH_BYTES of [p, p + bytes) requested into L2, a 128-byte line a lane. What the
// memory delivers while a block normalizes is a few KB a warp; asking for whole rows of a large
// projection would ask for more than L2 holds, and lines evicted before their read are read twice.
constexpr long long PREFETCH_BYTES = 2048;

__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
#ifdef __CUDA_ARCH__
  const char* c = static_cast<const char*>(p);
  const long long n = bytes < PREFETCH_BYTES ? bytes : PREFETCH_BYTES;
  for (long long i = (threadIdx.x & 31) * 128LL; i < n; i += 32 * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + i));
  }
#endif
}

}  // namespace gk
"""

#: CUDA: V elements of a token row ``h = T(x + r)`` (``x`` alone without RESID) from element ``i``,
#: written to ``h`` where that is given (the launch's one writer of the sum); pointers at the row.
CUDA_TOKEN_ROW = r"""
namespace gk {

template <typename T, int V, bool RESID>
__device__ __forceinline__ void token_row(const T* x, const T* r, T* h, long long i, float (&v)[V]) {
  load<T, V>(x, i, v);
  if constexpr (RESID) {
    float rv[V];
    load<T, V>(r, i, rv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = round_to<T>(v[j] + rv[j]);
    }
    if (h != nullptr) {
      store<T, V>(h, i, v);
    }
  }
}

}  // namespace gk
"""

#: Metal: row ``m`` of ``h = T(x + r)`` (``x`` alone without RESID) into the threadgroup rows
#: ``xs``, block 0 writing it to ``h``; returns this thread's part of its sum of squares. Each
#: pointer has its own type: MLX passes an input of fewer than 8 elements (a tiny row, the
#: one-element stand-in of an absent residual or weight) in constant memory, others in device memory.
METAL_STAGE_ROW = r"""
template <typename T, int K, int NT, bool RESID, typename PX, typename PR, typename PH>
inline float stage_row(PX x, PR r, PH h, threadgroup T* xs, int m, uint tid, uint block) {
  float ss = 0.0f;
  for (int i = tid; i < K; i += NT) {
    float v = static_cast<float>(x[m * K + i]);
    if (RESID) {
      v = round_to<T>(v + static_cast<float>(r[m * K + i]));
      if (block == 0) {
        h[m * K + i] = static_cast<T>(v);
      }
    }
    xs[m * K + i] = static_cast<T>(v);
    ss += v * v;
  }
  return ss;
}
"""

#: Metal: the M rows of x (+ r, rounded to T, block 0 writing the sum to h) RMS-normalized into
#: the threadgroup rows xs, rounded as rms_norm rounds.
METAL_NORM_ROWS = METAL_STAGE_ROW + r"""
template <typename T, int M, int K, int NT, bool RESID, bool HAS_W, typename PX, typename PR, typename PW,
          typename PH>
inline void norm_rows(PX x, PR r, PW w, PH h, threadgroup T* xs, float eps, uint tid, uint lane, uint sg,
                      uint block, threadgroup float* red) {
  for (int m = 0; m < M; ++m) {
    const float ss = stage_row<T, K, NT, RESID>(x, r, h, xs, m, tid, block);
    const float inv = metal::precise::rsqrt(block_reduce<NT>(ss, red, lane, sg, Sum()) / K + eps);
    for (int i = tid; i < K; i += NT) {
      float o = round_to<T>(static_cast<float>(xs[m * K + i]) * inv);
      if (HAS_W) {
        o *= static_cast<float>(w[i]);
      }
      xs[m * K + i] = static_cast<T>(o);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

"""


class NormRows(NamedTuple):
    """A launch's rows, checked: ``rows`` of ``k`` features; ``inputs`` its first three inputs
    (``x``, the residual, the norm weight; an absent one as the one-element stand-in
    ``unused``); ``h`` the spec of its first output (``x + residual``, or one element)."""

    rows: int
    k: int
    inputs: tuple[mx.array, mx.array, mx.array]
    h: OutputSpec
    unused: mx.array


def norm_rows(op: str, x: mx.array, residual: mx.array | None, weight: mx.array | None,
              memory: Callable[[int, int], tuple[dict[str, int], int | None]]) -> NormRows:
    """Check ``x`` (1 to :data:`MAX_ROWS` rows), the threadgroup memory its launch takes
    (``memory(rows, k)``: arrays -> bytes, and the limit, None for the backend's), ``residual`` and
    ``weight``; raises ``KernelError`` naming ``op``."""
    check_dtype(op, x)
    k = x.shape[-1]
    rows = x.size // max(k, 1)
    if not 0 < rows <= MAX_ROWS:
        raise KernelError(op, f"x has {rows} rows of {k} {dtype_name(x.dtype)}; one launch takes 1 to "
                          f"{MAX_ROWS} rows", Status.INVALID_LAUNCH)
    check_threadgroup_memory(op, *memory(rows, k))
    if residual is not None:
        check_dtype(op, residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise KernelError(op, f"residual is {tuple(residual.shape)} {dtype_name(residual.dtype)} but "
                              f"x is {tuple(x.shape)} {dtype_name(x.dtype)}", Status.INVALID_INPUT)
    if weight is not None:
        check_vector(op, weight, x, "weight")
    unused = unused_input(x.dtype)
    inputs = (x, unused if residual is None else residual, unused if weight is None else weight)
    return NormRows(rows, k, inputs, output_spec(x.shape if residual is not None else (1,), x.dtype), unused)


def row_output_specs(x: mx.array, h: OutputSpec, out_rows: Sequence[int], pad: int) -> tuple[OutputSpec, ...]:
    """``h``, then one output of ``n`` features per row of ``x`` for each ``n`` of ``out_rows``,
    then ``pad`` one-element stand-ins (absent outputs)."""
    lead = x.shape[:-1]
    return (h, *(output_spec((*lead, n), x.dtype) for n in out_rows), *(output_spec((1,), x.dtype),) * pad)


def norm_rows_template(op: str, x: mx.array, rows: NormRows, block: int, residual: mx.array | None,
                       weight: mx.array | None, eps: float) -> tuple[TemplateArg, ...]:
    """The template values every norm-fed projection launch starts with: ``T``, ``M``, ``K``, ``V``
    (the widest access dividing ``K``), ``NT`` (``block`` threads), ``RESID``, ``HAS_W``, ``EPS``."""
    return (template_arg("T", x.dtype), template_arg("M", rows.rows), template_arg("K", rows.k),
            template_arg("V", vector_width(rows.k, x.dtype)), template_arg("NT", block),
            template_arg("RESID", residual is not None), template_arg("HAS_W", weight is not None),
            eps_template(eps, op))


def random_rows(shape: Sequence[int], dtype: mx.Dtype,
                key: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Random rows ``x`` of ``shape``, a residual, a norm weight, and a key for the matrices."""
    kx, kr, kw, rest = mx.random.split(key, 4)
    x = mx.random.normal(tuple(shape), key=kx).astype(dtype)
    r = mx.random.normal(tuple(shape), key=kr).astype(dtype)
    w = (1.0 + 0.5 * mx.random.normal((shape[-1],), key=kw)).astype(dtype)
    return x, r, w, rest


def stock_normed(x: mx.array, weight: mx.array | None, eps: float,
                 residual: mx.array | None) -> tuple[mx.array, mx.array]:
    """Stock MLX's ``(h, rms_norm(h))`` with ``h = x (+ residual)``: what the kernels start from."""
    h = x if residual is None else x + residual
    return h, mx.fast.rms_norm(h, weight, eps)
