"""Trace cost: gk.trace vs the bare mx.export_function callback, 1k to 100k primitives.

Target: <= 2x the bare callback at 10,000 primitives, growing linearly to 100,000.
Run: python benchmarks/trace_scale.py [--max 100000]
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, median_seconds  # noqa: E402

import graphkern as gk  # noqa: E402


def chain(steps: int):
    """A function of ``4 * steps`` primitives (sin, multiply, add, tanh a step), no constants."""

    def fn(x: mx.array) -> mx.array:
        for _ in range(steps):
            x = mx.tanh(mx.sin(x) * x + x)
        return x

    return fn


def bare_export(fn, x: mx.array) -> int:
    events: list = []
    mx.export_function(events.append, fn, x)
    return sum(1 for e in events if e["type"] == "primitive")


def main() -> None:
    """MLX's export recurses per primitive: both sides run on a thread with a 1 GiB stack,
    as graphkern's own trace does (the default 8 MiB overflows near 50,000 primitives)."""
    threading.stack_size(1 << 30)
    thread = threading.Thread(target=_main)
    thread.start()
    thread.join()


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(header("trace cost: graphkern.trace vs bare mx.export_function callback"))
    x = mx.ones((4,))
    print(f"{'primitives':>10} {'bare ms':>10} {'trace ms':>10} {'ratio':>7} {'trace us/prim':>14}")
    sizes = [n for n in (1_000, 3_000, 10_000, 30_000, 100_000) if n <= args.max]
    for n in sizes:
        fn = chain(n // 4)
        prims = bare_export(fn, x)
        bare = median_seconds(functools.partial(bare_export, fn, x), repeats=args.repeats)
        traced = median_seconds(functools.partial(gk.trace, fn, x), repeats=args.repeats)
        print(f"{prims:>10} {bare * 1e3:>10.1f} {traced * 1e3:>10.1f} {traced / bare:>7.2f} "
              f"{traced / prims * 1e6:>14.2f}")


if __name__ == "__main__":
    main()
