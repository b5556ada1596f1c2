"""An attention layer's prologue in one launch: queries and keys from their projections to the
layout attention takes, each head RMS-normalized (optionally) and rotated.

``q`` is ``(B, L, heads * D)`` and ``k`` ``(B, L, kv_heads * D)``, as ``q_proj`` and ``k_proj`` give
them; the outputs are ``(B, heads, L, D)`` and ``(B, kv_heads, L, D)``, what
``scaled_dot_product_attention`` and mlx-lm's KV caches take. Keys are written contiguous, in the
cache's order. Queries are written in the projections' ``(B, L, heads, D)`` order and returned as
its transposed view, the layout MLX's RoPE gives a transposed input: MLX's CUDA attention lays its
output out as its queries, so the heads go back side by side before ``o_proj`` without a copy
(contiguous queries cost a long prefill one copy a layer). Per head, what the stock layer does
with ``reshape``, ``mx.fast.rms_norm`` (Qwen 3's ``q_norm``/``k_norm``), ``transpose`` and the RoPE
(``mx.fast.rope``, with YaRN's or LongRoPE's input scale), with the same rounding: the normalized
value rounded to the dtype, times the weight, rounded; the rotation in float32, rounded once. One
launch replaces two RoPEs, two RMSNorms and, where MLX lays transposed inputs out, their copies.

CUDA: one warp per ``(b, l, head)`` row (query heads first, then key heads); lane ``j`` holds pairs
``j, j + 32, ...`` and the features past ``dims`` the same way, so the row is read once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from graphkern.kernels.base import (
    MAX_GRID,
    Case,
    Plan,
    check_dtype,
    eps_template,
    float_from_bits,
    output_spec,
    template_arg,
    unused_input,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.ops.rms_norm import rms_norm_reference
from graphkern.kernels.ops.rope import (
    GPU_FORMULA_TOLERANCES,
    ROPE_CUDA,
    ROPE_METAL,
    launch_freqs,
    launch_offset,
    offset_input,
    rotary_template,
    rotate_reference,
)
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

__all__ = ["MAX_HEAD_DIM", "ROPE_QK", "check_head_counts", "plan_rope_qk", "rope_qk", "rope_qk_reference",
           "stock_prologue"]

#: Widest head the kernel takes: a lane keeps D / 32 features in registers.
MAX_HEAD_DIM = 1024
#: Threads a block: four warps.
BLOCK = 128
#: Positions (batch entries x tokens) from which a warp takes several heads of one position.
GROUPED_POSITIONS = 64


def heads_a_warp(positions: int, heads: int, kv_heads: int) -> int:
    """Heads one warp rotates (``G``): with many positions (prefill), 4 or 2 of one position
    where they divide both head counts, so the lane's angles are computed once for them and
    their rows are loaded together; with few (decoding), 1, so every head has a warp of its own.

    >>> heads_a_warp(2047, 16, 8), heads_a_warp(2047, 12, 2), heads_a_warp(1, 16, 8), heads_a_warp(2047, 5, 1)
    (4, 2, 1, 1)
    """
    if positions < GROUPED_POSITIONS:
        return 1
    common = math.gcd(heads, kv_heads)
    return next(g for g in (4, 2, 1) if common % g == 0)

_CUDA = r"""
namespace gk {

// One head row as a lane holds it: pairs j, j + 32, ... (a, b: the two features of each) and the
// features past dims (r), as floats.
template <int P, int R>
struct QkRow {
  float a[P];
  float b[P];
  float r[R > 0 ? R : 1];
};

template <typename T, int D, int HALF, bool TRADITIONAL, int P = (HALF + 31) / 32,
          int R = (D - 2 * HALF + 31) / 32>
__device__ __forceinline__ void load_qk_row(const T* x, QkRow<P, R>& row, int lane) {
#pragma unroll
  for (int c = 0; c < P; ++c) {
    const int i = lane + 32 * c;
    row.a[c] = i < HALF ? static_cast<float>(x[TRADITIONAL ? 2 * i : i]) : 0.0f;
    row.b[c] = i < HALF ? static_cast<float>(x[TRADITIONAL ? 2 * i + 1 : i + HALF]) : 0.0f;
  }
#pragma unroll
  for (int c = 0; c < R; ++c) {
    const int e = 2 * HALF + lane + 32 * c;
    row.r[c] = e < D ? static_cast<float>(x[e]) : 0.0f;
  }
}

// Normalize (NORM), scale the input (IN_SCALE) and rotate one loaded row by the lane's angles.
template <typename T, int D, int HALF, bool TRADITIONAL, bool NORM, int IN_SCALE>
__device__ __forceinline__ void rotate_qk_row(const QkRow<(HALF + 31) / 32, (D - 2 * HALF + 31) / 32>& row,
                                              T* out, const T* w, const float (&cs)[(HALF + 31) / 32],
                                              const float (&sn)[(HALF + 31) / 32], float eps, int lane) {
  constexpr int P = (HALF + 31) / 32;
  constexpr int R = (D - 2 * HALF + 31) / 32;
  float inv = 1.0f;
  if constexpr (NORM) {
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      ss += row.a[c] * row.a[c] + row.b[c] * row.b[c];
    }
#pragma unroll
    for (int c = 0; c < R; ++c) {
      ss += row.r[c] * row.r[c];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    inv = rsqrtf(ss / D + eps);
  }
#pragma unroll
  for (int c = 0; c < P; ++c) {
    const int i = lane + 32 * c;
    if (i < HALF) {
      const int i1 = TRADITIONAL ? 2 * i : i;
      const int i2 = TRADITIONAL ? 2 * i + 1 : i + HALF;
      float x1 = row.a[c];
      float x2 = row.b[c];
      if constexpr (NORM) {
        x1 = round_to<T>(round_to<T>(x1 * inv) * static_cast<float>(w[i1]));
        x2 = round_to<T>(round_to<T>(x2 * inv) * static_cast<float>(w[i2]));
      }
      x1 = in_scaled<T, IN_SCALE>(x1);
      x2 = in_scaled<T, IN_SCALE>(x2);
      out[i1] = static_cast<T>(x1 * cs[c] - x2 * sn[c]);
      out[i2] = static_cast<T>(x1 * sn[c] + x2 * cs[c]);
    }
  }
#pragma unroll
  for (int c = 0; c < R; ++c) {
    const int e = 2 * HALF + lane + 32 * c;
    if (e < D) {
      out[e] = static_cast<T>(NORM ? round_to<T>(row.r[c] * inv) * static_cast<float>(w[e]) : row.r[c]);
    }
  }
}

}  // namespace gk
"""

# One warp per G heads of one (b, l) position, all queries or all keys (G divides both head
# counts): the lane's angles are computed once for the G heads, and the G rows are all loaded
# before any is rotated and stored.
_CUDA_BODY = r"""
  constexpr int P = (HALF + 31) / 32;
  constexpr int R = (D - 2 * HALF + 31) / 32;
  const int L = q_shape[1];
  const int HQ = q_shape[2] / D;
  const int HK = k_shape[2] / D;
  const int groups = (HQ + HK) / G;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (warp >= static_cast<long long>(q_shape[0]) * L * groups) {
    return;
  }
  const int lane = threadIdx.x & 31;
  const int first = static_cast<int>(warp % groups) * G;
  const long long bl = warp / groups;
  const int l = static_cast<int>(bl % L);
  const int b = static_cast<int>(bl / L);
  const bool is_q = first < HQ;
  const int H = is_q ? HQ : HK;
  const int head0 = is_q ? first : first - HQ;
  const int off = SHAPED_OFFSET ? offset_shape[1] - (1 << 30) : offset[PER_BATCH ? b : 0];
  const float pos = __int_as_float(SCALE) * static_cast<float>(l + off);
  float cs[P];
  float sn[P];
