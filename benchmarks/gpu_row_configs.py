"""Sweep the launch shapes of the library's row kernels and RoPE on the GPU: which launch is
fastest for a dtype and shape, against the stock MLX op, by GPU time (CUPTI).

Row kernels (RMSNorm, LayerNorm, add+RMSNorm, softmax): every (threads, vector, chunks) that covers
the row. RoPE (both forms): rows a thread rotates at one position (``R``), pairs a thread takes
(``V``) and threads a block. Every candidate is checked against the stock op's output, then timed;
the one the kernel's plan picks today is marked ``*``; one run sweeps every kernel and dtype asked
for.

    python benchmarks/gpu_row_configs.py [--kernels rms_norm,softmax,rope] [--shapes 8192x4096]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import _gpu_time  # noqa: E402

from graphkern.kernels import LIBRARY  # noqa: E402
from graphkern.kernels.base import Plan, RowConfig, row_launch, run  # noqa: E402

ROW_KERNELS = ("rms_norm", "layer_norm", "add_rms_norm", "softmax")
ROPE_KERNELS = ("rope", "rope_traditional")
DEFAULT_SHAPES = {"row": "8192x4096,4096x16384", "rope": "4x32x2048x128"}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def chosen_config(plan: Plan) -> RowConfig:
    """The launch shape the kernel's plan picked (its NT, V and CH template arguments)."""
    values = {t.name: t.value for t in plan.template if isinstance(t.value, int)}
    return RowConfig(values["NT"], values["V"], values["CH"])


