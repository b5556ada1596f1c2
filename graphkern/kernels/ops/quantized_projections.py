"""RMSNorm feeding quantized projections, for the few token rows of a decoding step: one launch for
``rms_norm(x + residual)`` and its products with up to three affine-quantized weights (a block's
query, key and value projections), or with a gate and an up weight and the gating between them
(SwiGLU's SiLU, or GeGLU's GELU: one source, the ``ACT`` template value picks it, as in
``graphkern.kernels.ops.projections``).

The weights are MLX's affine quantization, as ``nn.QuantizedLinear`` holds them (``mx.quantize``):
``weight`` is uint32 ``(N, K * bits / 32)``, ``bits``-wide values packed along the input axis, low
bits first; ``scales`` and ``biases`` are ``(N, K / group_size)`` in the model's dtype, and input
``k`` of row ``n`` stands for ``scales[n, g] * q + biases[n, g]`` with ``g = k // group_size``. The
products are ``mx.quantized_matmul(n, weight, scales, biases, transpose=True)``'s, rounded to the
dtype once, as MLX's are (bits 4 and 8; group sizes 32, 64 and 128).

CUDA: every thread block normalizes the rows into shared memory as float32 values rounded to the
dtype (as ``rms_norm``'s output is), with each group's sum of them; then each warp reduces one
output row: its lanes read 16 bytes of packed weights at a time (32 4-bit or 16 8-bit values),
turn them into floats in registers, and accumulate ``scale * sum(x * q) + bias * sum(x)`` per group
(the form MLX's Metal ``qdot`` takes). Metal: the same launch, one simdgroup per output row, the
rows in threadgroup memory in the dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from graphkern.kernels.base import (
    THREADGROUP_MEMORY,
    Case,
    Plan,
    check_dtype,
    float_from_bits,
    output_spec,
    runs_on_cuda,
    template_arg,
    threadgroup_backend,
    unused_input,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.norm_rows import (
    CUDA_PREFETCH,
    CUDA_TOKEN_ROW,
    MAX_ROWS,
    METAL_NORM_ROWS,
    norm_rows,
    norm_rows_template,
    random_rows,
    row_output_specs,
    stock_normed,
)
from graphkern.kernels.ops.projections import (
    ACTIVATION_CUDA,
    ACTIVATION_METAL,
    ACTIVATIONS,
    DECODING_SHAPES,
    geglu_act,
)
from graphkern.kernels.ops.rms_norm import RMS_SCALE_CUDA
from graphkern.launching.launch_cache import memoized
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

__all__ = ["BLOCK", "GATED_TOLERANCES", "QUANTIZED_BITS", "QUANTIZED_CUDA", "QUANTIZED_GROUP_SIZES",
           "QUANTIZED_METAL", "QUANTIZED_METAL_START", "QUANTIZED_NORM_GEGLU", "QUANTIZED_NORM_PROJECTIONS",
           "QUANTIZED_NORM_SWIGLU", "QUANTIZED_ROW_BYTES", "QuantizedWeight", "Rotation", "WIDE_BLOCK",
           "check_quantization", "check_quantized_weight",
           "plan_quantized_norm_geglu", "plan_quantized_norm_projections", "plan_quantized_norm_swiglu",
           "plan_quantized_rows", "quantized_case", "quantized_cuda_rows", "quantized_norm_geglu",
           "quantized_norm_projections", "quantized_norm_swiglu", "quantized_prefetch", "quantized_product",
           "quantized_projections_fit", "random_quantized", "shared_parts", "with_row_memory"]

#: The affine quantizations the kernels read.
QUANTIZED_BITS = (4, 8)
QUANTIZED_GROUP_SIZES = (32, 64, 128)
#: Bytes of normalized rows and group sums a CUDA block keeps, at most, as float32 in dynamic shared
#: memory (an H100/H200 block may take 227 KB; past this much one block fills an SM). Metal keeps the
#: rows in the dtype, with its reduction scratch, in its 32 KB of threadgroup memory
#: (``THREADGROUP_MEMORY``).
CUDA_SHARED_BYTES = 160 * 1024
#: Threads a block, one output row a warp: 8 warps, or 16 for more than 2 rows of projections, where
#: normalizing the rows (which each block does) costs more and fewer blocks do it. The SwiGLU
#: kernel keeps 8 warps: its two products take up to 174 registers a thread at 8 rows (NVRTC for
#: sm_90a), and MLX compiles without launch bounds, so a block of 512 could not launch.
BLOCK = 256
WIDE_BLOCK = 512


class QuantizedWeight(NamedTuple):
    """One affine-quantized weight as ``nn.QuantizedLinear`` holds it: ``weight`` uint32
    ``(N, K * bits / 32)``, ``scales`` and ``biases`` ``(N, K / group_size)``."""

    weight: mx.array
    scales: mx.array
    biases: mx.array


QUANTIZED_CUDA = CUDA_PREFETCH + CUDA_TOKEN_ROW + r"""
namespace gk {

__device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Where float4 chunk c of a normalized row lies in shared memory: chunks swizzled within each 32
// floats, so the 32 lanes of a warp reading their own 16 or 32 consecutive values at the same step
// hit distinct banks.
__device__ __forceinline__ int chunk_at(int c) {
  return c ^ ((c >> 3) & 7);
}

// A group of GS values' sum over the GS / 4 lanes holding its float4 chunks (s: this lane's chunk's),
// written to *at by the group's first lane where valid.
template <int GS>
__device__ __forceinline__ void store_group_sum(float s, bool valid, int lane, float* at) {
#pragma unroll
  for (int o = 1; o < GS / 4; o <<= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
  }
  if (valid && lane % (GS / 4) == 0) {
    *at = s;
  }
}

// The M rows of x (+ r, rounded to T, block 0 writing the sum to h) RMS-normalized into xs as floats
// rounded as rms_norm rounds, T(T(v * inv) * w), and each group of GS values' sum into xsum.
// Every thread of the block takes part; red holds M * NT / 32 floats.
template <typename T, int M, int K, int V, int NT, int GS, bool RESID, bool HAS_W>
__device__ __forceinline__ void norm_rows_float(const T* x, const T* r, const T* w, T* h, float* xs,
                                                float* xsum, float eps, float* red) {
  constexpr int WARPS = NT / 32;
  constexpr int G = K / GS;
  const int lane = threadIdx.x & 31;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.0f;
    for (int i = threadIdx.x * V; i < K; i += NT * V) {
      float v[V];
      token_row<T, V, RESID>(x + m * K, r + m * K, blockIdx.x == 0 ? h + m * K : nullptr, i, v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        ss[m] += v[j] * v[j];
        const int k = i + j;
        xs[m * K + chunk_at(k >> 2) * 4 + (k & 3)] = v[j];
      }
    }
    ss[m] = lane_sum(ss[m]);
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      red[m * WARPS + threadIdx.x / 32] = ss[m];
    }
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      total += red[m * WARPS + i];
    }
    const float inv = rsqrtf(total / K + eps);
    // A warp takes 32 consecutive chunks at a time (its loop is uniform, for the shuffles); a group
    // is GS / 4 <= 32 consecutive lanes' chunks. Each thread rereads only what it wrote.
    for (int c0 = threadIdx.x & ~31; c0 < K / 4; c0 += NT) {
      const int c = c0 + lane;
      float s = 0.0f;
      if (c < K / 4) {
        float4* p = reinterpret_cast<float4*>(xs + m * K) + chunk_at(c);
        const float4 q = *p;
        float v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float one[1] = {v[j]};
          rms_scale<T, 1, HAS_W>(one, w, c * 4 + j, inv);
          v[j] = round_to<T>(one[0]);
          s += v[j];
        }
        *p = make_float4(v[0], v[1], v[2], v[3]);
      }
      store_group_sum<GS>(s, c < K / 4, lane, xsum + m * G + c * 4 / GS);
    }
  }
  __syncthreads();
}

