"""Probe: the last rows below stock. (1) float32 SwiGLU, 0.98-0.99x a compiled ``nn.silu(g) * u``:
is it the launch? MLX's compiled elementwise kernels take 16 bytes a thread in blocks of the
kernel's largest size (1024; ``mlx/backend/cuda/compiled.cpp``, ``get_launch_args``); the library
took 16 bytes in blocks of 256. Times blocks of 128-1024 threads with 16- and 32-byte vectors
(``small-blocks``: 32-256, float32). (2) float32 softmax on 16384-wide rows, 0.97x ``mx.softmax``:
both read each row twice (the second read mostly from L2). The shared-memory form keeps the row in
the block's dynamic shared memory (64 KiB, three blocks an SM), so it reads DRAM once; timed at
256-1024 threads (``shared16``: on bfloat16 rows, against the streamed form).
The first run (benchmarks/data/wide_rows_h200.txt) carried its own copy of the shared-memory kernel,
now the library's ``softmax_row_shared``, with U = 1, 2 or 4 loads in flight a thread before the
running max (U1 was as fast as any; the library has no U). Needs MLX's CUDA backend.
Run from the checkout: python benchmarks/probes/wide_rows.py [shared16 | small-blocks]
"""

import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

sys.path.insert(0, "benchmarks")

import mlx.core as mx
import mlx.nn as nn
from gpu_kernels import _gpu_time
from gpu_row_configs import with_template

from graphkern.kernels._base import Plan, run
from graphkern.kernels.ops import softmax as S
from graphkern.kernels.ops import swiglu as W

ROUNDS = 5


def chained(plan: Plan, pair: bool) -> Callable[[Any], Any]:
    """One step of a timed chain: ``plan`` on the chain's state, which replaces its first input
    (``pair``: the state is ``(x, other)``, both inputs, and ``other`` is passed on)."""
    def step(state: Any) -> Any:
        if pair:
            return run(replace(plan, inputs=state))[0], state[1]
        return run(replace(plan, inputs=(state, *plan.inputs[1:])))[0]
    return step


def compare(title: str, stock: Callable[[Any], Any], plans: dict[str, Plan], init: Any,
            ref: mx.array) -> None:
    """Time the stock step and each plan (its first input fed from the chain) in turns, ROUNDS times."""
    steps: dict[str, Callable[[Any], Any]] = {"stock": stock}
    errors = {}
    for name, plan in plans.items():
        errors[name] = mx.abs(run(plan)[0].astype(mx.float32) - ref).max().item()
        steps[name] = chained(plan, isinstance(init, tuple))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(_gpu_time(step, init) * 1e6)
    print(title, flush=True)
    for name, us in times.items():
        print(f"  {name:34} median {statistics.median(us):7.1f} us  min {min(us):7.1f}"
              f"  err {errors.get(name, 0.0):.3g}", flush=True)


def swiglu_launches(shape: tuple[int, int], dt: mx.Dtype, blocks: tuple[int, ...] = (128, 256, 512, 1024),
                    widths: tuple[int, ...] = (1, 2)) -> None:
    g = (2.0 * mx.random.normal(shape, key=mx.random.key(0))).astype(dt)
    u = mx.random.normal(shape, key=mx.random.key(1)).astype(dt)
    mx.eval(g, u)
    base = W.plan_swiglu(g, u)
    v0 = base.template_values["V"]
    plans = {f"V{v} block {block}": with_template(base, {"V": v}, (g.size // v, 1, 1), (block, 1, 1))
             for v in (v0 * w for w in widths) for block in blocks}
    compare(f"swiglu {dt} {shape}", mx.compile(lambda s: (nn.silu(s[0]) * s[1], s[1])), plans, (g, u),
            nn.silu(g.astype(mx.float32)) * u.astype(mx.float32))


def softmax_rows(shape: tuple[int, int], dt: mx.Dtype, threads: tuple[int, ...] = (256, 512, 1024)) -> None:
    """The streamed and the shared-memory softmax (at its own launch, and at ``threads``)."""
    x = (4.0 * mx.random.normal(shape, key=mx.random.key(0))).astype(dt)
    mx.eval(x)
    shared = S._plan(x, True)
    rows = x.size // shape[-1]
    plans = {"library streamed": S._plan(x, False), "library shared": shared}
    plans |= {f"shared NT{nt}": with_template(shared, {"NT": nt}, (rows * nt, 1, 1), (nt, 1, 1))
              for nt in threads}
    compare(f"softmax {dt} {shape}", mx.compile(lambda a: mx.softmax(a, axis=-1)), plans, x,
            mx.softmax(x.astype(mx.float32), axis=-1))


if __name__ == "__main__" and sys.argv[1:] == ["small-blocks"]:
    for shape in ((8192, 4096), (16384, 8192), (4096, 16384)):
        swiglu_launches(shape, mx.float32, blocks=(32, 64, 128, 256), widths=(1,))
elif __name__ == "__main__" and sys.argv[1:] == ["shared16"]:
    for shape in ((8192, 4096), (4096, 16384)):
        softmax_rows(shape, mx.bfloat16, threads=())
elif __name__ == "__main__":
    for shape in ((8192, 4096), (4096, 16384)):
        softmax_rows(shape, mx.float32)
    for shape in ((8192, 4096), (16384, 8192)):
        swiglu_launches(shape, mx.float32)
    swiglu_launches((8192, 4096), mx.bfloat16)
