"""Host time per launch: a library kernel against MLX's bare custom kernel and ``mx.fast``.

A chain of 64 dependent calls on a (128, 1024) float32 array, evaluated at the end, so each
launch's host cost (building the graph, then MLX's dispatch) is what the time measures, not the GPU.
Each is run eagerly and inside ``mx.compile``:

  mx.fast.rms_norm         the stock op
  raw cuda_kernel          an ``mx.fast.cuda_kernel`` copy, called directly (CUDA only)
  raw, rms_norm's source   MLX's kernel object built from ``gkk.rms_norm``'s own source and header,
                           called directly with the library's launch (CUDA only): what MLX itself
                           costs for that kernel, since it formats and hashes the whole source at
                           every launch
  gkk.rms_norm             the library's layer function (in ``gk.without_vjp()`` as an evaluating
                           patched model calls it; plain, differentiable, as a training one does;
                           "direct": calling MLX's kernel object instead of replaying the launch's
                           compiled form, the eager path's alternative)
  segment of 8             eight ``gkk.rms_norm`` calls in one ``mx.compile``d function, the way a
                           decoding patched block replays them (see graphkern.models.segments)

Ratios are taken round by round against the raw copy where there is one, else ``mx.fast``; the
``gkk`` rows also against the raw kernel of the same source (last column).
Run: python benchmarks/launch_cost.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, interleaved_samples, paired_ratio, summary  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.kernels as gkk  # noqa: E402
from graphkern.launching import launch_paths

CHAIN = 64
_COPY = "auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0] * x_shape[1]) out[i] = x[i];"


def chain(step: Callable[[mx.array], mx.array], x: mx.array, calls: int = CHAIN) -> Callable[[], None]:
    """``calls`` dependent calls of ``step`` from ``x``, then one evaluation."""
    def run() -> None:
        a = x
        for _ in range(calls):
            a = step(a)
        mx.eval(a)

    return run


def without_vjp(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with gk.without_vjp():
            fn()

    return run


def not_replayed(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with eager launches calling MLX's kernel object each time instead of replaying the
    launch's ``mx.compile``d form (``graphkern.launching.launch_paths.replayed``): which of the two costs the
    host less."""
    def run() -> None:
        replayed = launch_paths.replayed
        launch_paths.replayed = lambda launch: None  # type: ignore[assignment]
        try:
            fn()
        finally:
            launch_paths.replayed = replayed

    return run


SAME_SOURCE = "raw, rms_norm's source"


def same_source_step(x: mx.array, w: mx.array) -> Callable[[mx.array], mx.array]:
    """One launch of ``gkk.rms_norm``'s kernel on ``x``-shaped input through MLX's kernel object
    alone: the library's plan (grid, template), none of its call path."""
    from graphkern.kernels.ops.rms_norm import plan_rms_norm
    from graphkern.launching.mlx_kernels import build_mlx_kernel

    plan = plan_rms_norm(x, w, 1e-5)
    kernel = build_mlx_kernel("cuda", plan.kernel)
    template = [t.as_mlx() for t in plan.template]
    shapes, dtypes = [s.shape for s in plan.output_specs], [s.dtype for s in plan.output_specs]
    rest = list(plan.inputs[1:])

    def step(a: mx.array) -> mx.array:
        return kernel(inputs=[a, *rest], output_shapes=shapes, output_dtypes=dtypes, grid=plan.grid,
                      threadgroup=plan.threadgroup, template=template)[0]  # type: ignore[no-any-return]

    return step


def variants(x: mx.array, w: mx.array) -> dict[str, Callable[[], None]]:
    """Every chain to time, by name."""
    steps: dict[str, Callable[[mx.array], mx.array]] = {
        "mx.fast.rms_norm": lambda a: mx.fast.rms_norm(a, w, 1e-5)}
    if mx.cuda.is_available():
        raw = mx.fast.cuda_kernel(name="launch_cost_copy", input_names=["x"], output_names=["out"],
                                  source=_COPY)
        steps["raw cuda_kernel"] = lambda a: raw(
            inputs=[a], output_shapes=[a.shape], output_dtypes=[a.dtype], grid=(a.size, 1, 1),
            threadgroup=(256, 1, 1))[0]
        steps[SAME_SOURCE] = same_source_step(x, w)
    steps["gkk.rms_norm"] = lambda a: gkk.rms_norm(a, w, 1e-5)
    found: dict[str, Callable[[], None]] = {}
    for name, step in steps.items():
        eager, compiled = chain(step, x), chain(mx.compile(step), x)
        if name == "gkk.rms_norm":
            found[f"{name} eager, evaluating"] = without_vjp(eager)
            found[f"{name} eager, evaluating, direct"] = not_replayed(without_vjp(eager))
            found[f"{name} compiled, evaluating"] = without_vjp(compiled)
            found[f"{name} eager, differentiable"] = eager
        else:
            found[f"{name} eager"] = eager
            found[f"{name} compiled"] = compiled

    def eight(a: mx.array) -> mx.array:
        for _ in range(8):
            a = gkk.rms_norm(a, w, 1e-5)
        return a

    found["gkk.rms_norm, segment of 8"] = without_vjp(chain(mx.compile(eight), x, CHAIN // 8))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    x = mx.random.normal((128, 1024), key=mx.random.key(0))
    w = mx.ones((1024,))
    mx.eval(x, w)
    fns = variants(x, w)
    samples = interleaved_samples(fns, rounds=args.rounds, warmup=3, shuffle=True)
    per_launch = {name: [s / CHAIN * 1e6 for s in values] for name, values in samples.items()}
    stats = summary(per_launch)
    print(header("host time per launch, a chain of 64 on (128, 1024) float32"))
    print(f"# rounds {args.rounds}; us a launch (median, min-max); ratio and difference against the "
          "baseline of the same mode, round by round")
    print(f"{'launch':42s}{'us':>8s}{'min':>8s}{'max':>8s}{'vs baseline':>13s}{'+us':>8s}"
          f"{'+us over same source':>22s}")
    for name, st in stats.items():
        mode = "compiled" if ("compiled" in name or "segment" in name) else "eager"
        base = next(b for b in (f"raw cuda_kernel {mode}", f"mx.fast.rms_norm {mode}") if b in per_launch)
        ratio = paired_ratio(per_launch, name, base)
        extra = st["median"] - stats[base]["median"]
        same = f"{SAME_SOURCE} {mode}"
        over_same = (f"{st['median'] - stats[same]['median']:+22.2f}"
                     if name.startswith("gkk") and same in stats else "")
        print(f"{name:42s}{st['median']:8.2f}{st['min']:8.2f}{st['max']:8.2f}{ratio:12.2f}x{extra:+8.2f}"
              f"{over_same}")


if __name__ == "__main__":
    main()
