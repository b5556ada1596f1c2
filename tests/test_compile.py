import mlx.core as mx
import mlx.nn as nn
import pytest
from kernels_fixture import scale_add

import graphkern as gk

X = mx.arange(8, dtype=mx.float32)
Y = mx.ones((8,))


def model_fn(x, y):
    a = scale_add(x, y).outputs[0]
    return mx.tanh(a) * 3


def test_compiled_equals_eager_and_keeps_the_graph():
    cf = gk.compile(model_fn)
    out = cf(X, Y)
    assert mx.allclose(out, mx.tanh(X * 2 + Y) * 3).item()
    assert cf.graph.kernels() == ["scale_add"] and cf.graph.ok


def test_new_shapes_and_dtypes_retrace():
    cf = gk.compile(model_fn)
    cf(X, Y)
    first = cf.graph
    cf(X, Y)
    assert cf.graph is first
    out = cf(mx.ones((3,)), mx.ones((3,)))
    assert out.shape == (3,) and cf.graph is not first
    half = cf(X.astype(mx.float16), Y.astype(mx.float16))
    assert half.dtype == mx.float16 and len(list(cf.traces())) == 3


def test_failed_graph_never_runs_and_names_root_and_outputs():
    calls = []

    def fn(x, y):
        calls.append(1)
        bad = scale_add(x, y, threadgroup=(0, 1, 1)).outputs[0]
        return mx.exp(bad), y + 1

    cf = gk.compile(fn)
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    err = info.value
    assert err.node == "scale_add" and err.status == gk.Status.INVALID_LAUNCH
    assert err.affected_outputs == ("output_0",)
    assert "threadgroup entries must be positive" in str(err)
    assert calls == [1]  # traced once for inspection, never compiled or run
    outs, status = cf.call_with_status(X, Y)
    assert outs is None and status == gk.Status.INVALID_LAUNCH
    assert (mx.ones(2) + 1).tolist() == [2, 2]  # MLX still fine


def test_call_with_status_on_success():
    outs, status = gk.compile(model_fn).call_with_status(X, Y)
    assert status == gk.Status.OK and outs.shape == (8,)


def test_closure_arrays_are_passed_as_state_so_updates_are_seen():
    w = mx.ones((8,))

    def fn(x):
        return x * w

    cf = gk.compile(fn)
    assert cf(X).tolist() == X.tolist()
    w = mx.full((8,), 2.0)  # noqa: F841 - rebinding the closure cell
    assert cf(X).tolist() == (X * 2).tolist()
    assert [cf.graph.node(n)["label"] for n in cf.graph.nodes("input")] == ["x", "w"]


def test_module_parameters_are_state():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = mx.ones((3, 4))
    cf = gk.compile(model)
    assert mx.allclose(cf(x), model(x)).item()
    model.layers[2].weight = mx.zeros((2, 4))
    model.layers[2].bias = mx.full((2,), 5.0)
    assert cf(x).tolist() == [[5.0, 5.0]] * 3
    model.update({"layers": [{"weight": mx.ones((4, 4)), "bias": mx.zeros(4)}, {}, {}]})
    assert mx.allclose(cf(x), model(x)).item()


def test_bound_method_and_explicit_state():
    class Scaler(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = mx.array(2.0)

        def forward(self, x):
            return x * self.s

    m = Scaler()
    cf = gk.compile(m.forward)
    assert cf(X).tolist() == (X * 2).tolist()
    m.s = mx.array(3.0)
    assert cf(X).tolist() == (X * 3).tolist()

    params = {"b": mx.array(1.0)}
    cf2 = gk.compile(lambda x: x + params["b"], state=params)
    assert cf2(X).tolist() == (X + 1).tolist()
    params["b"] = mx.array(10.0)
    assert cf2(X).tolist() == (X + 10).tolist()


def test_run_failure_is_attributed_to_its_kernel_node():
    # On Linux a Metal kernel traces but cannot run: a failure only the run finds.
    cf = gk.compile(model_fn, backend="metal")
    assert cf.trace(X, Y).ok
    with pytest.raises(gk.GraphError) as info:
        cf(X, Y)
    assert info.value.node == "scale_add"
    assert info.value.status == gk.Status.BACKEND_UNAVAILABLE
    assert cf.graph.node("tanh")["status"] == gk.Status.UPSTREAM_FAILED
    assert gk.compile(model_fn)(X, Y).shape == (8,)  # the next compile and call work


def test_compiled_path_has_no_tags():
    from graphkern.launching.autodiff import without_vjp

    events = []
    cf = gk.compile(model_fn)
    cf(X, Y)
    [compiled] = cf._compiled.values()
    [cf._call_state.flat] = [prepared.flat for prepared in cf._fast.values()]  # as __call__ sets it
    with without_vjp():  # GPU launches carry an mx.custom_function vjp, which cannot be exported
        mx.export_function(lambda e: events.append(e), compiled, X, Y)
    names = [e["name"] for e in events if e["type"] == "primitive"]
    assert "Depends" not in names and names


def test_python_scalar_arguments_are_never_baked_into_a_shared_trace():
    cf = gk.compile(lambda x, n, *, shift=0.0: x * n + shift)
    assert cf(X, 2).tolist() == (X * 2).tolist()
    assert cf(X, 3).tolist() == (X * 3).tolist()
    assert cf(X, 3, shift=1.0).tolist() == (X * 3 + 1).tolist()
    assert cf(X, 2).tolist() == (X * 2).tolist()


def test_a_failing_stock_op_is_not_blamed_on_the_kernel_after_it(monkeypatch):
    import importlib

    trace_module = importlib.import_module("graphkern.compiling.compiled")

    probe = trace_module._PassThrough(probe=True)
    boom = RuntimeError("[gather_mm] not supported on this backend")

    def failing_eval(arrays):
        if any(a is X for a in arrays):  # the kernel's input: stands for a failed stock op
            raise boom

    monkeypatch.setattr(trace_module.mx, "eval", failing_eval)
    probe.kernel_call(None, None, [X], [Y], None)
    assert probe.failed == (-1, boom)  # an op before the kernel, not kernel call 0


def test_signatures_and_stats_say_why_calls_trace_again():
    """What a user debugging recompiles reads: each signature traced (a Python scalar is part of
    it), whether it compiled, the counts, and whether calls take the steady path."""
    cf = gk.compile(lambda x, n: x * n)
    for n in (2, 3, 2):
        cf(X, n)
    # least recently used first: the call with 2 came back last
    assert [s.call for s in cf.signatures()] == ["<lambda>(float32[8], 3)", "<lambda>(float32[8], 2)"]
    assert all(s.compiled and s.graph.ok for s in cf.signatures())
    assert cf.stats() == {"hits": 1, "misses": 2, "size": 2, "compiled": 2, "steady": 0}
    cf.forget_oldest_trace()
    assert [s.call for s in cf.signatures()] == ["<lambda>(float32[8], 2)"]
    assert not cf.signatures()[0].compiled  # the compiled functions went with it
    cf.clear()
    assert cf.signatures() == [] and cf.stats()["size"] == 0 and cf.group is None

    arrays = gk.compile(lambda x, y: x * y)
    arrays(X, Y)
    assert arrays.stats()["steady"] == 1  # one signature of positional arrays: MLX's call alone
    bad = gk.compile(model_fn, backend="metal")
    bad.trace(X, Y)
    [signature] = bad.signatures()
    assert signature.call == "model_fn(float32[8], float32[8])" and not signature.compiled
