"""Library layers keep one checked launch per argument signature (kernels.base.LayerLaunches)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.kernels.base import LayerLaunches, Plan, signature_constant
from graphkern.kernels.ops import add_rms_norm as add_rms_norm_module
from graphkern.kernels.ops import rms_norm as rms_norm_module
from graphkern.launching import backends


def _rms(x: mx.array, w: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def test_calls_of_one_signature_reuse_one_launch_with_their_own_values(opaque_gpu: list[str]) -> None:
    rms_norm_module._LAUNCHES.entries.clear()
    w = mx.random.normal((16,))
    for i in range(4):
        x = mx.random.normal((3, 16), key=mx.random.key(i))
        assert mx.allclose(gkk.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5), atol=1e-6).item()
    assert len(rms_norm_module._LAUNCHES.entries) == 1
    # the replayed form is traced once; the later calls replay it on their own inputs
    assert opaque_gpu.count("gk_rms_norm") == 1
    # another eps, no weight, another shape: three more signatures, each right
    x = mx.random.normal((3, 16))
    assert mx.allclose(gkk.rms_norm(x, w, 0.5), _rms(x, w, 0.5), atol=1e-6).item()
    assert mx.allclose(gkk.rms_norm(x, None, 1e-5), _rms(x, None, 1e-5), atol=1e-6).item()
    x5 = mx.random.normal((5, 16))
    assert mx.allclose(gkk.rms_norm(x5, w, 1e-5), _rms(x5, w, 1e-5), atol=1e-6).item()
    assert len(rms_norm_module._LAUNCHES.entries) == 4


def test_the_same_array_twice_then_two_arrays(opaque_gpu: list[str]) -> None:
    add_rms_norm_module._LAUNCHES.entries.clear()
    a, b, w = mx.ones((2, 8)), mx.arange(16, dtype=mx.float32).reshape(2, 8), mx.ones((8,))
    h, _ = gkk.add_rms_norm(a, a, w)
    assert h.tolist() == (a + a).tolist()
    h, y = gkk.add_rms_norm(a, b, w)  # same signature: the second input is b now, not a again
    assert h.tolist() == (a + b).tolist()
    assert mx.allclose(y, _rms(a + b, w, 1e-5), atol=1e-6).item()


def test_a_bad_argument_is_refused_on_every_call_never_kept(opaque_gpu: list[str]) -> None:
    x = mx.ones((2, 8))
    for _ in range(2):
        with pytest.raises(gk.KernelError, match="eps"):
            gkk.rms_norm(x, mx.ones((8,)), float("nan"))
        with pytest.raises(gk.KernelError, match="weight"):
            gkk.rms_norm(x, mx.ones((4,)))
        with pytest.raises(gk.KernelError, match="mx.array"):
            gkk.rms_norm([[1.0, 2.0]])  # type: ignore[arg-type]


def test_traces_and_backends_take_their_own_way(opaque_gpu: list[str]) -> None:
    norm = nn.RMSNorm(8)
    x = mx.random.normal((2, 8))
    gkk.rms_norm(x, norm.weight)  # an eager launch, kept
    graph = gk.trace(lambda v: gkk.rms_norm(v, norm.weight), x)
    assert [graph.node(k)["kernel"] for k in graph.kernels()] == ["gk_rms_norm"]  # a node, traced
    with backends.using_backend("reference"):  # another backend: its own launch
        assert mx.allclose(gkk.rms_norm(x, norm.weight), norm(x), atol=1e-6).item()
    assert {key[1] for key in rms_norm_module._LAUNCHES.entries} >= {"cuda", "reference"}


def test_a_plan_input_made_from_the_call_is_never_taken_as_a_constant() -> None:
    layer = LayerLaunches()
    kernel = gk.Kernel("doubled_input", ["x"], ["out"], reference=lambda x: [x + 1])

    def call(x: mx.array) -> mx.array:
        # the plan takes x * 2, which depends on x's values: it must be made anew every call
        plan = lambda: Plan(kernel, (x * 2,), (gk.OutputSpec(x.shape, x.dtype),), (x.size, 1, 1),  # noqa: E731
                            (x.size, 1, 1))
        return layer((x.shape, x.dtype), (x,), plan)[0]

    assert call(mx.ones((3,))).tolist() == [3.0] * 3
    assert call(mx.zeros((3,))).tolist() == [1.0] * 3
    assert len(layer.entries) == 0
    table = signature_constant(mx.full((3,), 5.0))
    kept = lambda: Plan(gk.Kernel("with_table", ["x", "t"], ["out"], reference=lambda x, t: [x + t]),  # noqa: E731
                        (mx.ones((3,)), table), (gk.OutputSpec((3,), mx.float32),), (3, 1, 1), (3, 1, 1))
    assert layer(("table",), (), kept)[0].tolist() == [6.0] * 3
    assert len(layer.entries) == 0  # its first input is neither the call's array nor a constant