#pragma unroll
  for (int c = 0; c < P; ++c) {
    const int i = lane + 32 * c;
    const float inv_freq =
        i < HALF ? gk::rope_inv_freq<FREQS>(freqs, i, HALF, __int_as_float(LOG2_BASE)) : 0.0f;
    const float theta = pos * inv_freq;
    cs[c] = cosf(theta);
    sn[c] = sinf(theta);
  }
  const T* x = is_q ? q : k;
  T* out = is_q ? q_out : k_out;
  gk::QkRow<P, R> rows[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    gk::load_qk_row<T, D, HALF, TRADITIONAL>(x + (bl * H + head0 + j) * D, rows[j], lane);
  }
#pragma unroll
  for (int j = 0; j < G; ++j) {
    const long long src = (bl * H + head0 + j) * D;
    // queries keep the projections' (B, L, H, D) order (returned as a transposed view); keys are
    // written in (B, H, L, D) order, the KV cache's
    const long long dst = is_q ? src : ((static_cast<long long>(b) * H + head0 + j) * L + l) * D;
    gk::rotate_qk_row<T, D, HALF, TRADITIONAL, NORM, IN_SCALE>(rows[j], out + dst, is_q ? q_weight : k_weight,
                                                               cs, sn, __int_as_float(EPS), lane);
  }