def candidates(n: int, dtype: mx.Dtype, chosen: RowConfig) -> Iterator[RowConfig]:
    """Every launch that covers a row of ``n`` with 32-1024 threads, 16- or 8-byte vectors, and up to
    128 bytes a thread in registers (``mx.fast.rms_norm`` keeps 32 floats), or streamed."""
    yield chosen
    threads = 32
    while threads <= 1024:
        for vector in (16 // dtype.size, 8 // dtype.size):
            if vector < 1 or n % vector:
                continue
            chunks = -(-(n // vector) // threads)
            for cfg in (RowConfig(threads, vector, chunks), RowConfig(threads, vector, 0)):
                if cfg != chosen and cfg.chunks * vector * dtype.size <= 128:
                    yield cfg
        threads *= 2


def on_first_input(plan: Plan) -> Callable[[mx.array], mx.array]:
    """``plan`` as a step of a timed chain: its first input replaced by the chain's array, its last
    output returned."""
    def step(a: mx.array) -> mx.array:
        return run(replace(plan, inputs=(a, *plan.inputs[1:])))[-1]
    return step


def with_template(plan: Plan, values: dict[str, int], grid: tuple[int, int, int],
                  group: tuple[int, int, int]) -> Plan:
    """``plan`` with these int template arguments and this launch."""
    template = tuple(replace(t, value=values[t.name]) if t.name in values else t for t in plan.template)
    return replace(plan, grid=grid, threadgroup=group, template=template)


def row_variants(plan: Plan, x: mx.array) -> Iterator[tuple[str, bool, Plan]]:
    chosen = chosen_config(plan)
    for cfg in candidates(x.shape[-1], x.dtype, chosen):
        grid, group = row_launch("sweep", x, cfg)
        values = {t.name: t.value for t in cfg.template() if isinstance(t.value, int)}
        label = f"threads {cfg.threads:4} vector {cfg.vector} chunks {cfg.chunks:2}"
        yield label, cfg == chosen, with_template(plan, values, grid, group)


def rope_variants(plan: Plan, x: mx.array) -> Iterator[tuple[str, bool, Plan]]:
    """RoPE launches: R rows a thread (sharing their angles), V pairs a thread, block size. The
    grid follows ``plan_rope``: one thread per (R rows, position, V pairs)."""
    values = {t.name: t.value for t in plan.template if isinstance(t.value, int)}
    half = int(values["HALF"])  # dims / 2
    length, d = x.shape[-2], x.shape[-1]
    outer = x.size // d // length
    best_v = int(values["V"])
    for rows in (1, 2, 4, 8):
        v = best_v
        while v >= max(1, best_v // 4):
            for block in (128, 256, 512):
                threads = -(-outer // rows) * length * (half // v)
                chosen = (rows, v, block) == (values["R"], best_v, plan.threadgroup[0])
                yield (f"rows {rows:2} pairs {v} block {block:3}", chosen,
                       with_template(plan, {"R": rows, "V": v}, (threads, 1, 1), (block, 1, 1)))
            v //= 2


def sweep(name: str, shape: tuple[int, ...], dtype: mx.Dtype, rotate: str = "partial",
          positions: tuple[float, int] = (1.0, 5)) -> list[dict[str, Any]]:
    """Time every launch variant of kernel ``name`` on the library's test input of this shape.
    RoPE's input rotates part of each row (``rotate="partial"``) or, ``"full"``, all of it, at
    positions ``(l + offset) * scale`` with ``positions = (scale, offset)``: by default those of
    ``gpu_kernels.py``, so the sweep tunes what the benchmark measures."""
    entry = LIBRARY[name]
    case = entry.make_inputs(shape, dtype, mx.random.key(0))
    if name in ROPE_KERNELS:
        scale, offset = positions
        dims = shape[-1] if rotate == "full" else case.args[1]
        kwargs = {**case.kwargs, "scale": scale, "offset": offset}
        case = replace(case, args=(case.args[0], dims), kwargs=kwargs)
    mx.eval(case.args)
    stock = entry.stock_outputs(case)

    def stock_step(a: mx.array) -> mx.array:
        return entry.stock_outputs(replace(case, args=(a, *case.args[1:])))[-1]  # the normalized output

    stock_us = _gpu_time(stock_step, case.args[0]) * 1e6
    plan = entry.plan(*case.args, **case.kwargs)
    x = case.args[0]
    rows = []
    variants = rope_variants(plan, x) if name in ROPE_KERNELS else row_variants(plan, x)
    for label, chosen, variant in variants:
        try:  # too many registers for the block, say: MLX raises when it launches
            outs = run(variant)
            err = max(mx.abs(o.astype(mx.float32) - s.astype(mx.float32)).max().tolist()  # type: ignore[type-var]
                      for o, s in zip(outs, stock))
        except Exception as exc:
            print(f"  {label}: failed: {exc}", flush=True)
            continue

        us = _gpu_time(on_first_input(variant), x) * 1e6
        rows.append({"kernel": name, "dtype": str(dtype).split(".")[-1], "shape": "x".join(map(str, shape)),
                     "config": label, "chosen": chosen, "us": us,
                     "stock_us": stock_us, "max_err": err})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(ROW_KERNELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--shapes", help=f"default: {DEFAULT_SHAPES}")
    parser.add_argument("--rotate", default="full,partial", help="RoPE cases: all features or part")
    parser.add_argument("--positions", default="1.0,5", help="RoPE's scale,offset (gpu_kernels.py's)")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        print("no CUDA backend: nothing to sweep", file=sys.stderr)
        return 0
    scale, offset = args.positions.split(",")
    positions = (float(scale), int(offset))
    for name in args.kernels.split(","):
        for dtype_name in args.dtypes.split(","):
            family = "rope" if name in ROPE_KERNELS else "row"
            for text in (args.shapes or DEFAULT_SHAPES[family]).split(","):
                for rotate in args.rotate.split(",") if family == "rope" else [""]:
                    shape = tuple(int(d) for d in text.split("x"))
                    rows = sweep(name, shape, DTYPES[dtype_name], rotate, positions)
                    rows.sort(key=lambda r: r["us"])
                    print(f"\n{name} {dtype_name} {text} {rotate}: stock {rows[0]['stock_us']:.1f} us")
                    for r in rows:
                        print(f"  {'*' if r['chosen'] else ' '} {r['config']}  {r['us']:8.1f} us  "
                              f"stock/ours {r['stock_us'] / r['us']:5.2f}x  max err {r['max_err']:.2g}",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
