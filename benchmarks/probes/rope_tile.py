"""Probe: a RoPE that reads its angles instead of computing them, and what the angles cost to make.
rope_lean.py found the table form (rope_table.py, angles read from a float32 (cos, sin) table) at
40.2 us for bfloat16 4x32x2048x128 against 51-56 us for every form that calls sincosf beside its
loads and stores (84% vs 64% of copy). Here, timed in rotation, five rounds:

- ``table kernel`` / ``table ops``: the table alone, by rope_table.py's kernel or by compiled MLX ops;
- ``table kernel + apply``: both launches of one call (what a RoPE without a cache costs);
- ``tile R``: one kernel: a block computes the (cos, sin) of its TL positions into shared memory
  (sincosf once per block), synchronizes, then rotates R rows at those positions.

Shapes: the benchmark's 4x32x2048x128, one long sequence 1x32x8192x128, grouped KV heads
1x8x2048x128. Run from the checkout: python benchmarks/probes/rope_tile.py
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

from graphkern.kernels._base import Plan, run
from graphkern.kernels.ops import rope as R
from graphkern.nodes import TemplateArg

# Block = TL positions x P threads (P = HALF / V pairs-groups a position); blocks are (tile, chunk of
# R rows); the tile's angles are computed once into shared memory, then each thread rotates its V
# pairs at its position for the chunk's rows.
_TILE_BODY = r"""
  const int D = x_shape[x_ndim - 1];
  const int L = x_shape[x_ndim - 2];
  constexpr int P = HALF / V;
  const long long outer = gk::numel(x_shape, x_ndim) / D / L;
  const int tiles = (L + TL - 1) / TL;
  const long long chunks = (outer + R - 1) / R;
  const long long blk = blockIdx.x;
  const int l0 = static_cast<int>(blk % tiles) * TL;
  const long long chunk = blk / tiles;
  if (chunk >= chunks) {
    return;
  }
  __shared__ float sc[TL * HALF];
  __shared__ float ss[TL * HALF];
  for (int e = threadIdx.x; e < TL * HALF; e += TL * P) {
    const int off = SHAPED_OFFSET ? offset_shape[1] - (1 << 30) : offset[0];  // as the library reads it
    const float pos = static_cast<float>(l0 + e / HALF + off) * __int_as_float(SCALE);
    sincosf(pos * inv_freq[e % HALF], &ss[e], &sc[e]);
  }
  __syncthreads();
  const int lt = threadIdx.x / P;
  const int t = threadIdx.x % P;
  const int l = l0 + lt;
  if (l >= L) {
    return;
  }
  float c[V];
  float s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    c[j] = sc[lt * HALF + t * V + j];
    s[j] = ss[lt * HALF + t * V + j];
  }
  const long long o_end = min((chunk + 1) * R, outer);
  for (long long o = chunk * R; o < o_end; ++o) {
    const long long row = o * L + l;
    gk::rope_pairs<T, V, false>(x + row * D, out + row * D, t * V, HALF, c, s);
  }
"""
TILE = replace(R.ROPE, name="gk_rope_tile", cuda=_TILE_BODY)


def tile_plan(library: Plan, x: mx.array, rows: int, v: int) -> Plan:
    outer, length, half = x.size // x.shape[-1] // x.shape[-2], x.shape[-2], x.shape[-1] // 2
    p = half // v
    tl = max(1, 128 // p)
    blocks = -(-length // tl) * -(-outer // rows)
    template = tuple(t for t in library.template if t.name in ("T", "SCALE", "SHAPED_OFFSET")) + (
        TemplateArg.int("V", v), TemplateArg.int("R", rows), TemplateArg.int("HALF", half),
        TemplateArg.int("TL", tl),
    )
    return replace(library, kernel=TILE, template=template, grid=(blocks * tl * p, 1, 1),
                   threadgroup=(tl * p, 1, 1))


@mx.compile
def _ops_table(positions: mx.array, inv_freq: mx.array) -> mx.array:
    angles = positions[:, None] * inv_freq[None, :]
    return mx.stack([mx.cos(angles), mx.sin(angles)], axis=-1)


def probe(dt: mx.Dtype, shape: tuple[int, ...], rounds: int = 5) -> None:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    length = shape[-2]
    ref = mx.fast.rope(x, 128, traditional=False, base=10000.0, scale=1.0, offset=5)
    library = R.plan_rope(x, 128, base=10000.0, offset=5, scale=1.0)
    tplan = RT.table_plan(length, 5, 1.0, 128)
    cs = run(tplan)[0]
    positions = mx.arange(5, 5 + length).astype(mx.float32)
    inv_freq = library.inputs[2]
    mx.eval(cs, positions)
    apply = RT.apply_plan(x, cs, 4, 4)
    forms: dict[str, Callable[[mx.array], mx.array]] = {
        "library": on_first_input(library),
        "table R4 V4 (table made once)": on_first_input(apply),
        "table kernel": lambda a: run(tplan)[0],
        "table ops": lambda a: _ops_table(positions, inv_freq),
        "table kernel + apply": lambda a: run(replace(apply, inputs=(a, inv_freq, run(tplan)[0])))[0],
        "table ops + apply": lambda a: run(
            replace(apply, inputs=(a, inv_freq, _ops_table(positions, inv_freq)))
        )[0],
    }
    for rows in (4, 16, 32):
        for v in (4, 8) if dt.size == 2 else (2, 4):
            plan = tile_plan(library, x, rows, v)
            err = mx.abs(run(plan)[0].astype(mx.float32) - ref.astype(mx.float32)).max().item()
            forms[f"tile R{rows} V{v} (err {err:.3g})"] = on_first_input(plan)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            times[name].append(_gpu_time(fn, x) * 1e6)
    print(dt, shape, f"copy-equivalent bytes {2 * x.nbytes / 2**20:.0f} MiB", flush=True)
    for name, us in times.items():
        print(f"  {name:34} median {statistics.median(us):6.1f} us  ({'/'.join(f'{u:.1f}' for u in us)})")


if __name__ == "__main__":
    for shape in ((4, 32, 2048, 128), (1, 32, 8192, 128), (1, 8, 2048, 128)):
        for dtype in (mx.bfloat16, mx.float32):
            probe(dtype, shape)
