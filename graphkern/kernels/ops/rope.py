"""Rotary position embedding over the last axis, as ``mx.fast.rope`` (float32 inside).

``x`` is ``(B, *, L, D)``: row ``(b, ..., l)`` sits at position ``(l + offset[b]) * scale``; the first
``dims`` features are rotated in pairs, ``(i, i + dims/2)`` or, ``traditional``, ``(2i, 2i + 1)``,
by ``theta = position * inv_freq[i]`` with ``inv_freq = base ** (-i / (dims/2))`` (or ``1 / freqs``);
the rest are copied. The frequencies are computed once, with MLX's own formula, and passed in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from graphkern.kernels._base import (
    MAX_GRID,
    Case,
    LibraryEntry,
    Plan,
    check_dtype,
    float_from_bits,
    float_template,
    output_spec,
    run,
    runs_on_cuda,
    template_arg,
    vector_width,
)
from graphkern.kernels._headers import dual_header
from graphkern.nodes import Kernel, KernelError, Status

__all__ = ["ROPE", "plan_rope", "rope", "rope_reference"]

#: Rows (heads, batch entries) one thread rotates at a position: their angles are computed once.
ROWS_PER_THREAD = 4
#: Threads that share a row's pairs, at least (narrower accesses otherwise): with 16-byte accesses a
#: 16-bit partial rotation (64 of 128 features) gave each row 4 threads, 1.45x slower on an H200.
MIN_THREADS_PER_ROW = 8
#: Threads a block (an H200 sweep of 128-512, benchmarks/data/rope_configs_h200.txt).
BLOCK = 128


_CUDA = r"""
namespace gk {

// The angles of pairs k .. k + V - 1 at one position: one sincosf each, shared by the R rows a
// thread rotates (sincosf, not a load, is what a 16-bit RoPE spends its time on).
template <int V>
__device__ __forceinline__ void rope_angles(float pos, const float* inv_freq, int k, float (&c)[V],
                                            float (&s)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    sincosf(pos * inv_freq[k + j], &s[j], &c[j]);
  }
}

// Rotate pairs k .. k + V - 1 of one row (x, out point at the row; half = dims / 2).
template <typename T, int V, bool TRADITIONAL>
__device__ __forceinline__ void rope_pairs(const T* x, T* out, int k, int half, const float (&c)[V],
                                           const float (&s)[V]) {
  float a[V];
  float b[V];
  if constexpr (TRADITIONAL) {
    float t[2 * V];
    load<T, 2 * V>(x, 2 * k, t);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      a[j] = t[2 * j];
      b[j] = t[2 * j + 1];
    }
  } else {
    load<T, V>(x, k, a);
    load<T, V>(x, k + half, b);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float r1 = a[j] * c[j] - b[j] * s[j];
    const float r2 = a[j] * s[j] + b[j] * c[j];
    a[j] = r1;
    b[j] = r2;
  }
  if constexpr (TRADITIONAL) {
    float t[2 * V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      t[2 * j] = a[j];
      t[2 * j + 1] = b[j];
    }
    store<T, 2 * V>(out, 2 * k, t);
  } else {
    store<T, V>(out, k, a);
    store<T, V>(out, k + half, b);
  }
}

