"""Probe: do 4 or 8 pairs a thread suit the 16-bit RoPE kernel, and does the allocator's state move
its time? Ran on an H200 on 2026-11-30: benchmarks/data/rope_math_h200.txt. Needs MLX's CUDA backend.
Run from the checkout: python benchmarks/probes/rope_alloc.py
"""

import sys

sys.path.insert(0, "benchmarks")

import mlx.core as mx
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input, with_template

from graphkern.kernels.ops.rope import plan_rope

x = mx.random.normal((4, 32, 2048, 128), key=mx.random.key(0)).astype(mx.bfloat16)
mx.eval(x)
plan = plan_rope(x, 128, traditional=False, base=10000.0, offset=5, scale=1.0)
v8 = with_template(plan, {"V": 8}, (plan.grid[0] // 2, 1, 1), plan.threadgroup)


def t(p):
    return _gpu_time(on_first_input(p), x) * 1e6


def stock():
    return (
        _gpu_time(lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=5), x)
        * 1e6
    )


def spare_buffers() -> None:
    for _ in range(8):
        mx.eval(mx.zeros((4, 32, 2048, 128), mx.bfloat16) + 1)


for label, prep in [
    ("plain", lambda: None),
    ("clear_cache", mx.clear_cache),
    ("after 8 spare buffers", spare_buffers),
    ("after stock", lambda: stock()),
]:
    res = []
    for _ in range(2):
        prep()
        a = t(plan)
        prep()
        b = t(v8)
        res.append(f"V4 {a:.1f} V8 {b:.1f}")
    print(label, res, "cache MB", mx.get_cache_memory() / 2**20, flush=True)
