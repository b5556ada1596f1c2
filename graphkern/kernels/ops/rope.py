"""Rotary position embedding over the last axis, as ``mx.fast.rope`` (float32 inside).

``x`` is ``(B, *, L, D)``: row ``(b, ..., l)`` sits at position ``(l + offset[b]) * scale``; the first
``dims`` features are rotated in pairs, ``(i, i + dims/2)`` or, ``traditional``, ``(2i, 2i + 1)``,
by ``theta = position * inv_freq[i]``, the rest copied. The GPU kernels compute the inverse
frequencies as MLX's own GPU kernels do (``exp2(-i / (dims/2) * log2(base))``, ``log2(base)`` from the
host's ``log2f``; or ``1 / freqs[i]`` in double), so they agree with ``mx.fast.rope`` on the device bit
for bit; the reference computes them as MLX's CPU fallback does (``exp(-i * log(base) / (dims/2))``).
``input_scale`` multiplies the rotated features first, rounded to the dtype, as mlx-lm's YaRN and
LongRoPE layers do with ``x.at[..., :dims].multiply(s)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from graphkern.kernels.base import (
    MAX_GRID,
    Case,
    Plan,
    check_dtype,
    float_bits,
    float_from_bits,
    float_template,
    output_spec,
    runs_on_cuda,
    signature_constant,
    template_arg,
    unused_input,
    vector_width,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.host_math import host_float
from graphkern.launching.launch_cache import memoized
from graphkern.nodes import Kernel, KernelError, Status, TemplateArg

__all__ = ["ROPE", "ROPE_CUDA", "int_offset_array", "launch_freqs", "launch_offset", "plan_rope", "rope",
           "rope_reference", "rotate_reference", "rotary_template"]

#: Rows (heads, batch entries) one thread rotates at a position: their angles are computed once.
ROWS_PER_THREAD = 4
#: Threads that share a row's pairs, at least: a partial rotation with 16-byte accesses would
#: otherwise give each row fewer threads and narrower accesses (benchmarks/RESULTS_kernels.md).
MIN_THREADS_PER_ROW = 8
#: Threads a block, chosen by a sweep of block sizes (benchmarks/RESULTS_kernels.md).
BLOCK = 128
#: Inputs of at least this many elements take an int offset in a shape on CUDA (see _offset_array).
SHAPED_OFFSET_SIZE = 2**20
#: The float32 bits of 1.0: an input scale of 1 changes nothing and is skipped.
ONE_BITS = float_bits(1.0)

#: Shared with the fused attention prologue (rope_qk): MLX's inverse frequency and an input scale.
ROPE_CUDA = r"""
namespace gk {

template <bool FREQS>
__device__ __forceinline__ float rope_inv_freq(const float* freqs, int i, int half, float log2_base) {
  if constexpr (FREQS) {
    return static_cast<float>(1.0 / static_cast<double>(freqs[i]));
  } else {
    const float d = static_cast<float>(i) / static_cast<float>(half);
    return exp2f(-d * log2_base);
  }
}

template <typename T, int IN_SCALE>
__device__ __forceinline__ float in_scaled(float v) {
  if constexpr (IN_SCALE != 0x3f800000) {
    return round_to<T>(v * round_to<T>(__int_as_float(IN_SCALE)));
  } else {
    return v;
  }
}

}  // namespace gk
"""

_CUDA = r"""
namespace gk {

template <int V, bool FREQS>
__device__ __forceinline__ void rope_angles(float pos, const float* freqs, int k, int half, float log2_base,
                                            float (&c)[V], float (&s)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float theta = pos * rope_inv_freq<FREQS>(freqs, k + j, half, log2_base);
    c[j] = cosf(theta);
    s[j] = sinf(theta);
  }
}

