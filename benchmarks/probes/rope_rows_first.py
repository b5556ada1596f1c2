"""Probe: does the RoPE kernel lose time because each row's stores come before the next row's loads
(``out`` may alias ``x`` as far as the compiler knows)? Times a variant that loads all R rows first,
and checks both against mx.fast.rope on large and odd shapes. Ran on an H200 on 2026-11-30:
benchmarks/data/rope_math_h200.txt. Needs MLX's CUDA backend.
Run from the checkout: python benchmarks/probes/rope_rows_first.py
"""

import dataclasses
import sys

sys.path.insert(0, "benchmarks")
from dataclasses import replace

import mlx.core as mx
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

from graphkern.kernels._base import run
from graphkern.kernels._headers import dual_header
from graphkern.kernels.ops import rope as R

ROWS_FN = r"""
// Rotate pairs k .. k + V - 1 of R rows (row r at x + r * stride). Every load is issued before
// any store: out may alias x as far as the compiler knows, which would serialize row after row.
template <typename T, int V, int R, bool TRADITIONAL>
__device__ __forceinline__ void rope_rows(const T* x, T* out, long long stride, int k, int half,
                                          const float (&c)[V], const float (&s)[V]) {
  float a[R][V];
  float b[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if constexpr (TRADITIONAL) {
      float t[2 * V];
      load<T, 2 * V>(x + r * stride, 2 * k, t);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        a[r][j] = t[2 * j];
        b[r][j] = t[2 * j + 1];
      }
    } else {
      load<T, V>(x + r * stride, k, a[r]);
      load<T, V>(x + r * stride, k + half, b[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float p[V];
    float q[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      p[j] = a[r][j] * c[j] - b[r][j] * s[j];
      q[j] = a[r][j] * s[j] + b[r][j] * c[j];
    }
    if constexpr (TRADITIONAL) {
      float t[2 * V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        t[2 * j] = p[j];
        t[2 * j + 1] = q[j];
      }
      store<T, 2 * V>(out + r * stride, 2 * k, t);
    } else {
      store<T, V>(out + r * stride, k, p);
      store<T, V>(out + r * stride, k + half, q);
    }
  }
}

}  // namespace gk
"""
header = R._CUDA.replace("}  // namespace gk\n", ROWS_FN, 1)
old = "  for (int r = 0; r < R && o0 + r < outer; ++r) {"
assert old in R._CUDA_BODY
body = R._CUDA_BODY.replace(
    old,
    """  if (vectors && o0 + R <= outer) {
    gk::rope_rows<T, V, R, TRADITIONAL>(x + (o0 * L + l) * D, out + (o0 * L + l) * D,
                                         static_cast<long long>(L) * D, t * V, half, c, s);
  }
  for (int r = 0; r < R && o0 + r < outer; ++r) {""",
)
old2 = "    if (vectors) {\n      gk::rope_pairs"
assert old2 in body
body = body.replace(
    old2, "    if (vectors && o0 + R <= outer) {\n    } else if (vectors) {\n      gk::rope_pairs"
)
variants = {
    "base": R.ROPE,
    "rows_first": dataclasses.replace(R.ROPE, name="gk_rope_rows", cuda=body, header=dual_header(header, "")),
}
for dt in (mx.bfloat16, mx.float16, mx.float32):
    for shape in ((4, 32, 2048, 128), (1, 32, 8192, 128), (2, 5, 37, 96)):
        x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
        mx.eval(x)
        for trad in (False, True):
            for dims, off in ((shape[-1], 5), (shape[-1] // 2, 7)):
                plan = R.plan_rope(x, dims, traditional=trad, base=10000.0, offset=off, scale=1.0)
                ref = mx.fast.rope(x, dims, traditional=trad, base=10000.0, scale=1.0, offset=off)
                errs = {
                    n: mx.abs(run(replace(plan, kernel=k))[-1].astype(mx.float32) - ref.astype(mx.float32))
                    .max()
                    .item()
                    for n, k in variants.items()
                }
                if shape[0] == 2 or dims != shape[-1]:
                    print(dt, shape, "trad" if trad else "full", dims, "errs", errs, flush=True)
                    continue
                out = []
                for _round in range(3):
                    for name, k in variants.items():
                        p = replace(plan, kernel=k)
                        us = _gpu_time(on_first_input(p), x)
                        out.append(f"{name} {us * 1e6:.1f}")
                print(dt, shape, "trad" if trad else "full", "errs", errs, "; ".join(out), flush=True)
