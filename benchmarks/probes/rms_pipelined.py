"""Probe: the last two rows below stock, 16-bit RMSNorm at 8192x4096 (0.995x ``mx.fast.rms_norm``,
both at 94% of copy). Both kernels keep a row in registers, so an SM only overlaps one row's loads
with another's reduction across resident blocks. Here a block stays resident and walks rows
``blockIdx.x, blockIdx.x + gridDim.x, ...``, loading the next row into a second register set
before it reduces the current one, and keeps the weight in registers across its rows. Times it at
2, 4 and 8 blocks an SM (on the 132 SMs of an H200) against the library kernel and the stock op,
bfloat16 and float16 at 8192x4096, bfloat16 at 16384x8192.
On an H200 (data/rms_pipelined_h200.txt), 4 blocks an SM is the best: 35.3 / 35.2 us against
36.0 / 36.0 for the library and 36.2 / 36.0 stock in one run, 35.1 / 35.0 against 35.5 / 35.4 and
35.1 / 35.1 stock in the next: level with stock, not ahead; slower at 16384x8192 (137 against
131-132 us). The library with resident blocks of 16 rows and the weight re-read from cache ran
slower than one block a row (36.3 against 35.5 us) and was not kept.
Run from the checkout: python benchmarks/probes/rms_pipelined.py
"""

import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/probes")

import mlx.core as mx
from wide_rows import compare

from graphkern.kernels._base import Plan
from graphkern.kernels._headers import dual_header
from graphkern.kernels.ops import rms_norm as R
from graphkern.nodes import TemplateArg

SMS = 132

PIPELINED_CUDA = r"""
namespace gk {

template <typename T, int NT, int V, int CH>
__device__ __forceinline__ void load_row(Vec<T, V> (&r)[CH], const T* src) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    r[c] = reinterpret_cast<const Vec<T, V>*>(src)[c * NT + threadIdx.x];
  }
}

// Rows of exactly NT * V * CH elements, aligned to V: rows blockIdx.x + k * gridDim.x, the next
// row's loads issued before the current row is reduced.
template <typename T, int NT, int V, int CH>
__device__ __forceinline__ void rms_rows(const T* x, const T* w, T* out, float eps, int n, long long rows) {
  __shared__ float smem[32];
  Vec<T, V> cur[CH], nxt[CH], wr[CH];
  long long r = blockIdx.x;
  if (r >= rows) {
    return;
  }
  load_row<T, NT, V, CH>(wr, w);
  load_row<T, NT, V, CH>(cur, x + r * n);
  for (; r < rows; r += gridDim.x) {
    const long long rn = r + gridDim.x;
    if (rn < rows) {
      load_row<T, NT, V, CH>(nxt, x + rn * n);
    }
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      float v[V];
      unpack<T, V>(cur[c], v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        ss += v[j] * v[j];
      }
    }
    const float inv = rsqrtf(block_sum<NT>(ss, smem) / n + eps);
    Vec<T, V>* dst = reinterpret_cast<Vec<T, V>*>(out + r * n);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      float v[V], wv[V], o[V];
      unpack<T, V>(cur[c], v);
      unpack<T, V>(wr[c], wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        o[j] = round_to<T>(v[j] * inv) * wv[j];
      }
      dst[c * NT + threadIdx.x] = pack<T, V>(o);
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      cur[c] = nxt[c];
    }
  }
}

}  // namespace gk
"""

PIPELINED_BODY = r"""
  const int n = x_shape[x_ndim - 1];
  const float eps = __int_as_float(EPS);
  long long rows = 1;
  for (int d = 0; d < x_ndim - 1; ++d) {
    rows *= x_shape[d];
  }
  gk::rms_rows<T, NT, V, CH>(x, w, out, eps, n, rows);
"""

PIPELINED = replace(R.RMS_NORM, name="gk_rms_norm_pipelined", cuda=PIPELINED_BODY,
                    header=dual_header(R.RMS_CUDA + PIPELINED_CUDA, ""))


def pipelined_plan(library: Plan, blocks_per_sm: int) -> Plan:
    """``library``'s launch (threads, vector width, chunks) with resident blocks walking the rows."""
    x = library.inputs[0]
    values = library.template_values
    nt, v, ch = values["NT"], values["V"], values["CH"]
    assert ch > 0 and nt * v * ch == x.shape[-1], "rows must fill the register slots exactly"
    rows = x.size // x.shape[-1]
    blocks = min(rows, SMS * blocks_per_sm)
    template = (TemplateArg.dtype("T", x.dtype), TemplateArg.int("NT", nt), TemplateArg.int("V", v),
                TemplateArg.int("CH", ch), next(t for t in library.template if t.name == "EPS"))
    return replace(library, kernel=PIPELINED, grid=(blocks * nt, 1, 1), template=template)


def probe(shape: tuple[int, int], dt: mx.Dtype) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    w = (1 + 0.1 * mx.random.normal((shape[1],), key=mx.random.key(1))).astype(dt)
    mx.eval(x, w)
    library = R.plan_rms_norm(x, w, 1e-5)
    plans = {"library": library}
    plans |= {f"pipelined, {k} blocks/SM": pipelined_plan(library, k) for k in (2, 4, 8)}
    compare(f"rms_norm {dt} {shape}", mx.compile(lambda a: mx.fast.rms_norm(a, w, 1e-5)), plans, x,
            mx.fast.rms_norm(x, w, 1e-5).astype(mx.float32))


if __name__ == "__main__":
    probe((8192, 4096), mx.bfloat16)
    probe((8192, 4096), mx.float16)
    probe((16384, 8192), mx.bfloat16)
