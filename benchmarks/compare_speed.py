"""``gk.compare`` against the ``gk.inspect`` runs it needs, on an mlx-lm llama at 8 and 32 layers.

What ``gk.compare(a, b, x)`` has to evaluate sets its yardstick:

- models in float32: both models once, so two inspects (``inspect a`` then ``inspect b``);
- models in float16 or bfloat16: those two, and both models again in float32 to judge each node
  against what rounding explains (``graphkern.debugging.precision``), so two more inspects of
  the models cast to float32 (their float32 weights made before the clock starts).

Time ratio: compare over the sum of the inspects it needs. Memory ratio: compare's peak over
the two models' weights plus one inspect's working memory, i.e. over the peak of ``inspect a``
alone with both models loaded. Targets: both at most 1.2.

Each measurement runs in a fresh process that loads both models from one safetensors file.
Model ``a`` is stock; ``b`` is the same weights loaded again (equal in value, other arrays, so
every parameter is read) and patched with the library's kernels (``gk.patch``). Time is process
CPU time (all threads; other jobs on a shared machine disturb it less than the wall clock, also
printed); memory is MLX's allocator peak (``mx.get_peak_memory()``, reset once the models are
loaded, so it includes their weights) and the process's peak RSS.

Sizes (``--runs LAYERS:DIMS,...``): ``1b`` is Llama 3.2 1B's (hidden 2048, 32 heads, 8 KV
heads, intermediate 8192, vocabulary 128256, tied embeddings); ``small`` is the same shape at half
the width and a quarter of the vocabulary (hidden 1024, 16 heads, 4 KV heads, intermediate 4096,
vocabulary 32064), which lets 32 layers and their float32 copies fit a 24 GB machine.

    python benchmarks/compare_speed.py                          # 8:1b,32:small, bfloat16
    python benchmarks/compare_speed.py --runs 4:1b --dtype float32 --rounds 2
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
DIMS = {
    "1b": {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 64},
    "small": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
              "intermediate_size": 4096, "vocab_size": 32064, "head_dim": 64},
}
COMMON = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True}
#: The runs of one size, in the order they run; ``inspect32`` only for half-precision models.
MODES = {"inspect": "inspect a + b", "inspect32": "inspect a + b in float32", "inspect1": "inspect a",
         "compare": "compare"}


def _config(layers: int, dims: str) -> dict[str, Any]:
    return {**COMMON, **DIMS[dims], "num_hidden_layers": layers}


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


def measure(mode: str, config: dict[str, Any], weights: str, tokens: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import mlx.core as mx

    import graphkern as gk

    a, b = _model(config, weights), _model(config, weights)
    gk.patch(b)
    weight_bytes = mx.get_active_memory()
    if mode == "inspect32":  # the float32 weights are made before the clock starts
        a.set_dtype(mx.float32)
        b.set_dtype(mx.float32)
        mx.eval(a.parameters(), b.parameters())
    x = mx.random.randint(0, config["vocab_size"], (1, tokens), key=mx.random.key(0))
    mx.eval(x)
    mx.reset_peak_memory()
    start, cpu = time.perf_counter(), time.process_time()
    found = ""
    if mode in ("inspect", "inspect32"):
        gk.inspect(a, x)
        gk.inspect(b, x)
    elif mode == "inspect1":
        gk.inspect(a, x)
    else:
        c = gk.compare(a, b, x, progress=False)
        first = c.first_divergence
        found = "no divergence" if first is None else f"first divergence {first.b} in {first.scope}"
        found += f" (rounding {'on' if c.rounding else 'off'})"
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "cpu": cpu, "mx_peak": mx.get_peak_memory(), "rss_peak": rss,
            "weights": weight_bytes, "found": found}


def run_child(mode: str, layers: int, dims: str, weights: str, tokens: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--measure", mode, "--layers", str(layers),
                          "--dims", dims, "--weights", weights, "--tokens", str(tokens)],
                         capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if out.returncode:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def ratios(results: dict[str, dict[str, Any]], half: bool) -> dict[str, float]:
    """compare's time over the inspects it needs (CPU and wall) and its peak memory over the
    weights plus one inspect's working memory (MLX's allocator and RSS)."""
    needed = ["inspect", "inspect32"] if half else ["inspect"]
    compare, one = results["compare"], results["inspect1"]
    return {"cpu": compare["cpu"] / sum(results[m]["cpu"] for m in needed),
            "wall": compare["seconds"] / sum(results[m]["seconds"] for m in needed),
            "mx_peak": compare["mx_peak"] / one["mx_peak"],
            "rss_peak": compare["rss_peak"] / one["rss_peak"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="8:1b,32:small",
                        help="LAYERS:DIMS,... (DIMS: 1b or small; default 8:1b,32:small)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating")
    parser.add_argument("--measure", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dims", choices=list(DIMS), help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, _config(args.layers, args.dims), args.weights, args.tokens)))
        return 0
    half = args.dtype != "float32"
    modes = [m for m in MODES if half or m != "inspect32"]
    print(header(f"gk.compare against the gk.inspect runs it needs: llama, {args.dtype}, 1 x {args.tokens} "
                 f"tokens ({'two inspects and two in float32' if half else 'two inspects'})"))
    summary = []
    for spec in args.runs.split(","):
        layers_text, dims = spec.split(":")
        layers = int(layers_text)
        with tempfile.TemporaryDirectory() as folder:
            weights = os.path.join(folder, "model.safetensors")
            write_weights(_config(layers, dims), args.dtype, weights)
            rounds = [{mode: run_child(mode, layers, dims, weights, args.tokens) for mode in modes}
                      for _ in range(args.rounds)]
        weight_bytes = rounds[0]["inspect"]["weights"]
        print(f"\n{layers} layers, {dims} dims: both models' weights {_gb(weight_bytes)}")
        print("| round | measured | wall s | CPU s | MLX peak | peak RSS | found |")
        print("|---|---|---|---|---|---|---|")
        for i, results in enumerate(rounds, 1):
            for mode in modes:
                r = results[mode]
                print(f"| {i} | {MODES[mode]} | {r['seconds']:.2f} | {r['cpu']:.2f} | {_gb(r['mx_peak'])} | "
                      f"{_gb(r['rss_peak'])} | {r['found'] or '-'} |")
        for i, results in enumerate(rounds, 1):
            q = ratios(results, half)
            summary.append(f"| {layers} | {dims} | {i} | {q['cpu']:.2f} | {q['wall']:.2f} | "
                           f"{q['mx_peak']:.2f} | {q['rss_peak']:.2f} |")
    print("\ncompare / what it needs (time: the inspects above; memory: weights + one inspect, the peak of "
          "'inspect a'); targets <= 1.2")
    print("| layers | dims | round | time (CPU) | time (wall) | MLX peak | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