// The 4 bytes of u as floats 0..255: each byte under a float's exponent for 2^23, less 2^23.
__device__ __forceinline__ float byte_value(unsigned int u, int b) {
  return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540u | b)) - 8388608.0f;
}

// The values of WV packed words (low bits first) as floats.
template <int BITS, int WV>
__device__ __forceinline__ void unpack_words(const unsigned int (&wv)[WV], float (&q)[WV * 32 / BITS]) {
#pragma unroll
  for (int t = 0; t < WV; ++t) {
    if constexpr (BITS == 4) {
      const unsigned int lo = wv[t] & 0x0F0F0F0Fu;          // values 0, 2, 4, 6 of the word
      const unsigned int hi = (wv[t] >> 4) & 0x0F0F0F0Fu;   // values 1, 3, 5, 7
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        q[t * 8 + 2 * b] = byte_value(lo, b);
        q[t * 8 + 2 * b + 1] = byte_value(hi, b);
      }
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        q[t * 4 + b] = byte_value(wv[t], b);
      }
    }
  }
}

// WV as a type, for a generic lambda's argument: the words a lane loads at a time.
template <int WV>
struct Words {
  static constexpr int value = WV;
};

template <int WV>
__device__ __forceinline__ void load_words(const uint32_t* p, unsigned int (&wv)[WV]) {
  if constexpr (WV == 4) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    wv[0] = u.x;
    wv[1] = u.y;
    wv[2] = u.z;
    wv[3] = u.w;
  } else {
#pragma unroll
    for (int t = 0; t < WV; ++t) {
      wv[t] = __ldg(p + t);
    }
  }
}

