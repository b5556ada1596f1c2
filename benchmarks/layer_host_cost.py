"""Host cost per call of each standalone patched layer beside the stock op it replaces.

Decoding shapes (batch 1, one token), hidden 2048 and 4096, bfloat16, the model in evaluation
mode (as ``mlx_lm.load`` leaves it) and patched with ``gk.patch(model, route="kernel")``, so every
call takes the layer's kernel. Graph building only: nothing is evaluated, so the figure is the
host's cost of a call, which bounds a decoding step (one token: every launch host-bound).

  stock op      what the replaced layer computes, called bare (``mx.fast.rms_norm(x, w, eps)``,
                ``mx.fast.rope``, ``nn.silu(g) * u``...)
  stock layer   the replaced layer itself, called as the model calls it
  patched       the patched layer, called as the model calls it
  auto          the same layer with ``route="auto"`` (the default): on a GPU backend (here: with
                ``--cuda-stand-in``) a standalone layer runs the stock forward, so this is the
                route's own cost over the stock layer; on the CPU it is the kernel again
  kernel        the patched layer's launch alone: its plan bound once (``gk.bind``) and called
                on the plan's inputs (the MLP: with its three projections around it); on a CPU
                that is the kernel's pure-MLX reference
  overhead      patched - kernel: what the layer adds to its launch (the forward, the signature
                lookup, the call into the launch path)

Each function is timed in rounds that alternate between all of them (a random order a round, the
calling thread's CPU time, ``--number`` calls a sample); the figures are medians over rounds,
"patched / stock op" the median of the round-by-round ratios.

``--cuda-stand-in`` runs the launches on graphkern's CUDA path instead (CUDA detected as on a GPU),
with MLX's kernel object replaced by a stand-in that returns its first input: the kernel column
is then graphkern's launch path to MLX's kernel call, and overhead is what the layer adds to that,
as a GPU would see it less the kernel call itself (no GPU figure is measured here).
Run: python benchmarks/layer_host_cost.py [--rounds 21] [--number 300] [--cuda-stand-in]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, interleaved_samples, paired_ratio  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.kernels import LIBRARY  # noqa: E402
from graphkern.launching import (
    backends,  # noqa: E402
    mlx_kernels,  # noqa: E402
)
from graphkern.models import KernelLayer, patch, set_route  # noqa: E402
from graphkern.models.layers import KernelAddRMSNorm  # noqa: E402

DTYPE = mx.bfloat16
HEAD_DIM = 128


def _llama_mlp(hidden: int) -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=1,
                           intermediate_size=4 * hidden, num_attention_heads=hidden // HEAD_DIM,
                           rms_norm_eps=1e-5, vocab_size=32, num_key_value_heads=hidden // HEAD_DIM)
    return llama.MLP(args)


class Case:
    """One layer: its stock module, the call's arguments, the bare stock op, and the library
    entry whose plan the patched layer launches (with that plan's arguments)."""

    def __init__(self, name: str, module: nn.Module, args: tuple[Any, ...], stock_op: Callable[[], Any],
                 kernel: str, plan_args: Callable[[nn.Module], tuple[tuple[Any, ...], dict[str, Any]]],
                 wrap: Callable[[nn.Module], nn.Module] | None = None,
                 stock_layer: Callable[[], Any] | None = None,
                 around: Callable[[Callable[..., Any]], Any] | None = None):
        self.name, self.args, self.stock_op, self.kernel = name, args, stock_op, kernel
        self.plan_args, self.around = plan_args, around
        self.stock_layer = stock_layer or (lambda: self.stock(*args))
        module.set_dtype(DTYPE)
        mx.eval(module.parameters())
        self.stock = module
        self.model = nn.Sequential(module)  # gk.patch replaces the layer inside its parent
        self.model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if wrap is None:
                patch(self.model, route="kernel")
            else:
                self.model.layers[0] = wrap(module)
                set_route(self.model, "kernel")
        self.model.eval()
        self.patched = self.model.layers[0]
        assert isinstance(self.patched, KernelLayer), (name, type(self.patched))
        self.auto = (wrap or (lambda m: self.patched.__class__(m)))(module)
        set_route(nn.Sequential(self.auto), "auto")
        self.auto.eval()

    def functions(self) -> dict[str, Callable[[], Any]]:
        args, plan_args, kwargs = self.args, *self.plan_args(self.patched)
        plan = LIBRARY[self.kernel].plan(*plan_args, **kwargs)
        bound = gk.bind(plan.kernel, plan.output_specs, grid=plan.grid, threadgroup=plan.threadgroup,
                        template=plan.template)
        inputs, around = plan.inputs, self.around

        def kernel() -> Any:
            with gk.without_vjp():  # as the patched layer launches, in evaluation mode
                return bound(*inputs) if around is None else around(bound)

        return {"stock op": self.stock_op, "stock layer": self.stock_layer,
                "patched": lambda: self.patched(*args), "auto": lambda: self.auto(*args), "kernel": kernel}


def cases(hidden: int) -> list[Case]:
    key = iter(mx.random.split(mx.random.key(hidden), 8))

    def rand(*shape: int) -> mx.array:
        a = mx.random.normal(shape, key=next(key)).astype(DTYPE)
        mx.eval(a)
        return a

    x, r = rand(1, 1, hidden), rand(1, 1, hidden)
    heads = hidden // HEAD_DIM
    q = rand(1, heads, 1, HEAD_DIM)
    g, u = rand(1, 1, 4 * hidden), rand(1, 1, 4 * hidden)
    rms, add_rms, ln = nn.RMSNorm(hidden), nn.RMSNorm(hidden), nn.LayerNorm(hidden)
    rope = nn.RoPE(HEAD_DIM, traditional=False, base=10000.0)
    mlp = _llama_mlp(hidden)
    for module in (rms, add_rms, ln, mlp):
        module.set_dtype(DTYPE)
    offset = 37  # a decoding position: an int, as mlx-lm's caches give it

    def stock_mlp() -> mx.array:
        return mlp.down_proj(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    return [
        Case("RMSNorm", rms, (x,), lambda: mx.fast.rms_norm(x, rms.weight, 1e-5), "rms_norm",
             lambda layer: ((x, layer.weight, 1e-5), {})),
        Case("add + RMSNorm", add_rms, (x, r),
             lambda: (h := x + r, mx.fast.rms_norm(h, add_rms.weight, 1e-5)), "add_rms_norm",
             lambda layer: ((x, r, layer.weight, 1e-5), {}), wrap=KernelAddRMSNorm,
             stock_layer=lambda: (h := x + r, add_rms(h))),
        Case("LayerNorm", ln, (x,), lambda: mx.fast.layer_norm(x, ln.weight, ln.bias, 1e-5), "layer_norm",
             lambda layer: ((x, layer.weight, layer.bias, 1e-5), {})),
        Case("RoPE", rope, (q, offset),
             lambda: mx.fast.rope(q, HEAD_DIM, traditional=False, base=10000.0, scale=1.0, offset=offset),
             "rope",
             lambda layer: ((q, HEAD_DIM), {"traditional": False, "base": 10000.0, "offset": offset})),
        Case("GELU", nn.GELU(), (x,), lambda: nn.gelu(x), "gelu", lambda layer: ((x,), {})),
        Case("Softmax", nn.Softmax(), (x,), lambda: mx.softmax(x, axis=-1), "softmax",
             lambda layer: ((x,), {})),
        Case("SwiGLU MLP", mlp, (x,), stock_mlp, "swiglu", lambda layer: ((g, u), {}),
             around=lambda bound: mlp.down_proj(bound(mlp.gate_proj(x), mlp.up_proj(x))[0])),
    ]


def stand_in(*, inputs: Any, output_shapes: Any, output_dtypes: Any, grid: Any, threadgroup: Any,
             template: Any, init_value: Any = None) -> list[mx.array]:
    """MLX's kernel object, stood in for: one output per declared one, each the first input."""
    return [inputs[0]] * len(output_shapes)


def measure(hidden: int, rounds: int, number: int) -> list[dict[str, Any]]:
    rows = []
    for case in cases(hidden):
        fns = case.functions()
        samples = interleaved_samples(fns, rounds=rounds, number=number, warmup=number, shuffle=True,
                                      clock=time.thread_time)
        us = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
        rows.append({"layer": case.name, "hidden": hidden, **us,
                     "ratio": paired_ratio(samples, "patched", "stock op"),
                     "overhead": us["patched"] - us["kernel"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layer | hidden | stock op us | stock layer us | patched us | patched / stock op | "
             "patched - stock op us | kernel us | overhead us | auto us | auto - stock layer us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['hidden']} | {r['stock op']:.2f} | {r['stock layer']:.2f} | "
                     f"{r['patched']:.2f} | {r['ratio']:.2f}x | {r['patched'] - r['stock op']:+.2f} | "
                     f"{r['kernel']:.2f} | {r['overhead']:.2f} | {r['auto']:.2f} | "
                     f"{r['auto'] - r['stock layer']:+.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--number", type=int, default=300)
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--cuda-stand-in", action="store_true",
                        help="graphkern's CUDA launch path, MLX's kernel object replaced by a stand-in")
    options = parser.parse_args()
    path = "CUDA launch path, MLX's kernel object stood in for" if options.cuda_stand_in else (
        f"launches on the {gk.active_backend()} backend")
    print(header(f"patched layers' host cost per call, {path}; bfloat16, batch 1, one token"))
    with ExitStack() as stack:
        if options.cuda_stand_in:
            stack.enter_context(mock.patch.object(mlx_kernels, "build_mlx_kernel",
                                                  lambda backend, kernel: stand_in))
            # detected as a GPU would be, not forced with using_backend: the auto route then reads
            # the backend as it does on a GPU (no override to check)
            stack.enter_context(mock.patch.object(backends, "_detected_backend", lambda: "cuda"))
        rows = [row for hidden in options.hidden for row in measure(hidden, options.rounds, options.number)]
    print(table(rows))


if __name__ == "__main__":
    main()
