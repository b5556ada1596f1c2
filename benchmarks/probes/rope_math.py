"""Probe: is the 16-bit RoPE kernel limited by its angle math? Times the library kernel against the
same kernel with ``__sincosf`` and with no angle math at all (wrong values, timing only).
Ran on an H200 on 2026-11-30: benchmarks/data/rope_math_h200.txt. Needs MLX's CUDA backend.
Run from the checkout: python benchmarks/probes/rope_math.py
"""

import dataclasses
import sys

sys.path.insert(0, "benchmarks")
from dataclasses import replace

import mlx.core as mx
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

from graphkern.kernels._base import run
from graphkern.kernels.ops import rope as R

variants = {
    "base": R.ROPE,
    "fast_sincos": dataclasses.replace(
        R.ROPE, name="gk_rope_fast", header=R.ROPE.header.replace("sincosf(pos", "__sincosf(pos")
    ),
    "no_math": dataclasses.replace(
        R.ROPE,
        name="gk_rope_nomath",
        header=R.ROPE.header.replace(
            "sincosf(pos * inv_freq[k + j], &s[j], &c[j]);",
            "s[j] = pos * inv_freq[k + j] * 1e-6f; c[j] = 1.0f;",
        ),
    ),
}
for dt in (mx.bfloat16, mx.float32):
    x = mx.random.normal((4, 32, 2048, 128), key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    for trad in (False, True):
        plan = R.plan_rope(x, 128, traditional=trad, base=10000.0, offset=5, scale=1.0)
        ref = mx.fast.rope(x, 128, traditional=trad, base=10000.0, scale=1.0, offset=5)
        out = []
        for rnd in range(3):
            for name, k in variants.items():
                p = replace(plan, kernel=k)
                us = _gpu_time(on_first_input(p), x) * 1e6
                err = (
                    mx.abs(run(p)[-1].astype(mx.float32) - ref.astype(mx.float32)).max().item()
                    if rnd == 0
                    else 0
                )
                out.append(f"{name} {us:.1f}" + (f" err {err:.3g}" if rnd == 0 else ""))
        print(dt, "trad" if trad else "full", "; ".join(out), flush=True)