// Copy elements e, e + step, ... below D (the features past dims), TW at a time when aligned.
template <typename T, int TW>
__device__ __forceinline__ void copy_tail(const T* x, T* out, int e, int D, int step, bool vectors) {
  if (vectors) {
    for (; e < D; e += step) {
      *reinterpret_cast<Vec<T, TW>*>(out + e) = *reinterpret_cast<const Vec<T, TW>*>(x + e);
    }
  } else {
    for (; e < D; e += step) {
#pragma unroll
      for (int j = 0; j < TW; ++j) {
        out[e + j] = x[e + j];
      }
    }
  }
}

}  // namespace gk
"""

# x is (outer, L, D) as rows: row = o * L + l. One thread rotates pairs t*V .. t*V + V - 1 at position
# l of R rows o0 .. o0 + R - 1 (one angle computation for all of them; R is 1 with per-batch offsets)
# and copies its share of the features past dims, TW at a time. D, L and half (dims / 2) come from
# the shapes.
_CUDA_BODY = r"""
  const int D = x_shape[x_ndim - 1];
  const int L = x_shape[x_ndim - 2];
  const int half = inv_freq_shape[0];
  const int P = half / V;
  const long long outer = gk::numel(x_shape, x_ndim) / D / L;
  const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= (outer + R - 1) / R * L * P) {
    return;
  }
  const int t = static_cast<int>(g % P);
  const long long rest = g / P;
  const int l = static_cast<int>(rest % L);
  const long long o0 = rest / L * R;
  const int b = PER_BATCH ? static_cast<int>(o0 / (outer / x_shape[0])) : 0;
  const int off = SHAPED_OFFSET ? offset_shape[1] - (1 << 30) : offset[b];  // OFFSET_BIAS
  const float pos = static_cast<float>(l + off) * __int_as_float(SCALE);
  float c[V];
  float s[V];
  gk::rope_angles<V>(pos, inv_freq, t * V, c, s);
  const bool vectors = gk::aligned<TRADITIONAL ? 2 * V : V>(x) && gk::aligned<TRADITIONAL ? 2 * V : V>(out);
  const bool tail_vectors = gk::aligned<TW>(x) && gk::aligned<TW>(out);
  for (int r = 0; r < R && o0 + r < outer; ++r) {
    const long long row = (o0 + r) * L + l;
    const T* xr = x + row * D;
    T* outr = out + row * D;
    if (vectors) {
      gk::rope_pairs<T, V, TRADITIONAL>(xr, outr, t * V, half, c, s);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float cj[1] = {c[j]};
        const float sj[1] = {s[j]};
        gk::rope_pairs<T, 1, TRADITIONAL>(xr, outr, t * V + j, half, cj, sj);
      }
    }
    gk::copy_tail<T, TW>(xr, outr, 2 * half + t * TW, D, P * TW, tail_vectors);
  }
"""

_METAL_BODY = r"""
  const int D = x_shape[x_ndim - 1];
  const int L = x_shape[x_ndim - 2];
  const int HALF = inv_freq_shape[0];
  const int P = HALF / V;
  size_t rows = 1;
  for (int d = 0; d < x_ndim - 1; ++d) {
    rows *= x_shape[d];
  }
  const size_t outer = rows / size_t(L);
  const size_t g = thread_position_in_grid.x;
  const int t = int(g % P);
  const size_t rest = g / P;
  const int l = int(rest % size_t(L));
  const size_t o0 = rest / size_t(L) * R;
  if (o0 >= outer) {
    return;
  }
  const int b = PER_BATCH ? int(o0 / (outer / size_t(x_shape[0]))) : 0;
  const float pos = float(l + offset[b]) * as_type<float>(SCALE);
  for (int j = 0; j < V; ++j) {
    const int k = t * V + j;
    const float theta = pos * inv_freq[k];
    const float c = metal::precise::cos(theta);
    const float s = metal::precise::sin(theta);
    for (size_t o = o0; o < o0 + R && o < outer; ++o) {
      const size_t i1 = (o * size_t(L) + size_t(l)) * size_t(D) + (TRADITIONAL ? 2 * k : k);
      const size_t i2 = i1 + (TRADITIONAL ? 1 : HALF);
      const float a = static_cast<float>(x[i1]);
      const float bb = static_cast<float>(x[i2]);
      out[i1] = static_cast<T>(a * c - bb * s);
      out[i2] = static_cast<T>(a * s + bb * c);
    }
  }
  for (size_t o = o0; o < o0 + R && o < outer; ++o) {
    const size_t base = (o * size_t(L) + size_t(l)) * size_t(D);
    for (int e = 2 * HALF + t * TW; e < D; e += P * TW) {
      for (int j = 0; j < TW; ++j) {
        out[base + e + j] = x[base + e + j];
      }
    }
  }
