"""Memory and scale of graphkern's tracer against MLX's own capture.

1. Peak memory of tracing an N-primitive function (default 100,000): ``gk.trace`` against the
   bare ``mx.export_function`` with a callback that keeps every event (what any graph built from
   MLX's capture must at least hold) and one that drops them. Each measurement runs in a fresh
   process; peak RSS is read from /proc (VmHWM, reset just before the call where the kernel
   allows it) and reported over the RSS just before the call. ``--tracemalloc`` adds the Python
   heap peak (slower: tracemalloc slows allocation-heavy code by several times).
2. Leaks: R repeated traces and compiles (default 1,000) of a small model with kernels and module
   scopes, after a warm-up; RSS and the Python heap (tracemalloc) are sampled as they go and
   should stay flat.

    python benchmarks/memory_scale.py                      # 100,000 primitives, 1,000 repeats
    python benchmarks/memory_scale.py --primitives 20000 --repeats 200 --json

tests/test_scale.py runs the same measurements at CI size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("bare", "bare-drop", "graphkern")
PRIMS_PER_BLOCK = 1_000  # each block: 2 ops per step, one kernel call at its end


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_workload(primitives: int) -> tuple[Any, tuple[Any, ...]]:
    """An nn.Module of blocks; each does sin/multiply steps then one kernel call (reference
    backend: its reference folds into one kernel node). About ``primitives`` primitives."""
    import mlx.core as mx
    import mlx.nn as nn

    import graphkern as gk

    kernel = gk.Kernel("scale_shift", ["x", "y"], ["out"],
                       metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
                       reference=lambda x, y: [x * 2 + y])
    spec = [gk.OutputSpec((4,), mx.float32)]

    class Block(nn.Module):
        def __init__(self, steps: int) -> None:
            super().__init__()
            self.steps = steps

        def __call__(self, x: Any, y: Any) -> Any:
            for _ in range(self.steps):
                x = mx.sin(x) * y
            return gk.apply_in_graph(kernel, [x, y], spec, grid=(4, 1, 1), threadgroup=(4, 1, 1),
                                     template=[("T", mx.float32)]).outputs[0]

    class Chain(nn.Module):
        def __init__(self, n_blocks: int, steps: int) -> None:
            super().__init__()
            self.blocks = [Block(steps) for _ in range(n_blocks)]

        def __call__(self, x: Any, y: Any) -> Any:
            for block in self.blocks:
                x = block(x, y)
            return x

    n_blocks = max(1, primitives // PRIMS_PER_BLOCK)
    steps = max(1, (primitives // n_blocks - 2) // 2)  # the reference adds 2 (multiply, add)
    x, y = mx.ones((4,)), mx.full((4,), 0.5)
    mx.eval(x, y)
    return Chain(n_blocks, steps), (x, y)


def _on_big_stack(work: Callable[[], Any]) -> Any:
    """MLX's export recurses once per primitive: deep chains need more than 8 MiB of stack
    (graphkern's trace does the same internally)."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # handed back
            errors.append(exc)

    previous = threading.stack_size(1 << 30)
    try:
        thread = threading.Thread(target=run)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def measure_trace(mode: str, primitives: int, with_tracemalloc: bool) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import mlx.core as mx

    import graphkern as gk

    model, args = build_workload(primitives)
    gc.collect()
    if with_tracemalloc:
        tracemalloc.start()
    resettable = reset_peak()
    before = rss_bytes()
    start = time.perf_counter()
    if mode == "graphkern":
        graph = gk.trace(model, *args)
        counts = {"nodes": graph.nx.number_of_nodes(), "edges": graph.nx.number_of_edges(),
                  "kernels": len(graph.kernels()), "ok": graph.ok}
    else:
        events: list[dict[str, Any]] = []
        keep = events.append if mode == "bare" else (lambda e: None)
        _on_big_stack(lambda: mx.export_function(keep, model, *args))
        counts = {"events": len(events)}
    seconds = time.perf_counter() - start
    peak = peak_bytes()
    heap_peak = tracemalloc.get_traced_memory()[1] if with_tracemalloc else None
    counted: dict[str, int] = {}
    if mode == "bare":  # count the primitives of the traced function (the workload's size)
        counted["primitives"] = sum(1 for e in events if e["type"] == "primitive")
    return {"mode": mode, "primitives_requested": primitives, **counted, **counts,
            "seconds": round(seconds, 3), "rss_before": before, "peak_rss": peak,
            "peak_over_before": peak - before, "peak_reset": resettable,
            "tracemalloc_peak": heap_peak}


def _in_child(args: list[str], what: str, timeout: int) -> dict[str, Any]:
    """This script with ``--child args`` in a fresh interpreter; its last stdout line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          env=env, check=False, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_child(mode: str, primitives: int, with_tracemalloc: bool) -> dict[str, Any]:
    """``measure_trace`` in a fresh interpreter, so peaks of one mode never hide another's."""
    args = [mode, "--primitives", str(primitives)] + (["--tracemalloc"] if with_tracemalloc else [])
    return _in_child(args, f"{mode} measurement", timeout=1800)


def compare(primitives: int, with_tracemalloc: bool = False) -> dict[str, Any]:
    runs = {mode: run_child(mode, primitives, False) for mode in MODES}
    result: dict[str, Any] = {"primitives": runs["bare"]["primitives"], "runs": runs,
                              "ratio_rss": runs["graphkern"]["peak_over_before"]
                              / runs["bare"]["peak_over_before"],
                              "ratio_rss_vs_drop": runs["graphkern"]["peak_over_before"]
                              / max(1, runs["bare-drop"]["peak_over_before"])}
    if with_tracemalloc:
        heap = {mode: run_child(mode, primitives, True)["tracemalloc_peak"] for mode in ("bare", "graphkern")}
        result["tracemalloc_peak"] = heap
        result["ratio_tracemalloc"] = heap["graphkern"] / heap["bare"]
    return result


def leak_check(repeats: int, warmup: int, every: int) -> dict[str, Any]:
    """Repeated traces and compiles of one small model; RSS and the Python heap sampled."""
    import mlx.core as mx
    import mlx.nn as nn

    import graphkern as gk

    kernel = gk.Kernel("leak_scale_add", ["x", "y"], ["out"],
                       metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
                       reference=lambda x, y: [x * 2 + y])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(8)
            self.proj = nn.Linear(8, 8)

        def __call__(self, x: Any) -> Any:
            h = self.proj(self.norm(x))
            out = gk.apply_in_graph(kernel, [h.reshape(-1), x.reshape(-1)], [gk.OutputSpec((16,), h.dtype)],
                                    grid=(16, 1, 1), threadgroup=(16, 1, 1), template=[("T", h.dtype)])
            return out.outputs[0].reshape(x.shape)

    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    x = mx.ones((2, 8))
    mx.eval(model.parameters(), x)
    expected = model(x)

    def once() -> None:
        graph = gk.trace(model, x)
        assert graph.ok and len(graph.kernels()) == 2
        out = gk.compile(model)(x)
        assert mx.allclose(out, expected).item()

    for _ in range(warmup):
        once()
    gc.collect()
    mx.clear_cache()
    tracemalloc.start()
    samples = []
    start = time.perf_counter()
    for i in range(repeats + 1):
        if i % every == 0:
            gc.collect()
            mx.clear_cache()
            samples.append({"iteration": i, "rss": rss_bytes(),
                            "python_heap": tracemalloc.get_traced_memory()[0]})
        if i < repeats:
            once()
    seconds = time.perf_counter() - start
    tracemalloc.stop()
    first, last = samples[0], samples[-1]
    return {"repeats": repeats, "warmup": warmup, "seconds": round(seconds, 2), "samples": samples,
            "rss_growth": last["rss"] - first["rss"],
            "rss_max_over_first": max(s["rss"] for s in samples) - first["rss"],
            "python_heap_growth": last["python_heap"] - first["python_heap"]}


def run_leak_child(repeats: int, warmup: int, every: int) -> dict[str, Any]:
    return _in_child(["leak", "--repeats", str(repeats), "--warmup", str(warmup), "--every", str(every)],
                     "leak check", timeout=3600)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--primitives", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=1_000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--tracemalloc", action="store_true", help="also measure the Python heap peak")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=(*MODES, "leak"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child == "leak":
        print(json.dumps(leak_check(args.repeats, args.warmup, args.every)))
        return 0
    if args.child:
        print(json.dumps(measure_trace(args.child, args.primitives, args.tracemalloc)))
        return 0

    scale = compare(args.primitives, args.tracemalloc)
    leak = run_leak_child(args.repeats, args.warmup, args.every) if args.repeats else None
    if args.json:
        print(json.dumps({"scale": scale, "leak": leak}))
        return 0
    runs = scale["runs"]
    print(f"tracing a {scale['primitives']:,}-primitive function "
          f"({runs['graphkern']['kernels']} kernel calls, one per module block), "
          f"each mode in a fresh process")
    print(f"  {'mode':<34}{'time':>9}{'peak RSS over start':>22}")
    labels = {"bare": "mx.export_function, events kept", "bare-drop": "mx.export_function, events dropped",
              "graphkern": "gk.trace (graph built)"}
    for mode in MODES:
        r = runs[mode]
        print(f"  {labels[mode]:<34}{r['seconds']:>8.2f}s{_mib(r['peak_over_before']):>22}")
    print(f"  ratio gk.trace / export (kept):   {scale['ratio_rss']:.2f}x   (limit 3x)")
    print(f"  ratio gk.trace / export (dropped): {scale['ratio_rss_vs_drop']:.2f}x")
    print(f"  graph: {runs['graphkern']['nodes']:,} nodes, {runs['graphkern']['edges']:,} edges; "
          f"peak reset via clear_refs: {runs['graphkern']['peak_reset']}")
    if "tracemalloc_peak" in scale:
        heap = scale["tracemalloc_peak"]
        print(f"  python heap peak (tracemalloc): export {_mib(heap['bare'])}, "
              f"gk.trace {_mib(heap['graphkern'])}, ratio {scale['ratio_tracemalloc']:.2f}x")
    if leak:
        print(f"{leak['repeats']:,} repeated traces + compiles + calls after {leak['warmup']} warm-up "
              f"({leak['seconds']:.1f}s):")
        for s in leak["samples"]:
            print(f"  after {s['iteration']:>5}: RSS {_mib(s['rss'])}, "
                  f"python heap {s['python_heap'] / 1024:.1f} KiB (tracemalloc, since the warm-up)")
        print(f"  RSS growth {_mib(leak['rss_growth'])} (max over first {_mib(leak['rss_max_over_first'])}), "
              f"python heap growth {leak['python_heap_growth'] / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
