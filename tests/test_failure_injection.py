"""Failure injection: each kind of failure lands as the right status on the right node, its
descendants are marked UPSTREAM_FAILED with a pointer to it, independent nodes stay OK, and the
next trace and call work.

Injected: a reference that raises, returns the wrong number or shape of outputs or no arrays;
a kernel that fails only when run (a Metal kernel on Linux, a reference that starts raising
after the inspection trace); an exception inside a traced ``nn.Module``; and, on a CUDA
device (``gpu`` marker), a kernel whose source NVRTC rejects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import networkx as nx
import pytest

import graphkern as gk

S = gk.Status
X = mx.arange(8, dtype=mx.float32)
Y = mx.ones((8,))
ELEM = "uint i = thread_position_in_grid.x;"
CUDA_ELEM = "auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) "

GOOD = gk.Kernel("good", ["x", "y"], ["out"], reference=lambda x, y: [x * 2 + y])  # no GPU source
AFTER = gk.Kernel("after", ["x"], ["out"], reference=lambda x: [x + 1])


def launch(kernel: gk.Kernel, *inputs: mx.array) -> mx.array:
    x = inputs[0]
    return gk.apply_in_graph(kernel, list(inputs), [gk.OutputSpec(x.shape, x.dtype)],
                             grid=(x.size, 1, 1), threadgroup=(8, 1, 1),
                             template=[("T", x.dtype)]).outputs[0]


def pipeline(bad: gk.Kernel) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """good -> bad -> exp -> after ; and an independent branch from good."""
    def fn(x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        a = launch(GOOD, x, y)
        b = launch(bad, a)
        d = launch(AFTER, mx.exp(b))
        return d, a * 3
    return fn


def healthy(x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
    a = launch(GOOD, x, y)
    return launch(AFTER, mx.exp(a * 0)), a * 3


def assert_next_trace_and_call_work() -> None:
    """After a failure: a new trace is OK, a new compiled call gives the right values."""
    assert gk.trace(healthy, X, Y).ok
    d, e = gk.compile(healthy)(X, Y)
    assert d.tolist() == [2.0] * 8 and e.tolist() == ((X * 2 + Y) * 3).tolist()
    assert (mx.arange(3) * 2).tolist() == [0, 2, 4]


def assert_marked(graph: gk.Graph, root: str, status: gk.Status, fragment: str) -> None:
    """``root`` failed with ``status``; exactly its descendants are UPSTREAM_FAILED."""
    [failure] = graph.failures()
    assert failure.node == root and failure.status == status and fragment in failure.message
    assert graph.status == status and not graph.ok
    below = nx.descendants(graph.nx, root)
    assert below, "the failed node must have descendants in these pipelines"
    for name in graph.nx:
        data = graph.node(name)
        if name == root:
            assert data["status"] == status and data["root_cause"] == root
        elif name in below:
            assert data["status"] == S.UPSTREAM_FAILED and data["root_cause"] == root, name
        else:
            assert data["status"] == S.OK, name
    assert failure.affected_outputs == ("output_0",)
    assert graph.node("output_1")["status"] == S.OK


def _raises(x: mx.array) -> list[mx.array]:
    raise ZeroDivisionError("injected failure")


@pytest.mark.parametrize("reference, fragment", [
    (_raises, "ZeroDivisionError: injected failure"),
    (lambda x: [x, x], "returned 2 outputs but 1 were declared"),
    (lambda x: [], "returned 0 outputs but 1 were declared"),
    (lambda x: [x[:3]], "has shape (3,) but (8,) was declared"),
    (lambda x: [x.reshape(2, 4)], "has shape (2, 4) but (8,) was declared"),
    (lambda x: None, "must return a list of mlx arrays"),
    (lambda x: ["not an array"], "must return a list of mlx arrays"),
    (lambda x: [x + mx.ones((3,))], "ValueError"),  # an MLX error inside the reference
], ids=["raises", "too-many", "none-returned", "short", "reshaped", "returns-None", "not-arrays",
        "mlx-error"])
def test_bad_reference_fails_its_node_and_marks_downstream(reference: Any, fragment: str) -> None:
    bad = gk.Kernel("bad", ["x"], ["out"], reference=reference)
    graph = gk.trace(pipeline(bad), X, Y)
    assert_marked(graph, "bad", S.REFERENCE_ERROR, fragment)
    assert graph.node("bad")["message"].startswith("run the reference of kernel 'bad': ")
    assert graph.node("good")["status"] == S.OK

    cf = gk.compile(pipeline(bad))
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "bad" and info.value.status == S.REFERENCE_ERROR
    assert info.value.affected_outputs == ("output_0",) and fragment in str(info.value)
    assert cf.call_with_status(X, Y) == (None, S.REFERENCE_ERROR)
    assert_next_trace_and_call_work()


def test_kernel_that_fails_only_when_run_is_blamed_on_its_node() -> None:
    # A Metal kernel traces on Linux but cannot run: only the compiled call finds out.
    metal_only = gk.Kernel("metal_only", ["x"], ["out"], metal=f"{ELEM} out[i] = x[i] + T(1);",
                           reference=lambda x: [x + 1])
    cf = gk.compile(pipeline(metal_only), backend="metal")
    assert cf.trace(X, Y).ok  # nothing wrong is visible before running
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "metal_only" and info.value.status == S.BACKEND_UNAVAILABLE
    assert_marked(cf.graph, "metal_only", S.BACKEND_UNAVAILABLE, "Metal")
    assert cf.graph.node("good")["backend"] == "reference"  # no Metal source: ran fine
    assert_next_trace_and_call_work()


def test_reference_that_starts_failing_after_the_trace_is_blamed_on_its_node() -> None:
    """The inspection trace succeeds; the compiled run calls the reference again and it raises."""
    calls = {"n": 0}

    def flaky(x: mx.array) -> list[mx.array]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("the device went away")
        return [x + 1]

    bad = gk.Kernel("flaky", ["x"], ["out"], reference=flaky)
    cf = gk.compile(pipeline(bad))
    assert cf.trace(X, Y).ok and calls["n"] == 1
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "flaky" and info.value.status == S.REFERENCE_ERROR
    assert "the device went away" in str(info.value)
    assert_marked(cf.graph, "flaky", S.REFERENCE_ERROR, "the device went away")
    assert_next_trace_and_call_work()


class Block(nn.Module):
    def __init__(self, fail_on_rows: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fail_on_rows = fail_on_rows

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == self.fail_on_rows:
            raise ValueError(f"cannot handle {x.shape[0]} rows")
        return nn.relu(self.proj(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [Block(), Block(fail_on_rows=3), Block()]
        self.side = nn.Linear(4, 2)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = x
        for block in self.blocks:
            h = block(h)
        return mx.tanh(h), self.side(x)


def test_exception_inside_a_traced_module_fails_that_module() -> None:
    net = Net()
    bad_x, good_x = mx.ones((3, 4)), mx.ones((2, 4))
    graph = gk.trace(net, bad_x)
    [failure] = graph.failures()
    assert failure.status == S.MODULE_ERROR and "cannot handle 3 rows" in failure.message
    assert graph.node(failure.node)["scope"] == "blocks.1"
    assert failure.message.startswith("call module 'blocks.1' (Block)")
    assert_marked(graph, failure.node, S.MODULE_ERROR, "ValueError")
    scopes = {graph.node(n)["scope"]: graph.node(n)["status"] for n in graph.nodes("op")}
    assert scopes["blocks.0.proj"] == S.OK and scopes["side"] == S.OK
    assert scopes["blocks.2.proj"] == S.UPSTREAM_FAILED

    cf = gk.compile(net)
    with pytest.raises(gk.GraphError) as info:
        cf(bad_x)
    assert info.value.status == S.MODULE_ERROR and info.value.affected_outputs == ("output_0",)
    out, side = cf(good_x)  # another shape re-traces, and the module works for it
    expected_out, expected_side = net(good_x)
    assert mx.allclose(out, expected_out).item() and mx.allclose(side, expected_side).item()
    # the module hooks are gone: the classes are as they were
    assert "__wrapped__" not in vars(Block.__call__) and "__wrapped__" not in vars(nn.Linear.__call__)
    assert_next_trace_and_call_work()


def test_exception_outside_any_module_is_a_clear_error_and_leaves_no_hooks() -> None:
    net = Net()

    def fn(x: mx.array) -> mx.array:
        net(mx.ones((2, 4)))
        raise KeyError("outside every module")

    with pytest.raises(gk.KernelError) as info:
        gk.trace(fn, X)
    assert info.value.status == S.MODULE_ERROR and "KeyError" in info.value.description
    with pytest.raises(gk.KernelError):
        gk.compile(fn)(X)
    assert "__wrapped__" not in vars(Block.__call__) and "__wrapped__" not in vars(nn.Linear.__call__)
    assert_next_trace_and_call_work()


BROKEN_CUDA = gk.Kernel(
    "broken_cuda", ["x"], ["out"],
    cuda=CUDA_ELEM + "out[i] = x[i] + gk_injected_undeclared_symbol;",
    reference=lambda x: [x + 1],
)


@pytest.mark.gpu
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (NVRTC)")
def test_cuda_source_that_fails_to_compile_is_a_compile_error_on_its_node() -> None:
    cf = gk.compile(pipeline(BROKEN_CUDA))
    assert cf.trace(X, Y).ok  # NVRTC only runs when MLX evaluates
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "broken_cuda" and info.value.status == S.COMPILE_ERROR
    assert "gk_injected_undeclared_symbol" in str(info.value)  # NVRTC's log comes along
    assert_marked(cf.graph, "broken_cuda", S.COMPILE_ERROR, "gk_injected_undeclared_symbol")
    assert cf.graph.node("broken_cuda")["backend"] == "cuda"
    assert_next_trace_and_call_work()


def test_failed_launches_with_identical_placeholders_keep_every_kernel_node() -> None:
    """MLX merges the identical placeholders of two failed launches into one node; folding the
    first must not hand that node to the second, which then swallowed the kernels upstream."""
    def fn(x: mx.array, y: mx.array) -> mx.array:
        a = launch(GOOD, x, y)
        bad = gk.Kernel("bad", ["x", "y"], ["out"], reference=lambda x, y: [x + y])
        spec = [gk.OutputSpec(x.shape, x.dtype)]
        b = gk.apply_in_graph(bad, [x, a], spec, grid=(8, 1, 1), threadgroup=(0, 1, 1)).outputs[0]
        c = gk.apply_in_graph(bad, [x, b], spec, grid=(8, 1, 1), threadgroup=(0, 1, 1)).outputs[0]
        return c

    graph = gk.trace(fn, X, Y)
    assert graph.kernels() == ["good", "bad", "bad_1"]
    assert graph.inputs_of("good") == ["x", "y"]
    assert graph.inputs_of("bad") == ["x", "good"] and graph.inputs_of("bad_1") == ["x", "bad"]
    assert graph.nodes("op") == []  # the placeholders folded into their kernel nodes
    assert [f.node for f in graph.failures()] == ["bad", "bad_1"]
    assert graph.node("good")["status"] == S.OK
    assert graph.node("output_0")["root_cause"] == "bad"
