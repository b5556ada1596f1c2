"""Device helpers shared by the library's kernels, as header strings (one per backend).

MLX puts a kernel's ``header`` before the function it generates from the body, so everything here
is a template: the body instantiates it with its template arguments (``T``, ``NT``, ``V``, ``CH``).

CUDA row model (one thread block of ``NT`` threads per row of ``n`` elements): thread ``t`` owns the
vector slots ``c * NT + t`` for ``c < CH``, each ``V`` consecutive elements loaded with one aligned
vector load. ``CH > 0`` keeps the thread's slots in registers (as ``T``: a 16-bit row takes half the
registers of floats), so the row is read from memory once; ``CH == 0`` is for rows too long for
registers and re-reads them (from L2, mostly) on each pass.
Bodies check pointer alignment at run time and fall back to ``V = 1`` with the same register budget.

Metal row model: one threadgroup of ``NT`` threads per row, each thread striding through the row.
"""

from __future__ import annotations

from graphkern.launching.source_text import two_backend_header

__all__ = ["CUDA_COMMON", "CUDA_NORM_ROW_START", "METAL_COMMON", "METAL_NORM_ROW_START", "dual_header"]

_CUDA_VECTORS = r"""
// ---- graphkern row helpers (CUDA) ----
namespace gk {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <int V, typename T>
__device__ __forceinline__ bool aligned(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) % (sizeof(T) * V)) == 0;
}

// x rounded to T and back: the cast MLX's own kernels and fallbacks make between steps.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// A vector's elements as floats, and floats rounded into a vector.
template <typename T, int V>
__device__ __forceinline__ void unpack(const Vec<T, V>& t, float (&out)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    out[j] = static_cast<float>(t.v[j]);
  }
}

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> pack(const float (&in)[V]) {
  Vec<T, V> t;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    t.v[j] = static_cast<T>(in[j]);
  }
  return t;
}

// The V elements at p (aligned to V elements) in one vector load. A Vec read element by element
// may be split into V scalar loads (NVRTC does so for 16-bit T and for float), so it travels as the
// builtin vector type of its size: one LDG.64 or LDG.128, the elements unpacked in registers.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  constexpr int bytes = sizeof(Vec<T, V>);
  if constexpr (bytes == 16) {
    const uint4 b = *reinterpret_cast<const uint4*>(p);
    return *reinterpret_cast<const Vec<T, V>*>(&b);
  } else if constexpr (bytes == 8) {
    const uint2 b = *reinterpret_cast<const uint2*>(p);
    return *reinterpret_cast<const Vec<T, V>*>(&b);
  } else if constexpr (bytes == 4) {
    const unsigned int b = *reinterpret_cast<const unsigned int*>(p);
    return *reinterpret_cast<const Vec<T, V>*>(&b);
  } else {
    return *reinterpret_cast<const Vec<T, V>*>(p);
  }
}

// V elements starting at element i (i % V == 0; p aligned to V elements) as floats.
template <typename T, int V>
__device__ __forceinline__ void load(const T* p, long long i, float (&out)[V]) {
  unpack<T, V>(load_vec<T, V>(p + i), out);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, long long i, const float (&in)[V]) {
  *reinterpret_cast<Vec<T, V>*>(p + i) = pack<T, V>(in);
}

// Number of elements in an array from its shape (MLX passes x_shape / x_ndim when the body names them).
template <typename S>
__device__ __forceinline__ long long numel(const S& shape, int ndim) {
  long long n = 1;
  for (int d = 0; d < ndim; ++d) {
    n *= shape[d];
  }
  return n;
}

"""

