"""graphkern's core on an NVIDIA GPU (MLX's CUDA backend): what graphkern costs over plain MLX.

1. Compiled graph: ``gk.compile(fn)`` against a hand-written ``mx.compile`` of the same function
   calling the bare ``mx.fast.cuda_kernel`` objects (same sources, same launches). Every call is
   followed by ``mx.eval`` of its outputs (a steady ``gk.compile`` call only schedules them); the
   two are timed in alternation. Target: ratio <= 1.02 like for like (``plain``: first compiled inside
   ``gk.without_vjp()``); the small sizes show the fixed per-call cost.
2. Eager overhead: ``gk.apply`` against calling the very MLX kernel object graphkern caches for the
   kernel (``gk.kernel_cache.get``), many calls without evaluation (graphkern's Python cost alone),
   and with ``mx.eval`` after each call. Target: <= 2 us a call.

Prints raw figures and ratios, stamped with date, GPU and MLX version; ``--markdown PATH`` writes
them as the table kept in benchmarks/RESULTS_gpu.md, ``--json PATH`` as data.
Without CUDA it runs the kernels' references instead, to check the script, and says so.
Run: python benchmarks/gpu_core.py [--quick] [--markdown gpu_core.md] [--json gpu_core.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, if not installed
import graphkern as gk  # noqa: E402
from graphkern.launching import validation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_samples, paired_ratio, summary  # noqa: E402


def samples(fns: dict[str, Callable[[], Any]], rounds: int, number: int) -> dict[str, list[float]]:
    """Per-call seconds of each function in each round, timed in turns in a new order each round."""
    return interleaved_samples(fns, rounds, number, warmup=3, shuffle=True)


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, number: int) -> dict[str, dict[str, float]]:
    """Median, min and max per-call seconds of each function (see ``samples``)."""
    return summary(samples(fns, rounds, number))

CUDA = mx.cuda.is_available()
BACKEND = "cuda" if CUDA else "reference"
TG = 256
ELEM = "int64_t elem = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;\nif (elem >= N) return;\n"

SCALE_ADD = gk.Kernel(
    "bench_scale_add", ["x", "y"], ["out"],
    cuda=ELEM + "out[elem] = x[elem] * 2.0f + y[elem];",
    reference=lambda x, y: [x * 2.0 + y],
)
SILU = gk.Kernel(
    "bench_silu", ["x"], ["out"],
    cuda=ELEM + "float v = x[elem]; out[elem] = v / (1.0f + expf(-v));",
    reference=lambda x: [x * mx.sigmoid(x)],
)


# ----------------------------------------------------------------------------- timing


def evaluating(fn: Callable[..., Any], *args: Any) -> Callable[[], None]:
    """A timed step: ``fn(*args)`` evaluated."""
    return lambda: mx.eval(fn(*args))


def stamp() -> dict[str, str]:
    try:
        device = str(mx.device_info().get("device_name", "?"))
    except Exception:  # only a label
        device = "?"
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": device if CUDA else f"none ({device}; kernels ran their references)",
            "mlx": getattr(mx, "__version__", "?"), "graphkern": gk.__version__, "backend": BACKEND,
            "python": platform.python_version(), "host": platform.machine()}


# ----------------------------------------------------------------------------- 1. compiled graph


def _spec(x: mx.array) -> list[gk.OutputSpec]:
    return [gk.OutputSpec(x.shape, x.dtype)]


def graphkern_block(depth: int) -> Callable[[mx.array, mx.array], mx.array]:
    """``depth`` blocks of kernel -> MLX ops -> kernel, through ``gk.apply_in_graph``."""
    def fn(x: mx.array, y: mx.array) -> mx.array:
        n = x.size
        kw: dict[str, Any] = dict(grid=(n, 1, 1), threadgroup=(TG, 1, 1), template=[("N", n)])
        h = x
        for _ in range(depth):
            a = gk.apply_in_graph(SCALE_ADD, [h, y], _spec(h), **kw).outputs[0]
            b = mx.tanh(a) * y
            h = gk.apply_in_graph(SILU, [b], _spec(b), **kw).outputs[0] + h
        return h
    return fn


def hand_block(depth: int) -> Callable[[mx.array, mx.array], mx.array]:
    """The same function written against MLX alone: bare ``mx.fast.cuda_kernel`` objects with the
    same sources (built here, under their own names), or the references without CUDA."""
    if CUDA:
        objs: dict[str, Any] = {
            k.name: mx.fast.cuda_kernel(name=f"hand_{k.name}", input_names=list(k.input_names),
                                        output_names=list(k.output_names), source=str(k.cuda))
            for k in (SCALE_ADD, SILU)}

        def call(k: gk.Kernel, inputs: list[mx.array]) -> mx.array:
            n = inputs[0].size
            return objs[k.name](inputs=inputs, output_shapes=[inputs[0].shape],
                                output_dtypes=[inputs[0].dtype], grid=(n, 1, 1),
                                threadgroup=(TG, 1, 1), template=[("N", n)])[0]
    else:
        def call(k: gk.Kernel, inputs: list[mx.array]) -> mx.array:
            assert k.reference is not None
            return k.reference(*inputs)[0]

    def fn(x: mx.array, y: mx.array) -> mx.array:
        h = x
        for _ in range(depth):
            a = call(SCALE_ADD, [h, y])
            b = mx.tanh(a) * y
            h = call(SILU, [b]) + h
        return h
    return fn


def bench_compiled(sizes: list[int], depths: list[int], rounds: int, budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        for n in sizes:
            mx.random.seed(0)
            x, y = mx.random.normal((n,)), mx.random.normal((n,))
            cf = gk.compile(graphkern_block(depth))
            plain = gk.compile(graphkern_block(depth))
            with gk.without_vjp():  # first compiled here: its launches stay plain, as mx.compile's are
                plain(x, y)
            hand = mx.compile(hand_block(depth))
            got, want = cf(x, y), hand(x, y)
            err = float((mx.abs(got - want).max() / (mx.abs(want).max() + 1e-30)).item())  # type: ignore[arg-type]
            assert err < 1e-5, f"gk.compile and mx.compile disagree: {err}"
            assert cf.graph is not None and len(cf.graph.kernels()) == 2 * depth
            start = time.perf_counter()
            mx.eval(hand(x, y))
            one = max(time.perf_counter() - start, 1e-6)
            number = max(3, min(2000, int(budget_s / rounds / 2 / one)))
            inner_fn = next(iter(cf._compiled.values()))  # the one mx.compile'd function it holds
            raw = samples({"mx.compile": evaluating(hand, x, y),
                           "gk.compile": evaluating(cf, x, y),  # its steady call schedules
                           "gk.compile plain": evaluating(plain, x, y),
                           # diagnosis: graphkern's mx.compile'd function without the
                           # CompiledGraph.__call__ wrapper (signature lookup, state, eval)
                           "gk graph only": evaluating(inner_fn, x, y)},
                          rounds, number)
            t = summary(raw)
            g, h = t["gk.compile"]["median"], t["mx.compile"]["median"]
            inner = t["gk graph only"]["median"]
            rows.append({"elements": n, "depth": depth, "kernels": 2 * depth, "calls": number * rounds,
                         "gk_us": g * 1e6, "mx_us": h * 1e6,
                         "ratio": paired_ratio(raw, "gk.compile", "mx.compile"),
                         "plain_us": t["gk.compile plain"]["median"] * 1e6,
                         "plain_ratio": paired_ratio(raw, "gk.compile plain", "mx.compile"),
                         "ratio_of_medians": g / h,
                         "wrapper_ratio": paired_ratio(raw, "gk.compile", "gk graph only"),
                         "gk_spread_us": [t["gk.compile"]["min"] * 1e6, t["gk.compile"]["max"] * 1e6],
                         "mx_spread_us": [t["mx.compile"]["min"] * 1e6, t["mx.compile"]["max"] * 1e6],
                         "graph_only_us": inner * 1e6, "max_rel_diff": err})
            r = rows[-1]
            print(f"compiled  n={n:>9} depth={depth} kernels={2 * depth:>2}: gk.compile "
                  f"{r['gk_us']:9.1f} us  mx.compile {r['mx_us']:9.1f} us  ratio {r['ratio']:.4f} "
                  f"(of medians {r['ratio_of_medians']:.4f})  plain {r['plain_us']:9.1f} us ratio "
                  f"{r['plain_ratio']:.4f}  [gk graph without wrapper "
                  f"{inner * 1e6:9.1f} us, wrapper ratio {r['wrapper_ratio']:.4f}]  "
                  f"(over {r['calls']} calls each)",
                  flush=True)
    return rows


# ----------------------------------------------------------------------------- 2. eager overhead


def bench_eager(rounds: int, number_lazy: int, number_eval: int) -> list[dict[str, Any]]:
    n = 1024
    mx.random.seed(1)
    x, y = mx.random.normal((n,)), mx.random.normal((n,))
    mx.eval(x, y)
    spec = _spec(x)
    template = [("N", n)]
    kw: dict[str, Any] = dict(grid=(n, 1, 1), threadgroup=(TG, 1, 1), template=template)
    if CUDA:
        obj = gk.kernel_cache.get("cuda", SCALE_ADD)  # the very object gk.apply calls

        def bare_call(a: mx.array, b: mx.array) -> Any:
            return obj(inputs=[a, b], output_shapes=[a.shape], output_dtypes=[a.dtype],
                       grid=(n, 1, 1), threadgroup=(TG, 1, 1), template=template)

        def bare() -> Any:
            return bare_call(x, y)
    else:
        reference = SCALE_ADD.reference
        assert reference is not None

        def bare() -> Any:
            return reference(x, y)

    def gk_apply() -> Any:
        return gk.apply(SCALE_ADD, [x, y], spec, **kw)

    def gk_in_graph() -> Any:
        return gk.apply_in_graph(SCALE_ADD, [x, y], spec, **kw).outputs

    bound = gk.bind(SCALE_ADD, spec, **kw)

    def gk_bound() -> Any:
        return bound(x, y)

    def gk_apply_no_vjp() -> Any:  # as inside `with gk.without_vjp():` (entering it is counted)
        with gk.without_vjp():
            return gk.apply(SCALE_ADD, [x, y], spec, **kw)

    assert mx.allclose(gk_apply()[0], bare()[0]).item()
    assert mx.allclose(gk_bound()[0], bare()[0]).item()
    rows = []
    if CUDA:  # diagnosis: where graphkern's time goes, layer by layer (private functions)
        from graphkern.launching import launch_paths
        try:
            launch, checked = validation.validate(SCALE_ADD, [x, y], spec, kw["grid"], kw["threadgroup"],
                                               template)
            replayed = mx.compile(bare_call)  # the bare call replayed, as a plain launch now is
            # the compiled custom function gk.apply calls for a known launch (on this thread)
            [form] = launch_paths.thread_forms(launch)
            layers = {"bare": bare,
                      "bare, replayed by mx.compile": lambda: replayed(x, y),
                      "plain launch (_run_native)": lambda: launch_paths.run_native(launch, checked),
                      "vjp wrapper, replayed": lambda: form(x, y),
                      "+ input check (bound launch)": gk_bound,
                      "+ launch check (gk.apply)": gk_apply}
            t = interleaved(layers, rounds, number_lazy)
            for name, v in t.items():
                print(f"eager layers, lazy: {name:>30}: {v['median'] * 1e6:7.2f} us", flush=True)
            rows.append({"mode": "layers", **{k: v["median"] * 1e6 for k, v in t.items()}})
        except (AttributeError, KeyError, ValueError) as exc:  # the runtime changed: skip the diagnosis
            print(f"eager layers: skipped ({exc})")
    for label, number, wrap in (("lazy (no eval)", number_lazy, lambda f: f),
                                ("with mx.eval", number_eval, lambda f: (lambda: mx.eval(f())))):
        t = interleaved({"bare": wrap(bare), "gk.apply": wrap(gk_apply), "gk.bind": wrap(gk_bound),
                         "gk.apply_in_graph": wrap(gk_in_graph), "no vjp": wrap(gk_apply_no_vjp)},
                        rounds, number)
        b, a, bd, ig, nv = (t[k]["median"] * 1e6
                            for k in ("bare", "gk.apply", "gk.bind", "gk.apply_in_graph", "no vjp"))
        rows.append({"mode": label, "calls": number * rounds, "bare_us": b, "gk_apply_us": a,
                     "overhead_us": a - b, "bound_us": bd, "bound_overhead_us": bd - b,
                     "gk_apply_in_graph_us": ig, "in_graph_overhead_us": ig - b,
                     "no_vjp_us": nv, "no_vjp_overhead_us": nv - b,
                     "bare_spread_us": [t["bare"]["min"] * 1e6, t["bare"]["max"] * 1e6],
                     "gk_spread_us": [t["gk.apply"]["min"] * 1e6, t["gk.apply"]["max"] * 1e6]})
        print(f"eager {label:>15}: bare {b:7.2f} us  gk.apply {a:7.2f} us  overhead {a - b:+6.2f} us  "
              f"bound launch {bd:7.2f} us ({bd - b:+6.2f})  "
              f"apply_in_graph {ig:7.2f} us ({ig - b:+6.2f})  without_vjp {nv:7.2f} us ({nv - b:+6.2f})  "
              f"(over {number * rounds} calls each)",
              flush=True)
    return rows


# ----------------------------------------------------------------------------- report


def markdown(meta: dict[str, str], compiled: list[dict[str, Any]], eager: list[dict[str, Any]]) -> str:
    lines = [
        "# graphkern on an NVIDIA GPU: core benchmarks",
        "",
        f"Produced by `python benchmarks/gpu_core.py` on {meta['date']}: GPU **{meta['gpu']}**, "
        f"MLX {meta['mlx']} (backend {meta['backend']}), graphkern {meta['graphkern']}, "
        f"Python {meta['python']}. Medians of interleaved rounds; each call evaluates its outputs "
        "unless marked lazy. Raw figures in microseconds per call.",
        "",
        "## Compiled graph vs hand-written mx.compile (target: ratio <= 1.02)",
        "",
        "`gk.compile(fn)` against `mx.compile` of the same function calling the bare "
        "`mx.fast.cuda_kernel` objects. Each block: custom kernel, `tanh`, multiply, custom kernel, "
        "add; float32 vectors of the given length.",
        "",
        "Ratio: the median over rounds of gk.compile's time over mx.compile's in the same round "
        "(each round times the four in turn, in a new random order each round). "
        "`gk.compile` launches carry their custom vjp (`mx.grad` differentiates through them); "
        "`plain` is the same graph first compiled inside `gk.without_vjp()`, whose launches are "
        "plain as the hand-written `mx.compile`'s are: the like-for-like ratio. "
        "The wrapper ratio compares gk.compile with its own `mx.compile`d function called directly.",
        "",
        "| elements | blocks | kernels | gk.compile (us) | plain (us) | mx.compile (us) | ratio "
        "| plain ratio | gap (us) | gk graph without wrapper (us) | wrapper ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in compiled:
        lines.append(f"| {r['elements']:,} | {r['depth']} | {r['kernels']} | {r['gk_us']:.1f} | "
                     f"{r['plain_us']:.1f} | {r['mx_us']:.1f} | {r['ratio']:.4f} | "
                     f"{r['plain_ratio']:.4f} | {r['gk_us'] - r['mx_us']:+.1f} | "
                     f"{r['graph_only_us']:.1f} | {r['wrapper_ratio']:.4f} |")
    lines += [
        "",
        "## Eager gk.apply overhead over the bare kernel object (target: <= 2 us a call)",
        "",
        "1024-element float32 kernel; `bare` calls the MLX kernel object graphkern caches for it. "
        "`gk.apply` wraps each GPU launch in a cached, `mx.compile`d `mx.custom_function` so `mx.grad` "
        "works through it (an eager call replays the recorded nodes); "
        "inside `gk.without_vjp()` (entered on every call here) it launches plain: the bare kernel "
        "call, also replayed through `mx.compile`. A bound launch (`gk.bind`) is the same launch "
        "with its configuration checked once, when it was bound.",
        "",
        "| mode | bare (us) | gk.apply (us) | overhead (us) | bound launch (us) | its overhead (us) "
        "| gk.apply_in_graph (us) | its overhead (us) | gk.apply in without_vjp (us) "
        "| its overhead (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    layers = [r for r in eager if r["mode"] == "layers"]
    for r in (r for r in eager if r["mode"] != "layers"):
        lines.append(f"| {r['mode']} | {r['bare_us']:.2f} | {r['gk_apply_us']:.2f} | "
                     f"{r['overhead_us']:+.2f} | {r['bound_us']:.2f} | {r['bound_overhead_us']:+.2f} | "
                     f"{r['gk_apply_in_graph_us']:.2f} | "
                     f"{r['in_graph_overhead_us']:+.2f} | {r['no_vjp_us']:.2f} | "
                     f"{r['no_vjp_overhead_us']:+.2f} |")
    if layers:
        lines += ["", "Where the eager time goes (lazy calls): the bare call, its `mx.compile` replay, "
                  "the plain launch uncompiled, the compiled custom function a known launch "
                  "replays, a bound launch (that plus the input check) and `gk.apply` (plus the "
                  "launch check):", "",
                  "| layer | us per call |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in layers[0].items() if k != "mode"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and calls (a smoke run)")
    parser.add_argument("--markdown", help="write the results table here")
    parser.add_argument("--json", help="write the raw figures here")
    args = parser.parse_args()
    meta = stamp()
    print(f"graphkern gpu_core: {meta}", flush=True)
    if args.quick:
        compiled = bench_compiled([1 << 12, 1 << 20], [1], rounds=3, budget_s=0.5)
        eager = bench_eager(rounds=3, number_lazy=2000, number_eval=200)
    else:
        compiled = bench_compiled([1 << 12, 1 << 20, 1 << 24, 1 << 26], [1, 4], rounds=21, budget_s=5.0)
        eager = bench_eager(rounds=15, number_lazy=20000, number_eval=2000)
    text = markdown(meta, compiled, eager)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "compiled": compiled, "eager": eager}, f, indent=1)


if __name__ == "__main__":
    main()
