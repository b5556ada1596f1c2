"""Steady-state call of a graphkern compiled graph vs a hand-written ``mx.compile``.

Target: ratio <= 1.02. Both sides run the demo model (two kernels per block) with the
same weights and inputs, evaluate their outputs, and are timed in alternation.
Run: python benchmarks/compile_overhead.py [--batch 8 --length 128]
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import forward_arguments, header, interleaved  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.demo import DemoModel, demo_inputs  # noqa: E402


def main() -> None:
    parser = forward_arguments(batch=4)
    args = parser.parse_args()
    print(header("compiled graph vs hand-written mx.compile (demo model)"))
    mx.random.seed(0)
    model = DemoModel(dims=128, hidden=256, layers=4)
    tokens = demo_inputs(args.batch, args.length)
    graphkern_fn = gk.compile(model)
    by_hand = mx.compile(model, inputs=model.state)
    assert mx.allclose(graphkern_fn(tokens), by_hand(tokens)).item()
    times = interleaved({
        "mx.compile": lambda: mx.eval(by_hand(tokens)),
        "gk.compile": lambda: mx.eval(graphkern_fn(tokens)),
    }, rounds=args.rounds, number=args.number)
    for name, seconds in times.items():
        print(f"{name:>12}: {seconds * 1e6:10.1f} us/call")
    print(f"ratio gk/mx: {times['gk.compile'] / times['mx.compile']:.3f}  (target <= 1.02); "
          f"overhead {(times['gk.compile'] - times['mx.compile']) * 1e6:.1f} us/call")


if __name__ == "__main__":
    main()
