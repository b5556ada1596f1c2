"""GPU benchmark of the kernel library against stock MLX, and as a fraction of copy bandwidth.

For each kernel at large sizes, the library kernel and its mx.fast / stock MLX equivalent
(``mx.compile``d, so MLX fuses what it can) are timed two ways:

- **GPU time**: the kernels' own durations on the device, recorded by CUPTI (through
  ``torch.profiler``, which sees every kernel of the process, MLX's included): what the bandwidth
  figures use, measured as the copy ceiling is (CUDA events around torch's device-to-device copy);
- **wall time**: ``mx.eval`` + ``mx.synchronize`` of a chain of K dependent calls built lazily
  beforehand, divided by K. It adds MLX's per-op CPU cost (encoding the op into a CUDA graph,
  launching it), which the GPU does not overlap for a chain this short.

Ratios are stock / ours (> 1: the library kernel is faster); GB/s counts the bytes each kernel must
read and write once. Medians over repeats after warm-up.

    python benchmarks/gpu_kernels.py [--json out.json] [--quick] [--kernels swiglu,moe_route]
                                     [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import cupti_seconds  # noqa: E402

import graphkern.kernels as gkk  # noqa: E402
from graphkern.kernels.ops.projections import projections_fit  # noqa: E402

Wanted = Callable[[str], bool]  # is this kernel to be measured?

CHAIN = 10
REPEATS = 9
WARMUP = 2


def _chain(step: Callable[[Any], Any], init: Any) -> Any:
    state = init
    for _ in range(CHAIN):
        state = step(state)
    return state


def _time_chain(step: Callable[[Any], Any], init: Any) -> float:
    """Median wall seconds per call of ``step`` over a dependent chain of CHAIN calls."""
    times = []
    for i in range(WARMUP + REPEATS):
        state = _chain(step, init)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(state)
        mx.synchronize()
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) / CHAIN)
    return statistics.median(times)


def _gpu_time(step: Callable[[Any], Any], init: Any) -> float:
    """Median GPU seconds per call of ``step``: the summed durations of the kernels CUPTI saw
    while a chain of CHAIN calls ran (NaN when torch's profiler is unavailable)."""
    return cupti_seconds(lambda: _chain(step, init))[0] / CHAIN


def copy_bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """Bytes/s of a device-to-device copy (read + write counted), GPU time: torch's D2D copy_
    and MLX's own elementwise copy-like kernel (negation); the best of them is the ceiling."""
    out: dict[str, float] = {}
    x = mx.random.normal((nbytes // 4,))
    mx.eval(x)
    seconds = _gpu_time(lambda a: -a, x)
    if seconds == seconds:  # not NaN: the profiler ran
        out["mlx_unary"] = 2 * nbytes / seconds
    del x
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            ts = []
            for _ in range(20):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                b.copy_(a)
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) / 1e3)
            out["torch_d2d"] = 2 * nbytes / statistics.median(ts)
            del a, b
            torch.cuda.empty_cache()
    except Exception as exc:  # torch is optional: MLX's figure stands alone then
        print(f"(torch copy not measured: {exc})", file=sys.stderr)
    return out


@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    ours_us: float  # GPU time
    stock_us: float
    speedup: float  # stock GPU time / ours
    gbps: float
    copy_fraction: float
    stock_copy_fraction: float
    ours_wall_us: float
    stock_wall_us: float
    wall_speedup: float
    stock: str


def _bench(name: str, shape: tuple[int, ...], dtype: mx.Dtype, nbytes: int, ours: Callable[[Any], Any],
           stock: Callable[[Any], Any], init: Any, stock_name: str, copy_bps: float) -> Row:
    compiled_stock = mx.compile(stock)
    w_ours, w_stock = _time_chain(ours, init), _time_chain(compiled_stock, init)
    g_ours, g_stock = _gpu_time(ours, init), _gpu_time(compiled_stock, init)
    return Row(name, "x".join(map(str, shape)), str(dtype).split(".")[-1], g_ours * 1e6, g_stock * 1e6,
               g_stock / g_ours, nbytes / g_ours / 1e9, nbytes / g_ours / copy_bps,
               nbytes / g_stock / copy_bps, w_ours * 1e6, w_stock * 1e6, w_stock / w_ours, stock_name)


def _row_kernels(shape: tuple[int, ...], dt: mx.Dtype, copy_bps: float, wanted: Wanted) -> list[Row]:
    n, size = shape[0] * shape[1], dt.size
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    r = mx.random.normal(shape, key=mx.random.key(1)).astype(dt)
    w = (1 + 0.1 * mx.random.normal((shape[1],))).astype(dt)
    b = (0.1 * mx.random.normal((shape[1],))).astype(dt)
    mx.eval(x, r, w, b)

    def add_norm_stock(s: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
        h = s[0] + s[1]
        return h, mx.fast.rms_norm(h, w, 1e-5)

    # (name, tensors moved, ours, stock, input, stock's label)
    cases: list[tuple[str, int, Callable[[Any], Any], Callable[[Any], Any], Any, str]] = [
        ("rms_norm", 2, lambda a: gkk.rms_norm(a, w, 1e-5), lambda a: mx.fast.rms_norm(a, w, 1e-5), x,
         "mx.fast.rms_norm"),
        ("layer_norm", 2, lambda a: gkk.layer_norm(a, w, b, 1e-5),
         lambda a: mx.fast.layer_norm(a, w, b, 1e-5), x, "mx.fast.layer_norm"),
        ("add_rms_norm", 4, lambda s: gkk.add_rms_norm(s[0], s[1], w, 1e-5), add_norm_stock, (x, r),
         "x + r; mx.fast.rms_norm"),
        ("softmax", 2, gkk.softmax, lambda a: mx.softmax(a, axis=-1), x, "mx.softmax"),
        ("swiglu", 3, lambda s: (gkk.swiglu(s[0], s[1]), s[1]),
         lambda s: (nn.silu(s[0]) * s[1], s[1]), (x, r), "nn.silu(g) * u (compiled)"),
        ("gelu", 2, gkk.gelu, nn.gelu, x, "nn.gelu (compiled)"),
        ("gelu_approx", 2, lambda a: gkk.gelu(a, approx=True), nn.gelu_approx, x,
         "nn.gelu_approx (compiled)"),
    ]
    return [_bench(name, shape, dt, moved * n * size, ours, stock, init, label, copy_bps)
            for name, moved, ours, stock, init, label in cases if wanted(name)]


def _rope_kernels(shape: tuple[int, ...], dt: mx.Dtype, copy_bps: float, wanted: Wanted) -> list[Row]:
    x = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(x)
    rows = []
    for trad in (False, True):
        name = "rope" + ("_traditional" if trad else "")
        if not wanted(name):
            continue

        def ours(a: mx.array, t: bool = trad) -> mx.array:
            return gkk.rope(a, 128, traditional=t, base=10000.0, offset=5)

        def stock(a: mx.array, t: bool = trad) -> mx.array:
            return mx.fast.rope(a, 128, traditional=t, base=10000.0, scale=1.0, offset=5)

        rows.append(_bench(name, shape, dt, 2 * x.size * dt.size, ours, stock, x, "mx.fast.rope", copy_bps))
    return rows


def _prologue_kernels(shape: tuple[int, ...], dt: mx.Dtype, copy_bps: float, wanted: Wanted) -> list[Row]:
    """rope_qk against the stock attention prologue it replaces (reshape, per-head mx.fast.rms_norm
    for ``rope_qk_norm``, transpose, mx.fast.rope; for queries and keys). ``shape`` is (B, L, query
    features) in heads of 128, a quarter as many key heads. Each call of the chain takes the last
    call's outputs as its queries and keys, as views of the same size (no copy on either side)."""
    from graphkern.kernels.ops.rope_qk import stock_prologue

    b, length, features = shape
    heads, d = features // 128, 128
    kv_heads = max(1, heads // 4)
    q = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    k = mx.random.normal((b, length, kv_heads * d), key=mx.random.key(1)).astype(dt)
    w = (1 + 0.1 * mx.random.normal((2, d))).astype(dt)
    mx.eval(q, k, w)
    rows = []
    for name in PROLOGUE_KERNELS:
        if not wanted(name):
            continue
        kw: dict[str, Any] = {"base": 1e6, "offset": 5}
        if name == "rope_qk_norm":
            kw.update(q_weight=w[0], k_weight=w[1], eps=1e-6)

        def ours(s: tuple[mx.array, mx.array], kw: dict[str, Any] = kw) -> tuple[mx.array, mx.array]:
            qo, ko = gkk.rope_qk(s[0], s[1], heads, kv_heads, d, **kw)
            # queries in the input's order (returned transposed), keys contiguous: views both
            return qo.transpose(0, 2, 1, 3).reshape(s[0].shape), ko.reshape(s[1].shape)

        def stock(s: tuple[mx.array, mx.array], kw: dict[str, Any] = kw) -> tuple[mx.array, mx.array]:
            qo, ko = stock_prologue(s[0], s[1], heads, kv_heads, d, **kw)
            # laid out as the transposed input: transposed back, a view too
            return (qo.transpose(0, 2, 1, 3).reshape(s[0].shape),
                    ko.transpose(0, 2, 1, 3).reshape(s[1].shape))

        moved = 2 * (q.size + k.size) * dt.size
        label = "reshape, " + ("mx.fast.rms_norm, " if kw.get("q_weight") is not None else "") + \
            "transpose, mx.fast.rope (q and k)"
        rows.append(_bench(name, shape, dt, moved, ours, stock, (q, k), label, copy_bps))
    return rows


def _projection_kernels(shape: tuple[int, ...], dt: mx.Dtype, copy_bps: float, wanted: Wanted) -> list[Row]:
    """norm_projections and norm_swiglu against what they replace at decoding's few rows: the
    residual add, mx.fast.rms_norm and the matrix products (and the SwiGLU gating), compiled.
    ``shape`` is (rows, hidden); the weights are a Llama block's of that hidden size: queries of
    hidden, keys and values of a quarter, gate and up of 2.75x. Each call takes the last call's
    sum as its input."""
    m, k = shape
    if not projections_fit(mx.zeros(shape, dt)):  # float32 rows past one block's shared memory
        return []
    key = iter(mx.random.split(mx.random.key(0), 8))
    x = mx.random.normal(shape, key=next(key)).astype(dt)
    r = (0.1 * mx.random.normal(shape, key=next(key))).astype(dt)
    w = (1 + 0.1 * mx.random.normal((k,), key=next(key))).astype(dt)
    hidden = (k * 11 // 4 + 63) // 64 * 64
    mats = [(mx.random.normal((n, k), key=next(key)) / k**0.5).astype(dt) for n in (k, k // 4, k // 4)]
    gate, up = [(mx.random.normal((hidden, k), key=next(key)) / k**0.5).astype(dt) for _ in range(2)]
    mx.eval(x, r, w, mats, gate, up)
    rows = []
    if wanted("norm_projections"):
        def ours_qkv(s: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
            return gkk.norm_projections(s[0], w, mats, 1e-5, residual=r)

        def stock_qkv(s: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
            h = s[0] + r
            n = mx.fast.rms_norm(h, w, 1e-5)
            return (h, *(n @ mat.T for mat in mats))

        init = (x, *(mx.zeros((m, w_.shape[0]), dt) for w_ in mats))
        moved = sum(a.size for a in mats) * dt.size
        rows.append(_bench("norm_projections", shape, dt, moved, ours_qkv, stock_qkv, init,
                           "add, mx.fast.rms_norm, 3 matmuls", copy_bps))
    if wanted("norm_swiglu"):
        def ours_mlp(s: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
            h, out = gkk.norm_swiglu(s[0], w, gate, up, 1e-5, residual=r)
            return h, out

        def stock_mlp(s: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
            h = s[0] + r
            n = mx.fast.rms_norm(h, w, 1e-5)
            return h, nn.silu(n @ gate.T) * (n @ up.T)

        moved = 2 * gate.size * dt.size
        init = (x, mx.zeros((m, hidden), dt))
        rows.append(_bench("norm_swiglu", shape, dt, moved, ours_mlp, stock_mlp, init,
                           "add, mx.fast.rms_norm, 2 matmuls, silu * up", copy_bps))
    return rows


def _router_kernels(shape: tuple[int, ...], dt: mx.Dtype, copy_bps: float, wanted: Wanted) -> list[Row]:
    """moe_route against mlx-lm's routing ops, compiled: Mixtral's (top 2 of 8 logits, then their
    softmax) for 8 experts, Qwen 3 MoE's (softmax, top 8, divided by their sum) for more. ``shape``
    is (tokens, experts)."""
    if not wanted("moe_route"):
        return []
    rows, experts = shape
    qwen = experts > 8
    k = 8 if qwen else 2
    gates = mx.random.normal(shape, key=mx.random.key(0)).astype(dt)
    mx.eval(gates)

    def ours(s: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return (s[0], *gkk.moe_route(s[0], k, softmax_first=qwen, normalize=qwen))

    def stock(s: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        g = s[0]
        if qwen:
            p = mx.softmax(g, axis=-1, precise=True)
            inds = mx.argpartition(p, kth=-k, axis=-1)[..., -k:]
            scores = mx.take_along_axis(p, inds, axis=-1)
            return g, inds, scores / mx.sum(scores, axis=-1, keepdims=True)
        inds = mx.argpartition(-g, kth=k - 1, axis=-1)[..., :k]
        return g, inds, mx.softmax(mx.take_along_axis(g, inds, axis=-1), axis=-1, precise=True)

    moved = gates.size * dt.size + rows * k * (4 + dt.size)
    label = "softmax, argpartition, take, sum, divide" if qwen else "negate, argpartition, take, softmax"
    return [_bench("moe_route", shape, dt, moved, ours, stock, (gates,), label, copy_bps)]


ROW_KERNELS = ("rms_norm", "layer_norm", "add_rms_norm", "softmax", "swiglu", "gelu", "gelu_approx")
ROPE_KERNELS = ("rope", "rope_traditional")
PROLOGUE_KERNELS = ("rope_qk", "rope_qk_norm")
PROJECTION_KERNELS = ("norm_projections", "norm_swiglu")
ROUTER_KERNELS = ("moe_route",)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


HEADER = (f"{'kernel':<17}{'shape':<18}{'dtype':<10}{'ours us':>9}{'stock us':>10}{'stock/ours':>11}"
          f"{'GB/s':>8}{'of copy':>9}{'stock of copy':>15}{'wall ours':>11}{'wall stock':>11}"
          f"{'wall ratio':>11}  stock")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['kernel']:<17}{r['shape']:<18}{r['dtype']:<10}{r['ours_us']:>9.1f}{r['stock_us']:>10.1f}"
            f"{r['speedup']:>10.2f}x{r['gbps']:>8.0f}{r['copy_fraction']:>8.0%}"
            f"{r['stock_copy_fraction']:>14.0%}{r['ours_wall_us']:>11.1f}{r['stock_wall_us']:>11.1f}"
            f"{r['wall_speedup']:>10.2f}x  {r['stock']}")


def selection(kernels: Sequence[str] | None, dtypes: Sequence[str] | None) -> tuple[set[str], list[mx.Dtype]]:
    """The kernel names and dtypes to measure (None: all); ValueError names what is unknown.

    >>> selection(["swiglu"], ["float32"])
    ({'swiglu'}, [mlx.core.float32])
    """
    known_kernels = ROW_KERNELS + ROPE_KERNELS + PROLOGUE_KERNELS + PROJECTION_KERNELS + ROUTER_KERNELS
    names = set(known_kernels if kernels is None else kernels)
    for given, known, what in ((names, known_kernels, "kernels"),
                               (set(dtypes or ()), tuple(DTYPES), "dtypes")):
        if given - set(known):
            raise ValueError(f"unknown {what} {sorted(given - set(known))}: choose from {','.join(known)}")
    return names, [DTYPES[d] for d in (DTYPES if dtypes is None else dtypes)]


def run(quick: bool = False, progress: bool = False, kernels: Sequence[str] | None = None,
        dtypes: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every kernel (or those named in ``kernels``) in every dtype (or ``dtypes``); with
    ``progress`` print each row as soon as it is measured (a run cut short by a time limit still
    shows what it got)."""
    names, chosen = selection(kernels, dtypes)
    wanted: Wanted = names.__contains__
    bw = copy_bandwidth()
    copy_bps = max(bw.values())
    if progress:
        print("copy bandwidth (GB/s, read+write): " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in bw.items()))
        print(HEADER, flush=True)
    rows: list[Row] = []
    groups: list[tuple[Callable[[tuple[int, ...], mx.Dtype, float, Wanted], list[Row]], tuple[int, ...]]] = []
    if names & set(ROW_KERNELS):
        groups += [(_row_kernels, shape) for shape in ([(8192, 4096)] if quick else
                                                       [(8192, 4096), (16384, 8192), (4096, 16384)])]
    if names & set(ROPE_KERNELS):
        groups += [(_rope_kernels, shape) for shape in ([(4, 32, 2048, 128)] if quick else
                                                        [(4, 32, 2048, 128), (1, 32, 8192, 128)])]
    if names & set(PROLOGUE_KERNELS):  # prefill of 2048 tokens, 32 heads; decode at batch 8
        groups += [(_prologue_kernels, shape) for shape in ([(1, 2048, 4096)] if quick else
                                                            [(1, 2048, 4096), (1, 8192, 8192), (8, 1, 4096)])]
    if names & set(PROJECTION_KERNELS):  # decoding: one token of a 2048 or 4096 model; 8 of 2048
        groups += [(_projection_kernels, shape) for shape in ([(1, 2048), (8, 2048)] if quick else
                                                              [(1, 2048), (8, 2048), (1, 4096)])]
    if names & set(ROUTER_KERNELS):  # Mixtral decoding at batch 1 and 8, its 2048-token prompt; Qwen 3 MoE's
        groups += [(_router_kernels, shape) for shape in ([(1, 8), (2048, 128)] if quick else
                                                          [(1, 8), (8, 8), (2048, 8), (1, 128), (2048, 128)])]
    for bench, shape in groups:
        for dt in chosen:
            new = bench(shape, dt, copy_bps, wanted)
            rows += new
            if progress:
                for r in new:
                    print(format_row(asdict(r)), flush=True)
    return {
        "mlx": getattr(mx, "__version__", "?"),
        "device": mx.device_info().get("device_name", "?"),
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_GBps": {k: v / 1e9 for k, v in bw.items()},
        "rows": [asdict(r) for r in rows],
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"graphkern kernel library on {result['device']} (mlx {result['mlx']}, {result['date']})",
             "times: GPU time per call (CUPTI); wall: per call in a chain of "
             f"{CHAIN} evaluated at once", "copy bandwidth (GB/s, read+write, GPU time): "
             + ", ".join(f"{k} {v:.0f}" for k, v in result["copy_bandwidth_GBps"].items()),
             HEADER]
    lines += [format_row(r) for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="one size per kernel")
    parser.add_argument("--kernels", help=f"comma-separated, of {','.join(ROW_KERNELS + ROPE_KERNELS)}")
    parser.add_argument("--dtypes", help=f"comma-separated, of {','.join(DTYPES)}")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",") if args.kernels else None
    dtypes = args.dtypes.split(",") if args.dtypes else None
    try:
        selection(kernels, dtypes)
    except ValueError as exc:
        parser.error(str(exc))
    if not mx.cuda.is_available() and not mx.metal.is_available():
        print("no GPU backend: the library would run its references; nothing to benchmark", file=sys.stderr)
        return 0
    result = run(quick=args.quick, progress=True, kernels=kernels, dtypes=dtypes)
    print()
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