"""


def rope_reference(x: mx.array, offset: mx.array, inv_freq: mx.array, *, SCALE: int, TRADITIONAL: bool,
                   PER_BATCH: bool = False, SHAPED_OFFSET: bool = False, R: int = 1,
                   TW: int = 1) -> list[mx.array]:
    """Pure-MLX RoPE in float32 with the given inverse frequencies (dims = 2 * their number; SCALE:
    the position scale's float32 bits; SHAPED_OFFSET: the offset is carried by ``offset``'s shape,
    see :func:`_offset_array`; R and TW, how many rows a GPU thread rotates and how many features
    past dims it copies at once, change nothing here)."""
    scale = float_from_bits(SCALE)
    half = inv_freq.shape[0]
    dims = 2 * half
    if SHAPED_OFFSET:
        offset = mx.array([offset.shape[1] - OFFSET_BIAS])
    off = offset.astype(mx.float32)
    if PER_BATCH:
        off = off.reshape((-1,) + (1,) * (x.ndim - 2))
    positions = (mx.arange(x.shape[-2], dtype=mx.float32) + off) * scale
    theta = positions[..., None] * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    xf = x.astype(mx.float32)
    rot = xf[..., :dims]
    if TRADITIONAL:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    if x.shape[-1] > dims:
        out = mx.concatenate([out, xf[..., dims:]], axis=-1)
    return [out.astype(x.dtype)]


ROPE = Kernel(
    "gk_rope",
    input_names=["x", "offset", "inv_freq"],
    output_names=["out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(_CUDA, ""),
    reference=rope_reference,
)


def inverse_frequencies(dims: int, base: float | None, freqs: mx.array | None) -> mx.array:
    """``base ** (-i / (dims/2))`` computed as mx.fast.rope's fallback does, or ``1 / freqs``."""
    if freqs is not None:
        return mx.reciprocal(freqs.astype(mx.float32))
    assert base is not None
    return _base_frequencies(dims, float(base))


@functools.lru_cache(maxsize=64)
def _base_frequencies(dims: int, base: float) -> mx.array:
    """Made once per (dims, base) and then reused: computed on the device, never rewritten.

    Evaluated at once: MLX streams belong to the thread that made them, and a lazy array first made
    on a trace's worker thread could not be evaluated from any other thread."""
    half = dims // 2
    coef = np.float32(np.float32(math.log(base)) / np.float32(half))
    freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(float(coef), dtype=mx.float32))
    mx.eval(freqs)
    return freqs


#: An int offset on CUDA travels as the shape ``(0, offset + OFFSET_BIAS)`` of an empty array.
OFFSET_BIAS = 1 << 30


@functools.lru_cache(maxsize=1024)
def _offset_array(offset: int, in_shape: bool) -> mx.array:
    """The ``offset`` input for an int offset, one array per value (reused by every layer at that
    position): ``[offset]`` as int32, or, ``in_shape``, an empty array of shape
    ``(0, offset + OFFSET_BIAS)`` that the kernel reads the offset from.

    MLX passes input shapes to a CUDA kernel by value, while it keeps an array of at most 8 bytes in
    host-mapped managed memory (the small pool of mlx/backend/cuda/allocator.cpp), where reading
    it from every warp costs a crossing to the host: 48 vs 38 us for a bfloat16 4x32x2048x128 RoPE,
    19 vs 6 us for a float32 1x8x2048x128 one on an H200 (benchmarks/data/rope_offset_h200.txt).
    A copy made on the GPU in every call was no cure (48 us in the benchmark): MLX's buffer cache
    does not tell device buffers from managed ones. A shape is passed by value: nothing to read.
    """
    if in_shape:
        return mx.array(np.zeros((0, offset + OFFSET_BIAS), dtype=np.int32))
    return mx.array([offset], dtype=mx.int32)


