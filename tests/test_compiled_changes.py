"""Compiled graphs stay correct while things change between calls.

Weights (module parameters, closure arrays, explicit state) updated between calls are seen; new
shapes and dtypes re-trace while known ones reuse their trace; and a kernel replaced by another
with the same name and a new source runs the new source: on this CPU machine the reference
changes with the source, so the new reference's values must come out, and the graph must show
the new source hash.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphkern as gk

N = 8
X = mx.arange(N, dtype=mx.float32)
Y = mx.ones((N,))


def _kernel(name: str, factor: float) -> gk.Kernel:
    """``out = x * factor + y``; the Metal and CUDA bodies carry the same factor."""
    return gk.Kernel(
        name, ["x", "y"], ["out"],
        metal=f"uint i = thread_position_in_grid.x; out[i] = x[i] * T({factor}) + y[i];",
        cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; "
             f"if (i < x_shape[0]) out[i] = x[i] * {factor} + y[i];",
        reference=lambda x, y: [x * factor + y],
    )


def call(kernel: gk.Kernel, x: mx.array, y: mx.array) -> mx.array:
    return gk.apply_in_graph(kernel, [x, y], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                             threadgroup=(min(x.size, 256), 1, 1), template=[("T", x.dtype)]).outputs[0]


# ----------------------------------------------------------------------------- weights


class KernelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)
        self.bias = mx.zeros((N,))
        self.kernel = _kernel("net_axpy", 2.0)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.proj(x)
        shift = mx.broadcast_to(self.bias, h.shape).reshape(-1)
        return call(self.kernel, h.reshape(-1), shift).reshape(h.shape)


def test_module_weights_updated_between_calls_are_seen() -> None:
    net = KernelNet()
    x = mx.ones((2, N))
    cf = gk.compile(net)
    assert mx.allclose(cf(x), net(x)).item()
    first = cf.graph
    net.proj.weight = mx.zeros((N, N))  # attribute assignment
    net.proj.bias = mx.full((N,), 0.5)
    assert cf(x).tolist() == [[1.0] * N] * 2
    net.update({"bias": mx.full((N,), 3.0)})  # Module.update, as optimizers do
    assert cf(x).tolist() == [[4.0] * N] * 2
    net.proj.weight += 1.0  # in-place arithmetic rebinds the array
    assert mx.allclose(cf(x), net(x)).item()
    assert cf.graph is first  # same shapes: no re-trace for new values


def test_closure_and_explicit_state_updates_are_seen() -> None:
    scale = mx.array(2.0)
    table = {"shift": mx.zeros((N,))}
    k = _kernel("state_axpy", 1.0)

    def fn(x: mx.array) -> mx.array:
        return call(k, x * scale, table["shift"])

    cf = gk.compile(fn, state=table)
    assert cf(X).tolist() == (X * 2).tolist()
    scale = mx.array(5.0)  # noqa: F841 - rebinding the closure cell
    assert cf(X).tolist() == (X * 5).tolist()
    table["shift"] = mx.full((N,), 7.0)
    assert cf(X).tolist() == (X * 5 + 7).tolist()


# ----------------------------------------------------------------------------- shapes


def test_new_shapes_and_dtypes_retrace_and_known_ones_reuse_their_trace() -> None:
    k = _kernel("shape_axpy", 3.0)
    runs: list[tuple[int, ...]] = []

    def fn(x: mx.array, y: mx.array) -> mx.array:
        runs.append(x.shape)  # Python runs only when something traces
        return mx.tanh(call(k, x, y))

    cf = gk.compile(fn)
    results = {}
    for n, dtype in [(8, mx.float32), (3, mx.float32), (8, mx.float32), (16, mx.float16), (3, mx.float32)]:
        x, y = mx.arange(n, dtype=dtype), mx.ones((n,), dtype=dtype)
        out = cf(x, y)
        assert out.shape == (n,) and out.dtype == dtype
        assert mx.allclose(out, mx.tanh(x * 3 + y), atol=1e-3).item()
        graph = cf.graph
        [edge] = [d for u, _, d in graph.nx.in_edges("shape_axpy", data=True) if u == "x"]
        assert edge["shape"] == (n,)
        results.setdefault((n, dtype), graph)
        assert graph is results[(n, dtype)]  # a known signature reuses its graph
    assert len(list(cf.traces())) == 3
    # each new signature ran fn twice (inspection trace, then mx.compile's trace), known ones never
    assert runs == [(8,), (8,), (3,), (3,), (16,), (16,)]


def test_steady_calls_skip_the_signature_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.compiling.compiled as compiled_module

    cf = gk.compile(lambda x, y: mx.tanh(call(_kernel("steady_axpy", 2.0), x, y)))
    lookups = []
    signature = compiled_module._array_signature
    monkeypatch.setattr(compiled_module, "_array_signature", lambda a: lookups.append(1) or signature(a))
    for _ in range(4):
        assert mx.allclose(cf(X, Y), mx.tanh(X * 2 + Y)).item()
    assert len(lookups) == 1  # the first call only: MLX's cache check stands for it afterwards
    assert mx.allclose(cf(X[:3], Y[:3]), mx.tanh(X[:3] * 2 + Y[:3])).item()
    assert len(lookups) > 1  # a new signature takes the long way again


def test_a_steady_call_schedules_its_outputs_and_blames_a_kernel_failing_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady call hands its outputs to ``mx.async_eval`` (kernels are compiled and encoded
    there, so a failure still raises in the call) and leaves waiting to the caller."""
    kernel = _kernel("steady_scheduled", 2.0)
    cf = gk.compile(lambda x, y: mx.tanh(call(kernel, x, y)))
    for _ in range(2):
        cf(X, Y)
    scheduled: list[list[mx.array]] = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda arrays: scheduled.append(arrays) or async_eval(arrays))
    out = cf(X, Y)
    assert len(scheduled) == 1 and scheduled[0][0] is out
    assert mx.allclose(out, mx.tanh(X * 2 + Y)).item()

    def failing(arrays: list[mx.array]) -> None:
        raise RuntimeError("[custom_kernel] Failed to compile kernel: error: boom")

    monkeypatch.setattr(mx, "async_eval", failing)
    with pytest.raises(gk.GraphError) as caught:
        cf(X, Y)
    # the reference backend names no generated kernel, so the error names the evaluation
    assert caught.value.status == gk.Status.COMPILE_ERROR and "boom" in str(caught.value)
    assert cf.graph.ok  # no node named: nothing marked (tests/gpu: a named kernel is marked)
    monkeypatch.setattr(mx, "async_eval", async_eval)
    assert mx.allclose(cf(X, Y), mx.tanh(X * 2 + Y)).item()  # MLX and graphkern stay usable