// acc[m] = xs[m] . dequantized row, summed over the warp. Each lane takes WV words (WV * 32 / BITS
// values, inside one group) at a time: scale * sum(x * q) for them, plus bias * (the group's sum of
// x) once a group, by the lane holding its first values.
template <typename T, int M, int K, int BITS, int GS, int WV>
__device__ __forceinline__ void quantized_row_dot(const uint32_t* row, const T* scales, const T* biases,
                                                  const float* xs, const float* xsum, float (&acc)[M]) {
  constexpr int VALS = WV * 32 / BITS;
  constexpr int LOADS = K / VALS;
  constexpr int G = K / GS;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
#pragma unroll 4
  for (int it = 0; it < (LOADS + 31) / 32; ++it) {
    const int c = lane + 32 * it;
    if (LOADS % 32 == 0 || c < LOADS) {
      unsigned int wv[WV];
      load_words<WV>(row + c * WV, wv);
      const int k0 = c * VALS;
      const int g = k0 / GS;
      const float scale = static_cast<float>(scales[g]);
      const bool first = k0 % GS == 0;
      const float bias = first ? static_cast<float>(biases[g]) : 0.0f;
      float q[VALS];
      unpack_words<BITS, WV>(wv, q);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4* xm = reinterpret_cast<const float4*>(xs + m * K);
        float d = 0.0f;
#pragma unroll
        for (int j = 0; j < VALS / 4; ++j) {
          const float4 xv = xm[chunk_at(k0 / 4 + j)];
          d = fmaf(xv.x, q[4 * j], d);
          d = fmaf(xv.y, q[4 * j + 1], d);
          d = fmaf(xv.z, q[4 * j + 2], d);
          d = fmaf(xv.w, q[4 * j + 3], d);
        }
        acc[m] = fmaf(scale, d, acc[m]);
        if (first) {
          acc[m] = fmaf(bias, xsum[m * G + g], acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[m] = lane_sum(acc[m]);
  }
}

// y[m, r] = xs[m] . row r of one quantized projection of n rows.
template <typename T, int M, int K, int BITS, int GS, int WV>
__device__ __forceinline__ void quantized_project_row(const uint32_t* wq, const T* scales, const T* biases,
                                                      T* y, int r, int n, const float* xs,
                                                      const float* xsum) {
  constexpr int WORDS = K * BITS / 32;
  constexpr int G = K / GS;
  float acc[M];
  quantized_row_dot<T, M, K, BITS, GS, WV>(wq + static_cast<long long>(r) * WORDS,
                                           scales + static_cast<long long>(r) * G,
                                           biases + static_cast<long long>(r) * G, xs, xsum, acc);
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      y[static_cast<long long>(m) * n + r] = static_cast<T>(acc[m]);
    }
  }
}

}  // namespace gk
"""

# The shared opening: the normalized rows and group sums in dynamic shared memory (the kernel's
# shared_memory), this warp's output row; x's rows V-wide when its pointers allow, else one by one.
_CUDA_START = r"""
  extern __shared__ __align__(16) float gk_quantized_rows[];
  __shared__ float red[M * (NT / 32)];
  float* xs = gk_quantized_rows;
  float* xsum = gk_quantized_rows + M * K;
  const float eps = __int_as_float(EPS);
  const int row = blockIdx.x * (NT / 32) + threadIdx.x / 32;"""

_CUDA_NORM = r"""
  if (gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(w) && gk::aligned<V>(h)) {
    gk::norm_rows_float<T, M, K, V, NT, GS, RESID, HAS_W>(x, residual, w, h, xs, xsum, eps, red);
  } else {
    gk::norm_rows_float<T, M, K, 1, NT, GS, RESID, HAS_W>(x, residual, w, h, xs, xsum, eps, red);
  }"""

#: A quantized weight row's bytes: its packed words, then its scales' and biases' (the same).
QUANTIZED_ROW_BYTES = r"""
  constexpr long long WORD_BYTES = K * BITS / 8;
  constexpr long long GROUP_BYTES = (K / GS) * sizeof(T);"""


def quantized_cuda_rows(aligned: str, prefetch: str, work: str) -> str:
    """The body: this warp's weight rows asked of L2 (``prefetch``, before the token rows are
    normalized), then ``work`` (naming ``WV``, the words a lane loads at a time) with 16-byte loads
    when the ``aligned`` weights allow, else one word at a time. ``work`` is written once, in a
    generic lambda instantiated for both: MLX hashes a kernel's whole source at every launch, so
    text written twice costs the host at each one."""
    return (_CUDA_START + QUANTIZED_ROW_BYTES + prefetch + _CUDA_NORM
            + "\n  auto rows_of = [&](auto words) {\n    constexpr int WV = decltype(words)::value;" + work
            + f"\n  }};\n  if ({aligned}) {{\n    rows_of(gk::Words<4>{{}});\n  }} else {{\n"
            + "    rows_of(gk::Words<1>{});\n  }\n")


def quantized_prefetch(weight: str, scales: str, biases: str, row: str) -> str:
    """CUDA statements asking L2 for row ``row`` of one quantized weight (its words, scales, biases)."""
    return (f"\n    gk::prefetch_l2({weight} + static_cast<long long>({row}) * (WORD_BYTES / 4), WORD_BYTES);"
            f"\n    gk::prefetch_l2({scales} + static_cast<long long>({row}) * (K / GS), GROUP_BYTES);"
            f"\n    gk::prefetch_l2({biases} + static_cast<long long>({row}) * (K / GS), GROUP_BYTES);")


_CUDA_PROJECTIONS = quantized_cuda_rows("gk::aligned<4>(w0) && gk::aligned<4>(w1) && gk::aligned<4>(w2)", r"""
  const int n0 = w0_shape[0];
  const int n1 = NW > 1 ? w1_shape[0] : 0;
  const int n2 = NW > 2 ? w2_shape[0] : 0;
  if (row < n0) {""" + quantized_prefetch("w0", "scales0", "biases0", "row") + r"""
  } else if (row < n0 + n1) {""" + quantized_prefetch("w1", "scales1", "biases1", "row - n0") + r"""
  } else if (row < n0 + n1 + n2) {""" + quantized_prefetch("w2", "scales2", "biases2", "row - n0 - n1") + r"""
  }""", r"""
    if (row < n0) {
      gk::quantized_project_row<T, M, K, BITS, GS, WV>(w0, scales0, biases0, y0, row, n0, xs, xsum);
    } else if (row < n0 + n1) {
      gk::quantized_project_row<T, M, K, BITS, GS, WV>(w1, scales1, biases1, y1, row - n0, n1, xs, xsum);
    } else if (row < n0 + n1 + n2) {
      gk::quantized_project_row<T, M, K, BITS, GS, WV>(w2, scales2, biases2, y2, row - n0 - n1, n2, xs,
                                                       xsum);
    }""")

# The gated body, of SwiGLU and GeGLU alike: ACT picks the activation of the rounded gate product.
_CUDA_GATED = quantized_cuda_rows("gk::aligned<4>(gate) && gk::aligned<4>(up)", r"""
  const int n = gate_shape[0];
  if (row < n) {""" + quantized_prefetch("gate", "gate_scales", "gate_biases", "row")
    + quantized_prefetch("up", "up_scales", "up_biases", "row") + r"""
  }""", r"""
    constexpr int WORDS = K * BITS / 32;
    constexpr int G = K / GS;
    if (row < n) {
      float g[M];
      float u[M];
      const long long wo = static_cast<long long>(row) * WORDS;
      const long long so = static_cast<long long>(row) * G;
      gk::quantized_row_dot<T, M, K, BITS, GS, WV>(gate + wo, gate_scales + so, gate_biases + so, xs, xsum,
                                                   g);
      gk::quantized_row_dot<T, M, K, BITS, GS, WV>(up + wo, up_scales + so, up_biases + so, xs, xsum, u);
      if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float gm = gk::round_to<T>(g[m]);
          out[static_cast<long long>(m) * n + row] =
              static_cast<T>(gk::activation<ACT, T>(gm) * gk::round_to<T>(u[m]));
        }
      }
    }""")

# Metal: the rows normalized into threadgroup memory in the dtype, one simdgroup per output row, each
# lane one packed word at a time.
QUANTIZED_METAL = r"""
namespace gk {

""" + METAL_NORM_ROWS + r"""
template <typename T, int M, int K, int BITS, int GS, typename PW, typename PS, typename PB>
inline void quantized_row_dot(PW row, PS scales, PB biases, threadgroup const T* xs, uint lane,
                              thread float (&acc)[M]) {
  constexpr int PER = 32 / BITS;
  constexpr int WORDS = K / PER;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
  for (int c = lane; c < WORDS; c += 32) {
    const uint32_t word = static_cast<uint32_t>(row[c]);
    const int k0 = c * PER;
    const float scale = static_cast<float>(scales[k0 / GS]);
    const float bias = static_cast<float>(biases[k0 / GS]);
    for (int j = 0; j < PER; ++j) {
      const float wv = scale * static_cast<float>((word >> (j * BITS)) & MASK) + bias;
      for (int m = 0; m < M; ++m) {
        acc[m] += wv * static_cast<float>(xs[m * K + k0 + j]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    acc[m] = metal::simd_sum(acc[m]);
  }
}

}  // namespace gk
"""

QUANTIZED_METAL_START = r"""
  threadgroup float red[32];
  threadgroup T xs[M * K];
  const uint lane = thread_index_in_simdgroup;
  gk::norm_rows<T, M, K, NT, RESID, HAS_W>(x, residual, w, h, xs, as_type<float>(EPS),
      thread_position_in_threadgroup.x, lane, simdgroup_index_in_threadgroup,
      threadgroup_position_in_grid.x, red);
  const int row = threadgroup_position_in_grid.x * (NT / 32) + simdgroup_index_in_threadgroup;
  constexpr int WORDS = K * BITS / 32;
  constexpr int G = K / GS;
  float acc[M];"""

_METAL_PROJECTIONS = QUANTIZED_METAL_START + r"""
  const int n0 = w0_shape[0];
  const int n1 = NW > 1 ? w1_shape[0] : 0;
  const int n2 = NW > 2 ? w2_shape[0] : 0;
  int r = row;
  int n = n0;
  if (row < n0) {
    gk::quantized_row_dot<T, M, K, BITS, GS>(w0 + size_t(r) * WORDS, scales0 + size_t(r) * G,
                                             biases0 + size_t(r) * G, xs, lane, acc);
  } else if (row < n0 + n1) {
    r = row - n0;
    n = n1;
    gk::quantized_row_dot<T, M, K, BITS, GS>(w1 + size_t(r) * WORDS, scales1 + size_t(r) * G,
                                             biases1 + size_t(r) * G, xs, lane, acc);
  } else if (row < n0 + n1 + n2) {
    r = row - n0 - n1;
    n = n2;
    gk::quantized_row_dot<T, M, K, BITS, GS>(w2 + size_t(r) * WORDS, scales2 + size_t(r) * G,
                                             biases2 + size_t(r) * G, xs, lane, acc);
  } else {
    return;
  }
  if (lane == 0) {
    for (int m = 0; m < M; ++m) {
      if (row < n0) y0[size_t(m) * n + r] = static_cast<T>(acc[m]);
      else if (row < n0 + n1) y1[size_t(m) * n + r] = static_cast<T>(acc[m]);
      else y2[size_t(m) * n + r] = static_cast<T>(acc[m]);
    }
  }
"""

_METAL_GATED = QUANTIZED_METAL_START + r"""
  const int n = gate_shape[0];
  if (row < n) {
    float u[M];
    gk::quantized_row_dot<T, M, K, BITS, GS>(gate + size_t(row) * WORDS, gate_scales + size_t(row) * G,
                                             gate_biases + size_t(row) * G, xs, lane, acc);
    gk::quantized_row_dot<T, M, K, BITS, GS>(up + size_t(row) * WORDS, up_scales + size_t(row) * G,
                                             up_biases + size_t(row) * G, xs, lane, u);
    if (lane == 0) {
      for (int m = 0; m < M; ++m) {
        const float g = gk::round_to<T>(acc[m]);
        out[size_t(m) * n + row] = static_cast<T>(gk::activation<ACT>(g) * gk::round_to<T>(u[m]));
      }
    }
  }
"""


# ----------------------------------------------------------------------------- references


def quantized_product(normed: mx.array, weight: QuantizedWeight | Sequence[mx.array], group_size: int,
                       bits: int) -> mx.array:
    """``mx.quantized_matmul``, as ``nn.QuantizedLinear`` calls it."""
    w, scales, biases = weight
    return mx.quantized_matmul(normed, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def quantized_norm_projections_reference(
        x: mx.array, residual: mx.array, w: mx.array, w0: mx.array, scales0: mx.array, biases0: mx.array,
        w1: mx.array, scales1: mx.array, biases1: mx.array, w2: mx.array, scales2: mx.array,
        biases2: mx.array, *, EPS: int, RESID: bool, HAS_W: bool, NW: int, BITS: int, GS: int,
        **_: Any) -> list[mx.array]:
    """Stock MLX: ``h = x + residual`` (when RESID), ``mx.fast.rms_norm(h)`` and its
    ``mx.quantized_matmul`` with the NW weights; an absent output is a one-element zero."""
    h, normed = stock_normed(x, w if HAS_W else None, float_from_bits(EPS), residual if RESID else None)
    absent = mx.zeros((1,), x.dtype)
    weights = ((w0, scales0, biases0), (w1, scales1, biases1), (w2, scales2, biases2))
    outputs = [quantized_product(normed, weights[i], GS, BITS) if i < NW else absent for i in range(3)]
    return [h if RESID else absent, *outputs]


def _stock_activation(act: int) -> Callable[[mx.array], mx.array]:
    """The ``mlx.nn`` function of ``ACTIVATIONS[act]``: ``nn.silu``, ``nn.gelu`` or ``nn.gelu_approx``."""
    import mlx.nn as nn

    return getattr(nn, ACTIVATIONS[act])  # type: ignore[no-any-return]


def quantized_norm_gated_reference(
        x: mx.array, residual: mx.array, w: mx.array, gate: mx.array, gate_scales: mx.array,
        gate_biases: mx.array, up: mx.array, up_scales: mx.array, up_biases: mx.array, *, EPS: int,
        RESID: bool, HAS_W: bool, BITS: int, GS: int, ACT: int, **_: Any) -> list[mx.array]:
    """Stock MLX: ``h`` and ``act(n @ gate) * (n @ up)`` with ``mx.quantized_matmul`` products and
    the ``mlx.nn`` activation ``ACT`` names (``nn.silu``: what mlx-lm's ``swiglu`` computes;
    ``nn.gelu``, ``nn.gelu_approx``: Gemma's GeGLU)."""
    h, normed = stock_normed(x, w if HAS_W else None, float_from_bits(EPS), residual if RESID else None)
    g = quantized_product(normed, (gate, gate_scales, gate_biases), GS, BITS)
    u = quantized_product(normed, (up, up_scales, up_biases), GS, BITS)
    return [h if RESID else mx.zeros((1,), x.dtype), _stock_activation(ACT)(g) * u]


QUANTIZED_NORM_PROJECTIONS = Kernel(
    "gk_quantized_norm_projections",
    input_names=["x", "residual", "w", "w0", "scales0", "biases0", "w1", "scales1", "biases1", "w2",
                 "scales2", "biases2"],
    output_names=["h", "y0", "y1", "y2"],
    metal=_METAL_PROJECTIONS,
    cuda=_CUDA_PROJECTIONS,
    header=dual_header(RMS_SCALE_CUDA + QUANTIZED_CUDA, QUANTIZED_METAL, body=_CUDA_PROJECTIONS),
    reference=quantized_norm_projections_reference,
)



def _gated_kernel(name: str) -> Kernel:
    """A quantized gated kernel named ``name``: the one gated source, its activation the ``ACT``
    template value."""
    return Kernel(
        name,
        input_names=["x", "residual", "w", "gate", "gate_scales", "gate_biases", "up", "up_scales",
                     "up_biases"],
        output_names=["h", "out"],
        metal=_METAL_GATED,
        cuda=_CUDA_GATED,
        header=dual_header(RMS_SCALE_CUDA + QUANTIZED_CUDA + ACTIVATION_CUDA,
                           QUANTIZED_METAL + ACTIVATION_METAL, body=_CUDA_GATED),
        reference=quantized_norm_gated_reference,
    )


QUANTIZED_NORM_SWIGLU = _gated_kernel("gk_quantized_norm_swiglu")
QUANTIZED_NORM_GEGLU = _gated_kernel("gk_quantized_norm_geglu")


@memoized("plan parts", maxsize=256)
def _with_shared(kernel: Kernel, nbytes: int) -> Kernel:
    """``kernel`` with ``nbytes`` of dynamic shared memory (one MLX kernel object per size)."""
    return dataclasses.replace(kernel, shared_memory=nbytes)


# ----------------------------------------------------------------------------- plans


def shared_parts(rows: int, k: int, group_size: int, dtype: mx.Dtype) -> tuple[dict[str, int], int]:
    """(threadgroup arrays -> bytes, the limit they must fit) of ``rows`` normalized rows of ``k``:
    CUDA's float32 rows and group sums in dynamic shared memory, or Metal's rows in ``dtype`` and its
    reduction scratch."""
    if threadgroup_backend() == "cuda":
        return {"normalized rows and group sums": _cuda_row_bytes(rows, k, group_size)}, CUDA_SHARED_BYTES
    return {"normalized rows": rows * k * dtype.size, "reduction": 32 * 4}, THREADGROUP_MEMORY["metal"]


def _cuda_row_bytes(rows: int, k: int, group_size: int) -> int:
    return 4 * rows * (k + k // max(group_size, 1))


def with_row_memory(kernel: Kernel, rows: int, k: int, group_size: int) -> Kernel:
    """``kernel`` with the dynamic shared memory its CUDA launch keeps ``rows`` rows of ``k`` in (as
    float32, with their groups' sums)."""
    return _with_shared(kernel, _cuda_row_bytes(rows, k, group_size))


def quantized_projections_fit(x: mx.array, group_size: int = 64) -> bool:
    """Whether rows like ``x``'s (``(..., K)``) fit one launch: ``M = x.size / K`` rows, at most
    ``MAX_ROWS``, whose normalized copies fit the active backend's shared (threadgroup) memory."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    parts, limit = shared_parts(rows, k, group_size, x.dtype)
    return 0 < rows <= MAX_ROWS and sum(parts.values()) <= limit


def check_quantization(op: str, group_size: Any, bits: Any, k: int) -> None:
    if isinstance(bits, bool) or bits not in QUANTIZED_BITS:
        raise KernelError(op, f"bits is {bits!r}; the kernel reads affine quantization of "
                          f"{QUANTIZED_BITS} bits", Status.INVALID_INPUT)
    if isinstance(group_size, bool) or group_size not in QUANTIZED_GROUP_SIZES:
        raise KernelError(op, f"group_size is {group_size!r}; the kernel reads groups of "
                          f"{QUANTIZED_GROUP_SIZES}", Status.INVALID_INPUT)
    if k % group_size:
        raise KernelError(op, f"x's last dimension {k} is not a multiple of group_size {group_size}",
                          Status.INVALID_INPUT)


def check_quantized_weight(op: str, name: str, weight: Any, x: mx.array, group_size: int,
                  bits: int) -> QuantizedWeight:
    """``weight`` as a checked QuantizedWeight for rows like x's."""
    if not isinstance(weight, (tuple, list)) or len(weight) != 3:
        raise KernelError(op, f"{name} must be a (weight, scales, biases) triple, got {weight!r:.80}",
                          Status.INVALID_INPUT)
    w, scales, biases = weight
    k = x.shape[-1]
    for part, value in (("weight", w), ("scales", scales), ("biases", biases)):
        if not isinstance(value, mx.array):
            raise KernelError(op, f"{name}'s {part} must be an mx.array, got {type(value).__name__}",
                              Status.INVALID_INPUT)
    if w.dtype != mx.uint32 or w.ndim != 2 or w.shape[1] != k * bits // 32 or w.shape[0] == 0:
        raise KernelError(op, f"{name}'s weight is {tuple(w.shape)} {dtype_name(w.dtype)}; expected uint32 "
                          f"(N, {k * bits // 32}) for {k} inputs of {bits} bits", Status.INVALID_INPUT)
    groups = (w.shape[0], k // group_size)
    for part, value in (("scales", scales), ("biases", biases)):
        if value.shape != groups:
            raise KernelError(op, f"{name}'s {part} have shape {tuple(value.shape)}; expected {groups} "
                              f"(groups of {group_size})", Status.INVALID_INPUT)
        if value.dtype != x.dtype:
            raise KernelError(op, f"dtype mismatch: {name}'s {part} are {dtype_name(value.dtype)} but x is "
                              f"{dtype_name(x.dtype)}", Status.INVALID_INPUT)
    return QuantizedWeight(w, scales, biases)


class Rotation(NamedTuple):
    """What a launch that also rotates its first two products (queries and keys) adds to
    :func:`plan_quantized_rows`: the head counts and size, its RoPE template values, its offset and
    frequency inputs (and any more its kernel takes after them)."""

    heads: int
    kv_heads: int
    head_dim: int
    dims: int
    template: tuple[Any, ...]
    inputs: tuple[mx.array, ...]


def plan_quantized_rows(op: str, kernel: Kernel, x: mx.array, residual: mx.array | None,
                        weight: mx.array | None, eps: float, matrices: Sequence[Any], names: Sequence[str],
                        gated: bool, group_size: int, bits: int, rotation: Rotation | None = None,
                        act: int = 0) -> Plan:
    """A launch of ``kernel``: one output per matrix (``gated``: one output, gate and up together,
    gated by ``ACTIVATIONS[act]``; ``rotation``: queries and keys rotated, in attention's layouts)."""
    check_dtype(op, x)
    check_quantization(op, group_size, bits, x.shape[-1])
    rows = norm_rows(op, x, residual, weight, lambda m, k: shared_parts(m, k, group_size, x.dtype))
    checked = [check_quantized_weight(op, name, m, x, group_size, bits) for name, m in zip(names, matrices)]
    if gated and checked[1].weight.shape != checked[0].weight.shape:
        raise KernelError(op, f"{names[1]} has shape {tuple(checked[1].weight.shape)} but {names[0]} has "
                          f"{tuple(checked[0].weight.shape)}", Status.INVALID_INPUT)
    out_rows = [checked[0].weight.shape[0]] if gated else [m.weight.shape[0] for m in checked]
    pad = 0 if gated else 3 - len(checked)  # absent weights and outputs: one-element stand-ins
    specs = row_output_specs(x, rows.h, out_rows, pad)
    stand_in = (unused_input(mx.uint32), rows.unused, rows.unused)
    inputs = (*rows.inputs, *(a for m in checked for a in m), *stand_in * pad)
    m, k = rows.rows, rows.k
    # two products a warp (gated, or a rotated pair) take twice the registers: 8 warps a block
    block = BLOCK if m <= 2 or gated or rotation is not None else WIDE_BLOCK
    template = (*norm_rows_template(op, x, rows, block, residual, weight, eps), template_arg("BITS", bits),
                template_arg("GS", group_size),
                template_arg("ACT", act) if gated else template_arg("NW", len(checked)))
    warps = sum(out_rows)
    if rotation is not None:
        specs, warps = _rotated_specs(op, x, specs, out_rows, rotation)
        inputs += rotation.inputs
        template += (*rotation.template, template_arg("D", rotation.head_dim), template_arg("L", x.shape[1]))
    blocks = -(-warps // (block // 32))
    if runs_on_cuda():
        kernel = with_row_memory(kernel, m, k, group_size)
    return Plan(kernel, inputs, specs, (blocks * block, 1, 1), (block, 1, 1), template)


def _rotated_specs(op: str, x: mx.array, specs: tuple[Any, ...], out_rows: list[int],
                   rotation: Rotation) -> tuple[tuple[Any, ...], int]:
    """The output specs of a rotating launch (queries ``(B, L, heads, D)``, keys ``(B, kv_heads,
    L, D)``) and its warps: one for two features (a rotated pair, two features past ``dims``, two
    rows of values)."""
    d, heads, kv_heads = rotation.head_dim, rotation.heads, rotation.kv_heads
    if out_rows[1] != kv_heads * d:  # x's rank, the three projections and heads * D: checked with rotation
        raise KernelError(op, f"the query and key projections have {out_rows[0]} and {out_rows[1]} rows; "
                          f"expected heads * D = {heads * d} and kv_heads * D = {kv_heads * d}",
                          Status.INVALID_INPUT)
    b, length = x.shape[:2]
    specs = (specs[0], output_spec((b, length, heads, d), x.dtype),
             output_spec((b, kv_heads, length, d), x.dtype), specs[3])
    return specs, ((heads + kv_heads) * d + out_rows[2]) // 2


def random_quantized(n: int, k: int, dtype: mx.Dtype, key: mx.array, group_size: int = 64, bits: int = 4,
                     gain: float = 1.0) -> QuantizedWeight:
    """A random ``(n, k)`` weight of ``dtype``, quantized as ``nn.quantize`` would."""
    dense = (gain * mx.random.normal((n, k), key=key) / k**0.5).astype(dtype)
    w, scales, biases = mx.quantize(dense, group_size=group_size, bits=bits)
    return QuantizedWeight(w, scales, biases)


def quantized_case(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, *, gated: bool, group_size: int = 64,
                   bits: int = 4, approx: bool | None = None) -> Case:
    """Arguments for one call: ``gated`` ones for :func:`quantized_norm_swiglu` (gate and up of 80
    rows; with ``approx`` given, for :func:`quantized_norm_geglu`), else for
    :func:`quantized_norm_projections` (three weights of 96, 32 and 32 rows)."""
    x, r, w, rest = random_rows(shape, dtype, key)
    k = shape[-1]
    options: dict[str, Any] = {"eps": 1e-5, "residual": r, "group_size": group_size, "bits": bits}
    if approx is not None:
        options["approx"] = approx
    if gated:
        kg, ku = mx.random.split(rest)
        gate = random_quantized(80, k, dtype, kg, group_size, bits, gain=2.0)
        return Case((x, w, gate, random_quantized(80, k, dtype, ku, group_size, bits)), options)
    mats = [random_quantized(n, k, dtype, kk, group_size, bits)
            for n, kk in zip((96, 32, 32), mx.random.split(rest, 3))]
    return Case((x, w, mats), options)


def _stock_projections(x: mx.array, weight: mx.array | None, projections: Sequence[Any], eps: float = 1e-5,
                       residual: mx.array | None = None, *, group_size: int = 64,
                       bits: int = 4) -> tuple[mx.array, ...]:
    h, normed = stock_normed(x, weight, eps, residual)
    outputs = tuple(quantized_product(normed, m, group_size, bits) for m in projections)
    return outputs if residual is None else (h, *outputs)


def _stock_swiglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                  residual: mx.array | None = None, *, group_size: int = 64,
                  bits: int = 4) -> mx.array | tuple[mx.array, mx.array]:
    import mlx.nn as nn

    h, normed = stock_normed(x, weight, eps, residual)
    out = nn.silu(quantized_product(normed, gate, group_size, bits)) * quantized_product(
        normed, up, group_size, bits)
    return out if residual is None else (h, out)


def _stock_geglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                 residual: mx.array | None = None, *, group_size: int = 64, bits: int = 4,
                 approx: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    import mlx.nn as nn

    h, normed = stock_normed(x, weight, eps, residual)
    gelu = nn.gelu_approx if approx else nn.gelu
    out = gelu(quantized_product(normed, gate, group_size, bits)) * quantized_product(
        normed, up, group_size, bits)
    return out if residual is None else (h, out)


# ----------------------------------------------------------------------------- declarations


@declare(QUANTIZED_NORM_PROJECTIONS, stock=_stock_projections,
         make_inputs=functools.partial(quantized_case, gated=False), shapes=DECODING_SHAPES,
         last_dim_multiple=64,
         description="residual add + RMSNorm + up to 3 affine-quantized projections (4-bit, group 64), "
                     "for up to 8 rows (decoding)")
def plan_quantized_norm_projections(x: mx.array, weight: mx.array | None, projections: Sequence[Any],
                                    eps: float = 1e-5, residual: mx.array | None = None, *,
                                    group_size: int = 64, bits: int = 4) -> Plan:
    """The launch :func:`quantized_norm_projections` makes (validated)."""
    op = "quantized_norm_projections"
    if not isinstance(projections, (list, tuple)) or not 1 <= len(projections) <= 3:
        raise KernelError(op, f"projections must be a list of 1 to 3 (weight, scales, biases) triples, got "
                          f"{projections!r:.80}", Status.INVALID_INPUT)
    names = [f"projections[{i}]" for i in range(len(projections))]
    return plan_quantized_rows(op, QUANTIZED_NORM_PROJECTIONS, x, residual, weight, eps, projections, names,
                               False, group_size, bits)


@plan_quantized_norm_projections.layer
def quantized_norm_projections(x: mx.array, weight: mx.array | None, projections: Sequence[Any],
                               eps: float = 1e-5, residual: mx.array | None = None, *,
                               group_size: int = 64, bits: int = 4) -> tuple[mx.array, ...]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and its product with each of
    1 to 3 affine-quantized weights, ``(weight, scales, biases)`` as ``nn.QuantizedLinear`` holds
    them (``mx.quantized_matmul(n, ..., transpose=True, group_size, bits)``), in one launch, for up
    to ``MAX_ROWS`` rows of ``x`` (``(..., K)``). Returns the products, after ``h = x + residual``
    when a residual is given: what a quantized block's input norm and its query, key and value
    projections compute.

    >>> w, scales, biases = mx.quantize(mx.ones((2, 64)), group_size=64, bits=4)
    >>> (q,) = quantized_norm_projections(mx.ones((1, 64)), None, [(w, scales, biases)], eps=0.0)
    >>> q.tolist()
    [[64.0, 64.0]]
    """
    outputs = plan_quantized_norm_projections.launch(x, weight, projections, eps, residual, group_size, bits)
    found = outputs[1:1 + len(projections)]
    return (outputs[0], *found) if residual is not None else tuple(found)


#: check()'s 16-bit tolerances for the gated kernel. It keeps the normalized rows in float32 where
#: the reference (stock MLX) rounds them to x's dtype first, so each product differs by about an ulp
#: of the products' scale, not of its own value, and the gating multiplies two such products: an
#: absolute error of an ulp at the outputs' scale (tens), and relative ones large near zero.
GATED_TOLERANCES = {mx.float16: (1.6e-2, 2e-3), mx.bfloat16: (1.25e-1, 1.6e-2)}


@declare(QUANTIZED_NORM_SWIGLU, stock=_stock_swiglu,
         make_inputs=functools.partial(quantized_case, gated=True), shapes=DECODING_SHAPES,
         last_dim_multiple=64, tolerances=GATED_TOLERANCES,
         description="residual add + RMSNorm + affine-quantized SwiGLU gate/up projections (4-bit, "
                     "group 64), for up to 8 rows (decoding)")
def plan_quantized_norm_swiglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                               residual: mx.array | None = None, *, group_size: int = 64,
                               bits: int = 4) -> Plan:
    """The launch :func:`quantized_norm_swiglu` makes (validated)."""
    return plan_quantized_rows("quantized_norm_swiglu", QUANTIZED_NORM_SWIGLU, x, residual, weight, eps,
                               (gate, up), ("gate", "up"), True, group_size, bits)


@plan_quantized_norm_swiglu.layer
def quantized_norm_swiglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                          residual: mx.array | None = None, *, group_size: int = 64,
                          bits: int = 4) -> mx.array | tuple[mx.array, mx.array]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``silu(n @ gate) *
    (n @ up)`` for affine-quantized ``gate`` and ``up`` (``(weight, scales, biases)`` each), in one
    launch, for up to ``MAX_ROWS`` rows: a quantized SwiGLU feed-forward's input side. Returns it,
    or ``(h, it)`` with ``h = x + residual`` when a residual is given.

    >>> w, scales, biases = mx.quantize(mx.full((2, 64), 0.5), group_size=64, bits=8)
    >>> gate = up = (w, scales, biases)
    >>> out = quantized_norm_swiglu(mx.ones((1, 64)), None, gate, up, bits=8)
    >>> [round(v) for v in out[0].tolist()]
    [1024, 1024]
    """
    h, out = plan_quantized_norm_swiglu.launch(x, weight, gate, up, eps, residual, group_size, bits)
    return (h, out) if residual is not None else out


@declare(QUANTIZED_NORM_GEGLU, stock=_stock_geglu,
         make_inputs=functools.partial(quantized_case, gated=True, approx=False), shapes=DECODING_SHAPES,
         last_dim_multiple=64, tolerances=GATED_TOLERANCES,
         description="residual add + RMSNorm + affine-quantized GeGLU gate/up projections (exact GELU; "
                     "4-bit, group 64), for up to 8 rows (decoding)")
def plan_quantized_norm_geglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                              residual: mx.array | None = None, *, group_size: int = 64, bits: int = 4,
                              approx: bool = False) -> Plan:
    """The launch :func:`quantized_norm_geglu` makes (validated)."""
    return plan_quantized_rows("quantized_norm_geglu", QUANTIZED_NORM_GEGLU, x, residual, weight, eps,
                               (gate, up), ("gate", "up"), True, group_size, bits, act=geglu_act(approx))


@plan_quantized_norm_geglu.layer
def quantized_norm_geglu(x: mx.array, weight: mx.array | None, gate: Any, up: Any, eps: float = 1e-5,
                         residual: mx.array | None = None, *, group_size: int = 64, bits: int = 4,
                         approx: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``gelu(n @ gate) *
    (n @ up)`` for affine-quantized ``gate`` and ``up`` (``(weight, scales, biases)`` each), in one
    launch, for up to ``MAX_ROWS`` rows: a quantized GeGLU feed-forward's input side, with
    ``nn.gelu`` or, with ``approx=True``, ``nn.gelu_approx`` (Gemma 2's and 3's). Returns it, or
    ``(h, it)`` with ``h = x + residual`` when a residual is given.

    >>> gate = mx.quantize(mx.full((2, 64), -0.03125), group_size=64, bits=8)   # n @ gate: -2
    >>> up = mx.quantize(mx.full((2, 64), 0.03125), group_size=64, bits=8)      # n @ up: 2
    >>> out = quantized_norm_geglu(mx.ones((1, 64)), None, gate, up, bits=8)
    >>> [round(v, 4) for v in out[0].tolist()]
    [-0.091, -0.091]
    >>> out = quantized_norm_geglu(mx.ones((1, 64)), None, gate, up, bits=8, approx=True)
    >>> [round(v, 4) for v in out[0].tolist()]
    [-0.0908, -0.0908]
    """
    h, out = plan_quantized_norm_geglu.launch(x, weight, gate, up, eps, residual, group_size, bits,
                                              bool(approx))
    return (h, out) if residual is not None else out


plan_quantized_norm_geglu.variant(
    "quantized_norm_geglu_approx", make_inputs=functools.partial(quantized_case, gated=True, approx=True),
    description="residual add + RMSNorm + affine-quantized GeGLU gate/up projections (tanh GELU; 4-bit, "
                "group 64), for up to 8 rows (decoding)")