// Rotate pairs k .. k + V - 1 of one row (x, out point at the row; half = dims / 2). An
// interleaved pair is one load of 2 * V elements, which must be aligned to them; NARROW (V = 1, the
// fallback off that alignment) reads and writes the pair one element at a time instead.
template <typename T, int V, bool TRADITIONAL, int IN_SCALE, bool NARROW = false>
__device__ __forceinline__ void rope_pairs(const T* x, T* out, int k, int half, const float (&c)[V],
                                           const float (&s)[V]) {
  static_assert(!NARROW || V == 1, "the narrow path rotates one pair");
  float a[V];
  float b[V];
  if constexpr (TRADITIONAL && NARROW) {
    a[0] = static_cast<float>(x[2 * k]);
    b[0] = static_cast<float>(x[2 * k + 1]);
  } else if constexpr (TRADITIONAL) {
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
    const float x1 = in_scaled<T, IN_SCALE>(a[j]);
    const float x2 = in_scaled<T, IN_SCALE>(b[j]);
    a[j] = x1 * c[j] - x2 * s[j];
    b[j] = x1 * s[j] + x2 * c[j];
  }
  if constexpr (TRADITIONAL && NARROW) {
    out[2 * k] = static_cast<T>(a[0]);
    out[2 * k + 1] = static_cast<T>(b[0]);
  } else if constexpr (TRADITIONAL) {
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
# and copies its share of the features past dims, TW at a time.
_CUDA_BODY = r"""
  const int D = x_shape[x_ndim - 1];
  const int L = x_shape[x_ndim - 2];
  constexpr int P = HALF / V;
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
  const int off = SHAPED_OFFSET ? offset_shape[1] - (1 << 30) : offset[b];
  const float pos = __int_as_float(SCALE) * static_cast<float>(l + off);
  float c[V];
  float s[V];
  gk::rope_angles<V, FREQS>(pos, freqs, t * V, HALF, __int_as_float(LOG2_BASE), c, s);
  const bool vectors = gk::aligned<TRADITIONAL ? 2 * V : V>(x) && gk::aligned<TRADITIONAL ? 2 * V : V>(out);
  const bool tail_vectors = gk::aligned<TW>(x) && gk::aligned<TW>(out);
  for (int r = 0; r < R && o0 + r < outer; ++r) {
    const long long row = (o0 + r) * L + l;
    const T* xr = x + row * D;
    T* outr = out + row * D;
    if (vectors) {
      gk::rope_pairs<T, V, TRADITIONAL, IN_SCALE>(xr, outr, t * V, HALF, c, s);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float cj[1] = {c[j]};
        const float sj[1] = {s[j]};
        gk::rope_pairs<T, 1, TRADITIONAL, IN_SCALE, true>(xr, outr, t * V + j, HALF, cj, sj);
      }
    }
    gk::copy_tail<T, TW>(xr, outr, 2 * HALF + t * TW, D, P * TW, tail_vectors);
  }
"""

#: Metal: MLX's Metal RoPE's inverse frequency (exp2 of the host's log2(base), or 1 / freqs[i]),
#: fast cos and sin, and the input scale; shared with rope_qk.
ROPE_METAL = r"""
namespace gk {

// P: MLX passes freqs as `const device float*`, or as `const constant float*` when it has fewer than
// 8 elements (a short table, or the one-element stand-in when FREQS is false)
template <bool FREQS, typename P>
inline float rope_inv_freq(P freqs, int i, int half_dims, float log2_base) {
  if (FREQS) {
    return 1.0f / freqs[i];
  }
  const float d = static_cast<float>(i) / static_cast<float>(half_dims);
  return metal::exp2(-d * log2_base);
}

template <typename T, int IN_SCALE>
inline float in_scaled(float v) {
  if (IN_SCALE != 0x3f800000) {
    return round_to<T>(v * round_to<T>(as_type<float>(IN_SCALE)));
  }
  return v;
}

}  // namespace gk
"""

_METAL_BODY = r"""
  const int D = x_shape[x_ndim - 1];
  const int L = x_shape[x_ndim - 2];
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
  const float pos = as_type<float>(SCALE) * float(l + offset[b]);
  for (int j = 0; j < V; ++j) {
    const int k = t * V + j;
    const float theta = pos * gk::rope_inv_freq<FREQS>(freqs, k, HALF, as_type<float>(LOG2_BASE));
    const float c = metal::fast::cos(theta);
    const float s = metal::fast::sin(theta);
    for (size_t o = o0; o < o0 + R && o < outer; ++o) {
      const size_t i1 = (o * size_t(L) + size_t(l)) * size_t(D) + (TRADITIONAL ? 2 * k : k);
      const size_t i2 = i1 + (TRADITIONAL ? 1 : HALF);
      const float a = gk::in_scaled<T, IN_SCALE>(static_cast<float>(x[i1]));
      const float bb = gk::in_scaled<T, IN_SCALE>(static_cast<float>(x[i2]));
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


def rotate_reference(x: mx.array, offset: mx.array, freqs: mx.array, *, half: int, traditional: bool,
                     use_freqs: bool, base: float, scale: float, input_scale: float = 1.0,
                     per_batch: bool = False, shaped_offset: bool = False) -> mx.array:
    """Pure-MLX RoPE of ``x`` (``(B, *, L, D)``, any layout) in float32, with mx.fast.rope's CPU
    fallback's frequencies (``1 / freqs`` when ``use_freqs``, else from ``base``) and positions;
    ``shaped_offset``: the offset is carried by ``offset``'s shape (see :func:`_offset_array`)."""
    dims = 2 * half
    inv_freq = mx.reciprocal(freqs) if use_freqs else _base_frequencies(dims, base)
    if shaped_offset:
        offset = mx.array([offset.shape[1] - OFFSET_BIAS])
    off = offset.astype(mx.float32)
    if per_batch:
        off = off.reshape((-1,) + (1,) * (x.ndim - 2))
    positions = (mx.arange(x.shape[-2], dtype=mx.float32) + off) * scale
    theta = positions[..., None] * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    rot = x[..., :dims]
    if input_scale != 1.0:  # x.at[..., :dims].multiply(s): in x's dtype
        rot = rot * input_scale
    rot = rot.astype(mx.float32)
    if traditional:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    if x.shape[-1] > dims:
        out = mx.concatenate([out, x[..., dims:].astype(mx.float32)], axis=-1)
    return out.astype(x.dtype)


def rope_reference(x: mx.array, offset: mx.array, freqs: mx.array, *, SCALE: int, TRADITIONAL: bool,
                   HALF: int, FREQS: bool, BASE: int, IN_SCALE: int = ONE_BITS, PER_BATCH: bool = False,
                   SHAPED_OFFSET: bool = False, **launch: Any) -> list[mx.array]:
    """The RoPE kernel's reference (:func:`rotate_reference`); SCALE, BASE and IN_SCALE are float32
    bits. ``launch``: how a GPU thread splits the work (R, TW, V), which changes nothing here."""
    return [rotate_reference(x, offset, freqs, half=HALF, traditional=TRADITIONAL, use_freqs=FREQS,
                             base=float_from_bits(BASE), scale=float_from_bits(SCALE),
                             input_scale=float_from_bits(IN_SCALE), per_batch=PER_BATCH,
                             shaped_offset=SHAPED_OFFSET)]


ROPE = Kernel(
    "gk_rope",
    input_names=["x", "offset", "freqs"],
    output_names=["out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(ROPE_CUDA + _CUDA, ROPE_METAL),
    reference=rope_reference,
)


@memoized("plan parts", maxsize=64)
def _base_frequencies(dims: int, base: float) -> mx.array:
    """``base ** (-i / (dims/2))`` as mx.fast.rope's CPU fallback computes it (``std::log`` of the
    float32 base, divided by dims/2 in float32, then ``exp`` of the multiples), made once per
    (dims, base).

    Evaluated at once: MLX streams belong to the thread that made them, and a lazy array first made
    on a trace's worker thread could not be evaluated from any other thread."""
    half = dims // 2
    coef = np.float32(host_float("logf", base)) / np.float32(half)
    freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(float(coef), dtype=mx.float32))
    mx.eval(freqs)
    return freqs


#: check()'s float32 tolerance for RoPE kernels: the reference takes its frequencies as MLX's CPU
#: fallback does (exp of multiples of log(base)), the kernel as MLX's GPU kernels do (exp2 of
#: log2f(base)); the two differ by an ulp of the frequency, which rotation angles of tens of
#: radians carry to a few 1e-6 of the output. (The GPU tests hold the kernel to mx.fast.rope itself.)
GPU_FORMULA_TOLERANCES = {mx.float32: (4e-5, 4e-5)}

#: An int offset on CUDA travels as the shape ``(0, offset + OFFSET_BIAS)`` of an empty array.
OFFSET_BIAS = 1 << 30


@memoized("plan parts")
def _offset_array(offset: int, in_shape: bool) -> mx.array:
    """The ``offset`` input for an int offset, one array per value (reused by every layer at that
    position): ``[offset]`` as int32, or, ``in_shape``, an empty array of shape
    ``(0, offset + OFFSET_BIAS)`` that the kernel reads the offset from.

    MLX passes input shapes to a CUDA kernel by value, while it keeps an array of at most 8 bytes in
    host-mapped managed memory (the small pool of mlx/backend/cuda/allocator.cpp), where reading
    it from every warp costs a crossing to the host (benchmarks/RESULTS_kernels.md has the times).
    A shape, though, is part of a launch's signature: each new offset would be a new launch to
    build, so only large inputs (``SHAPED_OFFSET_SIZE``), whose warps would wait longest, take it.
    """
    if in_shape:  # a constant of the signature, whose key holds the offset
        return signature_constant(mx.array(np.zeros((0, offset + OFFSET_BIAS), dtype=np.int32)))
    return mx.array([offset], dtype=mx.int32)


def int_offset_array(offset: int) -> mx.array:
    """An int offset as the int32 array a RoPE kernel takes, one array per value.

    >>> int_offset_array(7).tolist(), int_offset_array(7) is int_offset_array(7)
    ([7], True)
    """
    return _offset_array(offset, False)


_INT_DTYPES = (mx.int32, mx.int64, mx.uint32, mx.int16, mx.int8, mx.uint8, mx.uint16)


def offset_input(op: str, offset: int | mx.array, batch: int, size: int) -> tuple[mx.array, bool, bool]:
    """(the offset input, per batch entry, carried in its shape) for an offset of a RoPE of
    ``size`` elements and ``batch`` entries; raises KernelError for an offset no kernel can take."""
    if isinstance(offset, mx.array):
        if offset.ndim > 1 or offset.size not in (1, batch) or offset.dtype not in _INT_DTYPES:
            raise KernelError(op, f"offset must be an int or an integer array of 1 or {batch} elements, "
                              f"got shape {tuple(offset.shape)} {offset.dtype}", Status.INVALID_INPUT)
        # a 0-d array would reach Metal as a reference (`const constant int&`), which the kernel
        # cannot index: every offset travels as a 1-d array
        if offset.ndim == 0:
            offset = offset.reshape(1)
        return (offset if offset.dtype == mx.int32 else offset.astype(mx.int32)), offset.size > 1, False
    if isinstance(offset, int) and not isinstance(offset, bool):
        if not -OFFSET_BIAS <= offset < 2**31 - OFFSET_BIAS:
            raise KernelError(op, f"offset must be in [-2**30, 2**30), got {offset}", Status.INVALID_INPUT)
        shaped = size >= SHAPED_OFFSET_SIZE and runs_on_cuda()
        return _offset_array(offset, shaped), False, shaped
    raise KernelError(op, f"offset must be an int or an mx.array, got {type(offset).__name__}",
                      Status.INVALID_INPUT)


def _number(op: str, name: str, value: Any, positive: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
            positive and value <= 0):
        kind = "a finite number > 0" if positive else "a finite number"
        raise KernelError(op, f"{name} must be {kind}, got {value!r}", Status.INVALID_INPUT)
    return float(value)


def rotary_template(op: str, d: int, dims: int, *, traditional: bool, base: float | None,
                    freqs: mx.array | None, scale: float, input_scale: float) -> tuple[
                        tuple[TemplateArg, ...], mx.array]:
    """The template values every RoPE kernel takes (``TRADITIONAL``, ``HALF``, ``FREQS``, ``BASE``,
    ``LOG2_BASE``, ``SCALE``, ``IN_SCALE``) and its ``freqs`` input (float32, or an unused stand-in),
    for rows of ``d`` features; raises KernelError for arguments mx.fast.rope would refuse."""
    if not isinstance(dims, int) or isinstance(dims, bool) or dims <= 0 or dims % 2 or dims > d:
        raise KernelError(op, f"dims must be a positive even int <= x's last dimension ({d}), got {dims!r}",
                          Status.INVALID_INPUT)
    if (base is None) == (freqs is None):
        raise KernelError(op, "exactly one of base and freqs must be given", Status.INVALID_INPUT)
    if freqs is not None:
        if not isinstance(freqs, mx.array) or freqs.ndim != 1 or freqs.shape[0] != dims // 2:
            got = tuple(freqs.shape) if isinstance(freqs, mx.array) else type(freqs).__name__
            raise KernelError(op, f"freqs must be an array of shape ({dims // 2},), got {got}",
                              Status.INVALID_INPUT)
        if not mx.issubdtype(freqs.dtype, mx.floating):
            raise KernelError(op, f"freqs must be floating point, got {freqs.dtype}", Status.INVALID_INPUT)
        table, base_bits, log2_bits = (freqs if freqs.dtype == mx.float32 else freqs.astype(mx.float32)), 0, 0
    else:
        value = _number(op, "base", base, positive=True)
        table = unused_input(mx.float32)
        base_bits, log2_bits = float_bits(value), float_bits(host_float("log2f", value))
    template = (template_arg("TRADITIONAL", bool(traditional)), template_arg("HALF", dims // 2),
                template_arg("FREQS", freqs is not None), template_arg("BASE", base_bits),
                template_arg("LOG2_BASE", log2_bits), float_template("SCALE", _number(op, "scale", scale)),
                float_template("IN_SCALE", _number(op, "input_scale", input_scale)))
    return template, table


def launch_offset(offset: int | mx.array, x: mx.array | None) -> int | mx.array:
    """A RoPE call's ``offset`` as its launch takes it, so that decoding token after token is one
    signature: an int as the int32 array made once per value (:func:`int_offset_array`), an integer
    array as int32 of at least one dimension. An int carried in a shape (see :func:`_offset_array`)
    stays an int, part of the signature; so does anything no kernel takes (the plan refuses it)."""
    if offset.__class__ is int:
        if -OFFSET_BIAS <= offset < 2**31 - OFFSET_BIAS and not (  # type: ignore[operator]
                getattr(x, "size", 0) >= SHAPED_OFFSET_SIZE and runs_on_cuda()):
            return _offset_array(offset, False)  # type: ignore[arg-type]
    elif offset.__class__ is mx.array and offset.dtype in _INT_DTYPES:  # type: ignore[union-attr]
        if offset.dtype != mx.int32:  # type: ignore[union-attr]
            offset = offset.astype(mx.int32)  # type: ignore[union-attr]
        if offset.ndim == 0:
            offset = offset.reshape(1)
    return offset


def launch_freqs(freqs: mx.array | None) -> mx.array | None:
    """A RoPE call's ``freqs`` as its launch takes them: float32."""
    if freqs.__class__ is mx.array and freqs.dtype != mx.float32 and mx.issubdtype(  # type: ignore[union-attr]
            freqs.dtype, mx.floating):  # type: ignore[union-attr]
        return freqs.astype(mx.float32)  # type: ignore[union-attr]
    return freqs


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


@declare(ROPE, stock=_stock, make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, False),
         shapes=((1, 4, 64), (2, 3, 5, 32), (2, 2, 7, 100), (1, 8, 3, 128)), min_ndim=3,
         description="RoPE, rotate-half form (mx.fast.rope traditional=False)",
         tolerances=GPU_FORMULA_TOLERANCES)
def plan_rope(x: mx.array, dims: int, *, traditional: bool = False, base: float | None = 10000.0,
              scale: float = 1.0, offset: int | mx.array = 0, freqs: mx.array | None = None,
              input_scale: float = 1.0) -> Plan:
    """The launch :func:`rope` makes (validated)."""
    op = "rope"
    check_dtype(op, x)
    if x.ndim < 3:
        raise KernelError(op, f"x must have at least 3 dimensions (B, *, L, D), got shape {tuple(x.shape)}",
                          Status.INVALID_INPUT)
    d = x.shape[-1]
    rotary, table = rotary_template(op, d, dims, traditional=traditional, base=base, freqs=freqs,
                                    scale=scale, input_scale=input_scale)
    off, per_batch, shaped = offset_input(op, offset, x.shape[0], x.size)
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
    template = (template_arg("T", x.dtype), template_arg("V", v), *rotary,
                template_arg("PER_BATCH", per_batch), template_arg("SHAPED_OFFSET", shaped),
                template_arg("R", rows_each), template_arg("TW", tail))
    return Plan(ROPE, (x, off, table), (output_spec(x.shape, x.dtype),), (threads, 1, 1), (BLOCK, 1, 1),
                template)


@plan_rope.layer
def rope(x: mx.array, dims: int, *, traditional: bool = False, base: float | None = 10000.0,
         scale: float = 1.0, offset: int | mx.array = 0, freqs: mx.array | None = None,
         input_scale: float = 1.0) -> mx.array:
    """Rotary position embedding, with ``mx.fast.rope``'s arguments and results.

    ``offset`` is an int or an integer array of 1 or ``x.shape[0]`` elements (one per batch entry).
    ``input_scale`` multiplies ``x[..., :dims]`` first, in x's dtype (mlx-lm's YaRN and LongRoPE).

    >>> x = mx.ones((1, 2, 4))
    >>> [round(v, 4) for v in rope(x, 4, offset=1)[0, 0].tolist()]   # position 1
    [-0.3012, 0.99, 1.3818, 1.0099]
    """
    return plan_rope.launch(x, dims, traditional, base, scale, launch_offset(offset, x), launch_freqs(freqs),
                            input_scale)[0]


plan_rope.variant("rope_traditional",
                  make_inputs=lambda shape, dtype, key: _make_inputs(shape, dtype, key, True),
                  description="RoPE, interleaved pairs (mx.fast.rope traditional=True)")
