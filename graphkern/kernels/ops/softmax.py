"""Numerically safe softmax over the last axis, as ``mx.softmax(x, axis=-1)`` (in float32 inside).

One block per row, online softmax: one pass computes each thread's running max and the sum of
``exp(x - max)`` rescaled as the max grows, the block combines them, and a second pass writes the
output. On CUDA a row of up to 64 KiB (float32, or 16-bit from 32 KiB) is kept in the block's shared
memory by the first pass, so the second reads it from there; other rows (a 128K vocabulary's logits)
are read again from memory (mostly from L2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import (
    Case,
    Plan,
    check_dtype,
    output_spec,
    row_config,
    row_launch,
    runs_on_cuda,
    template_arg,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.launching.launch_cache import memoized
from graphkern.nodes import Kernel

__all__ = ["SOFTMAX", "in_shared_memory", "plan_softmax", "shared_row_bytes", "softmax", "softmax_reference"]

#: float32 rows this long (1024 threads of 16 elements) or longer take 8-byte accesses when streamed.
LONG_FLOAT32_ROW = 16384
#: The most shared memory a block keeps its row in (three such blocks fit an SM of a Hopper GPU).
SHARED_ROW_BYTES = 64 * 1024
#: Shared memory per SM in KB by compute capability (CUDA C++ Programming Guide, technical
#: specifications); architectures not listed have 100 KB (8.6, 8.9, 12.x).
_SHARED_KB_PER_SM = {(7, 0): 96, (7, 2): 96, (7, 5): 64, (8, 0): 164, (8, 7): 164, (9, 0): 228,
                     (10, 0): 228, (10, 3): 228}

_CUDA = r"""
namespace gk {

// exp is __expf (ex2.approx, a few ulp for the non-positive arguments here), as MLX's own softmax.
// Online softmax (one read of x): each thread keeps a running max m and the sum s of exp(v - m),
// rescaling s when m grows; the block then combines them, and a second pass writes the output.
template <int V>
__device__ __forceinline__ void online_add(const float (&v)[V], float& m, float& s) {
  float cm = v[0];
#pragma unroll
  for (int j = 1; j < V; ++j) {
    cm = fmaxf(cm, v[j]);
  }
  if (cm > m) {
    s *= __expf(m - cm);
    m = cm;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s += __expf(v[j] - m);
  }
}

// o = exp(v - gm) * inv: the output, once the block has the row's max gm and 1 / sum inv.
template <int V>
__device__ __forceinline__ void online_output(const float (&v)[V], float (&o)[V], float gm, float inv) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    o[j] = __expf(v[j] - gm) * inv;
  }
}

template <typename T, int NT, int V, int CH>
__device__ __forceinline__ void softmax_row(const T* x, T* out, int n) {
  __shared__ float smem[32];
  Row<T, NT, V, CH> row(x, n);
  float m = Max::identity();
  float s = 0.0f;
  row.read([&](float (&v)[V], long long) { online_add(v, m, s); });
  const float gm = block_max<NT>(m, smem);
  const float inv = 1.0f / block_sum<NT>(s * __expf(m - gm), smem);
  row.visit([&](float (&v)[V], long long i) {
    float o[V];
    online_output(v, o, gm, inv);
    store<T, V>(out, i, o);
  });
}

// The same with the row kept in dynamic shared memory (the kernel's shared_memory) as it is read:
// DRAM is read once, the output pass reads shared memory.
template <typename T, int NT, int V>
__device__ __forceinline__ void softmax_row_shared(const T* x, T* out, int n) {
  extern __shared__ __align__(16) unsigned char gk_row[];
  __shared__ float smem[32];
  using VT = Vec<T, V>;
  VT* buf = reinterpret_cast<VT*>(gk_row);
  const VT* src = reinterpret_cast<const VT*>(x);
  const int nv = n / V;
  float m = Max::identity();
  float s = 0.0f;
  for (int k = threadIdx.x; k < nv; k += NT) {
    const VT r = src[k];
    buf[k] = r;
    float v[V];
    unpack<T, V>(r, v);
    online_add(v, m, s);
  }
  const float gm = block_max<NT>(m, smem);
  const float inv = 1.0f / block_sum<NT>(s * __expf(m - gm), smem);
  VT* dst = reinterpret_cast<VT*>(out);
  for (int k = threadIdx.x; k < nv; k += NT) {
    float v[V];
    unpack<T, V>(buf[k], v);
    float o[V];
    online_output(v, o, gm, inv);
    dst[k] = pack<T, V>(o);
  }
}

}  // namespace gk
"""

_CUDA_BODY = r"""
  const int n = x_shape[x_ndim - 1];
  const long long off = static_cast<long long>(blockIdx.x) * n;
  const bool vectors = gk::aligned<V>(x) && gk::aligned<V>(out);
  if constexpr (SHARED) {
    if (vectors) {
      gk::softmax_row_shared<T, NT, V>(x + off, out + off, n);
    } else {
      gk::softmax_row_shared<T, NT, 1>(x + off, out + off, n);
    }
  } else if (vectors) {
    gk::softmax_row<T, NT, V, CH>(x + off, out + off, n);
  } else {
    gk::softmax_row<T, NT, 1, 0>(x + off, out + off, n);
  }
