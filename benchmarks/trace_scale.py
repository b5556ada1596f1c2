"""Trace cost: gk.trace vs the bare mx.export_function callback, on a chain of 1k to 100k primitives
and on a real mlx-lm llama; and the values trace (gk.inspect) vs an eager forward plus a trace.

Targets: <= 2x the bare callback at 10,000 primitives, growing linearly to 100,000; on a 32-layer
llama with its module scopes, gk.trace <= 2x the bare callback plus a networkx build of its
events, and gk.inspect <= 3x an eager forward plus gk.trace.
Run: python benchmarks/trace_scale.py [--max 100000] [--model-only --layers 32 --tokens 8]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import networkx as nx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, interleaved_samples, median_seconds, paired_ratio, summary  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, random_model  # noqa: E402


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


def bare_graph(fn: Any, *args: mx.array) -> nx.MultiDiGraph:
    """The bare callback plus the plainest networkx graph of its events: a node per primitive
    with its name, an edge per array read (the cyclic collector paused, as gk.trace does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        events: list = []
        mx.export_function(events.append, fn, *args)
        g = nx.MultiDiGraph()
        made: dict[str, int] = {}
        edges = []
        for event in events:
            if event["type"] != "primitive":
                continue
            node = len(g)
            g.add_node(node, op=event["name"])
            for array, _, _ in event["outputs"]:
                made[array] = node
            edges += [(made[a], node, a) for a, _, _ in event["inputs"] if a in made]
        g.add_edges_from(edges)
        return g
    finally:
        if enabled:
            gc.enable()


def main() -> None:
    """MLX's export recurses per primitive: both sides of the chain run on a thread with a 1 GiB
    stack, as graphkern's own trace does (the default 8 MiB overflows near 50,000 primitives).
    The model section (4,000 primitives) runs on the main thread: an eager forward on a thread
    of its own, next to graphkern's trace threads, makes MLX abort at exit."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--max", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-only", action="store_true", help="Only the llama section.")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--trace-only", action="store_true",
                        help="Leave out gk.inspect (to time the trace of a graphkern without it).")
    args = parser.parse_args()
    if not args.model_only:
        threading.stack_size(1 << 30)
        thread = threading.Thread(target=chain_section, args=(args,))
        thread.start()
        thread.join()
    model_section(args)


def chain_section(args: argparse.Namespace) -> None:
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


def model_section(args: argparse.Namespace) -> None:
    """gk.trace and gk.inspect on a random-weight mlx-lm llama of ``--layers`` layers."""
    model = random_model({**TINY_CONFIGS["llama"], "num_hidden_layers": args.layers})
    tokens = mx.array([[(7 * i) % 128 for i in range(args.tokens)]])
    prims = bare_graph(model, tokens).number_of_nodes()
    graph = gk.trace(model, tokens)
    print(f"\n{header('a real model: gk.trace and gk.inspect against their baselines')}")
    print(f"llama, {args.layers} layers, {args.tokens} tokens, {prims} primitives; gk.trace: "
          f"{graph.nx.number_of_nodes()} nodes, {len({d['scope'] for _, d in graph.nx.nodes(data=True)})} "
          f"module scopes")
    fns = {
        "bare callback + networkx": lambda: bare_graph(model, tokens),
        "gk.trace": lambda: gk.trace(model, tokens),
    }
    if not args.trace_only:
        fns["eager forward"] = lambda: mx.eval(model(tokens))
        fns["gk.inspect"] = lambda: gk.inspect(model, tokens)
    for clock_name, clock in (("process CPU time", time.process_time), ("wall time", time.perf_counter)):
        samples = interleaved_samples(fns, rounds=args.rounds, clock=clock)
        stats = summary(samples)
        print(f"\n{clock_name}, median (min-max) of {args.rounds} interleaved rounds:")
        for name, s in stats.items():
            print(f"{name:>26}: {s['median'] * 1e3:8.1f} ms  ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})")
        trace_ratio = paired_ratio(samples, "gk.trace", "bare callback + networkx")
        print(f"gk.trace / (bare callback + networkx build): {trace_ratio:.2f}  (target <= 2)")
        if not args.trace_only:
            base = [e + t for e, t in zip(samples["eager forward"], samples["gk.trace"])]
            values_ratio = statistics.median(v / b for v, b in zip(samples["gk.inspect"], base))
            print(f"gk.inspect / (eager forward + gk.trace):     {values_ratio:.2f}  (target <= 3)")


if __name__ == "__main__":
    main()
