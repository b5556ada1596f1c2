"""RMSNorm feeding the projections after it, for a few tokens at a time: one launch for
``rms_norm(x + residual) @ W.T`` over up to three weights (a block's query, key and value
projections), or for ``act(n @ Wg.T) * (n @ Wu.T)`` (its gated feed-forward's gate and up:
``silu`` for SwiGLU, ``gelu`` or its tanh form for GeGLU).

Decoding feeds a handful of token rows (``M = x.size / K``) through each layer, and then every
launch costs the host more than the GPU spends on it. Stock MLX makes an add, a norm and three
matrix-vector products (or two and the gating) as separate launches; here each thread block
normalizes the rows into shared memory (block 0 also writes the sum ``h``) and its warps each
reduce one weight row against them: one launch, the weights read once, for ``M <= MAX_ROWS`` rows
within the backend's threadgroup memory. The products round to the dtype as MLX's do before the
gating, which runs in float32. The SwiGLU and GeGLU kernels share one source, whose ``ACT`` template
value picks the activation (:data:`ACTIVATIONS`).
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
    MAX_ROWS,
    METAL_NORM_ROWS,
    norm_rows,
    norm_rows_template,
    random_rows,
    row_output_specs,
    stock_normed,
)
from graphkern.kernels.ops.gelu import GELU_CUDA, GELU_METAL, gelu_float32
from graphkern.kernels.ops.rms_norm import RMS_SCALE_CUDA, rms_norm_reference
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

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

_CUDA = r"""
namespace gk {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// The M rows of x (+ r, rounded to T, block 0 writing the sum to h) RMS-normalized into xs, rounded
// as rms_norm rounds: T(T(v * inv) * w). One pass of V-wide loads, one reduction for all M rows.
// Every thread of the block takes part; red holds M * NT / 32 floats.
template <typename T, int M, int K, int V, int NT, bool RESID, bool HAS_W>
__device__ __forceinline__ void norm_rows(const T* x, const T* r, const T* w, T* h, T* xs, float eps,
                                          float* red) {
  constexpr int WARPS = NT / 32;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.0f;
    for (int i = threadIdx.x * V; i < K; i += NT * V) {
      float v[V];
      load<T, V>(x + m * K, i, v);
      if constexpr (RESID) {
        float rv[V];
        load<T, V>(r + m * K, i, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          v[j] = round_to<T>(v[j] + rv[j]);
        }
        if (blockIdx.x == 0) {
          store<T, V>(h + m * K, i, v);
        }
      }
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
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      total += red[m * WARPS + i];
    }
    const float inv = rsqrtf(total / K + eps);
    for (int i = threadIdx.x * V; i < K; i += NT * V) {  // each thread rereads only what it wrote
      float v[V];
      load<T, V>(xs + m * K, i, v);
      rms_scale<T, V, HAS_W>(v, w, i, inv);
      store<T, V>(xs + m * K, i, v);
    }
  }
  __syncthreads();
}

