"""The norm-fed projection kernels at checkpoint dimensions, weights read from memory as a decoding
stack reads them: GPU time per block against stock MLX's ops.

``gpu_kernels.py`` times a kernel on one set of weights, which then sits in the GPU's L2 cache. A
decoding model reads each layer's weights once a token, from memory, so here a chain of ``--layers``
blocks, each with its own weights (far more bytes than L2 holds), runs the two launches a fused
block makes before its attention and feed-forward:

- ours: ``norm_projections`` (residual add, RMSNorm, query/key/value products; Phi-3's one fused
  ``qkv`` weight) and ``norm_swiglu`` (residual add, RMSNorm, SwiGLU's gate and up products;
  ``norm_geglu`` with the tanh GELU for Gemma 2), or their quantized forms;
- stock: the add, ``mx.fast.rms_norm`` and the products (``mx.quantized_matmul`` for quantized
  weights) and the gating, compiled;

at 1, 2 and 8 token rows. The feed-forward's residual stands in for the attention's output (the
first projection's values), so each block's feed-forward waits for its projections as in a model.
GPU time per block is the sum of the kernels' durations (CUPTI, through ``torch.profiler``), divided
by the blocks, and their span (first start to last end: a CUDA graph runs independent kernels
side by side, which the sum counts twice); wall time is the chain's evaluation, host and GPU; GB/s
counts the weights' bytes (scales and biases included), each read
once, over the span. Ratios (span's, wall's) are stock / ours (> 1: ours is faster).

    python benchmarks/block_projections.py [--models phi-3-mini,llama-3.2-1b] [--rows 1,8]
                                           [--weights bf16,4bit] [--layers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from _timing import cupti_seconds  # noqa: E402

import graphkern.kernels as gkk  # noqa: E402
from graphkern.kernels.ops.projections import projections_fit  # noqa: E402
from graphkern.kernels.ops.quantized_projections import quantized_projections_fit, random_quantized  # noqa: E402

#: hidden size, the attention's projections' output sizes (one fused weight for Phi-3), the
#: feed-forward's intermediate size: published checkpoints' dimensions.
MODELS: dict[str, tuple[int, tuple[int, ...], int]] = {
    "llama-3.2-1b": (2048, (2048, 512, 512), 8192),
    "qwen2.5-1.5b": (1536, (1536, 256, 256), 8960),
    "phi-3-mini": (3072, (9216,), 8192),
    "gemma-2-2b": (2304, (2048, 1024, 1024), 9216),
    "mistral-7b": (4096, (4096, 1024, 1024), 14336),
}
#: Models whose feed-forward is a GeGLU with the tanh GELU (``norm_geglu``); the others' a SwiGLU.
GEGLU = {"gemma-2-2b"}
WEIGHTS = ("bf16", "4bit", "8bit")
GROUP_SIZE = 64
REPEATS = 5

Layer = dict[str, Any]
Block = Callable[[mx.array, mx.array, Layer], tuple[mx.array, ...]]


def _layer(hidden: int, outs: Sequence[int], inner: int, weights: str, key: mx.array) -> Layer:
    keys = iter(mx.random.split(key, 8))
    norm = (1 + 0.1 * mx.random.normal((hidden,), key=next(keys))).astype(mx.bfloat16)
    ffn_norm = (1 + 0.1 * mx.random.normal((hidden,), key=next(keys))).astype(mx.bfloat16)
    if weights == "bf16":
        def make(n: int) -> Any:
            return (mx.random.normal((n, hidden), key=next(keys)) / hidden**0.5).astype(mx.bfloat16)
    else:
        bits = int(weights[0])

        def make(n: int) -> Any:
            return tuple(random_quantized(n, hidden, mx.bfloat16, next(keys), GROUP_SIZE, bits))
    layer = {"norm": norm, "ffn_norm": ffn_norm, "projections": [make(n) for n in outs],
             "gate": make(inner), "up": make(inner)}
    mx.eval(layer)
    return layer


def _nbytes(layer: Layer) -> int:
    weights = [layer["projections"], layer["gate"], layer["up"]]
    arrays = cast(list[tuple[str, mx.array]], tree_flatten(weights))
    return sum(a.nbytes for _, a in arrays)


def _product(n: mx.array, w: Any, bits: int) -> mx.array:
    if bits:
        wq, scales, biases = w
        return mx.quantized_matmul(n, wq, scales, biases, transpose=True, group_size=GROUP_SIZE, bits=bits)
    return n @ w.T


def attention_stand_in(found: Sequence[mx.array], h: mx.array) -> mx.array:
    """The feed-forward's residual: the first projection's leading values in ``h``'s shape (the
    projections' together where the first is narrower than ``h``, as Gemma 2's queries are), standing
    in for the attention's output, so that the feed-forward's launches wait for the projections' as
    in a decoding block (independent, a CUDA graph would run them side by side)."""
    first = found[0].reshape(found[0].shape[0], -1)
    if first.shape[-1] < h.shape[-1]:
        first = mx.concatenate([f.reshape(f.shape[0], -1) for f in found], axis=-1)
    return first[:, :h.shape[-1]].reshape(h.shape)


def block_ours(bits: int, geglu: bool = False) -> Block:
    """The fused block's two launches: ``(x, residual, layer) -> (h, *products, gated)``; ``geglu``:
    the feed-forward's launch is ``norm_geglu``'s (tanh GELU), else ``norm_swiglu``'s."""
    def run(x: mx.array, r: mx.array, layer: Layer) -> tuple[mx.array, ...]:
        gating = {"approx": True} if geglu else {}
        if bits:
            q: dict[str, Any] = dict(group_size=GROUP_SIZE, bits=bits)
            gated_fn = gkk.quantized_norm_geglu if geglu else gkk.quantized_norm_swiglu
            h, *found = gkk.quantized_norm_projections(x, layer["norm"], layer["projections"], 1e-5,
                                                       residual=r, **q)
            h2, gated = gated_fn(h, layer["ffn_norm"], layer["gate"], layer["up"], 1e-5,
                                 residual=attention_stand_in(found, h), **q, **gating)
        else:
            plain_fn = gkk.norm_geglu if geglu else gkk.norm_swiglu
            h, *found = gkk.norm_projections(x, layer["norm"], layer["projections"], 1e-5, residual=r)
            h2, gated = plain_fn(h, layer["ffn_norm"], layer["gate"], layer["up"], 1e-5,
                                 residual=attention_stand_in(found, h), **gating)
        return (h2, *found, gated)
    return run


