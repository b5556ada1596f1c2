"""Probe: the RoPE kernels' slow reads were the offset's. MLX's CUDA allocator keeps arrays of at most
8 bytes in host-mapped managed memory (the small pool of mlx/backend/cuda/allocator.cpp), so every
warp's read of a one-element offset crosses to the host; rope_table.py's kernel, the one form that
read no offset, was the one at 40 us (rope_lean.py, rope_tile.py). Times, in rotation, five rounds,
the library kernel with its offset carried in a shape (``plan_rope``'s form on CUDA now), in a view
of a 16-byte array a GPU op wrote (made once) and in the cached one-element array (the old form),
the no-table kernel of rope_lean.py likewise, and the table form as the reference.
Run from the checkout: python benchmarks/probes/rope_offset.py
"""

import statistics
import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/probes")

import mlx.core as mx
import rope_lean as RL
import rope_table as RT
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

from graphkern.kernels._base import Plan, run
from graphkern.kernels.ops import rope as R


def with_offset(plan: Plan, offset: mx.array) -> Plan:
    """``plan`` reading its offset from the array ``offset`` (not from a shape)."""
    template = tuple(replace(t, value=False) if t.name == "SHAPED_OFFSET" else t for t in plan.template)
    return replace(plan, inputs=(plan.inputs[0], offset, *plan.inputs[2:]), template=template)


def probe(dt: mx.Dtype, shape: tuple[int, ...], rounds: int = 5) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    ref = mx.fast.rope(x, 128, traditional=False, base=10000.0, scale=1.0, offset=5)
    library = R.plan_rope(x, 128, base=10000.0, offset=5, scale=1.0)
    scalar = R._offset_array(5, False)
    device = mx.concatenate([scalar, mx.zeros((3,), dtype=mx.int32)])[:1]  # a GPU op's 16 bytes
    cs = run(RT.table_plan(shape[-2], 5, 1.0, 128))[0]
    mx.eval(cs, device)
    lean = RL.lean_plan(library, x, 4, 4)
    plans = {
        "library, offset in a shape": library,
        "library, device offset": with_offset(library, device),
        "library, small-pool offset": with_offset(library, scalar),
        "lean R4 V4, device offset": with_offset(lean, device),
        "lean R4 V4, small-pool offset": with_offset(lean, scalar),
        "table R4 V4 (no offset)": RT.apply_plan(x, cs, 4, 4),
    }
    times: dict[str, list[float]] = {name: [] for name in plans}
    errors = {}
    for name, plan in plans.items():
        errors[name] = mx.abs(run(plan)[0].astype(mx.float32) - ref.astype(mx.float32)).max().item()
    for _ in range(rounds):
        for name, plan in plans.items():
            times[name].append(_gpu_time(on_first_input(plan), x) * 1e6)
    print(dt, shape, flush=True)
    for name, us in times.items():
        print(f"  {name:30} median {statistics.median(us):6.1f} us  err {errors[name]:.3g}"
              f"  ({'/'.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    for shape in ((4, 32, 2048, 128), (1, 32, 8192, 128), (1, 8, 2048, 128)):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            probe(dtype, shape)
