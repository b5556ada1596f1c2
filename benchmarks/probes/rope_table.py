"""Probe: RoPE from a cos/sin table. One small kernel writes the table of
(cos, sin) for every position and pair (a model builds it once per forward pass and every layer at
that offset reads it); the rotation kernel then reads x, the table (L2-resident: 1 MiB at 2048 x 64
pairs) and writes out, R rows and V pairs a thread. Timed against the library kernel and
``mx.fast.rope`` (16-bit and float32, 4x32x2048x128, full rotation), with the table's own launch
counted or not, and checked against ``mx.fast.rope``. If one row a thread from a table reaches
75% of copy, the library's RoPE takes this form.
Ran on an H200 on 2026-11-30: benchmarks/data/rope_offset_h200.txt (it was the offset's read).
Run from the checkout: python benchmarks/probes/rope_table.py
"""

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import cast

sys.path.insert(0, "benchmarks")

import mlx.core as mx
from gpu_kernels import _gpu_time
from gpu_row_configs import on_first_input

from graphkern.kernels._base import Plan, float_bits, run
from graphkern.kernels._headers import dual_header
from graphkern.kernels.ops import rope as R
from graphkern.nodes import Kernel, OutputSpec, TemplateArg

BLOCK = 128

_TABLE_BODY = r"""
  const int half = inv_freq_shape[0];
  const long long g = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= static_cast<long long>(length[0]) * half) {  // a Python int arrives as a 0-d array
    return;
  }
  const int l = static_cast<int>(g / half);
  const int k = static_cast<int>(g % half);
  const float pos = static_cast<float>(l + offset[0]) * __int_as_float(SCALE);
  float s;
  float c;
  sincosf(pos * inv_freq[k], &s, &c);
  cs[2 * g] = c;
  cs[2 * g + 1] = s;
"""

# The library kernel's thread mapping (its body up to the angles: x is (outer, L, D) as rows, one
# thread has pairs t*V .. t*V + V - 1 of rows o0 .. o0 + R - 1 at position l), full rotation, the
# (cos, sin) read once from the table instead of computed.
_MAPPING = R._CUDA_BODY[: R._CUDA_BODY.index("  const int b = PER_BATCH")]
_APPLY_BODY = (
    _MAPPING
    + r"""
  float c[V];
  float s[V];
  const float* table = cs + (static_cast<long long>(l) * half + t * V) * 2;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    c[j] = table[2 * j];
    s[j] = table[2 * j + 1];
  }
  for (int r = 0; r < R && o0 + r < outer; ++r) {
    const long long row = (o0 + r) * L + l;
    gk::rope_pairs<T, V, false>(x + row * D, out + row * D, t * V, half, c, s);
  }
"""
)


def _table_reference(offset: mx.array, inv_freq: mx.array, length: int, *, SCALE: int) -> list[mx.array]:
    scale = R.float_from_bits(SCALE)
    pos = (mx.arange(length).astype(mx.float32) + offset.astype(mx.float32)) * scale
    angles = pos[:, None] * inv_freq[None, :]
    return [mx.stack([mx.cos(angles), mx.sin(angles)], axis=-1)]


def _apply_reference(x: mx.array, inv_freq: mx.array, cs: mx.array, **_: object) -> list[mx.array]:
    half = x.shape[-1] // 2
    a, b = x[..., :half].astype(mx.float32), x[..., half:].astype(mx.float32)
    c, s = cs[..., 0], cs[..., 1]
    return [mx.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(x.dtype)]


TABLE = Kernel(
    "gk_rope_table",
    ["offset", "inv_freq", "length"],
    ["cs"],
    cuda=_TABLE_BODY,
    header=dual_header("", ""),
    reference=_table_reference,
)
APPLY = Kernel(
    "gk_rope_apply",
    ["x", "inv_freq", "cs"],
    ["out"],
    cuda=_APPLY_BODY,
    header=R.ROPE.header,
    reference=_apply_reference,
)


def table_plan(length: int, offset: int, scale: float, dims: int) -> Plan:
    inv_freq = R.inverse_frequencies(dims, 10000.0, None)
    half = dims // 2
    return Plan(
        TABLE,
        cast(tuple[mx.array, ...], (mx.array([offset], dtype=mx.int32), inv_freq, length)),  # a scalar too
        (OutputSpec((length, half, 2), mx.float32),),
        (length * half, 1, 1),
        (BLOCK, 1, 1),
        (TemplateArg.int("SCALE", float_bits(scale)),),
    )


def apply_plan(x: mx.array, cs: mx.array, rows: int, v: int) -> Plan:
    outer, length, half = x.size // x.shape[-1] // x.shape[-2], x.shape[-2], x.shape[-1] // 2
    threads = -(-outer // rows) * length * (half // v)
    template = (TemplateArg.dtype("T", x.dtype), TemplateArg.int("V", v), TemplateArg.int("R", rows))
    inputs = (x, R.inverse_frequencies(x.shape[-1], 10000.0, None), cs)  # its shape gives half
    return Plan(APPLY, inputs, (OutputSpec(x.shape, x.dtype),), (threads, 1, 1), (BLOCK, 1, 1), template)


def probe(
    dt: mx.Dtype, shape: tuple[int, ...] = (4, 32, 2048, 128), offset: int = 5, scale: float = 1.0
) -> str:
    """GPU microseconds of each form of RoPE on ``x`` of ``shape`` and ``dt``, with the table forms'
    largest error against ``mx.fast.rope``."""
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    dims = shape[-1]
    tplan = table_plan(shape[-2], offset, scale, dims)
    cs = run(tplan)[0]
    mx.eval(cs)
    ref = mx.fast.rope(x, dims, traditional=False, base=10000.0, scale=scale, offset=offset)
    library = R.plan_rope(x, dims, base=10000.0, offset=offset, scale=scale)

    def stock(a: mx.array) -> mx.array:
        return mx.fast.rope(a, dims, traditional=False, base=10000.0, scale=scale, offset=offset)

    one_row = apply_plan(x, cs, 1, 4)

    def with_its_table(a: mx.array) -> mx.array:
        return run(replace(one_row, inputs=(a, one_row.inputs[1], run(tplan)[0])))[0]

    timed: dict[str, Callable[[mx.array], mx.array]] = {"mx.fast.rope": stock,
                                                        "library": on_first_input(library)}
    for rows in (1, 2, 4):
        for v in (2, 4, 8) if dt.size == 2 else (1, 2, 4):
            plan = apply_plan(x, cs, rows, v)
            err = mx.abs(run(plan)[0].astype(mx.float32) - ref.astype(mx.float32)).max().item()
            timed[f"table R{rows} V{v} (err {err:.3g})"] = on_first_input(plan)
    timed["table R1 V4 + its table"] = with_its_table
    return "; ".join(f"{name} {_gpu_time(fn, x) * 1e6:.1f}" for name, fn in timed.items())


if __name__ == "__main__":
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        print(dtype, probe(dtype), flush=True)