"""

_METAL = r"""
namespace gk {

template <typename T, int NT, typename PX, typename PO>
inline void softmax_row(PX x, PO out, int n, uint tid, uint lane, uint sg, threadgroup float* smem) {
  float m = Max::identity();
  for (int i = tid; i < n; i += NT) {
    m = metal::max(m, static_cast<float>(x[i]));
  }
  m = block_reduce<NT>(m, smem, lane, sg, Max());
  float s = 0.0f;
  for (int i = tid; i < n; i += NT) {
    s += metal::fast::exp(static_cast<float>(x[i]) - m);
  }
  const float inv = 1.0f / block_reduce<NT>(s, smem, lane, sg, Sum());
  for (int i = tid; i < n; i += NT) {
    out[i] = static_cast<T>(metal::fast::exp(static_cast<float>(x[i]) - m) * inv);
  }
}

}  // namespace gk
"""

_METAL_BODY = r"""
  threadgroup float smem[32];
  const int n = x_shape[x_ndim - 1];
  const size_t off = size_t(threadgroup_position_in_grid.x) * n;
  gk::softmax_row<T, NT>(x + off, out + off, n, thread_position_in_threadgroup.x, thread_index_in_simdgroup,
                            simdgroup_index_in_threadgroup, smem);
"""


def softmax_reference(x: mx.array) -> list[mx.array]:
    """Pure-MLX softmax over the last axis, computed in float32."""
    return [mx.softmax(x.astype(mx.float32), axis=-1).astype(x.dtype)]


SOFTMAX = Kernel(
    "gk_softmax",
    input_names=["x"],
    output_names=["out"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(_CUDA, _METAL),
    reference=softmax_reference,
)


@memoized("plan parts", maxsize=64)
def _shared_kernel(nbytes: int) -> Kernel:
    """SOFTMAX with ``nbytes`` of shared memory for its row (one MLX kernel object per size)."""
    return dataclasses.replace(SOFTMAX, shared_memory=nbytes)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    return Case(((4.0 * mx.random.normal(tuple(shape), key=key)).astype(dtype),))


@declare(SOFTMAX, stock=lambda x: mx.softmax(x, axis=-1, precise=True), make_inputs=_make_inputs,
         shapes=((4, 64), (2, 3, 100), (7, 1000), (2, 4097), (2, 20000)),
         description="softmax over the last axis (mx.softmax, precise=True)")
def plan_softmax(x: mx.array) -> Plan:
    """The launch :func:`softmax` makes (validated)."""
    check_dtype("softmax", x)
    shared = runs_on_cuda() and in_shared_memory(x.shape[-1], x.dtype, shared_row_bytes())
    return _plan(x, shared)


def in_shared_memory(n: int, dtype: mx.Dtype, limit: int = SHARED_ROW_BYTES) -> bool:
    """Whether a CUDA softmax keeps rows of ``n`` elements of ``dtype`` in shared memory: float32
    rows up to ``limit`` bytes, 16-bit rows from half of it (shorter 16-bit rows read twice from L2
    as fast; benchmarks/RESULTS_kernels.md).

    >>> in_shared_memory(4096, mx.float32), in_shared_memory(4096, mx.bfloat16)
    (True, False)
    >>> in_shared_memory(32000, mx.bfloat16), in_shared_memory(32000, mx.float32)
    (True, False)
    """
    nbytes = n * dtype.size
    least = 1 if dtype == mx.float32 else limit // 2
    return least <= nbytes <= limit


@memoized("plan parts", maxsize=1)
def shared_row_bytes() -> int:
    """The longest row, in bytes, that a CUDA softmax keeps in shared memory on this GPU: three
    blocks of it fit an SM (64 KiB at most, what a Hopper GPU gets). An sm_75 GPU
    (64 KB an SM, at most 64 KB a block) gets 20 KiB, an sm_86 one 32 KiB, an A100 52 KiB.

    >>> shared_row_bytes() % 4096, shared_row_bytes() <= SHARED_ROW_BYTES
    (0, True)
    """
    info = mx.device_info()
    capability = (int(info.get("compute_capability_major", 0)), int(info.get("compute_capability_minor", 0)))
    # a third of the SM, less the 1 KB the system keeps per block and the reduction's 32 floats
    per_block = _SHARED_KB_PER_SM.get(capability, 100) * 1024 // 3 - 1024 - 128
    return min(SHARED_ROW_BYTES, per_block // 4096 * 4096)


def _plan(x: mx.array, shared: bool) -> Plan:
    n = x.shape[-1]
    if shared:
        # the row in shared memory (in_shared_memory), 16 elements a thread, 512 threads at most
        # so that three blocks of 64 KiB fit an SM
        cfg = row_config(n, x.dtype, vector=4, streamed=True, max_threads=512)
        kernel = _shared_kernel(-(-n * x.dtype.size // 4096) * 4096)
    else:
        # streamed (max, sum and output in one read each; the second read hits L2), 16-byte
        # accesses, 64 bytes a thread (the fastest in benchmarks/gpu_row_configs.py's sweep);
        # float32 rows that fill a 1024-thread block take 8-byte accesses
        vector = 2 if x.dtype == mx.float32 and n >= LONG_FLOAT32_ROW else 8
        cfg = row_config(n, x.dtype, vector=vector, items=64 // x.dtype.size, streamed=True, max_threads=1024)
        kernel = SOFTMAX
    grid, group = row_launch("softmax", x, cfg)
    template = (template_arg("T", x.dtype), *cfg.template(), template_arg("SHARED", shared))
    return Plan(kernel, (x,), (output_spec(x.shape, x.dtype),), grid, group, template)


@plan_softmax.layer
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis, like ``mx.softmax(x, axis=-1)``; safe for large logits.

    >>> [round(v, 4) for v in softmax(mx.array([[1000.0, 1000.0, 999.0]]))[0].tolist()]
    [0.4223, 0.4223, 0.1554]
    """
    return plan_softmax.launch(x)[0]