def block_stock(bits: int, geglu: bool = False) -> Block:
    """What stock MLX runs for the same: adds, ``mx.fast.rms_norm``, products, gating."""
    act = nn.gelu_approx if geglu else nn.silu
    def run(x: mx.array, r: mx.array, layer: Layer) -> tuple[mx.array, ...]:
        h = x + r
        n = mx.fast.rms_norm(h, layer["norm"], 1e-5)
        found = [_product(n, w, bits) for w in layer["projections"]]
        h2 = h + attention_stand_in(found, h)
        n2 = mx.fast.rms_norm(h2, layer["ffn_norm"], 1e-5)
        gated = act(_product(n2, layer["gate"], bits)) * _product(n2, layer["up"], bits)
        return (h2, *found, gated)
    return run


def _stack(block: Callable[..., tuple[mx.array, ...]], x: mx.array, r: mx.array,
           layers: list[Layer]) -> list[mx.array]:
    outputs = []
    for layer in layers:
        h2, *rest = block(x, r, layer)
        outputs += rest
        x = h2
    return [x, *outputs]


def _wall_seconds(fn: Callable[[], list[mx.array]]) -> float:
    samples = []
    for _ in range(REPEATS):
        out = fn()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def fits(model: str, weights: str, rows: int) -> bool:
    """Whether the kernels take ``rows`` token rows of the model in one launch (shared memory)."""
    x = mx.zeros((rows, MODELS[model][0]), mx.bfloat16)
    return projections_fit(x) if weights == "bf16" else quantized_projections_fit(x, GROUP_SIZE)