"""

_METAL = r"""
namespace gk {

// PX, PW, PF: device or constant pointers, as MLX passes each input (constant below 8 elements:
// a tiny q or k, the one-element stand-in of an absent norm weight, a short frequency table)
template <typename T, int D, int HALF, bool TRADITIONAL, bool FREQS, bool NORM, int IN_SCALE, typename PX,
          typename PW, typename PF>
inline void rope_qk_row(PX x, device T* out, PW w, PF freqs, float pos, float log2_base, float eps,
                        int lane) {
  float ss = 0.0f;
  for (int e = lane; e < D; e += 32) {
    const float v = static_cast<float>(x[e]);
    ss += v * v;
  }
  const float inv = NORM ? metal::precise::rsqrt(metal::simd_sum(ss) / D + eps) : 1.0f;
  for (int i = lane; i < HALF; i += 32) {
    const int i1 = TRADITIONAL ? 2 * i : i;
    const int i2 = TRADITIONAL ? 2 * i + 1 : i + HALF;
    float x1 = static_cast<float>(x[i1]);
    float x2 = static_cast<float>(x[i2]);
    if (NORM) {
      x1 = round_to<T>(round_to<T>(x1 * inv) * static_cast<float>(w[i1]));
      x2 = round_to<T>(round_to<T>(x2 * inv) * static_cast<float>(w[i2]));
    }
    x1 = in_scaled<T, IN_SCALE>(x1);
    x2 = in_scaled<T, IN_SCALE>(x2);
    const float theta = pos * rope_inv_freq<FREQS>(freqs, i, HALF, log2_base);
    const float cs = metal::fast::cos(theta);
    const float sn = metal::fast::sin(theta);
    out[i1] = static_cast<T>(x1 * cs - x2 * sn);
    out[i2] = static_cast<T>(x1 * sn + x2 * cs);
  }
  for (int e = 2 * HALF + lane; e < D; e += 32) {
    const float v = static_cast<float>(x[e]);
    out[e] = static_cast<T>(NORM ? round_to<T>(v * inv) * static_cast<float>(w[e]) : v);
  }
}

}  // namespace gk
"""

_METAL_BODY = r"""
  const int L = q_shape[1];
  const int HQ = q_shape[2] / D;
  const int HK = k_shape[2] / D;
  const int groups = (HQ + HK) / G;
  const size_t warp = thread_position_in_grid.x / 32;
  if (warp >= size_t(q_shape[0]) * size_t(L) * size_t(groups)) {
    return;
  }
  const int first = int(warp % size_t(groups)) * G;
  const size_t bl = warp / size_t(groups);
  const int l = int(bl % size_t(L));
  const int b = int(bl / size_t(L));
  const bool is_q = first < HQ;
  const int H = is_q ? HQ : HK;
  const int head0 = is_q ? first : first - HQ;
  const float pos = as_type<float>(SCALE) * float(l + offset[PER_BATCH ? b : 0]);
  for (int j = 0; j < G; ++j) {
    const size_t src = (bl * size_t(H) + size_t(head0 + j)) * size_t(D);
    const size_t dst = is_q ? src : ((size_t(b) * size_t(H) + size_t(head0 + j)) * size_t(L) + size_t(l)) *
                                        size_t(D);
    if (is_q) {
      gk::rope_qk_row<T, D, HALF, TRADITIONAL, FREQS, NORM, IN_SCALE>(
          q + src, q_out + dst, q_weight, freqs, pos, as_type<float>(LOG2_BASE), as_type<float>(EPS),
          int(thread_index_in_simdgroup));
    } else {
      gk::rope_qk_row<T, D, HALF, TRADITIONAL, FREQS, NORM, IN_SCALE>(
          k + src, k_out + dst, k_weight, freqs, pos, as_type<float>(LOG2_BASE), as_type<float>(EPS),
          int(thread_index_in_simdgroup));
    }
  }
