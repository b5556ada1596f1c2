"""Probe: does the 16-bit RoPE kernel's thread structure set its speed? Times
the kernel with no angle math (timing only) at R rows a thread in 1, 2, 4, 8 and V pairs a thread in
2, 4, 8, against a copy of the same tensor (``x + 0`` compiled). If one row a thread without math
reaches the copy's time, the fix is angles shared another way (a cos/sin table per call, reused by
every layer at that offset, or a warp shuffle), not a new launch shape.
Ran on an H200 on 2026-11-30: benchmarks/data/rope_offset_h200.txt (it was the offset's read).
Run from the checkout: python benchmarks/probes/rope_structure.py
"""

import dataclasses
import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")

import mlx.core as mx
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input, with_template

from graphkern.kernels.ops import rope as R

NO_MATH = dataclasses.replace(
    R.ROPE,
    name="gk_rope_nomath",
    header=R.ROPE.header.replace(
        "sincosf(pos * inv_freq[k + j], &s[j], &c[j]);",
        "s[j] = pos * inv_freq[k + j] * 1e-6f; c[j] = 1.0f;",
    ),
)
assert NO_MATH.header != R.ROPE.header, "the angle line of the RoPE header moved: update the probe"

for dt in (mx.bfloat16, mx.float32):
    x = mx.random.normal((4, 32, 2048, 128), key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    copy = _gpu_time(mx.compile(lambda a: a + 0), x) * 1e6
    plan = R.plan_rope(x, 128, base=10000.0, offset=5, scale=1.0)
    outer, length, half = x.size // 128 // 2048, 2048, 64
    results = []
    for rows in (1, 2, 4, 8):
        for v in (2, 4, 8) if dt.size == 2 else (1, 2, 4):  # 16-byte accesses at most
            threads = -(-outer // rows) * length * (half // v)
            variant = with_template(
                replace(plan, kernel=NO_MATH), {"R": rows, "V": v}, (threads, 1, 1), plan.threadgroup
            )
            try:
                us = [
                    _gpu_time(on_first_input(variant), x) * 1e6
                    for _ in range(3)
                ]
            except Exception as exc:  # a launch MLX refuses: say so and go on
                results.append(f"R{rows} V{v} failed: {exc}")
                continue
            results.append(f"R{rows} V{v} " + "/".join(f"{u:.1f}" for u in us))
    print(dt, f"copy {copy:.1f} us;", "; ".join(results), flush=True)
