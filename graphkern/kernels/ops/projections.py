"""RMSNorm feeding the projections after it, for a few tokens at a time: one launch for
``rms_norm(x + residual) @ W.T`` over up to three weights (a block's query, key and value
projections), or for ``act(n @ Wg.T) * (n @ Wu.T)`` (its gated feed-forward's gate and up:
``silu`` for SwiGLU, ``gelu`` or its tanh form for GeGLU).

Decoding feeds a handful of token rows (``M = x.size / K``) through each layer, and then every
launch costs the host more than the GPU spends on it. Stock MLX makes an add, a norm and three
matrix-vector products (or two and the gating) as separate launches; here one launch does it, the
weights read once, each warp reducing one weight row (a gated one, a gate row and an up row; on
CUDA at one token row, two rows of a projection where every projection's rows pair up) against the
token rows, for ``M <= MAX_ROWS`` rows within the backend's threadgroup memory.

The norm is linear in its scale, ``rms_norm(h) . W = inv * sum(h * w * W)``, so the kernels take
the normalized rows in float32 and never round them to the dtype; each output rounds once (stock
rounds the normalized rows too, an ulp apart). On CUDA, for one token row (``STREAM_ROWS``), each warp
forms ``h = x + residual`` and its sum of squares as it streams its weights, with no prologue before
its first weight load, as MLX's own ``gemv`` starts; more rows are staged in shared memory once a
block (block 0 also writes ``h``). The products round to the dtype as MLX's do before the gating,
which runs in float32. The SwiGLU and GeGLU kernels share one source, whose ``ACT`` template value
picks the activation (:data:`ACTIVATIONS`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import THREADGROUP_MEMORY, Case, Plan, template_arg, threadgroup_backend
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.norm_rows import (
    CUDA_PREFETCH,
    CUDA_TOKEN_ROW,
    MAX_ROWS,
    METAL_STAGE_ROW,
    norm_rows,
    norm_rows_template,
    random_rows,
    row_output_specs,
    stock_normed,
)
from graphkern.kernels.ops.gelu import GELU_CUDA, GELU_METAL, gelu_float32
from graphkern.nodes import Kernel, KernelError, Status, dtype_name, float_from_bits

__all__ = ["ACTIVATIONS", "ACTIVATION_CUDA", "ACTIVATION_METAL", "DECODING_SHAPES", "NORM_GEGLU",
           "NORM_PROJECTIONS", "NORM_SWIGLU", "activation_float32", "geglu_act", "norm_geglu",
           "norm_projections", "norm_swiglu", "plan_norm_geglu", "plan_norm_projections", "plan_norm_swiglu",
           "projections_fit"]

#: The gated kernels' activations, by their ``ACT`` template value: SiLU (SwiGLU), exact GELU
#: (``nn.gelu``: Gemma's GeGLU) and the tanh GELU (``nn.gelu_approx``: Gemma 2's and 3's).
ACTIVATIONS = ("silu", "gelu", "gelu_approx")

#: ``gk::activation<ACT, T>(g)``: the gating's activation of a float32 product, for the gated
#: kernels of both weight kinds; the GELUs are the ``gelu`` kernel's own device functions (its 16-bit
#: erf for a 16-bit T).
ACTIVATION_CUDA = GELU_CUDA + r"""
namespace gk {
template <int ACT, typename T>
__device__ __forceinline__ float activation(float g) {
  if constexpr (ACT == 0) {
    return g * (1.0f / (1.0f + expf(-g)));
  } else {
    return gelu<ACT == 2, (sizeof(T) < 4)>(g);
  }
}
}  // namespace gk
"""

ACTIVATION_METAL = GELU_METAL + r"""
namespace gk {
template <int ACT>
inline float activation(float g) {
  if (ACT == 0) {
    return g * (1.0f / (1.0f + metal::precise::exp(-g)));
  }
  return gelu<ACT == 2>(g);
}
}  // namespace gk
"""


def activation_float32(g: mx.array, act: int) -> mx.array:
    """``ACTIVATIONS[act]`` of ``g`` in float32, as the gated kernels compute it.

    >>> [round(v, 4) for v in activation_float32(mx.array([1.0]), 0).tolist()]
    [0.7311]
    """
    gf = g.astype(mx.float32)
    return gf * mx.sigmoid(gf) if act == 0 else gelu_float32(gf, approx=act == 2)


def geglu_act(approx: bool) -> int:
    """The ``ACT`` value of a GeGLU kernel: 2 for the tanh GELU (``approx``), else 1."""
    return 2 if approx else 1


#: Threads a block, one weight row a warp: 8 warps, or 16 for more than 2 rows, where normalizing
#: the rows (which each block does) costs more and fewer blocks do it.
BLOCK = 256
WIDE_BLOCK = 512

#: The most token rows the streaming form takes: past it, each warp's reads of the token rows (from
#: L1, every warp of a block reading them all) cost more than one staging a block into shared memory
#: (two rows measured slower streamed than staged on an H100: benchmarks/RESULTS_kernels.md).
STREAM_ROWS = 1

#: Steps of the CUDA weight loop written together, their weight loads ahead of their uses (ptxas
#: may still place each load next to its use: what a warp has in flight is mostly its rows).
UNROLL = 4

_CUDA = f"""
namespace gk {{

constexpr int STREAM_ROWS = {STREAM_ROWS};
constexpr int UNROLL = {UNROLL};
""" + r"""
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// V weights at p + i, read past L1: each is read once, while the token rows, which every warp
// rereads, stay there.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> stream_load(const T* p, long long i) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(Vec<T, V>) == 16) {
    uint4 b;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w)
                 : "l"(p + i));
    return *reinterpret_cast<const Vec<T, V>*>(&b);
  }