"""


def rope_qk_reference(q: mx.array, k: mx.array, offset: mx.array, freqs: mx.array, q_weight: mx.array,
                      k_weight: mx.array, *, D: int, NORM: bool, EPS: int, SCALE: int, TRADITIONAL: bool,
                      HALF: int, FREQS: bool, BASE: int, IN_SCALE: int, PER_BATCH: bool = False,
                      SHAPED_OFFSET: bool = False, **launch: Any) -> list[mx.array]:
    """Pure MLX, in the stock layer's order: each ``(B, L, H * D)`` input split into heads, RMS-normalized
    with the rounding of ``mx.fast.rms_norm`` (NORM), transposed to ``(B, H, L, D)`` and rotated (see
    ``rope.rotate_reference``). EPS, SCALE, BASE and IN_SCALE are float32 bits."""
    outputs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        heads = x.reshape(x.shape[0], x.shape[1], -1, D)
        if NORM:
            heads = rms_norm_reference(heads, w, EPS=EPS)[0]
        outputs.append(rotate_reference(
            heads.transpose(0, 2, 1, 3), offset, freqs, half=HALF, traditional=TRADITIONAL, use_freqs=FREQS,
            base=float_from_bits(BASE), scale=float_from_bits(SCALE), input_scale=float_from_bits(IN_SCALE),
            per_batch=PER_BATCH, shaped_offset=SHAPED_OFFSET))
    return [outputs[0].transpose(0, 2, 1, 3), outputs[1]]  # queries in (B, L, H, D) order


ROPE_QK = Kernel(
    "gk_rope_qk",
    input_names=["q", "k", "offset", "freqs", "q_weight", "k_weight"],
    output_names=["q_out", "k_out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(ROPE_CUDA + _CUDA, ROPE_METAL + _METAL),
    reference=rope_qk_reference,
)


def check_head_counts(op: str, heads: Any, kv_heads: Any) -> None:
    """Raise KernelError unless both head counts are positive ints."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KernelError(op, f"{name} must be a positive int, got {value!r}", Status.INVALID_INPUT)


def _check_pair(op: str, q: mx.array, k: mx.array, heads: int, kv_heads: int) -> int:
    """The head dimension D, after checking the projections' shapes against the head counts."""
    check_dtype(op, q, "q")
    check_dtype(op, k, "k")
    check_head_counts(op, heads, kv_heads)
    if q.ndim != 3 or k.ndim != 3 or q.shape[:2] != k.shape[:2]:
        raise KernelError(op, f"q and k must be (B, L, heads * D) and (B, L, kv_heads * D), got "
                          f"{tuple(q.shape)} and {tuple(k.shape)}", Status.INVALID_INPUT)
    if k.dtype != q.dtype:
        raise KernelError(op, f"dtype mismatch: k is {dtype_name(k.dtype)} but q is {dtype_name(q.dtype)}",
                          Status.INVALID_INPUT)
    if q.shape[2] % heads:
        raise KernelError(op, f"q's last dimension {q.shape[2]} is not a multiple of heads={heads}",
                          Status.INVALID_INPUT)
    d = q.shape[2] // heads
    if k.shape[2] != kv_heads * d:
        raise KernelError(op, f"k's last dimension is {k.shape[2]}, expected kv_heads * D = {kv_heads} * {d}",
                          Status.INVALID_INPUT)
    if not 0 < d <= MAX_HEAD_DIM:
        raise KernelError(op, f"head dimension {d} is outside 1..{MAX_HEAD_DIM}", Status.INVALID_INPUT)
    return d


