"""Probe: cache hints for the last two rows at parity, 16-bit RMSNorm at 8192x4096 (0.99-1.00x
``mx.fast.rms_norm``, both kernels at 92-94% of copy with the same launch shape).

Each element of ``x`` is read once and each output written once, yet both kernels load and store
with the default policy, which keeps the lines in L2 (50 MB on an H200) ahead of data that is
still to come. This probe times the library kernel with PTX cache qualifiers on its row loads and
output stores, everything else unchanged: ``.cs`` (streaming: evict first), ``.lu`` on loads (last
use) and ``L1::no_allocate`` on the read-only path (``ld.global.nc``). The weight keeps the default
policy: every row reads it. bfloat16 and float16 at 8192x4096, bfloat16 at 16384x8192.
Run from the checkout: python benchmarks/probes/rms_cache_hints.py
"""

import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/probes")

import mlx.core as mx
from gpu_row_configs import with_template
from wide_rows import compare

from graphkern.kernels import _headers as H
from graphkern.kernels._base import Plan
from graphkern.kernels.ops import rms_norm as R
from graphkern.nodes import Kernel

#: Vector loads and stores with a PTX cache qualifier (8 bytes: the library's 16-bit rows, V = 4;
#: 16 bytes: V = 8); the unaligned fallback's scalar accesses stay plain. They need nothing of
#: graphkern's header, so they go before it.
HINTS_CUDA = r"""
namespace gk {

template <typename R>
__device__ __forceinline__ R load_hinted(const void* p) {
  if constexpr (sizeof(R) == 16) {
    uint4 u;
    asm volatile(LOAD_OP ".v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    return *reinterpret_cast<const R*>(&u);
  } else if constexpr (sizeof(R) == 8) {
    uint2 u;
    asm volatile(LOAD_OP ".v2.u32 {%0, %1}, [%2];" : "=r"(u.x), "=r"(u.y) : "l"(p));
    return *reinterpret_cast<const R*>(&u);
  } else {
    return *reinterpret_cast<const R*>(p);
  }
}

template <typename R>
__device__ __forceinline__ void store_hinted(void* p, const R& value) {
  if constexpr (sizeof(R) == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(&value);
    asm volatile(STORE_OP ".v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w) : "memory");
  } else if constexpr (sizeof(R) == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(&value);
    asm volatile(STORE_OP ".v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(u.x), "r"(u.y) : "memory");
  } else {
    *reinterpret_cast<R*>(p) = value;
  }
}

}  // namespace gk
"""

ROW_LOAD = "r[c] = load_vec<T, V>(src + i);"
OUT_STORE = "store<T, V>(out, i, o);"

VARIANTS = {  # name: (load instruction, store instruction), without the vector suffix
    "ld.cs": ("ld.global.cs", "st.global"),
    "st.cs": ("ld.global", "st.global.cs"),
    "ld.cs + st.cs": ("ld.global.cs", "st.global.cs"),
    "ld.lu + st.cs": ("ld.global.lu", "st.global.cs"),
    "ld.nc no_allocate + st.cs": ("ld.global.nc.L1::no_allocate", "st.global.cs"),
}


def hinted_kernel(label: str, load_op: str, store_op: str) -> Kernel:
    """The library kernel with its row loads and output stores going through the hinted helpers."""
    common = H.CUDA_COMMON.replace(ROW_LOAD, "r[c] = load_hinted<Vec<T, V>>(src + i);")
    finish = R.RMS_CUDA.replace(OUT_STORE, "store_hinted(out + i, pack<T, V>(o));")
    assert common != H.CUDA_COMMON and finish != R.RMS_CUDA, "the library's source moved"
    header = (f'\n#if defined(__CUDACC__)\n#define LOAD_OP "{load_op}"\n#define STORE_OP "{store_op}"\n'
              f"{HINTS_CUDA}{common}{finish}\n#endif\n")
    name = "gk_rms_norm_" + "".join(ch if ch.isalnum() else "_" for ch in label)
    return replace(R.RMS_NORM, name=name, metal=None, header=header)


KERNELS = {label: hinted_kernel(label, *ops) for label, ops in VARIANTS.items()}


def hinted_plans(library: Plan) -> dict[str, Plan]:
    """Each hint at the library's launch, and the library and its best-guess hint with 16-byte
    vectors (V doubled, CH halved: the same elements a thread)."""
    values = library.template_values
    wide = with_template(library, {"V": values["V"] * 2, "CH": values["CH"] // 2},
                         (library.grid[0], 1, 1), library.threadgroup)
    plans = {name: replace(library, kernel=kernel) for name, kernel in KERNELS.items()}
    plans["16-byte vectors"] = wide
    plans["16-byte vectors, ld.cs + st.cs"] = replace(wide, kernel=KERNELS["ld.cs + st.cs"])
    return plans


def probe(shape: tuple[int, int], dt: mx.Dtype) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    w = (1 + 0.1 * mx.random.normal((shape[1],), key=mx.random.key(1))).astype(dt)
    mx.eval(x, w)
    library = R.plan_rms_norm(x, w, 1e-5)
    compare(f"rms_norm {dt} {shape}", mx.compile(lambda a: mx.fast.rms_norm(a, w, 1e-5)),
            {"library": library, **hinted_plans(library)}, x,
            mx.fast.rms_norm(x, w, 1e-5).astype(mx.float32))


if __name__ == "__main__":
    probe((8192, 4096), mx.bfloat16)
    probe((8192, 4096), mx.float16)
    probe((16384, 8192), mx.bfloat16)