def plan_rope(x: mx.array, dims: int, *, traditional: bool = False, base: float | None = 10000.0,
              scale: float = 1.0, offset: int | mx.array = 0, freqs: mx.array | None = None) -> Plan:
    """The launch :func:`rope` makes (validated)."""
    op = "rope"
    check_dtype(op, x)
    if x.ndim < 3:
        raise KernelError(op, f"x must have at least 3 dimensions (B, *, L, D), got shape {tuple(x.shape)}",
                          Status.INVALID_INPUT)
    d = x.shape[-1]
    if not isinstance(dims, int) or dims <= 0 or dims % 2 or dims > d:
        raise KernelError(op, f"dims must be a positive even int <= x's last dimension ({d}), got {dims!r}",
                          Status.INVALID_INPUT)
    if (base is None) == (freqs is None):
        raise KernelError(op, "exactly one of base and freqs must be given", Status.INVALID_INPUT)
    if freqs is not None and (freqs.ndim != 1 or freqs.shape[0] != dims // 2):
        raise KernelError(op, f"freqs must have shape ({dims // 2},), got {tuple(freqs.shape)}",
                          Status.INVALID_INPUT)
    shaped = False
    if isinstance(offset, mx.array):
        if offset.ndim > 1 or offset.size not in (1, x.shape[0]) or offset.dtype not in (
                mx.int32, mx.int64, mx.uint32, mx.int16, mx.int8, mx.uint8, mx.uint16):
            raise KernelError(op, f"offset must be an int or an integer array of 1 or {x.shape[0]} elements, "
                              f"got shape {tuple(offset.shape)} {offset.dtype}", Status.INVALID_INPUT)
        per_batch = offset.size > 1
        off = offset.reshape(-1).astype(mx.int32)
    elif isinstance(offset, int) and not isinstance(offset, bool):
        if not -OFFSET_BIAS <= offset < 2**31 - OFFSET_BIAS:
            raise KernelError(op, f"offset must be in [-2**30, 2**30), got {offset}", Status.INVALID_INPUT)
        shaped = runs_on_cuda()  # the offset in a shape
        per_batch, off = False, _offset_array(offset, shaped)
    else:
        raise KernelError(op, f"offset must be an int or an mx.array, got {type(offset).__name__}",
                          Status.INVALID_INPUT)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise KernelError(op, f"scale must be a finite number, got {scale!r}", Status.INVALID_INPUT)
    half = dims // 2
    v = vector_width(half, x.dtype) if not traditional else min(vector_width(dims, x.dtype) // 2, half)
    while v > 1 and (half % v or d % (2 * v if traditional else v) or half // v < MIN_THREADS_PER_ROW):
        v //= 2
    v = max(v, 1)
    length = x.shape[-2]
    outer = x.size // d // length if x.size else 0
    rows_each = 1 if per_batch else ROWS_PER_THREAD  # per-batch offsets: a position per row
    threads = -(-outer // rows_each) * length * (half // v)
    tail = vector_width(math.gcd(d, dims), x.dtype) if d > dims else 1  # copied TW at a time
    if threads > MAX_GRID:
        raise KernelError(op, f"input too large: {threads} threads exceed MLX's int32 grid",
                          Status.INVALID_LAUNCH)
    template = [template_arg("T", x.dtype), template_arg("V", v),
                template_arg("TRADITIONAL", bool(traditional)), template_arg("PER_BATCH", per_batch),
                template_arg("SHAPED_OFFSET", shaped),
                float_template("SCALE", float(scale)), template_arg("R", rows_each),
                template_arg("TW", tail)]
    inputs = (x, off, inverse_frequencies(dims, base, freqs))
    return Plan(ROPE, inputs, (output_spec(x.shape, x.dtype),), (threads, 1, 1), (BLOCK, 1, 1),
                tuple(template))


def rope(x: mx.array, dims: int, *, traditional: bool = False, base: float | None = 10000.0,
         scale: float = 1.0, offset: int | mx.array = 0, freqs: mx.array | None = None) -> mx.array:
    """Rotary position embedding, with ``mx.fast.rope``'s arguments and results.

    ``offset`` is an int or an integer array of 1 or ``x.shape[0]`` elements (one per batch entry).

    >>> x = mx.ones((1, 2, 4))
    >>> [round(v, 4) for v in rope(x, 4, offset=1)[0, 0].tolist()]   # position 1
    [-0.3012, 0.99, 1.3818, 1.0099]
    """
    return run(plan_rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                         freqs=freqs))[0]


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, traditional: bool) -> Case:
    x = mx.random.normal(tuple(shape), key=key).astype(dtype)
    d = shape[-1]
    dims = d if d % 2 == 0 else d - 1
    if d >= 16 and d % 4 == 0:
        dims = d // 2  # partial rotation: the rest is copied
    return Case((x, dims), {"traditional": traditional, "base": 10000.0, "scale": 0.5, "offset": 7})


def _stock(x: mx.array, dims: int, *, traditional: bool = False, base: float | None = 10000.0,
           scale: float = 1.0, offset: int | mx.array = 0, freqs: mx.array | None = None) -> mx.array:
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)


_SHAPES = ((1, 4, 64), (2, 3, 5, 32), (2, 2, 7, 100), (1, 8, 3, 128))

ENTRY = LibraryEntry(
    name="rope",
    kernel=ROPE,
    fn=rope,
    plan=plan_rope,
    make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, False),
    stock=_stock,
    shapes=_SHAPES,
    min_ndim=3,
    description="RoPE, rotate-half form (mx.fast.rope traditional=False)",
)

ENTRY_TRADITIONAL = dataclasses.replace(
    ENTRY,
    name="rope_traditional",
    make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, True),
    description="RoPE, interleaved pairs (mx.fast.rope traditional=True)",
)