def _norm_weight(op: str, weight: mx.array | None, d: int, dtype: mx.Dtype, name: str) -> mx.array:
    if weight is None:
        return unused_input(dtype)
    if not isinstance(weight, mx.array) or weight.ndim != 1 or weight.shape[0] != d:
        got = tuple(weight.shape) if isinstance(weight, mx.array) else type(weight).__name__
        raise KernelError(op, f"{name} must be an array of shape ({d},) (the head dimension), got {got}",
                          Status.INVALID_INPUT)
    if weight.dtype != dtype:
        raise KernelError(op, f"dtype mismatch: {name} is {dtype_name(weight.dtype)} but q is "
                          f"{dtype_name(dtype)}", Status.INVALID_INPUT)
    return weight


def _heads(features: int) -> tuple[int, int]:
    """(head dim, query heads) for ``features`` query features: 128-wide heads where they fit."""
    d = next(d for d in (128, 64, 32, 16, 8, 4, 2) if features % d == 0 and features // d >= 2)
    return d, features // d


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, norm: bool) -> Case:
    """``shape`` is (B, L, query features); keys get a quarter of the heads (grouped-query attention);
    ``norm``: Qwen 3's q_norm/k_norm, with part of each head rotated (the rest copied)."""
    b, length, features = shape[-3:]
    d, heads = _heads(features)
    kv_heads = max(1, heads // 4)
    kq, kk, kw = mx.random.split(key, 3)
    q = mx.random.normal((b, length, heads * d), key=kq).astype(dtype)
    k = mx.random.normal((b, length, kv_heads * d), key=kk).astype(dtype)
    kwargs: dict[str, Any] = {"base": 1e6, "offset": 7}
    dims = d
    if norm:
        weights = (1.0 + 0.5 * mx.random.normal((2, d), key=kw)).astype(dtype)
        kwargs.update(q_weight=weights[0], k_weight=weights[1], eps=1e-6, scale=0.5)
        dims = d // 2 if d >= 8 else d
    return Case((q, k, heads, kv_heads, dims), kwargs)


def stock_prologue(q: mx.array, k: mx.array, heads: int, kv_heads: int, dims: int, *,
                   traditional: bool = False, base: float | None = 10000.0, scale: float = 1.0,
                   offset: int | mx.array = 0, freqs: mx.array | None = None, input_scale: float = 1.0,
                   q_weight: mx.array | None = None, k_weight: mx.array | None = None,
                   eps: float = 1e-5) -> tuple[mx.array, mx.array]:
    """The stock layer's ops: reshape, mx.fast.rms_norm, transpose, the input scale, mx.fast.rope."""
    b, length = q.shape[:2]
    outputs = []
    for x, h, w in ((q, heads, q_weight), (k, kv_heads, k_weight)):
        x = x.reshape(b, length, h, -1)
        if w is not None:
            x = mx.fast.rms_norm(x, w, eps)
        x = x.transpose(0, 2, 1, 3)
        if input_scale != 1.0:
            x = x.at[..., :dims].multiply(input_scale)
        outputs.append(mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                                    freqs=freqs))
    return outputs[0], outputs[1]


@declare(ROPE_QK, stock=stock_prologue,
         make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, False),
         shapes=((1, 1, 256), (2, 5, 64), (1, 7, 512), (3, 2, 96)), min_ndim=3,
         description="attention prologue: q and k to (B, H, L, D), rotated (Llama)",
         tolerances=GPU_FORMULA_TOLERANCES)