#endif
  return load_vec<T, V>(p + i);
}

// The norm's product, unrounded: a row of W against the M token rows h (the rows of xs), each
// rms_norm(h) . W = inv * sum_k W[k] * h[k] * w[k] with inv = rsqrt(mean(h^2) + eps). The rows are
// normalized in float32 and never rounded to T, so each output rounds once.

// The M rows of h = T(x + r) into xs (block 0 writing them to h) and each row's scale into inv.
// Every thread of the block takes part; red holds M * NT / 32 floats.
template <typename T, int M, int K, int V, int NT, bool RESID>
__device__ __forceinline__ void stage_rows(const T* x, const T* r, T* h, T* xs, float eps, float* red,
                                           float* inv) {
  constexpr int WARPS = NT / 32;
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
      }
      store<T, V>(xs + m * K, i, v);
    }
    ss[m] = warp_sum(ss[m]);
  }
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      red[m * WARPS + threadIdx.x / 32] = ss[m];
    }
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      total += red[threadIdx.x * WARPS + i];
    }
    inv[threadIdx.x] = rsqrtf(total / K + eps);
  }
  __syncthreads();
}

// One step of normed_dot at feature k: the weight vectors wv (loaded) against the token rows' V
// features there, accumulated into acc, and (streaming) their squares into ss.
template <typename T, int M, int K, int V, int NR, bool RESID, bool HAS_W>
__device__ __forceinline__ void normed_step(int k, const Vec<T, V> (&wq)[NR], const T* xs, const T* x,
                                            const T* r, const T* w, float (&ss)[M],
                                            float (&acc)[NR][M]) {
  float wv[NR][V];
#pragma unroll
  for (int n = 0; n < NR; ++n) {
    unpack<T, V>(wq[n], wv[n]);
  }
  float nw[V];
  if constexpr (HAS_W) {
    load<T, V>(w, k, nw);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v[V];
    if constexpr (M <= STREAM_ROWS) {
      token_row<T, V, RESID>(x + m * K, r + m * K, nullptr, k, v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        ss[m] += v[j] * v[j];
      }
    } else {
      load<T, V>(xs + m * K, k, v);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float s = HAS_W ? v[j] * nw[j] : v[j];
#pragma unroll
      for (int n = 0; n < NR; ++n) {
        acc[n][m] += wv[n][j] * s;
      }
    }
  }
}