def measure(model: str, weights: str, rows: int, n_layers: int) -> dict[str, Any]:
    """One model's blocks at ``rows`` token rows: per-block GPU and wall times, ours and stock."""
    hidden, outs, inner = MODELS[model]
    bits = 0 if weights == "bf16" else int(weights[0])
    layers = [_layer(hidden, outs, inner, weights, mx.random.key(i)) for i in range(n_layers)]
    x = mx.random.normal((rows, hidden), key=mx.random.key(100)).astype(mx.bfloat16)
    r = (0.1 * mx.random.normal((rows, hidden), key=mx.random.key(101))).astype(mx.bfloat16)
    mx.eval(x, r)
    stock = mx.compile(block_stock(bits, model in GEGLU))
    ours = block_ours(bits, model in GEGLU)
    result: dict[str, Any] = {"model": model, "weights": weights, "rows": rows, "layers": n_layers,
                              "weight_MB_per_block": _nbytes(layers[0]) / 1e6}
    for name, block in (("stock", stock), ("ours", ours)):
        def fn(block: Callable[..., tuple[mx.array, ...]] = block) -> list[mx.array]:
            return _stack(block, x, r, layers)
        mx.eval(fn())  # warm-up: compiles, and NVRTC for ours
        busy, span = cupti_seconds(fn, REPEATS)
        result[f"{name}_gpu_us"], result[f"{name}_span_us"] = busy / n_layers * 1e6, span / n_layers * 1e6
        result[f"{name}_wall_us"] = _wall_seconds(fn) / n_layers * 1e6
    result["gpu_ratio"] = result["stock_span_us"] / result["ours_span_us"]
    result["wall_ratio"] = result["stock_wall_us"] / result["ours_wall_us"]
    mb = result["weight_MB_per_block"]
    result["ours_GBps"] = mb / result["ours_span_us"] * 1e3
    result["stock_GBps"] = mb / result["stock_span_us"] * 1e3
    return result


HEADER = (f"{'model':<14}{'weights':<8}{'rows':>5}{'MB/block':>10}{'ours us':>9}{'stock us':>9}"
          f"{'span ours':>10}{'span stock':>11}"
          f"{'stock/ours':>11}{'ours GB/s':>10}{'stock GB/s':>11}{'wall ours':>10}{'wall stock':>11}"
          f"{'wall ratio':>11}")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['model']:<14}{r['weights']:<8}{r['rows']:>5}{r['weight_MB_per_block']:>10.1f}"
            f"{r['ours_gpu_us']:>9.1f}{r['stock_gpu_us']:>9.1f}{r['ours_span_us']:>10.1f}"
            f"{r['stock_span_us']:>11.1f}{r['gpu_ratio']:>10.3f}x"
            f"{r['ours_GBps']:>10.0f}{r['stock_GBps']:>11.0f}{r['ours_wall_us']:>10.1f}"
            f"{r['stock_wall_us']:>11.1f}{r['wall_ratio']:>10.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--weights", default="bf16,4bit", help=f"comma-separated, of {','.join(WEIGHTS)}")
    parser.add_argument("--rows", default="1,2,8", help="token rows, comma-separated (the kernels take 1-8)")
    parser.add_argument("--layers", type=int, default=8, help="blocks in the chain, each its own weights")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    models, weights = args.models.split(","), args.weights.split(",")
    for given, known, what in ((models, MODELS, "models"), (weights, WEIGHTS, "weights")):
        if set(given) - set(known):
            parser.error(f"unknown {what} {sorted(set(given) - set(known))}: choose from {','.join(known)}")
    if not mx.cuda.is_available() and not mx.metal.is_available():
        print("no GPU backend: the library would run its references; nothing to benchmark", file=sys.stderr)
        return 0
    device, version = mx.device_info().get("device_name", "?"), getattr(mx, "__version__", "?")
    print(f"{device}, mlx {version}, {time.strftime('%Y-%m-%d')}: "
          f"per block of {args.layers} chained, bfloat16 activations, groups of {GROUP_SIZE}")
    print(HEADER, flush=True)
    rows = []
    for model in models:
        for w in weights:
            for m in (int(v) for v in args.rows.split(",")):
                if not fits(model, w, m):
                    print(f"{model:<14}{w:<8}{m:>5}  past one launch's shared memory: stock's products "
                          "serve it", flush=True)
                    continue
                row = measure(model, w, m, args.layers)
                rows.append(row)
                print(format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
