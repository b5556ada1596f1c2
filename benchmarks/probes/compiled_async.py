"""Probe: does the steady compiled call close its gap to a hand-written ``mx.compile`` at the
launch-bound sizes if it schedules its outputs (``mx.async_eval``: kernels compile and encode in
the call, so failures still raise there) instead of waiting for them (``mx.eval``)? Every figure
is a compiled call followed by the caller's ``mx.eval``: hand-written ``mx.compile``, graphkern
scheduling (the library's steady call), graphkern waiting inside (the steady call before 3585f72), in
alternation, at 4K and 1M elements with 2 and 8 kernels (``benchmarks/gpu_core.py``'s functions).
Without CUDA it runs the kernels' references, to check the script.
Run from the checkout: python benchmarks/probes/compiled_async.py
"""

import sys
import types

sys.path.insert(0, "benchmarks")

import mlx.core as mx
from _timing import paired_ratio, summary
from gpu_core import CUDA, graphkern_block, hand_block, samples, stamp

import graphkern as gk
import graphkern.compiled as compiled_module

# graphkern.compiled with mx.async_eval standing for mx.eval: its steady call as it was before
WAITING = types.SimpleNamespace(**{**vars(mx), "async_eval": mx.eval})


def timed(cf, x, y, module):  # type: ignore[no-untyped-def]
    """One call of ``cf`` with ``module`` as graphkern.compiled's ``mx``, evaluated."""
    def step() -> None:
        compiled_module.mx = module
        mx.eval(cf(x, y))
        compiled_module.mx = mx
    return step


def main() -> None:
    print(f"compiled_async: {stamp()}", flush=True)
    for depth in (1, 4):
        for n in (1 << 12, 1 << 20):
            x, y = mx.random.normal((n,)), mx.random.normal((n,))
            hand = mx.compile(hand_block(depth))
            scheduling, waiting = gk.compile(graphkern_block(depth)), gk.compile(graphkern_block(depth))
            for cf in (scheduling, waiting):
                assert mx.allclose(cf(x, y), hand(x, y), rtol=1e-5, atol=1e-5).item()
            raw = samples({"mx.compile": timed(hand, x, y, mx),
                           "gk scheduling": timed(scheduling, x, y, mx),
                           "gk waiting": timed(waiting, x, y, WAITING)},
                          rounds=21, number=400 if CUDA else 10)
            t = summary(raw)
            print(f"n={n:>8} kernels={2 * depth}: " + "  ".join(
                f"{name} {t[name]['median'] * 1e6:7.2f} us" for name in raw)
                + f"  ratio scheduling {paired_ratio(raw, 'gk scheduling', 'mx.compile'):.4f}"
                f"  waiting {paired_ratio(raw, 'gk waiting', 'mx.compile'):.4f}", flush=True)


if __name__ == "__main__":
    main()
