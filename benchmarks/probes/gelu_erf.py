"""Probe: is a 16-bit GELU (erf) limited by its math? Times the library kernel against variants
with no math (out = x), erf by Abramowitz & Stegun 7.1.26, and x * normcdff(x), at two sizes, with
their largest error against nn.gelu. Ran on an H200 on 2026-11-30 before and after the library took
the 7.1.26 erf for 16-bit dtypes: benchmarks/data/gelu_erf_h200.txt. Those runs carried their own
copy of the 7.1.26 erf (now the library's ``erf_16bit``, which "as7126" calls) and had no "erff"
variant (run 1's "base" was erff). Needs MLX's CUDA backend.
Run from the checkout: python benchmarks/probes/gelu_erf.py
"""

import dataclasses
import sys

sys.path.insert(0, "benchmarks")
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

from graphkern.kernels._base import run
from graphkern.kernels._elementwise import cuda_map_body
from graphkern.kernels._headers import dual_header
from graphkern.kernels.ops import gelu as G

FAST = r"""
namespace gk {
__device__ __forceinline__ float gelu_normcdf(float x) { return x * normcdff(x); }
}  // namespace gk
"""
hdr = G._CUDA + FAST


def variant(name, expr):
    return dataclasses.replace(
        G.GELU, name=f"gk_gelu_{name}", cuda=cuda_map_body(["x"], expr), header=dual_header(hdr, "")
    )


variants = {
    "base": G.GELU,
    "no_math": variant("nomath", "x"),
    "erff": variant("erff", "gk::gelu<false, false>(x)"),
    "as7126": variant("as", "gk::gelu<false, true>(x)"),  # the library's erf_16bit, in any dtype
    "normcdf": variant("ncdf", "gk::gelu_normcdf(x)"),
}
for shape in ((8192, 4096), (16384, 8192)):
    for dt in (mx.bfloat16, mx.float16, mx.float32):
        x = (mx.random.normal(shape, key=mx.random.key(0)) * 3).astype(dt)
        mx.eval(x)
        plan = G.plan_gelu(x)
        ref = nn.gelu(x.astype(mx.float32))
        errs = {
            n: mx.abs(run(replace(plan, kernel=k))[-1].astype(mx.float32) - ref).max().item()
            for n, k in variants.items()
            if n != "no_math"
        }
        refd = mx.abs(nn.gelu(x).astype(mx.float32) - ref).max().item()
        out = []
        for _round in range(2):
            for name, k in variants.items():
                p = replace(plan, kernel=k)
                out.append(
                    f"{name} {_gpu_time(on_first_input(p), x) * 1e6:.1f}"
                )
        stock = _gpu_time(mx.compile(nn.gelu), x) * 1e6
        print(
            shape,
            dt,
            f"stock {stock:.1f}",
            "; ".join(out),
            "errs",
            {k: f"{v:.3g}" for k, v in errs.items()},
            f"stock err {refd:.3g}",
            flush=True,
        )