// acc[n][m] = rms_norm(h_m) . rows[n] for NR weight rows, this warp's lanes V elements at a time,
// summed over the warp. h_m: row m of xs (staged) or, up to STREAM_ROWS rows, T(x + r) formed here from the
// token rows (every warp of a block reads the same ones, from L1), its scale from its sum of squares
// taken in the same pass (the warp given h writes the rows to it afterwards). The latter, the streaming form,
// has no prologue: a warp's weights stream from its first instruction, as gemv's do.
template <typename T, int M, int K, int V, int NR, bool RESID, bool HAS_W>
__device__ __forceinline__ void normed_dot(const T* const (&rows)[NR], const T* xs, const float* inv,
                                           const T* x, const T* r, const T* w, T* h, float eps,
                                           float (&acc)[NR][M]) {
  const int lane = threadIdx.x & 31;
  constexpr bool stream = M <= STREAM_ROWS;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.0f;
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      acc[n][m] = 0.0f;
    }
  }
  // Every lane takes FULL steps of 32 * V features, UNROLL at a time with their weight loads
  // written first (no branch between them), then the rest one at a time (and one more where K
  // leaves a partial step).
  constexpr int STEP = 32 * V;
  constexpr int FULL = K / STEP;
  int it = 0;
  for (; it + UNROLL <= FULL; it += UNROLL) {
    Vec<T, V> wq[UNROLL][NR];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int n = 0; n < NR; ++n) {
        wq[u][n] = stream_load<T, V>(rows[n], lane * V + (it + u) * STEP);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      normed_step<T, M, K, V, NR, RESID, HAS_W>(lane * V + (it + u) * STEP, wq[u], xs, x, r, w, ss, acc);
    }
  }
  for (int k = lane * V + it * STEP; k < K; k += STEP) {
    Vec<T, V> wq[NR];
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      wq[n] = stream_load<T, V>(rows[n], k);
    }
    normed_step<T, M, K, V, NR, RESID, HAS_W>(k, wq, xs, x, r, w, ss, acc);
  }
  if constexpr (stream && RESID) {
    // The launch's one writer of h = T(x + r) writes it in a pass of its own: a store in the loop
    // above would keep the compiler from issuing a weight load before the store ahead of it, so
    // each warp would have one weight vector in flight instead of one an unrolled iteration.
    if (h != nullptr) {
      for (int k = lane * V; k < K; k += 32 * V) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float v[V];
          token_row<T, V, RESID>(x + m * K, r + m * K, h + m * K, k, v);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float scale;
    if constexpr (stream) {
      scale = rsqrtf(warp_sum(ss[m]) / K + eps);
    } else {
      scale = inv[m];
    }
#pragma unroll
    for (int n = 0; n < NR; ++n) {
      acc[n][m] = warp_sum(acc[n][m]) * scale;
    }
  }
}

}  // namespace gk
"""

# Every body's opening: this warp's row of the weights stacked, and the norm's epsilon.
_CUDA_ROW = r"""
  const float eps = __int_as_float(EPS);
  const int row = blockIdx.x * (NT / 32) + threadIdx.x / 32;"""


def _cuda_body(opening: str, aligned: str, write: str) -> str:
    """A body: ``opening`` names this warp's ``NR`` weight ``rows`` (pointers) and whether it has
    any (``has_row``); the warp reduces them against the normalized token rows and ``write`` stores
    ``acc`` (``float[NR][M]``). V-wide where the ``aligned`` pointers are, else one element at a time.
    Up to ``STREAM_ROWS`` token rows take the streaming form; more are staged into shared memory
    once a block, while each warp asks L2 for its weight rows."""
    work = r"""
      if (has_row) {
        float acc[NR][M];
        gk::normed_dot<T, M, K, VA, NR, RESID, HAS_W>(rows, xs, inv, x, residual, w, h_out, eps,
                                                      acc);""" + write + r"""
      }"""

    def widths(stage: str) -> str:
        return (f"\n    if ({aligned}) {{\n      constexpr int VA = V;" + stage + work
                + "\n    } else {\n      constexpr int VA = 1;" + stage + work + "\n    }")

    return (_CUDA_ROW + opening + r"""
  if constexpr (M <= gk::STREAM_ROWS) {
    const T* const xs = nullptr;
    const float* const inv = nullptr;
    T* const h_out = RESID && row == 0 ? h : nullptr;""" + widths("") + r"""
  } else {
    __shared__ float red[M * (NT / 32)];
    __shared__ float inv[M];
    __shared__ __align__(16) unsigned char xs_bytes[M * K * sizeof(T)];
    T* const xs = reinterpret_cast<T*>(xs_bytes);
    T* const h_out = nullptr;
    if (has_row) {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        gk::prefetch_l2(rows[i], K * sizeof(T));
      }
    }""" + widths(r"""
      gk::stage_rows<T, M, K, VA, NT, RESID>(x, residual, h, xs, eps, red, inv);""") + "\n  }\n")


# This warp's weight rows: the row-th of the three weights stacked (absent ones have no rows), or
# with PAIRED (every weight of an even count of rows) that pair of rows, both of one weight.
_CUDA_PICK = r"""
  const int n0 = w0_shape[0];
  const int n1 = NW > 1 ? w1_shape[0] : 0;
  const int n2 = NW > 2 ? w2_shape[0] : 0;
  constexpr int NR = PAIRED ? 2 : 1;
  const int first = row * NR;
  const int pick = first < n0 ? 0 : first < n0 + n1 ? 1 : first < n0 + n1 + n2 ? 2 : 3;
  const bool has_row = pick < 3;
  const int r = first - (pick > 0 ? n0 : 0) - (pick > 1 ? n1 : 0);
  const int n = pick == 0 ? n0 : pick == 1 ? n1 : n2;
  T* const y = pick == 0 ? y0 : pick == 1 ? y1 : y2;
  const T* const pb = pick == 0 ? pb0 : pick == 1 ? pb1 : pb2;  // its bias (HAS_BIAS)
  const T* rows[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    rows[i] = (pick == 0 ? w0 : pick == 1 ? w1 : w2) + static_cast<long long>(r + i) * K;
  }"""

_CUDA_PROJECTIONS = _cuda_body(
    _CUDA_PICK,
    "gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(w) && gk::aligned<V>(h) && "
    "gk::aligned<V>(w0) && gk::aligned<V>(w1) && gk::aligned<V>(w2)", r"""
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
          for (int i = 0; i < NR; ++i) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
              float v = acc[i][m];
              if constexpr (HAS_BIAS) {  // nn.Linear's bias: on the product rounded, rounded again
                v = gk::round_to<T>(gk::round_to<T>(v) + static_cast<float>(pb[r + i]));
              }
              y[static_cast<long long>(m) * n + r + i] = static_cast<T>(v);
            }
          }
        }""")

# The gated body, of SwiGLU and GeGLU alike: ACT picks the activation of the rounded gate product.
_CUDA_GATED = _cuda_body(r"""
  const int n = gate_shape[0];
  const bool has_row = row < n;
  constexpr int NR = 2;
  const long long at = static_cast<long long>(row) * K;
  const T* const rows[NR] = {gate + at, up + at};""",
    "gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(w) && gk::aligned<V>(h) && "
    "gk::aligned<V>(gate) && gk::aligned<V>(up)", r"""
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float g = gk::round_to<T>(acc[0][m]);
            out[static_cast<long long>(m) * n + row] =
                static_cast<T>(gk::activation<ACT, T>(g) * gk::round_to<T>(acc[1][m]));
          }
        }""")

_METAL = r"""
namespace gk {
""" + METAL_STAGE_ROW + r"""
// The M rows of h = T(x + r) into xs (block 0 writing them to h) and each row's norm scale
// rsqrt(mean(h^2) + eps) into inv.
template <typename T, int M, int K, int NT, bool RESID, typename PX, typename PR, typename PH>
inline void stage_rows(PX x, PR r, PH h, threadgroup T* xs, threadgroup float* inv, float eps, uint tid,
                       uint lane, uint sg, uint block, threadgroup float* red) {
  for (int m = 0; m < M; ++m) {
    const float ss = stage_row<T, K, NT, RESID>(x, r, h, xs, m, tid, block);
    const float total = block_reduce<NT>(ss, red, lane, sg, Sum());
    if (tid == 0) {
      inv[m] = metal::precise::rsqrt(total / K + eps);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// acc[m] = rms_norm(h_m) . row = inv[m] * sum_k row[k] * h_m[k] * w[k], in float32, unrounded.
template <typename T, int M, int K, bool HAS_W, typename PR, typename PW>
inline void normed_dot(PR row, PW w, threadgroup const T* xs, threadgroup const float* inv, uint lane,
                       thread float (&acc)[M]) {
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
  for (int k = lane; k < K; k += 32) {
    const float wv = static_cast<float>(row[k]);
    const float nw = HAS_W ? static_cast<float>(w[k]) : 1.0f;
    for (int m = 0; m < M; ++m) {
      acc[m] += wv * (static_cast<float>(xs[m * K + k]) * nw);
    }
  }
  for (int m = 0; m < M; ++m) {
    acc[m] = metal::simd_sum(acc[m]) * inv[m];
  }
}

}  // namespace gk
"""

_METAL_START = r"""
  threadgroup float red[32];
  threadgroup float inv[M];
  threadgroup T xs[M * K];
  const uint lane = thread_index_in_simdgroup;
  gk::stage_rows<T, M, K, NT, RESID>(x, residual, h, xs, inv, as_type<float>(EPS),
      thread_position_in_threadgroup.x, lane, simdgroup_index_in_threadgroup,
      threadgroup_position_in_grid.x, red);
  const int row = threadgroup_position_in_grid.x * (NT / 32) + simdgroup_index_in_threadgroup;
  float acc[M];"""

_METAL_PROJECTIONS = _METAL_START + r"""
  const int n0 = w0_shape[0];
  const int n1 = NW > 1 ? w1_shape[0] : 0;
  const int n2 = NW > 2 ? w2_shape[0] : 0;
  int r = row;
  int n = n0;
  if (row < n0) {
    gk::normed_dot<T, M, K, HAS_W>(w0 + size_t(r) * K, w, xs, inv, lane, acc);
  } else if (row < n0 + n1) {
    r = row - n0;
    n = n1;
    gk::normed_dot<T, M, K, HAS_W>(w1 + size_t(r) * K, w, xs, inv, lane, acc);
  } else if (row < n0 + n1 + n2) {
    r = row - n0 - n1;
    n = n2;
    gk::normed_dot<T, M, K, HAS_W>(w2 + size_t(r) * K, w, xs, inv, lane, acc);
  } else {
    return;
  }
  float bias = 0.0f;  // nn.Linear's bias (HAS_BIAS): on the product rounded, rounded again
  if (HAS_BIAS) {
    if (row < n0) bias = static_cast<float>(pb0[r]);
    else if (row < n0 + n1) bias = static_cast<float>(pb1[r]);
    else bias = static_cast<float>(pb2[r]);
  }
  if (lane == 0) {
    for (int m = 0; m < M; ++m) {
      const float v = HAS_BIAS ? gk::round_to<T>(gk::round_to<T>(acc[m]) + bias) : acc[m];
      if (row < n0) y0[size_t(m) * n + r] = static_cast<T>(v);
      else if (row < n0 + n1) y1[size_t(m) * n + r] = static_cast<T>(v);
      else y2[size_t(m) * n + r] = static_cast<T>(v);
    }
  }
"""

_METAL_GATED = _METAL_START + r"""
  const int n = gate_shape[0];
  if (row < n) {
    float u[M];
    gk::normed_dot<T, M, K, HAS_W>(gate + size_t(row) * K, w, xs, inv, lane, acc);
    gk::normed_dot<T, M, K, HAS_W>(up + size_t(row) * K, w, xs, inv, lane, u);
    if (lane == 0) {
      for (int m = 0; m < M; ++m) {
        const float g = gk::round_to<T>(acc[m]);
        out[size_t(m) * n + row] = static_cast<T>(gk::activation<ACT>(g) * gk::round_to<T>(u[m]));
      }
    }
  }
"""


def _product(normed: mx.array, weight: mx.array) -> mx.array:
    """``normed @ weight.T`` in float32 (``normed`` is), rounded once to the weight's dtype. MLX's CUDA
    backend multiplies float32 matrices of more than one row on TF32 tensor cores (errors near
    1e-3), so there the product runs on the CPU, whose float32 products are exact."""
    on_cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    product = mx.matmul(normed, weight.astype(mx.float32).T, stream=mx.cpu if on_cuda else None)
    return product.astype(weight.dtype)


def _normed(x: mx.array, residual: mx.array, w: mx.array, EPS: int, RESID: bool,
            HAS_W: bool) -> tuple[mx.array, mx.array]:
    """``h = x + residual`` (when RESID) and ``rms_norm(h)`` in float32, never rounded to the dtype:
    the rows the kernels' products take."""
    h = x + residual if RESID else x
    hf = h.astype(mx.float32)
    normed = hf * mx.rsqrt(mx.mean(mx.square(hf), axis=-1, keepdims=True) + float_from_bits(EPS))
    return h, normed * w.astype(mx.float32) if HAS_W else normed


def norm_projections_reference(x: mx.array, residual: mx.array, w: mx.array, w0: mx.array, w1: mx.array,
                               w2: mx.array, pb0: mx.array, pb1: mx.array, pb2: mx.array, *, EPS: int,
                               RESID: bool, HAS_W: bool, NW: int, HAS_BIAS: bool,
                               PAIRED: bool = False) -> list[mx.array]:
    """Pure-MLX ``h = x + residual`` (when RESID) and ``rms_norm(h) @ W.T`` for the NW weights, the
    norm and products in float32, each product rounded once, plus its bias as ``nn.Linear`` adds
    it (when HAS_BIAS); an absent output is a one-element zero. (``PAIRED``: how CUDA's warps
    take the rows, two a warp; the results are the same.)"""
    h, normed = _normed(x, residual, w, EPS, RESID, HAS_W)
    absent = mx.zeros((1,), x.dtype)
    outputs = [_product(normed, weight) if i < NW else absent for i, weight in enumerate((w0, w1, w2))]
    if HAS_BIAS:
        outputs = [o + b if i < NW else o for i, (o, b) in enumerate(zip(outputs, (pb0, pb1, pb2)))]
    return [h if RESID else absent, *outputs]


def norm_gated_reference(x: mx.array, residual: mx.array, w: mx.array, gate: mx.array, up: mx.array, *,
                         EPS: int, RESID: bool, HAS_W: bool, ACT: int) -> list[mx.array]:
    """Pure-MLX ``h`` and ``act(n @ gate.T) * (n @ up.T)``, ``act`` as ``ACT`` says (the norm in
    float32, products rounded to the dtype as MLX's are, gating in float32)."""
    h, normed = _normed(x, residual, w, EPS, RESID, HAS_W)
    g = activation_float32(_product(normed, gate), ACT)
    u = _product(normed, up).astype(mx.float32)
    return [h if RESID else mx.zeros((1,), x.dtype), (g * u).astype(x.dtype)]


NORM_PROJECTIONS = Kernel(
    "gk_norm_projections",
    input_names=["x", "residual", "w", "w0", "w1", "w2", "pb0", "pb1", "pb2"],
    output_names=["h", "y0", "y1", "y2"],
    metal=_METAL_PROJECTIONS,
    cuda=_CUDA_PROJECTIONS,
    header=dual_header(CUDA_PREFETCH + CUDA_TOKEN_ROW + _CUDA, _METAL, body=_CUDA_PROJECTIONS),
    reference=norm_projections_reference,
)



def _gated_kernel(name: str) -> Kernel:
    """A gated kernel named ``name``: the one gated source, its activation the ``ACT`` template value."""
    return Kernel(
        name,
        input_names=["x", "residual", "w", "gate", "up"],
        output_names=["h", "out"],
        metal=_METAL_GATED,
        cuda=_CUDA_GATED,
        header=dual_header(CUDA_PREFETCH + CUDA_TOKEN_ROW + _CUDA + ACTIVATION_CUDA,
                           _METAL + ACTIVATION_METAL, body=_CUDA_GATED),
        reference=norm_gated_reference,
    )


NORM_SWIGLU = _gated_kernel("gk_norm_swiglu")
NORM_GEGLU = _gated_kernel("gk_norm_geglu")


def _threadgroup_parts(rows: int, k: int, dtype: mx.Dtype) -> dict[str, int]:
    """The threadgroup arrays of a launch for ``rows`` rows of ``k``: the token rows, their scales and
    the reduction scratch (CUDA: a float per row and warp; Metal: 32 floats). CUDA's streaming form
    declares them and leaves them unused."""
    block = BLOCK if rows <= 2 else WIDE_BLOCK
    reduction = rows * (block // 32) * 4 if threadgroup_backend() == "cuda" else 32 * 4
    return {"token rows": rows * k * dtype.size, "row scales": rows * 4, "reduction": reduction}


def projections_fit(x: mx.array) -> bool:
    """Whether rows like ``x``'s (``(..., K)``) fit one launch: ``M = x.size / K`` rows, at most
    ``MAX_ROWS``, within the active backend's threadgroup memory (``THREADGROUP_MEMORY``)."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    limit = THREADGROUP_MEMORY[threadgroup_backend()]
    return 0 < rows <= MAX_ROWS and sum(_threadgroup_parts(rows, k, x.dtype).values()) <= limit


def _plan(op: str, kernel: Kernel, x: mx.array, residual: mx.array | None, weight: mx.array | None,
          eps: float, matrices: Sequence[mx.array], names: Sequence[str], gated: bool, act: int = 0,
          biases: Sequence[mx.array] | None = None) -> Plan:
    """A launch of ``kernel``: one output per matrix, plus its bias of ``biases`` (``gated``: one
    output, gate and up together, gated by ``ACTIVATIONS[act]``)."""
    rows = norm_rows(op, x, residual, weight, lambda m, k: (_threadgroup_parts(m, k, x.dtype), None))
    k = rows.k
    for name, matrix in zip(names, matrices):
        if not isinstance(matrix, mx.array):
            raise KernelError(op, f"{name} must be an mx.array, got {type(matrix).__name__}",
                              Status.INVALID_INPUT)
        if matrix.ndim != 2 or matrix.shape[1] != k or matrix.shape[0] == 0:
            raise KernelError(op, f"{name} has shape {tuple(matrix.shape)}; expected (N, {k}) for x's last "
                              f"dimension {k}", Status.INVALID_INPUT)
        if matrix.dtype != x.dtype:
            raise KernelError(op, f"dtype mismatch: {name} is {dtype_name(matrix.dtype)} but x is "
                              f"{dtype_name(x.dtype)}", Status.INVALID_INPUT)
    if gated and matrices[1].shape != matrices[0].shape:
        raise KernelError(op, f"{names[1]} has shape {tuple(matrices[1].shape)} but {names[0]} has "
                          f"{tuple(matrices[0].shape)}", Status.INVALID_INPUT)
    out_rows = [matrices[0].shape[0]] if gated else [w.shape[0] for w in matrices]
    pad = 0 if gated else 3 - len(matrices)  # absent weights and outputs: one-element stand-ins
    specs = row_output_specs(x, rows.h, out_rows, pad)
    inputs = (*rows.inputs, *matrices, *(rows.unused,) * pad)
    block = BLOCK if rows.rows <= 2 else WIDE_BLOCK
    template = (*norm_rows_template(op, x, rows, block, residual, weight, eps),
                template_arg("ACT", act) if gated else template_arg("NW", len(matrices)))
    warp_rows = 1
    if not gated:
        inputs += _checked_biases(op, x, out_rows, biases, rows.unused)
        warp_rows = 2 if rows.rows <= STREAM_ROWS and all(n % 2 == 0 for n in out_rows) else 1
        template += (template_arg("HAS_BIAS", biases is not None), template_arg("PAIRED", warp_rows == 2))
    blocks = -(-sum(out_rows) // warp_rows // (block // 32))
    return Plan(kernel, inputs, specs, (blocks * block, 1, 1), (block, 1, 1), template)


def _checked_biases(op: str, x: mx.array, out_rows: Sequence[int], biases: Sequence[mx.array] | None,
                    unused: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """One bias a projection (``(N,)`` of x's dtype), padded to three with ``unused``; three
    ``unused`` without ``biases``."""
    if biases is None:
        return (unused,) * 3
    if not isinstance(biases, (list, tuple)) or len(biases) != len(out_rows):
        raise KernelError(op, f"biases must be {len(out_rows)} arrays, one a projection, got {biases!r:.80}",
                          Status.INVALID_INPUT)
    for i, (bias, n) in enumerate(zip(biases, out_rows)):
        if not isinstance(bias, mx.array) or bias.shape != (n,) or bias.dtype != x.dtype:
            found = (f"{tuple(bias.shape)} {dtype_name(bias.dtype)}" if isinstance(bias, mx.array)
                     else type(bias).__name__)
            raise KernelError(op, f"biases[{i}] is {found}; expected ({n},) {dtype_name(x.dtype)}, one value "
                              f"a row of projections[{i}]", Status.INVALID_INPUT)
    return (*biases, *(unused,) * (3 - len(biases)))  # type: ignore[return-value]


def _make_projection_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    x, r, w, rest = random_rows(shape, dtype, key)
    k = shape[-1]
    mats = [(mx.random.normal((n, k), key=kk) / k**0.5).astype(dtype)
            for n, kk in zip((96, 32, 32), mx.random.split(rest, 3))]
    return Case((x, w, mats), {"eps": 1e-5, "residual": r})


def _make_gated_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array,
                       approx: bool | None = None) -> Case:
    """Arguments for a gated call: gate and up of 80 rows; ``approx`` given for a GeGLU one."""
    x, r, w, rest = random_rows(shape, dtype, key)
    k = shape[-1]
    kg, ku = mx.random.split(rest)
    gate = (2.0 * mx.random.normal((80, k), key=kg) / k**0.5).astype(dtype)
    up = (mx.random.normal((80, k), key=ku) / k**0.5).astype(dtype)
    options = {"eps": 1e-5, "residual": r}
    return Case((x, w, gate, up), options if approx is None else {**options, "approx": approx})


def _stock_projections(x: mx.array, weight: mx.array | None, projections: Sequence[mx.array],
                       eps: float = 1e-5, residual: mx.array | None = None,
                       biases: Sequence[mx.array] | None = None) -> tuple[mx.array, ...]:
    h, normed = stock_normed(x, weight, eps, residual)
    outputs = tuple(normed @ w.T for w in projections)
    if biases is not None:
        outputs = tuple(o + b for o, b in zip(outputs, biases))
    return outputs if residual is None else (h, *outputs)


def _stock_swiglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
                  residual: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
    import mlx.nn as nn

    h, normed = stock_normed(x, weight, eps, residual)
    out = nn.silu(normed @ gate.T) * (normed @ up.T)
    return out if residual is None else (h, out)


def _stock_geglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
                 residual: mx.array | None = None, *,
                 approx: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    import mlx.nn as nn

    h, normed = stock_normed(x, weight, eps, residual)
    out = (nn.gelu_approx if approx else nn.gelu)(normed @ gate.T) * (normed @ up.T)
    return out if residual is None else (h, out)


#: check()'s shapes: one row, two tokens of one position, eight rows, one token of 2048 features.
DECODING_SHAPES = ((1, 64), (2, 1, 128), (8, 256), (1, 1, 2048))


@declare(NORM_PROJECTIONS, stock=_stock_projections, make_inputs=_make_projection_inputs,
         shapes=DECODING_SHAPES,
         description="residual add + RMSNorm + up to 3 projections, for up to 8 rows (decoding)")
def plan_norm_projections(x: mx.array, weight: mx.array | None, projections: Sequence[mx.array],
                          eps: float = 1e-5, residual: mx.array | None = None,
                          biases: Sequence[mx.array] | None = None) -> Plan:
    """The launch :func:`norm_projections` makes (validated)."""
    op = "norm_projections"
    if not isinstance(projections, (list, tuple)) or not 1 <= len(projections) <= 3:
        raise KernelError(op, f"projections must be a list of 1 to 3 weight matrices, got "
                          f"{projections!r:.80}",
                          Status.INVALID_INPUT)
    names = [f"projections[{i}]" for i in range(len(projections))]
    return _plan(op, NORM_PROJECTIONS, x, residual, weight, eps, projections, names, gated=False,
                 biases=biases)


@plan_norm_projections.layer
def norm_projections(x: mx.array, weight: mx.array | None, projections: Sequence[mx.array],
                     eps: float = 1e-5, residual: mx.array | None = None,
                     biases: Sequence[mx.array] | None = None) -> tuple[mx.array, ...]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``n @ W.T`` for each of
    1 to 3 weight matrices ``W`` of shape ``(N, K)``, in one launch, for up to ``MAX_ROWS`` rows of
    ``x`` (``(..., K)``). Returns the products, after ``h = x + residual`` when a residual is given:
    what a block's input norm and its query, key and value projections compute. ``biases`` (one
    1-D array a weight: Qwen 2's) are added to the products as ``nn.Linear`` adds its bias.

    >>> x, w = mx.ones((1, 4)), mx.ones((4,))
    >>> q, k = norm_projections(x, w, [mx.ones((2, 4)), mx.full((1, 4), 0.5)], eps=0.0)
    >>> q.tolist(), k.tolist()
    ([[4.0, 4.0]], [[2.0]])
    """
    outputs = plan_norm_projections.launch(x, weight, projections, eps, residual, biases)
    found = outputs[1:1 + len(projections)]
    return (outputs[0], *found) if residual is not None else tuple(found)


@declare(NORM_SWIGLU, stock=_stock_swiglu, make_inputs=_make_gated_inputs, shapes=DECODING_SHAPES,
         description="residual add + RMSNorm + SwiGLU gate/up projections, for up to 8 rows (decoding)")
def plan_norm_swiglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
                     residual: mx.array | None = None) -> Plan:
    """The launch :func:`norm_swiglu` makes (validated)."""
    return _plan("norm_swiglu", NORM_SWIGLU, x, residual, weight, eps, (gate, up), ("gate", "up"), gated=True)


@plan_norm_swiglu.layer
def norm_swiglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
                residual: mx.array | None = None) -> mx.array | tuple[mx.array, mx.array]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``silu(n @ gate.T) *
    (n @ up.T)`` in one launch, for up to ``MAX_ROWS`` rows: a SwiGLU feed-forward's input side.
    Returns it, or ``(h, it)`` with ``h = x + residual`` when a residual is given.

    >>> out = norm_swiglu(mx.ones((1, 4)), None, mx.ones((2, 4)), mx.ones((2, 4)), eps=0.0)
    >>> [round(v, 4) for v in out[0].tolist()]
    [15.7122, 15.7122]
    """
    h, out = plan_norm_swiglu.launch(x, weight, gate, up, eps, residual)
    return (h, out) if residual is not None else out


@declare(NORM_GEGLU, stock=_stock_geglu, make_inputs=functools.partial(_make_gated_inputs, approx=False),
         shapes=DECODING_SHAPES,
         description="residual add + RMSNorm + GeGLU gate/up projections (exact GELU), for up to 8 rows "
                     "(decoding)")
def plan_norm_geglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
                    residual: mx.array | None = None, *, approx: bool = False) -> Plan:
    """The launch :func:`norm_geglu` makes (validated)."""
    return _plan("norm_geglu", NORM_GEGLU, x, residual, weight, eps, (gate, up), ("gate", "up"), gated=True,
                 act=geglu_act(approx))


@plan_norm_geglu.layer
def norm_geglu(x: mx.array, weight: mx.array | None, gate: mx.array, up: mx.array, eps: float = 1e-5,
               residual: mx.array | None = None, *,
               approx: bool = False) -> mx.array | tuple[mx.array, mx.array]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``gelu(n @ gate.T) *
    (n @ up.T)`` in one launch, for up to ``MAX_ROWS`` rows: a GeGLU feed-forward's input side, with
    ``nn.gelu`` or, with ``approx=True``, ``nn.gelu_approx`` (Gemma 2's and 3's). Returns it, or
    ``(h, it)`` with ``h = x + residual`` when a residual is given.

    >>> out = norm_geglu(mx.ones((1, 4)), None, mx.ones((2, 4)), mx.ones((2, 4)), eps=0.0)
    >>> [round(v, 4) for v in out[0].tolist()]
    [15.9995, 15.9995]
    >>> out = norm_geglu(mx.ones((1, 4)), None, mx.full((2, 4), -0.25), mx.ones((2, 4)), eps=0.0, approx=True)
    >>> [round(v, 4) for v in out[0].tolist()]
    [-0.6352, -0.6352]
    """
    h, out = plan_norm_geglu.launch(x, weight, gate, up, eps, residual, bool(approx))
    return (h, out) if residual is not None else out


plan_norm_geglu.variant("norm_geglu_approx", make_inputs=functools.partial(_make_gated_inputs, approx=True),
                        description="residual add + RMSNorm + GeGLU gate/up projections (tanh GELU), for up "
                                    "to 8 rows (decoding)")