def plan_rope_qk(q: mx.array, k: mx.array, heads: int, kv_heads: int, dims: int, *, traditional: bool = False,
                 base: float | None = 10000.0, scale: float = 1.0, offset: int | mx.array = 0,
                 freqs: mx.array | None = None, input_scale: float = 1.0, q_weight: mx.array | None = None,
                 k_weight: mx.array | None = None, eps: float = 1e-5) -> Plan:
    """The launch :func:`rope_qk` makes (validated)."""
    op = "rope_qk"
    d = _check_pair(op, q, k, heads, kv_heads)
    if (q_weight is None) != (k_weight is None):
        raise KernelError(op, "give both q_weight and k_weight (per-head RMSNorm) or neither",
                          Status.INVALID_INPUT)
    norm = q_weight is not None
    qw = _norm_weight(op, q_weight, d, q.dtype, "q_weight")
    kw = _norm_weight(op, k_weight, d, q.dtype, "k_weight")
    rotary, table = rotary_template(op, d, dims, traditional=traditional, base=base, freqs=freqs, scale=scale,
                                    input_scale=input_scale)
    off, per_batch, shaped = offset_input(op, offset, q.shape[0], q.size)
    b, length = q.shape[:2]
    group = heads_a_warp(b * length, heads, kv_heads)
    threads = b * length * ((heads + kv_heads) // group) * 32
    if threads > MAX_GRID:
        raise KernelError(op, f"input too large: {threads} threads exceed MLX's int32 grid",
                          Status.INVALID_LAUNCH)
    template = (template_arg("T", q.dtype), template_arg("D", d), *rotary, template_arg("NORM", norm),
                eps_template(eps, op), template_arg("PER_BATCH", per_batch),
                template_arg("SHAPED_OFFSET", shaped), template_arg("G", group))
    specs = (output_spec((b, length, heads, d), q.dtype), output_spec((b, kv_heads, length, d), q.dtype))
    return Plan(ROPE_QK, (q, k, off, table, qw, kw), specs, (threads, 1, 1), (BLOCK, 1, 1), template)


@plan_rope_qk.layer
def rope_qk(q: mx.array, k: mx.array, heads: int, kv_heads: int, dims: int, *, traditional: bool = False,
            base: float | None = 10000.0, scale: float = 1.0, offset: int | mx.array = 0,
            freqs: mx.array | None = None, input_scale: float = 1.0, q_weight: mx.array | None = None,
            k_weight: mx.array | None = None, eps: float = 1e-5) -> tuple[mx.array, mx.array]:
    """Queries and keys straight from their projections, per head RMS-normalized (when ``q_weight``
    and ``k_weight`` are given) and rotated, in attention's layout; one launch.

    ``q``: ``(B, L, heads * D)``, ``k``: ``(B, L, kv_heads * D)``; returns ``(B, heads, L, D)`` and
    ``(B, kv_heads, L, D)``, what ``q.reshape(B, L, heads, D)``, ``mx.fast.rms_norm(., q_weight, eps)``,
    ``.transpose(0, 2, 1, 3)`` and ``mx.fast.rope(., dims, ...)`` give. The RoPE arguments are
    :func:`~graphkern.kernels.rope`'s.

    >>> q, k = mx.ones((1, 3, 2 * 8)), mx.ones((1, 3, 8))
    >>> qh, kh = rope_qk(q, k, 2, 1, 8, offset=5)
    >>> stock = mx.fast.rope(k.reshape(1, 3, 1, 8).transpose(0, 2, 1, 3), 8, traditional=False, base=1e4,
    ...                      scale=1.0, offset=5)
    >>> qh.shape, kh.shape, bool(mx.allclose(kh, stock))
    ((1, 2, 3, 8), (1, 1, 3, 8), True)
    """
    q_out, k_out = plan_rope_qk.launch(q, k, heads, kv_heads, dims, traditional, base, scale,
                                       launch_offset(offset, q), launch_freqs(freqs), input_scale, q_weight,
                                       k_weight, eps)
    return q_out.transpose(0, 2, 1, 3), k_out


plan_rope_qk.variant("rope_qk_norm",
                     make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, True),
                     description="attention prologue with per-head RMSNorm and partial rotation (Qwen 3)")