def test_static_arguments_after_steady_calls_get_their_own_trace() -> None:
    k = _kernel("static_axpy", 2.0)
    cf = gk.compile(lambda x, y: call(k, x, x * y))
    for y in [Y, Y, Y, 3.0, 5.0, Y * 2, 3.0, [Y][0]]:
        assert mx.allclose(cf(X, y), X * 2 + X * y).item()
    assert len(list(cf.traces())) == 3


class ShapeFussyNet(nn.Module):
    """A linear layer, then a kernel whose launch is invalid for 3 rows; 5 rows make Python raise."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)
        self.kernel = _kernel("fussy_axpy", 2.0)

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == 5:
            raise ValueError("five rows are not welcome")
        h = self.proj(x).reshape(-1)
        launch = dict(grid=(h.size, 1, 1), threadgroup=(0 if x.shape[0] == 3 else 8, 1, 1))
        return gk.apply_in_graph(self.kernel, [h, h], [gk.OutputSpec(h.shape, h.dtype)],
                                 template=[("T", h.dtype)], **launch).outputs[0]


def test_a_failing_new_signature_after_steady_calls_is_refused_and_leaves_the_state_intact() -> None:
    net = ShapeFussyNet()
    weight = net.proj.weight
    cf = gk.compile(net)
    x2 = mx.ones((2, N))
    expected = net(x2)
    for rows, error in [(3, gk.GraphError), (5, gk.KernelError)]:
        for _ in range(3):  # steady calls, then MLX meets the new signature first
            assert mx.allclose(cf(x2), expected).item()
        with pytest.raises(error) as failed:
            cf(mx.ones((rows, N)))
        assert failed.value.status == (gk.Status.INVALID_LAUNCH if rows == 3 else gk.Status.MODULE_ERROR)
    assert mx.array_equal(net.proj.weight, weight).item()  # no MLX tracer left in the module
    assert mx.allclose(cf(x2), expected).item()
    assert mx.allclose(cf(mx.ones((4, N))), net(mx.ones((4, N)))).item()


# ----------------------------------------------------------------------------- kernels replaced


KERNELS: dict[str, gk.Kernel] = {}


def registry_fn(x: mx.array, y: mx.array) -> mx.array:
    """Reads its kernel from a mutable place at call time, as a kernel library would."""
    return call(KERNELS["axpy"], x, y) + 1


def test_same_named_kernel_with_a_new_source_runs_the_new_source() -> None:
    old, new = _kernel("registry_axpy", 2.0), _kernel("registry_axpy", 10.0)
    assert old.name == new.name and old.source_hash != new.source_hash
    KERNELS["axpy"] = old
    cf = gk.compile(registry_fn)
    assert cf(X, Y).tolist() == (X * 2 + Y + 1).tolist()
    assert cf.graph.node("registry_axpy")["source_hash"] == old.source_hash

    KERNELS["axpy"] = new  # same name, new source (and, here on the CPU, new reference)
    assert cf(X, Y).tolist() == (X * 10 + Y + 1).tolist()
    assert cf.graph.node("registry_axpy")["source_hash"] == new.source_hash
    outs, status = cf.call_with_status(X, Y)
    assert status == gk.Status.OK and outs.tolist() == (X * 10 + Y + 1).tolist()

    KERNELS["axpy"] = old  # and back again
    assert cf(X, Y).tolist() == (X * 2 + Y + 1).tolist()
    assert cf.graph.node("registry_axpy")["source_hash"] == old.source_hash


def test_replacing_a_kernel_reaches_every_traced_signature() -> None:
    KERNELS["axpy"] = _kernel("registry_axpy", 2.0)
    cf = gk.compile(registry_fn)
    small = (mx.arange(3, dtype=mx.float32), mx.ones((3,)))
    assert cf(X, Y).tolist() == (X * 2 + Y + 1).tolist()
    assert cf(*small).tolist() == (small[0] * 2 + 2).tolist()
    KERNELS["axpy"] = _kernel("registry_axpy", -1.0)
    assert cf(*small).tolist() == (-small[0] + 2).tolist()
    assert cf(X, Y).tolist() == (-X + Y + 1).tolist()


def test_a_replaced_kernel_that_fails_is_reported_and_the_good_one_comes_back() -> None:
    good = _kernel("registry_axpy", 2.0)
    broken = gk.Kernel("registry_axpy", ["x", "y"], ["out"], metal="out[0] = x[0];",
                       reference=lambda x, y: [x[:2]])  # wrong shape: REFERENCE_ERROR
    KERNELS["axpy"] = good
    cf = gk.compile(registry_fn)
    assert cf(X, Y).tolist() == (X * 2 + Y + 1).tolist()
    KERNELS["axpy"] = broken
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "registry_axpy" and info.value.status == gk.Status.REFERENCE_ERROR
    KERNELS["axpy"] = good
    assert cf(X, Y).tolist() == (X * 2 + Y + 1).tolist() and cf.graph.ok


def test_an_unchanged_kernel_never_causes_a_retrace() -> None:
    """Re-creating a kernel identical to the one in use (same name, source and reference) must
    not throw traces away; nor may a function that builds its kernel while tracing."""
    factor = 4.0
    reference = lambda x, y: [x * factor + y]  # noqa: E731
    runs = []

    def builds_its_kernel(x: mx.array, y: mx.array) -> mx.array:
        runs.append(1)
        k = gk.Kernel("inline_axpy", ["x", "y"], ["out"], metal="uint i = thread_position_in_grid.x; "
                      "out[i] = x[i] * T(4) + y[i];", reference=lambda x, y: [x * 4 + y])
        return call(k, x, y)

    KERNELS["axpy"] = gk.Kernel("steady_axpy", ["x", "y"], ["out"], metal="out[0] = x[0];",
                                reference=reference)
    cf = gk.compile(registry_fn)
    inline = gk.compile(builds_its_kernel)
    for _ in range(3):
        assert cf(X, Y).tolist() == (X * 4 + Y + 1).tolist()
        assert inline(X, Y).tolist() == (X * 4 + Y).tolist()
    graph = cf.graph
    gk.Kernel("steady_axpy", ["x", "y"], ["out"], metal="out[0] = x[0];", reference=reference)
    assert cf(X, Y).tolist() == (X * 4 + Y + 1).tolist() and cf.graph is graph
    assert len(runs) == 2  # traced once (inspection + compile), then never again


def _weights_and_kernel(net: Any) -> None:
    net.kernel = _kernel("net_axpy", -2.0)


def test_a_kernel_swapped_on_a_module_runs_the_new_source() -> None:
    net = KernelNet()
    x = mx.ones((2, N))
    cf = gk.compile(net)
    before = cf(x)
    _weights_and_kernel(net)
    after = cf(x)
    assert mx.allclose(after, net(x)).item() and not mx.allclose(after, before).item()
    assert cf.graph.node("net_axpy")["source_hash"] == net.kernel.source_hash


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = KernelNet()
        self.table = {"scale": [_kernel("nested_axpy", 3.0)]}

    def __call__(self, x: mx.array) -> mx.array:
        h = self.inner(x)
        return call(self.table["scale"][0], h.reshape(-1), h.reshape(-1)).reshape(h.shape)


def test_kernels_deep_in_a_module_tree_are_watched_and_a_removed_place_retraces() -> None:
    """A kernel several steps from the root (a child module's attribute, an item of a list in a
    dict) is read afresh on every steady call; a place that is gone makes the call trace again."""
    outer = Outer()
    x = mx.ones((2, N))
    cf = gk.compile(outer)
    assert mx.allclose(cf(x), outer(x)).item() and mx.allclose(cf(x), outer(x)).item()
    outer.inner.kernel = _kernel("net_axpy", -5.0)
    outer.table["scale"] = [_kernel("nested_axpy", 0.5)]  # the list itself replaced
    assert mx.allclose(cf(x), outer(x)).item()
    assert cf.graph.node("nested_axpy")["source_hash"] == outer.table["scale"][0].source_hash
    del outer.table["scale"]
    with pytest.raises(gk.KernelError, match="Outer raised KeyError") as info:  # traced again
        cf(x)
    assert info.value.status == gk.Status.MODULE_ERROR


# ----------------------------------------------------------------------------- any order of calls

_ROWS = st.sampled_from([2, 4, 3, 5])  # 3: an invalid launch, 5: the module raises
_SCALES = st.sampled_from(["array", "array", "array", 2.0, 3.0])  # mostly all-array calls, the
_KEYWORD = st.sampled_from([False, False, False, True])  # ones that take the steady path
_CALLS = st.lists(st.tuples(_ROWS, _SCALES, _KEYWORD, st.booleans(), st.integers(1, 3)),
                  min_size=1, max_size=8)  # (rows, scale, as a keyword, new weights, times in a row)


class ScaledFussyNet(ShapeFussyNet):
    def __call__(self, x: mx.array, scale: Any = 1.0) -> mx.array:
        return super().__call__(x * scale)


@settings(max_examples=30)
@given(_CALLS)
def test_any_sequence_of_calls_behaves_as_eager(calls: list[tuple[int, Any, bool, bool, int]]) -> None:
    """Steady calls, new shapes, static arguments, keywords, failing signatures and weight updates in
    any order: every call returns what the module returns eagerly, or refuses as it must."""
    net = ScaledFussyNet()
    cf = gk.compile(net)
    steps = [call[:4] for call in calls for _ in range(call[4])]
    for step, (rows, scale, as_keyword, update) in enumerate(steps):
        if update:
            net.proj.weight = mx.full((N, N), 0.01 * step)
        value = mx.array(1.5) if scale == "array" else scale
        x = mx.arange(rows * N, dtype=mx.float32).reshape(rows, N) / 10
        args, kwargs = ((x,), {"scale": value}) if as_keyword else ((x, value), {})
        if rows == 3:
            with pytest.raises(gk.GraphError) as refused:
                cf(*args, **kwargs)
            assert refused.value.status == gk.Status.INVALID_LAUNCH
        elif rows == 5:
            with pytest.raises(gk.KernelError) as raised:
                cf(*args, **kwargs)
            assert raised.value.status == gk.Status.MODULE_ERROR
        else:
            assert mx.allclose(cf(*args, **kwargs), net(x, value), atol=1e-5).item()
    for weight in (net.proj.weight, net.proj.bias):  # no MLX tracer left behind
        assert mx.isfinite(weight).all().item()
