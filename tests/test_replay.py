"""graphkern.tracing.replay: MLX primitives run again from the export's description give MLX's own values."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import graphkern as gk
from graphkern.tracing import replay

X = mx.random.normal((4, 6, 8), key=mx.random.key(0))
IDX = mx.array([3, 0, 2])

CASES: dict[str, Callable[[mx.array], mx.array]] = {
    "index rows": lambda x: x[IDX],
    "index two axes": lambda x: x[IDX, IDX],
    "take along axis 1": lambda x: mx.take(x, IDX, axis=1),
    "take_along_axis": lambda x: mx.take_along_axis(x, mx.argsort(x, axis=-1), axis=-1),
    "reverse slice": lambda x: x[::-1, 1:5:2, ::-3],
    "slice update": lambda x: _assigned(x),
    "slice add": lambda x: x.at[1:3].add(1.0),
    "dynamic slice": lambda x: mx.slice(x, mx.array([1, 2]), [0, 1], [2, 3, 8]),
    "dynamic slice update": lambda x: mx.slice_update(x, mx.ones((1, 2, 8)), mx.array([2, 3]), [0, 1]),
    "cumsum reversed": lambda x: mx.cumsum(x, axis=1, reverse=True, inclusive=False),
    "cummax": lambda x: mx.cummax(x, axis=2),
    "pad": lambda x: mx.pad(x, [(1, 0), (0, 2), (3, 1)], constant_values=-2.0),
    "concat and split": lambda x: sum(mx.split(mx.concatenate([x, x * 2], axis=2), [3, 9], axis=2)[1:2]),
    "reductions": lambda x: mx.max(x, axis=1).sum() + mx.min(x, axis=(0, 2)) + x.prod(axis=2),
    "any all": lambda x: mx.any(x > 1, axis=0).astype(mx.float32) + mx.all(x > -3, axis=0),
    "argmax argmin": lambda x: mx.argmax(x, axis=1) + mx.argmin(x, axis=-1).sum(),
    "sort partition": lambda x: mx.sort(x, axis=1) + mx.partition(x, 2, axis=1) + mx.argpartition(x, 3),
    "softmax logsumexp": lambda x: mx.softmax(x, axis=-1, precise=True)
    + mx.logsumexp(x, axis=-1, keepdims=True),
    "unary": lambda x: mx.erf(x) + mx.erfinv(mx.tanh(x) * 0.9) + mx.expm1(x) + mx.log1p(mx.abs(x))
    + mx.sign(x),
    "logs": lambda x: mx.log2(mx.abs(x) + 1) + mx.log10(mx.abs(x) + 1) + mx.rsqrt(mx.abs(x) + 1),
    "binary": lambda x: mx.arctan2(x, x + 1) + mx.remainder(x, 0.7) + mx.logaddexp(x, -x) + x ** 2,
    "divmod": lambda x: sum(mx.divmod(x, 0.3)),
    "compare": lambda x: mx.where(x > 0, x, -x) + (x == x) + mx.isclose(x, x * 1.0000001, equal_nan=True),
    "bitwise": lambda x: ((x * 100).astype(mx.int32) & 7 | 16) ^ 3 << 1 >> 1,
    "matmul addmm": lambda x: mx.addmm(x[0][:, :6], x[1], x[2].T, alpha=2.0, beta=0.5) @ x[3],
    "transpose reshape": lambda x: mx.transpose(x, (2, 0, 1)).reshape(8, -1).flatten()[None],
    "conv1d": lambda x: mx.conv1d(x, mx.ones((5, 3, 8)) * 0.1, stride=2, padding=1),
    "conv2d": lambda x: mx.conv2d(x[None], mx.ones((2, 3, 3, 8)) * 0.1, padding=(1, 0), dilation=1),
    "randint even": lambda x: x + mx.random.randint(0, 9, x.shape, key=mx.random.key(1)),
    "view": lambda x: x.view(mx.int32).astype(mx.float32) * 1e-9,
    "gather_mm": lambda x: mx.gather_mm(x, mx.ones((3, 8, 5)), rhs_indices=mx.array([[2], [0], [1], [2]])),
    "hadamard": lambda x: mx.hadamard_transform(x, scale=0.5),
    "stop_gradient and copy": lambda x: mx.stop_gradient(x) + mx.array(x),
}


def _assigned(x: mx.array) -> mx.array:
    y = mx.array(x)
    y[1, 2:5] = 0.0
    return y


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_node_is_run_again_with_mlxs_values(name: str) -> None:
    fn = CASES[name]
    g = gk.inspect(fn, X)
    unreached = {n: g.node(n)["values_note"] for n in g.nodes() if "values_note" in g.node(n)}
    assert not unreached and g.nx.graph["values"]["from_eager_run"] == 0, unreached
    expected = np.asarray(fn(X).astype(mx.float32))
    stats = g.node("output_0")["stats"]
    assert stats["min"] == pytest.approx(float(expected.min()), rel=1e-6, abs=1e-6)
    assert stats["max"] == pytest.approx(float(expected.max()), rel=1e-6, abs=1e-6)
    assert stats["mean"] == pytest.approx(float(expected.mean()), rel=1e-5, abs=1e-5)


def test_quantized_layers_are_run_again() -> None:
    model = nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 64))
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[1, 5, 9]])
    g = gk.inspect(model, tokens)
    assert {"QuantizedMatmul", "Gather"} <= {g.node(n)["op"] for n in g.nodes("op")}
    assert g.nx.graph["values"]["unreached"] == 0
    assert g.node("output_0")["stats"]["max"] == pytest.approx(model(tokens).max().item(), rel=1e-6)


def test_the_fast_primitives_of_gpu_traces_run_again_on_any_device() -> None:
    """On a GPU the export holds RMSNorm, LayerNorm, RoPE and ScaledDotProductAttention as single
    primitives (their state as MLX's headers declare it); on a CPU the same calls are checked here."""
    x, w, b = mx.random.normal((1, 2, 4, 8)), mx.random.normal((8,)), mx.random.normal((8,))
    spec = [(x.shape, mx.float32)]
    pairs = [
        (replay.run("RMSNorm", [1e-5], [x, w], spec), mx.fast.rms_norm(x, w, 1e-5)),
        (replay.run("RMSNorm", [1e-5], [x, mx.array(1.0)], spec), mx.fast.rms_norm(x, None, 1e-5)),
        (replay.run("LayerNorm", [1e-5], [x, w, b], spec), mx.fast.layer_norm(x, w, b, 1e-5)),
        (replay.run("LayerNorm", [1e-5], [x, mx.array(1.0), mx.array(0.0)], spec),
         mx.fast.layer_norm(x, None, None, 1e-5)),
        (replay.run("RoPE", [8, False, 10000.0, 1.0, True], [x, mx.array(3)], spec),
         mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=3)),
        (replay.run("RoPE", [8, True, 0.0, 0.5, True], [x, mx.array(1), mx.ones((4,))], spec),
         mx.fast.rope(x, 8, traditional=True, base=None, scale=0.5, offset=1, freqs=mx.ones((4,)))),
        (replay.run("ScaledDotProductAttention", [0.3, True, False, False, False], [x, x, x], spec),
         mx.fast.scaled_dot_product_attention(x, x, x, scale=0.3, mask="causal")),
        (replay.run("ScaledDotProductAttention", [0.3, False, False, False, False],
                    [x, x, x, mx.zeros((1, 2, 4, 4))], spec),
         mx.fast.scaled_dot_product_attention(x, x, x, scale=0.3, mask=mx.zeros((1, 2, 4, 4)))),
    ]
    for got, expected in pairs:
        assert mx.allclose(got[0], expected, atol=1e-6).item()


def test_what_cannot_run_again_says_why() -> None:
    with pytest.raises(replay.NotReplayable, match="cannot run the MLX primitive 'Eigh'"):
        replay.run("Eigh", [], [X], [(X.shape, mx.float32)])
    with pytest.raises(replay.NotReplayable, match="custom kernel launched outside graphkern"):
        replay.run("CustomKernel", [], [X], [(X.shape, mx.float32)])
    with pytest.raises(replay.NotReplayable, match=r"gave shape \(4, 6, 8\) again, MLX reported \(2,\)"):
        replay.run("Exp", [], [X], [((2,), mx.float32)])
    with pytest.raises(replay.NotReplayable, match="RoPE run backwards"):
        replay.run("RoPE", [8, False, 1e4, 1.0, False], [X, mx.array(0)], [(X.shape, mx.float32)])