_CUDA_REDUCE = r"""
struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static __device__ __forceinline__ float identity() { return 0.0f; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static __device__ __forceinline__ float identity() { return -3.402823466e+38f; }
};

// Reduce v over the block of NT threads (NT a multiple of 32, at most 1024); every thread gets
// the result. smem: 32 floats of shared memory; safe to call several times in a row.
template <int NT, typename Op>
__device__ __forceinline__ float block_reduce(float v, float* smem, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if constexpr (NT > 32) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // the previous reduction's readers are done with smem
    if (lane == 0) {
      smem[warp] = v;
    }
    __syncthreads();
    v = lane < NT / 32 ? smem[lane] : Op::identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
  }
  return v;
}

template <int NT>
__device__ __forceinline__ float block_sum(float v, float* smem) {
  return block_reduce<NT>(v, smem, Sum{});
}

template <int NT>
__device__ __forceinline__ float block_max(float v, float* smem) {
  return block_reduce<NT>(v, smem, Max{});
}

"""

_CUDA_ROW = r"""
// This thread's part of one row of n elements (n % V == 0): the vector slots c * NT + threadIdx.x.
// A cached row (CH > 0) keeps its CH slots in registers as T, so a 16-bit row takes half the
// registers of floats; a streamed row (CH == 0) re-reads src on every pass. Callbacks take
// (float (&v)[V], long long i): the slot's V values as floats and the index of its first element.
//   read(f):    the first pass, the slot's values read from src;
//   produce(f): the first pass, f computes the slot's values (each exactly representable in T);
//   visit(f):   a later pass over the same values, from the registers or re-read from src (so a
//               streamed row needs src to hold them by then); changes f makes to v are dropped.
template <typename T, int NT, int V, int CH>
struct Row {
  static constexpr bool cached = CH > 0;
  Vec<T, V> r[cached ? CH : 1];
  const T* src;
  int n;

  __device__ __forceinline__ Row(const T* src_, int n_) : src(src_), n(n_) {}

  // f(c, i) for each of this thread's slots: c its register slot, i its first element.
  template <typename F>
  __device__ __forceinline__ void each(F&& f) {
    if constexpr (cached) {
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const long long i = (static_cast<long long>(c) * NT + threadIdx.x) * V;
        if (i < n) {
          f(c, i);
        }
      }
    } else {
      for (long long i = threadIdx.x * V; i < n; i += NT * V) {
        f(0, i);
      }
    }
  }

  template <typename F>
  __device__ __forceinline__ void read(F&& f) {
    each([&](int c, long long i) {
      float v[V];
      r[c] = load_vec<T, V>(src + i);
      unpack<T, V>(r[c], v);
      f(v, i);
    });
  }

  template <typename F>
  __device__ __forceinline__ void produce(F&& f) {
    each([&](int c, long long i) {
      float v[V];
      f(v, i);
      if constexpr (cached) {
        r[c] = pack<T, V>(v);
      }
    });
  }

  template <typename F>
  __device__ __forceinline__ void visit(F&& f) {
    each([&](int c, long long i) {
      float v[V];
      if constexpr (cached) {
        unpack<T, V>(r[c], v);
      } else {
        load<T, V>(src, i, v);
      }
      f(v, i);
    });
  }
};

"""

_CUDA_MAP = r"""
// Elementwise: out[k] = f(in[k]...) for this thread's V elements (n % V == 0), with 16-byte
// vector accesses when every pointer allows them.
template <typename T, int V, typename F, typename... In>
__device__ __forceinline__ void map(T* out, long long n, F f, const In*... in) {
  const long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (i >= n) {
    return;
  }
  if ((aligned<V>(out) && ... && aligned<V>(in))) {
    float o[V];
    auto apply = [&](const auto&... vs) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        o[j] = f(static_cast<float>(vs.v[j])...);
      }
    };
    apply(load_vec<In, V>(in + i)...);
    store<T, V>(out, i, o);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out[i + j] = static_cast<T>(f(static_cast<float>(in[i + j])...));
    }
  }
}

"""

_CUDA_END = r"""
}  // namespace gk
"""

#: Every CUDA helper (what a kernel body may use; ``dual_header`` includes the ones it names).
CUDA_COMMON = _CUDA_VECTORS + _CUDA_REDUCE + _CUDA_ROW + _CUDA_MAP + _CUDA_END