// acc[m] += row . xs[m] over this warp's lanes (each V elements at a time), then summed over the warp.
template <typename T, int M, int K, int V>
__device__ __forceinline__ void row_dot(const T* row, const T* xs, float (&acc)[M]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
#pragma unroll 4
  for (int k = lane * V; k < K; k += 32 * V) {
    float wv[V];
    load<T, V>(row, k, wv);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[V];
      load<T, V>(xs + m * K, k, xv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        acc[m] += wv[j] * xv[j];
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[m] = warp_sum(acc[m]);
  }
}

// y[m, r] = xs[m] . W[r] for the r-th row of one projection of n rows.
template <typename T, int M, int K, int V>
__device__ __forceinline__ void project_row(const T* W, T* y, int r, int n, const T* xs) {
  float acc[M];
  row_dot<T, M, K, V>(W + static_cast<long long>(r) * K, xs, acc);
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      y[static_cast<long long>(m) * n + r] = static_cast<T>(acc[m]);
    }
  }
}

}  // namespace gk
"""

# The shared opening: the normalized rows in shared memory, and this warp's weight row. Rows of
# V-aligned pointers take V-wide accesses throughout, others the scalar path (``VA``).
_CUDA_START = r"""
  __shared__ float red[M * (NT / 32)];
  __shared__ __align__(16) unsigned char xs_bytes[M * K * sizeof(T)];
  T* xs = reinterpret_cast<T*>(xs_bytes);
  const float eps = __int_as_float(EPS);
  const int row = blockIdx.x * (NT / 32) + threadIdx.x / 32;"""


def _cuda_body(aligned: str, prefetch: str, work: str) -> str:
    """A body that asks L2 for this warp's weight rows (``prefetch``), then runs ``work`` (which
    names ``VA``, the vector width it may use) V-wide when the ``aligned`` pointers are, else one
    element at a time."""
    run = r"""
    gk::norm_rows<T, M, K, VA, NT, RESID, HAS_W>(x, residual, w, h, xs, eps, red);""" + work
    return (_CUDA_START + prefetch + f"\n  if ({aligned}) {{\n    constexpr int VA = V;" + run
            + "\n  } else {\n    constexpr int VA = 1;" + run + "\n  }\n")


_CUDA_PROJECTIONS = _cuda_body(
    "gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(w) && gk::aligned<V>(h) && "
    "gk::aligned<V>(w0) && gk::aligned<V>(w1) && gk::aligned<V>(w2)", r"""
  const int n0 = w0_shape[0];
  const int n1 = NW > 1 ? w1_shape[0] : 0;
  const int n2 = NW > 2 ? w2_shape[0] : 0;
  constexpr long long ROW_BYTES = K * sizeof(T);
  if (row < n0) {
    gk::prefetch_l2(w0 + static_cast<long long>(row) * K, ROW_BYTES);
  } else if (row < n0 + n1) {
    gk::prefetch_l2(w1 + static_cast<long long>(row - n0) * K, ROW_BYTES);
  } else if (row < n0 + n1 + n2) {
    gk::prefetch_l2(w2 + static_cast<long long>(row - n0 - n1) * K, ROW_BYTES);
  }""", r"""
    if (row < n0) {
      gk::project_row<T, M, K, VA>(w0, y0, row, n0, xs);
    } else if (row < n0 + n1) {
      gk::project_row<T, M, K, VA>(w1, y1, row - n0, n1, xs);
    } else if (row < n0 + n1 + n2) {
      gk::project_row<T, M, K, VA>(w2, y2, row - n0 - n1, n2, xs);
    }""")

# The gated body, of SwiGLU and GeGLU alike: ACT picks the activation of the rounded gate product.
_CUDA_GATED = _cuda_body(
    "gk::aligned<V>(x) && gk::aligned<V>(residual) && gk::aligned<V>(w) && gk::aligned<V>(h) && "
    "gk::aligned<V>(gate) && gk::aligned<V>(up)", r"""
  const int n = gate_shape[0];
  if (row < n) {
    gk::prefetch_l2(gate + static_cast<long long>(row) * K, K * sizeof(T));
    gk::prefetch_l2(up + static_cast<long long>(row) * K, K * sizeof(T));
  }""", r"""
    if (row < n) {
      float g[M];
      float u[M];
      gk::row_dot<T, M, K, VA>(gate + static_cast<long long>(row) * K, xs, g);
      gk::row_dot<T, M, K, VA>(up + static_cast<long long>(row) * K, xs, u);
      if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float gm = gk::round_to<T>(g[m]);
          out[static_cast<long long>(m) * n + row] =
              static_cast<T>(gk::activation<ACT, T>(gm) * gk::round_to<T>(u[m]));
        }
      }
    }""")

_METAL = r"""
namespace gk {
""" + METAL_NORM_ROWS + r"""
template <typename T, int M, int K, typename PW>
inline void row_dot(PW row, threadgroup const T* xs, uint lane, thread float (&acc)[M]) {
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
  for (int k = lane; k < K; k += 32) {
    const float wv = static_cast<float>(row[k]);
    for (int m = 0; m < M; ++m) {
      acc[m] += wv * static_cast<float>(xs[m * K + k]);
    }
  }
  for (int m = 0; m < M; ++m) {
    acc[m] = metal::simd_sum(acc[m]);
  }
}

}  // namespace gk
"""

_METAL_START = r"""
  threadgroup float red[32];
  threadgroup T xs[M * K];
  const uint lane = thread_index_in_simdgroup;
  gk::norm_rows<T, M, K, NT, RESID, HAS_W>(x, residual, w, h, xs, as_type<float>(EPS),
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
    gk::row_dot<T, M, K>(w0 + size_t(r) * K, xs, lane, acc);
  } else if (row < n0 + n1) {
    r = row - n0;
    n = n1;
    gk::row_dot<T, M, K>(w1 + size_t(r) * K, xs, lane, acc);
  } else if (row < n0 + n1 + n2) {
    r = row - n0 - n1;
    n = n2;
    gk::row_dot<T, M, K>(w2 + size_t(r) * K, xs, lane, acc);
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

_METAL_GATED = _METAL_START + r"""
  const int n = gate_shape[0];
  if (row < n) {
    float u[M];
    gk::row_dot<T, M, K>(gate + size_t(row) * K, xs, lane, acc);
    gk::row_dot<T, M, K>(up + size_t(row) * K, xs, lane, u);
    if (lane == 0) {
      for (int m = 0; m < M; ++m) {
        const float g = gk::round_to<T>(acc[m]);
        out[size_t(m) * n + row] = static_cast<T>(gk::activation<ACT>(g) * gk::round_to<T>(u[m]));
      }
    }
  }
"""


def _product(normed: mx.array, weight: mx.array) -> mx.array:
    """``normed @ weight.T`` in the inputs' precision. MLX's CUDA backend multiplies float32 matrices
    of more than one row on TF32 tensor cores (errors near 1e-3), so a float32 oracle runs its
    product on the CPU, whose float32 products are exact."""
    if normed.dtype == mx.float32 and mx.default_device() == mx.gpu and not mx.metal.is_available():
        return mx.matmul(normed, weight.T, stream=mx.cpu)
    return normed @ weight.T


def _normed(x: mx.array, residual: mx.array, w: mx.array, EPS: int, RESID: bool,
            HAS_W: bool) -> tuple[mx.array, mx.array]:
    h = x + residual if RESID else x
    return h, rms_norm_reference(h, w, EPS=EPS, HAS_W=HAS_W)[0]


def norm_projections_reference(x: mx.array, residual: mx.array, w: mx.array, w0: mx.array, w1: mx.array,
                               w2: mx.array, *, EPS: int, RESID: bool, HAS_W: bool,
                               NW: int) -> list[mx.array]:
    """Pure-MLX ``h = x + residual`` (when RESID) and ``rms_norm(h) @ W.T`` for the NW weights; an
    absent output is a one-element zero."""
    h, normed = _normed(x, residual, w, EPS, RESID, HAS_W)
    absent = mx.zeros((1,), x.dtype)
    outputs = [_product(normed, weight) if i < NW else absent for i, weight in enumerate((w0, w1, w2))]
    return [h if RESID else absent, *outputs]


def norm_gated_reference(x: mx.array, residual: mx.array, w: mx.array, gate: mx.array, up: mx.array, *,
                         EPS: int, RESID: bool, HAS_W: bool, ACT: int) -> list[mx.array]:
    """Pure-MLX ``h`` and ``act(n @ gate.T) * (n @ up.T)``, ``act`` as ``ACT`` says (products
    rounded, gating in float32)."""
    h, normed = _normed(x, residual, w, EPS, RESID, HAS_W)
    g = activation_float32(_product(normed, gate), ACT)
    u = _product(normed, up).astype(mx.float32)
    return [h if RESID else mx.zeros((1,), x.dtype), (g * u).astype(x.dtype)]


NORM_PROJECTIONS = Kernel(
    "gk_norm_projections",
    input_names=["x", "residual", "w", "w0", "w1", "w2"],
    output_names=["h", "y0", "y1", "y2"],
    metal=_METAL_PROJECTIONS,
    cuda=_CUDA_PROJECTIONS,
    header=dual_header(RMS_SCALE_CUDA + CUDA_PREFETCH + _CUDA, _METAL, body=_CUDA_PROJECTIONS),
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
        header=dual_header(RMS_SCALE_CUDA + CUDA_PREFETCH + _CUDA + ACTIVATION_CUDA,
                           _METAL + ACTIVATION_METAL, body=_CUDA_GATED),
        reference=norm_gated_reference,
    )


NORM_SWIGLU = _gated_kernel("gk_norm_swiglu")
NORM_GEGLU = _gated_kernel("gk_norm_geglu")


def _threadgroup_parts(rows: int, k: int, dtype: mx.Dtype) -> dict[str, int]:
    """The threadgroup arrays of a launch for ``rows`` rows of ``k``: the normalized rows, and the
    reduction scratch (CUDA: a float per row and warp; Metal: 32 floats)."""
    block = BLOCK if rows <= 2 else WIDE_BLOCK
    reduction = rows * (block // 32) * 4 if threadgroup_backend() == "cuda" else 32 * 4
    return {"normalized rows": rows * k * dtype.size, "reduction": reduction}


def projections_fit(x: mx.array) -> bool:
    """Whether rows like ``x``'s (``(..., K)``) fit one launch: ``M = x.size / K`` rows, at most
    ``MAX_ROWS``, within the active backend's threadgroup memory (``THREADGROUP_MEMORY``)."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    limit = THREADGROUP_MEMORY[threadgroup_backend()]
    return 0 < rows <= MAX_ROWS and sum(_threadgroup_parts(rows, k, x.dtype).values()) <= limit


def _plan(op: str, kernel: Kernel, x: mx.array, residual: mx.array | None, weight: mx.array | None,
          eps: float, matrices: Sequence[mx.array], names: Sequence[str], gated: bool, act: int = 0) -> Plan:
    """A launch of ``kernel``: one output per matrix (``gated``: one output, gate and up together,
    gated by ``ACTIVATIONS[act]``)."""
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
    blocks = -(-sum(out_rows) // (block // 32))
    return Plan(kernel, inputs, specs, (blocks * block, 1, 1), (block, 1, 1), template)


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
                       eps: float = 1e-5,
                       residual: mx.array | None = None) -> tuple[mx.array, ...]:
    h, normed = stock_normed(x, weight, eps, residual)
    outputs = tuple(normed @ w.T for w in projections)
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
                          eps: float = 1e-5, residual: mx.array | None = None) -> Plan:
    """The launch :func:`norm_projections` makes (validated)."""
    op = "norm_projections"
    if not isinstance(projections, (list, tuple)) or not 1 <= len(projections) <= 3:
        raise KernelError(op, f"projections must be a list of 1 to 3 weight matrices, got "
                          f"{projections!r:.80}",
                          Status.INVALID_INPUT)
    names = [f"projections[{i}]" for i in range(len(projections))]
    return _plan(op, NORM_PROJECTIONS, x, residual, weight, eps, projections, names, gated=False)


@plan_norm_projections.layer
def norm_projections(x: mx.array, weight: mx.array | None, projections: Sequence[mx.array],
                     eps: float = 1e-5, residual: mx.array | None = None) -> tuple[mx.array, ...]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given) and ``n @ W.T`` for each of
    1 to 3 weight matrices ``W`` of shape ``(N, K)``, in one launch, for up to ``MAX_ROWS`` rows of
    ``x`` (``(..., K)``). Returns the products, after ``h = x + residual`` when a residual is given:
    what a block's input norm and its query, key and value projections compute.

    >>> x, w = mx.ones((1, 4)), mx.ones((4,))
    >>> q, k = norm_projections(x, w, [mx.ones((2, 4)), mx.full((1, 4), 0.5)], eps=0.0)
    >>> q.tolist(), k.tolist()
    ([[4.0, 4.0]], [[2.0]])
    """
    outputs = plan_norm_projections.launch(x, weight, projections, eps, residual)
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
