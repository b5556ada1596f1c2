"""The built-in demo: a tiny transformer-style model whose norm and MLP run as graphkern kernels.

``graphkern demo`` traces it, prints the graph, runs the compiled graph against eager MLX, then
breaks one kernel launch on purpose (threadgroup 0, which would divide by zero in MLX's CUDA
backend) and shows the status reaching the outputs instead of a crash.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from .compiling import compile
from .nodes import dtype_name
from .runtime import apply_in_graph
from .tracing.graph import Graph, GraphError
from .tracing.traceable import trace

__all__ = ["DEMO_FILES", "DemoModel", "DemoResult", "demo_inputs", "run_demo"]


class DemoBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + down(swiglu(gate(n), up(n)))`` with ``n = rms_norm(x)``."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.norm_weight = mx.ones((dims,))
        self.gate = nn.Linear(dims, hidden, bias=False)
        self.up = nn.Linear(dims, hidden, bias=False)
        self.down = nn.Linear(hidden, dims, bias=False)
        self.broken = False

    def norm(self, x: mx.array) -> mx.array:
        # lazy: the kernel library loads when the demo model runs, not with the command line
        from .kernels import rms_norm
        from .kernels.ops.rms_norm import plan_rms_norm

        if not self.broken:
            return rms_norm(x, self.norm_weight, eps=1e-5)
        plan = plan_rms_norm(x, self.norm_weight, eps=1e-5)
        return apply_in_graph(plan.kernel, list(plan.inputs), list(plan.output_specs),
                              grid=plan.grid, threadgroup=(0, 1, 1),  # the deliberate mistake
                              template=list(plan.template)).outputs[0]

    def __call__(self, x: mx.array) -> mx.array:
        from .kernels import swiglu  # lazy: the kernel library loads when the demo model runs

        n = self.norm(x)
        return x + self.down(swiglu(self.gate(n), self.up(n)))


class DemoModel(nn.Module):
    """Embedding, a few kernel-backed blocks, a final norm and an output head.

    >>> logits = DemoModel()(demo_inputs())
    >>> logits.shape
    (2, 16, 128)
    """

    def __init__(self, vocab: int = 128, dims: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dims)
        self.layers = [DemoBlock(dims, hidden) for _ in range(layers)]
        self.norm = nn.RMSNorm(dims)
        self.head = nn.Linear(dims, vocab, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def demo_inputs(batch: int = 2, length: int = 16, vocab: int = 128, seed: int = 0) -> mx.array:
    return mx.random.randint(0, vocab, (batch, length), key=mx.random.key(seed))


@dataclass
class DemoResult:
    graph: Graph
    broken_graph: Graph
    max_abs_error: float
    error: GraphError | None
    written: list[str]


#: The files ``run_demo`` writes into its folder.
DEMO_FILES = [f"{name}.{suffix}" for name in ("graph", "broken") for suffix in ("json", "dot", "html")]


def _write_plainly(files: dict[str, str]) -> None:
    for path, text in files.items():
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def run_demo(out_dir: str | None = None, echo: Callable[[str], Any] = print,
             write: Callable[[dict[str, str]], None] = _write_plainly) -> DemoResult:
    """Run the demo; with ``out_dir``, also write the graphs as JSON, DOT and HTML there (the files
    of :data:`DEMO_FILES`, ``{path: text}``, given to ``write``)."""
    mx.random.seed(0)
    model = DemoModel()
    tokens = demo_inputs()

    echo("== 1. trace the forward pass (MLX's own capture, kernels as single nodes)")
    graph = trace(model, tokens)
    echo(graph.summary())

    echo("\n== 2. run it as a compiled graph and compare with eager MLX")
    compiled = compile(model)
    logits = compiled(tokens)
    error = cast(float, mx.max(mx.abs(logits - model(tokens))).item())
    echo(f"compiled logits {tuple(logits.shape)} {dtype_name(logits.dtype)}, their sum "
         f"{mx.sum(logits).item():.4f}; max |compiled - eager| = {error:.3g}")

    echo("\n== 3. a deliberately invalid launch: layers.1 norm with threadgroup (0, 1, 1)")
    model.layers[1].broken = True
    broken = trace(model, tokens)
    for failure in broken.failures():
        echo(f"root failure  {failure}")
    downstream = [n for n in broken.nodes() if broken.node(n)["status"] == 10]
    echo(f"{len(downstream)} nodes downstream marked UPSTREAM_FAILED, outputs affected: "
         f"{broken.affected_outputs()}")
    graph_error = None
    try:
        compile(model)(tokens)
    except GraphError as exc:
        graph_error = exc
        echo(f"compiled call refused: {exc}")
    model.layers[1].broken = False
    total = mx.sum(compiled(tokens)).item()
    echo(f"after the refused call, the repaired model runs compiled again: the sum of its logits is "
         f"{total:.4f}, as in step 2: a failure leaves the model and MLX usable")

    written = _write(out_dir, {"graph": graph, "broken": broken}, echo, write) if out_dir else []
    return DemoResult(graph, broken, error, graph_error, written)


def _write(out_dir: str, graphs: dict[str, Graph], echo: Callable[[str], Any],
           write: Callable[[dict[str, str]], None]) -> list[str]:
    """Render ``graphs`` as :data:`DEMO_FILES` into ``out_dir`` (made when missing) with ``write``."""
    os.makedirs(out_dir, exist_ok=True)
    renders: dict[str, Callable[[Graph], str]] = {"json": lambda g: g.to_json(indent=1),
                                                  "dot": Graph.to_dot, "html": Graph.to_html}
    files: dict[str, str] = {}
    for name in DEMO_FILES:
        stem, suffix = name.split(".")
        path = os.path.join(out_dir, name)
        try:
            files[path] = renders[suffix](graphs[stem])
        except ImportError as exc:  # an optional part is not installed
            echo(f"skipped {path}: {exc}")
    write(files)
    echo("\nwrote " + ", ".join(files))
    return list(files)
