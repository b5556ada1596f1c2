"""Hand-built trace graphs in graphkern's schema, for the drawing tests and benchmarks.

They follow the graph's contract in ``graphkern.tracing.schema`` exactly (node kinds, attributes, one
edge per array keyed by its name; ``tests/test_viz_graphs.py`` lints every one), so the viewers
can be tested without tracing, at any size, with failures placed where a test wants them.
``FakeGraph`` stands in for ``gk.Graph``: it has ``.nx`` and ``.status``. ``traced`` and ``llama``
are real ``gk.trace``s: a two-block module with a graphkern kernel, and a patched random-weight
mlx-lm llama of any depth; ``nan_values``, ``swiglu_comparison`` and ``weight_comparison`` are
``gk.inspect`` and ``gk.compare`` of the planted bugs (``planted_bugs``). ``page_data`` reads a
viewer page's JSON.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

OK = 0
COMPILE_ERROR = 8
INVALID_LAUNCH = 2
UPSTREAM_FAILED = 10


@dataclass(frozen=True)
class Ref:
    """One array: the node that made it, its name, shape and dtype."""

    node: str
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


class FakeGraph:
    """What the viewers need of ``gk.Graph``: ``.nx`` and ``.status``."""

    def __init__(self, g: nx.MultiDiGraph):
        self.nx = g

    @property
    def status(self) -> int:
        for n in sorted(self.nx.nodes, key=lambda n: self.nx.nodes[n]["order"]):
            s = self.nx.nodes[n]["status"]
            if s not in (OK, UPSTREAM_FAILED):
                return s
        return OK

    def failures(self) -> list[str]:
        return [n for n, d in self.nx.nodes(data=True) if d["status"] not in (OK, UPSTREAM_FAILED)]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Builder:
    """Builds a graph node by node, in topological order, with torch.fx-like ids."""

    def __init__(self, name: str = "forward", backend: str = "reference"):
        self.g = nx.MultiDiGraph()
        # (not as constructor keywords: networkx takes ``backend=`` for itself)
        self.g.graph.update(name=name, backend=backend, mlx_version="0.32.4")
        self._ids: Counter[str] = Counter()
        self._arrays = 0
        self._order = 0

    def _id(self, base: str) -> str:
        n = self._ids[base]
        self._ids[base] += 1
        return base if n == 0 else f"{base}_{n}"

    def _node(self, base: str, kind: str, *, label: str | None = None, op: str = "",
              scope: str = "", **attrs: Any) -> str:
        node = self._id(base)
        self.g.add_node(node, kind=kind, label=label or node, op=op, scope=scope, status=OK,
                        root_cause=None, message="", order=self._order, **attrs)
        self._order += 1
        return node

    def _array(self, node: str, shape: Sequence[int], dtype: str) -> Ref:
        self._arrays += 1
        return Ref(node, f"a{self._arrays}", tuple(shape), dtype)

    def _connect(self, inputs: Iterable[Ref], node: str) -> None:
        for i, ref in enumerate(inputs):
            self.g.add_edge(ref.node, node, key=ref.name, shape=ref.shape, dtype=ref.dtype, index=i)

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Ref:
        node = self._node(name, "input")
        return Ref(node, name, tuple(shape), dtype)

    def const(self, shape: Sequence[int], value: str = "0.5", scope: str = "",
              dtype: str = "float32") -> Ref:
        node = self._node("constant", "constant", scope=scope, value=value)
        return self._array(node, shape, dtype)

    def op(self, op: str, inputs: Sequence[Ref], shape: Sequence[int] | None = None, *,
           scope: str = "", dtype: str | None = None, arguments: str = "") -> Ref:
        node = self._node(_snake(op), "op", label=op, op=op, scope=scope, arguments=arguments)
        self._connect(inputs, node)
        return self._array(node, inputs[0].shape if shape is None else shape,
                           dtype or inputs[0].dtype)

    def kernel(self, name: str, inputs: Sequence[Ref], shape: Sequence[int] | None = None, *,
               scope: str = "", backend: str = "metal", source: str | None = None) -> Ref:
        out_shape = tuple(inputs[0].shape if shape is None else shape)
        size = 1
        for d in out_shape:
            size *= d
        node = self._node(
            name, "kernel", label=name, op=name, scope=scope, kernel=name, backend=backend,
            grid=[size, 1, 1], threadgroup=[256, 1, 1], template=[["T", "float32"]],
            source_hash="3f2a9c41d0be",
            source=source if source is not None else (
                "uint i = thread_position_in_grid.x;\nout[i] = x[i] * T(2) + y[i];"),
            generated_name=f"custom_kernel_{name}_3f2a9c41",
        )
        self._connect(inputs, node)
        return self._array(node, out_shape, inputs[0].dtype)

    def output(self, ref: Ref) -> str:
        n = self._ids["output"]
        node = self._node(f"output_{n}", "output")
        self._ids["output"] += 1
        self._connect([ref], node)
        return node

    def done(self) -> FakeGraph:
        return FakeGraph(self.g)


def fail(graph: FakeGraph | nx.MultiDiGraph, node: str, status: int = COMPILE_ERROR,
         message: str = "error: use of undeclared identifier 'q'") -> list[str]:
    """Mark ``node`` failed and everything downstream UPSTREAM_FAILED; returns the descendants."""
    g = graph.nx if isinstance(graph, FakeGraph) else graph
    g.nodes[node].update(status=status, root_cause=node, message=message)
    down = sorted(nx.descendants(g, node), key=lambda n: g.nodes[n]["order"])
    for d in down:
        if g.nodes[d]["status"] == OK:
            g.nodes[d].update(status=UPSTREAM_FAILED, root_cause=node)
    return down


def small(*, failed: bool = False) -> FakeGraph:
    """Nine nodes: an input, a weight, a scoped MLP with a kernel, a residual add, one output.

    With ``failed``, the kernel ``scale_add`` has COMPILE_ERROR and its descendants are marked.
    """
    b = Builder("small_model")
    x = b.input("x", (4, 8))
    w = b.const((8, 8), "[[0.1, ...]]", scope="mlp.up")
    h = b.op("Matmul", [x, w], (4, 8), scope="mlp.up")
    y = b.kernel("scale_add", [h, x], scope="mlp")
    a = b.op("Sigmoid", [y], scope="mlp.act")
    m = b.op("Multiply", [a, y], scope="mlp.act")
    r = b.op("Add", [m, x], arguments="")
    s = b.op("Sum", [r], (4,), arguments="axes=[1], keepdims=false")
    b.output(s)
    g = b.done()
    if failed:
        fail(g, "scale_add")
    return g


def transformer(layers: int = 2, *, d: int = 64, seq: int = 16, failed_layer: int | None = None,
                kernel_norm: bool = True) -> FakeGraph:
    """A decoder-like trace: embedding, ``layers`` blocks (attention, MLP, norms), head.

    About 60 nodes per block. With ``kernel_norm`` each block's first norm is the kernel
    ``rms_norm``; otherwise it is the six ops it stands for (``patch`` turns one into the other).
    ``failed_layer`` gives that block's ``rms_norm`` a COMPILE_ERROR.
    """
    b = Builder("decoder_forward")
    tokens = b.input("tokens", (1, seq), "int32")
    table = b.const((1000, d), "<embedding 1000x64>", scope="embed_tokens")
    h = b.op("Gather", [table, tokens], (1, seq, d), scope="embed_tokens", dtype="float32")
    for i in range(layers):
        p = f"layers.{i}"
        norm_scope = f"{p}.input_layernorm"
        if kernel_norm:
            wn = b.const((d,), "<weight>", scope=norm_scope)
            n1 = b.kernel("rms_norm", [h, wn], scope=norm_scope)
        else:
            n1 = _norm_ops(b, h, norm_scope, d)
        heads: list[Ref] = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            sc = f"{p}.self_attn.{proj}"
            w = b.const((d, d), "<weight>", scope=sc)
            t = b.op("Transpose", [w], (d, d), scope=sc, arguments="axes=[1, 0]")
            mm = b.op("Matmul", [n1, t], (1, seq, d), scope=sc)
            heads.append(b.op("Reshape", [mm], (1, seq, 4, d // 4), scope=f"{p}.self_attn"))
        q, k, v = (b.op("Transpose", [hh], (1, 4, seq, d // 4), scope=f"{p}.self_attn",
                        arguments="axes=[0, 2, 1, 3]") for hh in heads)
        rope = f"{p}.self_attn.rope"
        q = b.op("RoPE", [q], scope=rope, arguments="dims=16, base=10000")
        k = b.op("RoPE", [k], scope=rope, arguments="dims=16, base=10000")
        kt = b.op("Transpose", [k], (1, 4, d // 4, seq), scope=f"{p}.self_attn")
        sc_ = b.op("Matmul", [q, kt], (1, 4, seq, seq), scope=f"{p}.self_attn")
        scale = b.const((), "0.25", scope=f"{p}.self_attn")
        sc_ = b.op("Multiply", [sc_, scale], scope=f"{p}.self_attn")
        sm = b.op("Softmax", [sc_], scope=f"{p}.self_attn", arguments="axes=[-1]")
        att = b.op("Matmul", [sm, v], (1, 4, seq, d // 4), scope=f"{p}.self_attn")
        att = b.op("Transpose", [att], (1, seq, 4, d // 4), scope=f"{p}.self_attn")
        att = b.op("Reshape", [att], (1, seq, d), scope=f"{p}.self_attn")
        wo = b.const((d, d), "<weight>", scope=f"{p}.self_attn.o_proj")
        att = b.op("Matmul", [att, wo], (1, seq, d), scope=f"{p}.self_attn.o_proj")
        h = b.op("Add", [h, att], scope=p)
        n2 = _norm_ops(b, h, f"{p}.post_attention_layernorm", d)
        ups = []
        for proj in ("gate_proj", "up_proj"):
            w = b.const((d, 4 * d), "<weight>", scope=f"{p}.mlp.{proj}")
            ups.append(b.op("Matmul", [n2, w], (1, seq, 4 * d), scope=f"{p}.mlp.{proj}"))
        sg = b.op("Sigmoid", [ups[0]], scope=f"{p}.mlp")
        act = b.op("Multiply", [ups[0], sg], scope=f"{p}.mlp")
        act = b.op("Multiply", [act, ups[1]], scope=f"{p}.mlp")
        wd = b.const((4 * d, d), "<weight>", scope=f"{p}.mlp.down_proj")
        down = b.op("Matmul", [act, wd], (1, seq, d), scope=f"{p}.mlp.down_proj")
        h = b.op("Add", [h, down], scope=p)
    h = _norm_ops(b, h, "norm", d)
    wh = b.const((d, 1000), "<weight>", scope="lm_head")
    logits = b.op("Matmul", [h, wh], (1, seq, 1000), scope="lm_head")
    b.output(logits)
    g = b.done()
    if failed_layer is not None:
        kernels = [n for n, data in g.nx.nodes(data=True)
                   if data["kind"] == "kernel" and data["scope"].startswith(f"layers.{failed_layer}.")]
        fail(g, kernels[0])
    return g


def _norm_ops(b: Builder, h: Ref, scope: str, d: int) -> Ref:
    sq = b.op("Square", [h], scope=scope)
    mean = b.op("Mean", [sq], (1, 16, 1), scope=scope, arguments="axes=[-1], keepdims=true")
    eps = b.const((), "1e-05", scope=scope)
    var = b.op("Add", [mean, eps], scope=scope)
    inv = b.op("Rsqrt", [var], scope=scope)
    y = b.op("Multiply", [h, inv], (1, 16, d), scope=scope)
    w = b.const((d,), "<weight>", scope=scope)
    return b.op("Multiply", [y, w], scope=scope)


def big(nodes: int = 10_000, *, failed: bool = True) -> FakeGraph:
    """A transformer-like trace of at least ``nodes`` nodes (the 10,000-node benchmark graph).

    With ``failed`` a kernel in the middle has COMPILE_ERROR, so about half the graph is marked
    UPSTREAM_FAILED.
    """
    per_layer = transformer(1).nx.number_of_nodes() - transformer(0).nx.number_of_nodes()
    base = transformer(0).nx.number_of_nodes()
    layers = max(1, -(-(nodes - base) // per_layer))
    return transformer(layers, failed_layer=layers // 2 if failed else None)


def random_dag(nodes: int = 200, *, seed: int = 0, scopes: int = 6) -> FakeGraph:
    """A random layered DAG with random scopes, for robustness tests of the layout."""
    rng = random.Random(seed)
    b = Builder(f"random_{seed}")
    refs = [b.input(f"in{i}", (rng.randint(1, 9),)) for i in range(3)]
    scope_names = [""] + [f"block{j}" + ("" if rng.random() < 0.5 else f".sub{rng.randint(0, 2)}")
                          for j in range(scopes)]
    while b.g.number_of_nodes() < nodes - 2:
        k = rng.randint(1, 3)
        ins = [refs[max(0, len(refs) - 1 - int(rng.expovariate(0.2)))] for _ in range(k)]
        refs.append(b.op(rng.choice(["Add", "Multiply", "Exp", "Matmul"]), ins,
                         scope=rng.choice(scope_names)))
    b.output(refs[-1])
    return b.done()


SCALE_ADD_METAL = "uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];"
SCALE_ADD_CUDA = ("auto i = blockIdx.x * blockDim.x + threadIdx.x; "
                  "if (i < x_shape[0]) out[i] = x[i] * T(2) + y[i];")


def traced(*, failed: bool = False, kernel: bool = True) -> Any:
    """A real ``gk.trace`` of a two-block model with module scopes and a graphkern kernel in each
    block; with ``failed``, block 1 launches it with threadgroup 0 (INVALID_LAUNCH). With
    ``kernel=False`` the blocks compute the same thing with plain MLX ops (the "before patch")."""
    import mlx.core as mx
    import mlx.nn as nn

    import graphkern as gk

    k = gk.Kernel("scale_add", ["x", "y"], ["out"], metal=SCALE_ADD_METAL, cuda=SCALE_ADD_CUDA,
                  reference=lambda x, y: [x * 2 + y])

    class Block(nn.Module):
        def __init__(self, broken: bool):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.broken = broken

        def __call__(self, x: mx.array) -> mx.array:
            h = self.proj(x)
            if kernel:
                tg = (0, 1, 1) if self.broken else (256, 1, 1)
                h = gk.apply_in_graph(k, [h, x], [gk.OutputSpec(h.shape, h.dtype)],
                                      grid=(h.size, 1, 1), threadgroup=tg,
                                      template=[("T", h.dtype)]).outputs[0]
            else:
                h = h * 2 + x
            return mx.tanh(h) + x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [Block(False), Block(failed)]
            self.head = nn.Linear(8, 4)

        def __call__(self, x: mx.array) -> mx.array:
            for layer in self.layers:
                x = layer(x)
            return self.head(x).sum(-1)

    mx.random.seed(0)
    model = Model()
    mx.eval(model.parameters())
    return gk.trace(model, mx.ones((4, 8)))


@functools.lru_cache(maxsize=8)
def llama(layers: int = 2, *, patched: bool = True, broken: int | None = None) -> Any:
    """A real ``gk.trace`` of a random-weight mlx-lm llama with ``layers`` decoder layers (hidden
    size 64, as ``graphkern.models.tiny``), its layers ``gk.patch``ed onto library kernels, on
    eight tokens. With ``broken``, that layer's input RMSNorm weight is one feature short of the
    activations, so its kernel layer refuses the call (MODULE_ERROR) and everything after it is
    UPSTREAM_FAILED. Cached: callers must not change the graph."""
    import mlx.core as mx

    import graphkern as gk

    model = llama_model(layers, patched=patched)
    if broken is not None:
        norm = model.model.layers[broken].input_layernorm
        norm.weight = norm.weight[:-1]
    return gk.trace(model, mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]))


def llama_model(layers: int, *, patched: bool = True) -> Any:
    """The random-weight mlx-lm llama behind ``llama``."""
    import graphkern as gk
    from graphkern.models.tiny import TINY_CONFIGS, random_model

    model = random_model({**TINY_CONFIGS["llama"], "num_hidden_layers": layers})
    if patched:
        gk.patch(model)
    return model


@functools.lru_cache(maxsize=1)
def nan_values() -> Any:
    """``gk.inspect`` of the 8-layer tiny llama whose layer 3 post-attention norm makes NaNs
    (``planted_bugs.nan_llama``). Cached: callers must not change the graph."""
    import planted_bugs as pb

    import graphkern as gk

    return gk.inspect(pb.nan_llama(), pb.TOKENS)


@functools.lru_cache(maxsize=1)
def swiglu_comparison() -> Any:
    """``gk.compare`` of the stock 8-layer tiny llama against it patched, layer 3's SwiGLU 1% off
    (``planted_bugs.swiglu_off_llama``). Cached: callers must not change it."""
    import planted_bugs as pb

    import graphkern as gk

    return gk.compare(pb.llama(), pb.swiglu_off_llama(), pb.TOKENS)


@functools.lru_cache(maxsize=2)
def weight_comparison(loud: float = 1.0) -> Any:
    """``gk.compare`` of the stock 8-layer tiny llama against it patched, layer 5's query weight 1%
    off (``planted_bugs.weight_off_llama``); ``loud`` scales both models' embeddings (see
    ``planted_bugs.llama``). Cached: callers must not change it."""
    import planted_bugs as pb

    from graphkern.debugging.comparison import compare

    return compare(pb.llama(loud=loud), pb.weight_off_llama(loud=loud), pb.TOKENS)


def page_data(page: str) -> dict[str, Any]:
    """The JSON document a viewer page carries in its ``<script id="gk-data">``, read as strictly as
    a browser does (no NaN or Infinity)."""
    found = re.search(r'<script id="gk-data" type="application/json">(.*?)</script>', page, re.S)
    assert found, "no data block"
    return dict(json.loads(found.group(1), parse_constant=_not_json))


def _not_json(name: str) -> None:
    raise AssertionError(f"the page's data holds {name}, which the browser's JSON.parse refuses")
