"""Bound launches (``gk.bind``): the configuration checked once, each call checks its inputs and
behaves as ``gk.apply`` outside traces and ``gk.apply_in_graph`` inside them."""

import mlx.core as mx
import pytest
from kernels_fixture import SCALE_ADD

import graphkern as gk
from graphkern.launching import backends, launch_paths, validation

X = mx.arange(8, dtype=mx.float32)
Y = mx.ones((8,))
SPEC = [gk.OutputSpec((8,), mx.float32)]
CONFIG = dict(grid=(8, 1, 1), threadgroup=(8, 1, 1), template=[("T", mx.float32)])


def scaled_kernel(name):
    """A kernel of its own, with a CUDA source for the stand-in GPU backend and a scalar input."""
    return gk.Kernel(name, ["x", "s"], ["out"], cuda="/* stands in */",
                     reference=lambda x, s: [x * s])


def test_a_bound_launch_gives_what_apply_gives_and_is_the_launch_apply_uses():
    bound = gk.bind(SCALE_ADD, SPEC, **CONFIG)
    for i in range(3):
        assert bound(X + i, Y)[0].tolist() == gk.apply(SCALE_ADD, [X + i, Y], SPEC, **CONFIG)[0].tolist()
    assert bound(X, Y)[0].tolist() == (X * 2 + Y).tolist()
    assert validation.validated_launch(SCALE_ADD, SPEC, **CONFIG) is bound.launch
    assert "scale_add" in repr(bound) and "reference" in repr(bound)


@pytest.mark.parametrize("overrides, status", [
    ({"grid": (0, 1, 1)}, gk.Status.INVALID_LAUNCH),
    ({"threadgroup": (2048, 1, 1)}, gk.Status.INVALID_LAUNCH),
    ({"template": [("T", "float32")]}, gk.Status.INVALID_TEMPLATE),
])
def test_a_bad_configuration_is_refused_when_bound(overrides, status):
    with pytest.raises(gk.KernelError) as info:
        gk.bind(SCALE_ADD, SPEC, **{**CONFIG, **overrides})
    assert info.value.status == status and info.value.operation == backends.APPLY


def test_bad_inputs_are_refused_at_each_call_and_scalars_are_taken():
    bound = gk.bind(SCALE_ADD, SPEC, **CONFIG)
    with pytest.raises(gk.KernelError, match="takes 2 inputs") as info:
        bound(X)
    assert info.value.status == gk.Status.INVALID_INPUT
    with pytest.raises(gk.KernelError, match="must be an mlx array or a Python scalar"):
        bound(X, "one")
    assert bound(X, 1.0)[0].tolist() == (X * 2 + 1).tolist()  # a scalar: apply's way
    assert bound(X, Y)[0].tolist() == (X * 2 + Y).tolist()  # and usable after the failures


def test_inside_a_trace_a_bound_launch_is_a_kernel_node_and_failures_are_statuses():
    bound = gk.bind(SCALE_ADD, SPEC, **CONFIG)
    graph = gk.trace(lambda x, y: bound(x, y)[0] * 3, X, Y)
    [node] = graph.kernels()
    assert graph.node(node)["kernel"] == "scale_add" and graph.ok
    failed = gk.trace(lambda x: bound(x)[0] * 3, X)  # one input missing: the node fails
    assert failed.status == gk.Status.INVALID_INPUT
    compiled = gk.compile(lambda x, y: bound(x, y)[0] + 1)
    assert compiled(X, Y).tolist() == (X * 2 + Y + 1).tolist()
    assert compiled.graph.kernels()


def test_on_the_gpu_path_calls_replay_the_compiled_launch_and_gradients_flow(opaque_gpu):
    kernel = scaled_kernel("bound_replayed")
    bound = gk.bind(kernel, SPEC[:1], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    s = mx.array(3.0)
    assert [bound(X + i, s)[0].tolist() for i in range(3)] == [((X + i) * 3).tolist() for i in range(3)]
    assert opaque_gpu.count("bound_replayed") == 1  # traced once, replayed after
    grad = mx.grad(lambda x: bound(x, s)[0].sum())(X)  # the wrapper's vjp: the launch is opaque
    assert grad.tolist() == [3.0] * 8
    with gk.without_vjp():  # the plain launch, compiled too
        assert [bound(X + i, s)[0].tolist() for i in range(3)] == [((X + i) * 3).tolist() for i in range(3)]
        assert mx.grad(lambda x: bound(x, s)[0].sum())(X).abs().max().item() == 0.0


def test_a_backend_chosen_after_binding_is_the_one_used(opaque_gpu):
    kernel = scaled_kernel("bound_backend")
    bound = gk.bind(kernel, SPEC[:1], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert bound.launch.backend == "cuda"
    s = mx.array(2.0)
    bound(X, s)
    with backends.using_backend("reference"):  # the reference runs: the stand-in is not called
        assert bound(X, s)[0].tolist() == (X * 2).tolist()
    assert opaque_gpu.count("bound_backend") == 1
    pinned = gk.bind(kernel, SPEC[:1], grid=(8, 1, 1), threadgroup=(8, 1, 1), backend="reference")
    assert pinned.launch.backend == "reference" and pinned(X, s)[0].tolist() == (X * 2).tolist()
    assert opaque_gpu.count("bound_backend") == 1


def test_threads_each_replay_their_own_form_of_a_bound_launch(opaque_gpu, two_live_threads):
    kernel = scaled_kernel("bound_threads")
    bound = gk.bind(kernel, SPEC[:1], grid=(8, 1, 1), threadgroup=(8, 1, 1))

    def work():
        with backends.using_backend("cuda"):  # the backend override is per thread
            x, s = mx.arange(8, dtype=mx.float32), mx.array(2.0)  # default streams are per thread
            values = [bound(x + i, s)[0].tolist() for i in range(3)]
        return values, launch_paths.thread_forms(bound.launch)

    results, _ = two_live_threads(work)
    assert [values for values, _ in results] == [[((X + i) * 2).tolist() for i in range(3)]] * 2
    [[first], [second]] = [held for _, held in results]  # one form a thread
    assert first is not second and launch_paths.thread_forms(bound.launch) == []
    assert opaque_gpu.count("bound_threads") == 2  # traced once a thread, replayed after
