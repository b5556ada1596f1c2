"""``gk.compare`` against the two ``gk.inspect`` runs it replaces, on a Llama at real widths.

The model is an mlx-lm llama at Llama-3.2-1B's sizes (hidden 2048, 32 heads, 8 KV heads,
intermediate 8192, vocabulary 128256, tied embeddings) with fewer layers (``--layers``), random
weights in ``--dtype``. Model ``a`` is stock; model ``b`` is the same weights loaded separately
(equal in value, other arrays, so every parameter is read) and patched with the library's
kernels (``gk.patch``). Each measurement runs in a fresh process that loads both models from one
safetensors file (no float32 copy is ever made) and then times:

- ``inspect a + b``: ``gk.inspect(a, x)`` then ``gk.inspect(b, x)``;
- ``compare``: ``gk.compare(a, b, x, rounding=False)`` (the plain tolerance rule);
- ``compare, rounding``: ``gk.compare(a, b, x)``, which for half-precision models also runs both
  in float32 to judge each node against what rounding explains (see ``graphkern.debugging.precision``).

Peak memory: MLX's allocator peak (``mx.get_peak_memory()``, reset once the models are loaded)
and the process's peak RSS (``ru_maxrss``, including loading the models and Python), each over the
bytes of both models' weights. Time: wall clock and process CPU time (all threads; other jobs on
a shared machine disturb it less). Ratios are to ``inspect a + b`` of the same round (time) and
to the weights (memory).

    python benchmarks/compare_speed.py --layers 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import header

ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "head_dim": 64}
MODES = {"inspect": "inspect a + b", "compare": "compare", "rounding": "compare, rounding"}


def _config(layers: int) -> dict[str, Any]:
    return {**LLAMA_1B, "num_hidden_layers": layers}


def _model(config: dict[str, Any], weights: str) -> Any:
    """The llama with the weights of the file; its own random initialisation is never evaluated."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(config))
    model = model_class(args_class.from_dict(dict(config)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def write_weights(config: dict[str, Any], dtype: str, path: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(config))
    model = model_class(args_class.from_dict(dict(config)))
    mx.random.seed(0)
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    for name in list(weights):  # a layer at a time: the float32 draws are never all held
        mx.eval(weights[name])
    mx.save_safetensors(path, weights)


def measure(mode: str, layers: int, weights: str, tokens: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import mlx.core as mx

    import graphkern as gk

    config = _config(layers)
    a, b = _model(config, weights), _model(config, weights)
    gk.patch(b)
    weight_bytes = mx.get_active_memory()
    x = mx.random.randint(0, config["vocab_size"], (1, tokens), key=mx.random.key(0))
    mx.eval(x)
    mx.reset_peak_memory()
    start, cpu = time.perf_counter(), time.process_time()
    if mode == "inspect":
        gk.inspect(a, x)
        gk.inspect(b, x)
        found = ""
    else:
        c = gk.compare(a, b, x, rounding=mode == "rounding", progress=False)
        first = c.first_divergence
        found = "no divergence" if first is None else f"first divergence {first.b} in {first.scope}"
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "cpu": cpu, "mx_peak": mx.get_peak_memory(), "rss_peak": rss,
            "weights": weight_bytes, "found": found}


def run_child(mode: str, layers: int, weights: str, tokens: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--measure", mode, "--layers", str(layers),
                          "--weights", weights, "--tokens", str(tokens)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if out.returncode:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating")
    parser.add_argument("--measure", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.layers, args.weights, args.tokens)))
        return 0
    print(header(f"gk.compare against two gk.inspect runs: llama at 1B sizes, {args.layers} layers, "
                 f"{args.dtype}, 1 x {args.tokens} tokens"))
    with tempfile.TemporaryDirectory() as folder:
        weights = os.path.join(folder, "model.safetensors")
        write_weights(_config(args.layers), args.dtype, weights)
        results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                results[mode].append(run_child(mode, args.layers, weights, args.tokens))
    base = results["inspect"]
    weight_bytes = base[0]["weights"]
    print(f"weights of both models: {_gb(weight_bytes)}")
    print("| run | measured | wall s | ratio | CPU s | ratio | MLX peak | / weights | peak RSS | / weights "
          "| found |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i in range(args.rounds):
        for mode, label in MODES.items():
            r = results[mode][i]
            print(f"| {i + 1} | {label} | {r['seconds']:.2f} | {r['seconds'] / base[i]['seconds']:.2f} | "
                  f"{r['cpu']:.2f} | {r['cpu'] / base[i]['cpu']:.2f} | "
                  f"{_gb(r['mx_peak'])} | {r['mx_peak'] / weight_bytes:.2f} | {_gb(r['rss_peak'])} | "
                  f"{r['rss_peak'] / weight_bytes:.2f} | {r['found'] or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