METAL_COMMON = r"""
// ---- graphkern row helpers (Metal) ----
namespace gk {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

struct Sum {
  inline float operator()(float a, float b) const { return a + b; }
  inline float simd_reduce(float v) const { return metal::simd_sum(v); }
  static inline float identity() { return 0.0f; }
};
struct Max {
  inline float operator()(float a, float b) const { return metal::max(a, b); }
  inline float simd_reduce(float v) const { return metal::simd_max(v); }
  static inline float identity() { return -3.402823466e+38f; }
};

// Reduce v over a threadgroup of NT threads (a multiple of 32); every thread gets the result.
template <int NT, typename Op>
inline float block_reduce(float v, threadgroup float* smem, uint lane, uint sg, Op op) {
  v = op.simd_reduce(v);
  if (NT > 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) {
      smem[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = lane < uint(NT / 32) ? smem[lane] : Op::identity();
    v = op.simd_reduce(v);
  }
  return v;
}

// erf with < 1 ulp error on float (Metal has none); after MLX's kernels/erf.h.
inline float erf(float a) {
  float r, s, t, u;
  t = metal::abs(a);
  s = a * a;
  if (t > 0.927734375f) {
    r = metal::fma(-1.72853470e-5f, t, 3.83197126e-4f);
    u = metal::fma(-3.88396438e-3f, t, 2.42546219e-2f);
    r = metal::fma(r, s, u);
    r = metal::fma(r, t, -1.06777877e-1f);
    r = metal::fma(r, t, -6.34846687e-1f);
    r = metal::fma(r, t, -1.28717512e-1f);
    r = metal::fma(r, t, -t);
    r = 1.0f - metal::precise::exp(r);
    r = metal::copysign(r, a);
  } else {
    r = -5.96761703e-4f;
    r = metal::fma(r, s, 4.99119423e-3f);
    r = metal::fma(r, s, -2.67681349e-2f);
    r = metal::fma(r, s, 1.12819925e-1f);
    r = metal::fma(r, s, -3.76125336e-1f);
    r = metal::fma(r, s, 1.28379166e-1f);
    r = metal::fma(r, a, a);
  }
  return r;
}

}  // namespace gk
"""


# The opening of a normalization body, one block (threadgroup) per row: the row length ``n``, ``eps``
# from the EPS template argument's float32 bits, and ``off``, where this block's row starts (Metal
# also declares the reductions' scratch).
CUDA_NORM_ROW_START = r"""
  const int n = x_shape[x_ndim - 1];
  const float eps = __int_as_float(EPS);
  const long long off = static_cast<long long>(blockIdx.x) * n;"""

METAL_NORM_ROW_START = r"""
  threadgroup float smem[32];
  const int n = x_shape[x_ndim - 1];
  const float eps = as_type<float>(EPS);
  const size_t off = size_t(threadgroup_position_in_grid.x) * n;"""


def dual_header(cuda: str, metal: str, body: str = "") -> str:
    """One ``Kernel.header`` for both backends: the shared helpers of each, then ``cuda``/``metal``
    (see ``graphkern.launching.source_text.two_backend_header``: each backend's compiler gets its branch).

    Of the CUDA helpers, only those ``cuda`` and the kernel's CUDA ``body`` name are included: MLX
    hashes a kernel's whole source on every launch.

    >>> rows = dual_header("gk::Row<T, NT, V, CH> row(x, n);", "")
    >>> "struct Row" in rows, "struct Row" in dual_header("", "")
    (True, False)
    """
    uses = cuda + body
    parts = [_CUDA_VECTORS]
    if "Row<" in uses or "block_" in uses:
        parts.append(_CUDA_REDUCE)
    if "Row<" in uses:
        parts.append(_CUDA_ROW)
    if "map<" in uses:
        parts.append(_CUDA_MAP)
    return two_backend_header("".join(parts) + _CUDA_END + cuda, METAL_COMMON + metal)
