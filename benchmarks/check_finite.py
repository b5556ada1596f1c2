"""What check_finite costs a compiled call: gk.compile / gk.wrap with and without it, side by side.

check_finite reduces each call's outputs to one flag (``isfinite`` + ``all`` per output) and waits
for it; without it, a steady call schedules its outputs and returns. Both sides here are followed
by the caller's ``mx.eval`` of the outputs, as a caller that uses them would do, and timed in
alternation. The values trace that names a root cause runs only when a NaN/Inf was found, so it
is not part of a call's cost (gk.inspect's own cost: benchmarks/trace_scale.py).
Run: python benchmarks/check_finite.py [--rounds 15 --number 20]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, interleaved_samples, median_seconds, paired_ratio, summary  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.compiling import all_finite  # noqa: E402
from graphkern.models import patch, wrap  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, random_model  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(header("check_finite: compiled calls with and without the NaN/Inf check"))
    for size, extra in SIZES.items():
        model = random_model({**TINY_CONFIGS["llama"], **extra})
        patch(model)
        tokens = mx.array([[(7 * i) % 128 for i in range(args.tokens)]])
        fns = {}
        for name, fn in (("gk.compile", gk.compile(model)),
                         ("gk.compile check_finite", gk.compile(model, check_finite=True)),
                         ("gk.wrap", wrap(model)),
                         ("gk.wrap check_finite", wrap(model, check_finite=True))):
            fns[name] = (lambda f, t: lambda: mx.eval(f(t)))(fn, tokens)
        print(f"\n## patched llama, {size}: hidden {model.args.hidden_size}, "
              f"{model.args.num_hidden_layers} layers, 1 x {args.tokens} tokens")
        for clock_name, clock in (("wall", time.perf_counter), ("process CPU", time.process_time)):
            samples = interleaved_samples(fns, rounds=args.rounds, number=args.number, clock=clock)
            stats = summary(samples)
            print(f"{clock_name} time, median (min-max) per call over {args.rounds} rounds of {args.number}:")
            for name, s in stats.items():
                print(f"{name:>26}: {s['median'] * 1e6:9.1f} us  ({s['min'] * 1e6:.1f}-{s['max'] * 1e6:.1f})")
            for base in ("gk.compile", "gk.wrap"):
                checked = f"{base} check_finite"
                extra_us = (stats[checked]["median"] - stats[base]["median"]) * 1e6
                print(f"{checked} / {base}: {paired_ratio(samples, checked, base):.3f} "
                      f"({extra_us:+.1f} us a call)")
        logits = model(tokens)
        mx.eval(logits)
        alone = median_seconds(functools.partial(all_finite, logits), repeats=args.rounds,
                               number=args.number * 10)
        print(f"the check alone, on evaluated logits {tuple(logits.shape)}: {alone * 1e6:.1f} us")


if __name__ == "__main__":
    main()
