"""Probe: is the 16-bit RoPE's 50 us its structure or the luck of the draw? rope_table.py gave a table
form 40 us (8 of 9 launches at 2-4 rows a thread) while the library kernel read 51.6 us in the same
process. Here every form is timed in rotation, five rounds, against two ceilings for a kernel with a
fresh output (a graphkern copy kernel, 16-byte accesses; GELU of the same tensor), and the library
kernel again with its input at four offsets inside one buffer (does the address set the time?):

- ``lean``: the table probe's body (vector path only, no tail copy) with the angles computed by
  sincosf instead of read from a table (R rows, V pairs a thread);
- ``table``: rope_table.py's apply kernel at R4 V4 (its table made once, outside the timing).

Run from the checkout: python benchmarks/probes/rope_lean.py
"""

import statistics
import sys
from collections.abc import Callable
from dataclasses import replace

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/probes")

import mlx.core as mx
import rope_table as RT
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

import graphkern.kernels as gkk
from graphkern.kernels._base import Plan, run
from graphkern.kernels.ops import rope as R
from graphkern.nodes import Kernel, OutputSpec, TemplateArg

_COPY_BODY = r"""
  const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if ((g + 1) * V <= N) {
    *reinterpret_cast<gk::Vec<T, V>*>(out + g * V) = *reinterpret_cast<const gk::Vec<T, V>*>(x + g * V);
  }
"""
COPY = Kernel("gk_copy_probe", ["x"], ["out"], cuda=_COPY_BODY, header=R.ROPE.header,
              reference=lambda x, **_: [x])

_LEAN_BODY = RT._MAPPING + r"""
  const int off = SHAPED_OFFSET ? offset_shape[1] - (1 << 30) : offset[0];  // as the library reads it
  const float pos = static_cast<float>(l + off) * __int_as_float(SCALE);
  float c[V];
  float s[V];
  gk::rope_angles<V>(pos, inv_freq, t * V, c, s);
  for (int r = 0; r < R && o0 + r < outer; ++r) {
    const long long row = (o0 + r) * L + l;
    gk::rope_pairs<T, V, false>(x + row * D, out + row * D, t * V, half, c, s);
  }
"""
LEAN = replace(R.ROPE, name="gk_rope_lean", cuda=_LEAN_BODY)


def copy_plan(x: mx.array) -> Plan:
    v = 16 // x.dtype.size
    return Plan(COPY, (x,), (OutputSpec(x.shape, x.dtype),), (x.size // v, 1, 1), (256, 1, 1),
                (TemplateArg.dtype("T", x.dtype), TemplateArg.int("V", v), TemplateArg.int("N", x.size)))


def lean_plan(library: Plan, x: mx.array, rows: int, v: int) -> Plan:
    outer, length, half = x.size // x.shape[-1] // x.shape[-2], x.shape[-2], x.shape[-1] // 2
    threads = -(-outer // rows) * length * (half // v)
    template = tuple(
        replace(t, value={"R": rows, "V": v}[t.name]) if t.name in ("R", "V") else t for t in library.template
    )
    return replace(library, kernel=LEAN, template=template, grid=(threads, 1, 1))


def on_view(step: Callable[[mx.array], mx.array], view: mx.array) -> Callable[[mx.array], mx.array]:
    """``step`` on ``view`` whatever the chain passes (an input at a given offset)."""
    return lambda _: step(view)


def probe(dt: mx.Dtype, shape: tuple[int, ...] = (4, 32, 2048, 128), rounds: int = 5) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    ref = mx.fast.rope(x, 128, traditional=False, base=10000.0, scale=1.0, offset=5)
    library = R.plan_rope(x, 128, base=10000.0, offset=5, scale=1.0)
    cs = run(RT.table_plan(shape[-2], 5, 1.0, 128))[0]
    mx.eval(cs)
    forms: dict[str, Callable[[mx.array], mx.array]] = {
        "copy kernel": on_first_input(copy_plan(x)),
        "gelu": gkk.gelu,
        "library": on_first_input(library),
        "table R4 V4": on_first_input(RT.apply_plan(x, cs, 4, 4)),
    }
    for rows, v in ((1, 8), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8)):
        plan = lean_plan(library, x, rows, v)
        err = mx.abs(run(plan)[0].astype(mx.float32) - ref.astype(mx.float32)).max().item()
        forms[f"lean R{rows} V{v} (err {err:.3g})"] = on_first_input(plan)
    # The library kernel with its input at an offset inside one buffer (a view MLX passes as is).
    n = x.size
    base = mx.concatenate([x.reshape(-1), x.reshape(-1)[: 1 << 20]])
    mx.eval(base)
    for shift in (256, 65536, 1 << 19):
        view = base[shift: shift + n].reshape(shape)
        forms[f"library, input +{shift * dt.size} B"] = on_view(on_first_input(library), view)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            times[name].append(_gpu_time(fn, x) * 1e6)
    print(dt, shape, flush=True)
    for name, us in times.items():
        print(f"  {name:34} median {statistics.median(us):6.1f} us  ({'/'.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    for dtype in (mx.bfloat16, mx.float32):
        probe(dtype)
