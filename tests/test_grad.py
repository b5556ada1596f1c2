"""Gradients through kernel nodes: the reference's vjp, a user's Kernel.vjp, and the GPU-path wrapper.

On CPU kernels run their reference, which MLX differentiates as it is. A GPU launch (MLX's
CustomKernel) has no vjp; graphkern runs it inside mx.custom_function. These tests force that path on
CPU by making the "GPU" launch opaque to autodiff (its outputs under stop_gradient, as a CustomKernel
is: the ``opaque_gpu`` fixture of conftest.py), so a gradient can only come from graphkern's wrapper.
"""


import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from model_comparisons import ATOL, NEEDS_STOCK_GRADIENTS, RTOL, assert_same_gradients, same_values

import graphkern as gk
from graphkern.launching import backends, launch_paths, validation
from graphkern.launching.autodiff import with_vjp, without_vjp
from graphkern.models import patch, unpatch
from graphkern.models.tiny import tiny_model

TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])
TARGETS = mx.array([[17, 42, 5, 99, 1, 7, 64, 2]])


def loss_fn(model, tokens, targets):
    return nn.losses.cross_entropy(model(tokens), targets, reduction="mean")


def value_and_grads(model):
    loss, grads = nn.value_and_grad(model, loss_fn)(model, TOKENS, TARGETS)
    return loss, dict(tree_flatten(grads))


def assert_same_grads(expected, got):
    atol = max(ATOL, 1e-5)
    assert_same_gradients(expected, got, loss_atol=atol, atol=atol, rtol=max(RTOL, 1e-4))


@pytest.mark.parametrize("arch", ["llama", "gemma", pytest.param("mixtral", marks=NEEDS_STOCK_GRADIENTS)])
def test_value_and_grad_through_a_patched_model_matches_the_stock_model(arch):
    model = tiny_model(arch)
    expected = value_and_grads(model)
    patch(model)
    assert_same_grads(expected, value_and_grads(model))
    unpatch(model)


def test_gradients_on_the_gpu_path_come_from_the_wrapper(opaque_gpu):
    model = tiny_model("qwen3")
    expected = value_and_grads(model)
    patch(model, route="kernel")  # the kernels, not the stock ops auto takes for standalone layers
    got = value_and_grads(model)
    assert {"gk_rms_norm", "gk_add_rms_norm", "gk_rope_qk", "gk_swiglu"} <= set(opaque_gpu)
    assert_same_grads(expected, got)


def test_an_evaluating_model_launches_plain_and_a_training_one_differentiably(opaque_gpu):
    """model.eval() (as mlx_lm.load leaves a model): no custom vjp around the launches, so no
    gradient reaches through them; model.train(): the wrapper is back and gradients match."""
    model = tiny_model("llama")
    expected = value_and_grads(model)
    patch(model)
    model.eval()
    logits = model(TOKENS)
    _, grads = value_and_grads(model)
    norm_grads = [v for k, v in grads.items() if k.endswith("input_layernorm.weight")]
    assert norm_grads and all(g.abs().max().item() == 0.0 for g in norm_grads)  # plain launches
    model.train()
    assert_same_grads(expected, value_and_grads(model))
    assert same_values(model(TOKENS), logits)  # either way (on a GPU: other kernels, same values)


def test_without_the_wrapper_an_opaque_launch_has_no_gradient(opaque_gpu, monkeypatch):
    x = mx.random.normal((4, 16), key=mx.random.key(0))
    w = mx.ones((16,))

    def loss(w):
        return gk.kernels.rms_norm(x, w, 1e-5).sum()

    assert mx.allclose(mx.grad(loss)(w), mx.grad(lambda w: mx.fast.rms_norm(x, w, 1e-5).sum())(w),
                       atol=1e-5).item()
    monkeypatch.setattr(launch_paths, "differentiable_launch", launch_paths.run_native)
    gk.clear_caches()  # no launch replays a form built before (another test may have built one)
    x = mx.random.normal((5, 16), key=mx.random.key(1))
    assert mx.grad(loss)(w).abs().max().item() == 0.0  # what MLX alone would give (or raise, on a GPU)


def test_without_vjp_makes_gpu_launches_exportable(opaque_gpu):
    x, w = mx.random.normal((2, 16), key=mx.random.key(0)), mx.ones((16,))

    def fn(x, w):
        return gk.kernels.rms_norm(x, w, 1e-5)

    with pytest.raises(ValueError, match="CustomTransforms"):  # MLX cannot export a custom vjp
        mx.export_function(lambda event: None, fn, x, w)
    events = []
    with without_vjp():
        mx.export_function(events.append, fn, x, w)
        assert mx.grad(lambda w: fn(x, w).sum())(w).abs().max().item() == 0.0  # and no gradient
    assert any(e["type"] == "primitive" for e in events)
    assert mx.grad(lambda w: fn(x, w).sum())(w).abs().max().item() > 0  # back on afterwards


def _twice_kernel(vjp=None):
    return gk.Kernel("twice_grad", ["x", "s"], ["out"], reference=lambda x, s: [x * 2 * s], vjp=vjp)


def _twice(kernel, x, s=1.0):
    return gk.launch(kernel, [x, s], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                     threadgroup=(32, 1, 1))[0]


def test_a_users_backward_kernel_is_used_when_given():
    seen = []

    def backward(primals, cotangents, outputs):
        x, s = primals
        seen.append((s, outputs[0].shape))
        return [cotangents[0] * 100 * s, None]  # deliberately not the true gradient

    x = mx.ones((4,))
    plain, custom = _twice_kernel(), _twice_kernel(backward)
    assert mx.grad(lambda x: _twice(plain, x, 3.0).sum())(x).tolist() == [6.0] * 4
    assert mx.grad(lambda x: _twice(custom, x, 3.0).sum())(x).tolist() == [300.0] * 4
    assert seen == [(3.0, (4,))]
    compiled = mx.compile(mx.grad(lambda x: _twice(custom, x, 3.0).sum()))
    assert compiled(x).tolist() == [300.0] * 4


def test_a_users_backward_kernel_on_the_gpu_path(opaque_gpu):
    kernel = _twice_kernel(lambda primals, cots, outs: [cots[0] * 7, None])
    kernel = gk.Kernel(kernel.name, kernel.input_names, kernel.output_names, cuda="out[0] = x[0];",
                       reference=kernel.reference, vjp=kernel.vjp)
    assert mx.grad(lambda x: _twice(kernel, x).sum())(mx.ones((3,))).tolist() == [7.0] * 3
    assert opaque_gpu == ["twice_grad"]


def test_inspection_traces_and_compiled_graphs_still_work_with_a_vjp():
    kernel = _twice_kernel(lambda primals, cots, outs: [cots[0], None])
    fn = lambda x: mx.tanh(_twice(kernel, x))  # noqa: E731
    graph = gk.trace(fn, mx.ones((4,)))  # export_function cannot export a custom vjp: none is used
    assert graph.ok and graph.kernels() == ["twice_grad"]
    assert mx.allclose(gk.compile(fn)(mx.ones((4,))), mx.tanh(mx.full((4,), 2.0))).item()


def test_with_vjp_uses_the_reference_for_an_opaque_forward():
    def reference(xs):
        x, y = xs
        return [x * y, mx.sin(x)]

    def opaque(xs):
        return [mx.stop_gradient(o) for o in reference(xs)]

    def loss(fn_outputs):
        a, b = fn_outputs
        return (a * a).sum() + b.sum()

    x, y = mx.array([0.5, 1.0, 2.0]), mx.array([3.0, -1.0, 0.25])
    expected = mx.grad(lambda x, y: loss(reference([x, y])), argnums=(0, 1))(x, y)
    got = mx.grad(lambda x, y: loss(with_vjp(opaque, [x, y], reference=reference)),
                  argnums=(0, 1))(x, y)
    for e, g in zip(expected, got):
        assert mx.allclose(e, g).item()
    assert mx.grad(lambda x: loss(opaque([x, y])))(x).abs().max().item() == 0.0


def test_with_vjp_differentiates_the_floating_outputs_beside_integer_ones():
    """A kernel that returns indices beside values (moe_route): the indices take no cotangent."""
    def reference(xs):
        top = mx.stop_gradient(mx.argsort(-xs[0], axis=-1)[..., :2]).astype(mx.uint32)
        return [top, mx.take_along_axis(xs[0], top, axis=-1) * 3.0]

    def opaque(xs):
        return [mx.stop_gradient(o) for o in reference(xs)]

    x = mx.array([[0.5, 2.0, -1.0, 1.0]])
    expected = mx.grad(lambda x: reference([x])[1].sum())(x)
    got = mx.grad(lambda x: with_vjp(opaque, [x], reference=reference)[1].sum())(x)
    assert expected.tolist() == got.tolist() == [[0.0, 3.0, 0.0, 3.0]]
    indices_only = mx.grad(lambda x: with_vjp(opaque, [x], reference=reference)[0].astype(mx.float32).sum())
    assert indices_only(x).tolist() == [[0.0] * 4]


def test_with_vjp_scalars_get_no_cotangent_and_bad_backwards_are_reported():
    scaled = lambda xs: [xs[0] * xs[1]]  # noqa: E731
    grad = mx.grad(lambda x: with_vjp(scaled, [x, 4.0], reference=scaled)[0].sum())
    assert grad(mx.ones((2,))).tolist() == [4.0, 4.0]
    wrong_shape = lambda primals, cots, outs: [mx.ones((5,))]  # noqa: E731
    with pytest.raises(gk.KernelError, match="cotangent of \\(5,\\) for an input of shape \\(2,\\)"):
        mx.grad(lambda x: with_vjp(scaled, [x, 4.0], vjp=wrong_shape)[0].sum())(mx.ones((2,)))
    with pytest.raises(gk.KernelError, match="neither a vjp nor a reference"):
        with_vjp(scaled, [mx.ones((2,))])


def test_without_vjp_is_public_nests_and_is_undone_by_an_exception():
    from graphkern.launching.autodiff import vjp_enabled

    with gk.without_vjp():
        with gk.without_vjp():
            assert not vjp_enabled()
        assert not vjp_enabled()  # still inside the outer one
    assert vjp_enabled()
    with pytest.raises(RuntimeError, match="inside"), gk.without_vjp():
        raise RuntimeError("inside")
    assert vjp_enabled()


def scaling(name):
    """A kernel of its own (launches are cached per kernel, with their compiled forms)."""
    kernel = gk.Kernel(name, ["x"], ["out"], cuda="/* stands in */", reference=lambda x: [x * 3])
    return lambda x: gk.apply(kernel, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                              threadgroup=(1, 1, 1))[0]


def test_eager_gpu_launches_replay_a_compiled_launch_with_the_new_inputs(opaque_gpu):
    # a differentiable GPU launch goes through mx.compile: eager calls after the first replay the
    # recorded kernel node on their own inputs instead of calling MLX's kernel object again
    scale = scaling("replayed")
    xs = [mx.arange(4, dtype=mx.float32) + i for i in range(3)]
    assert [scale(x).tolist() for x in xs] == [(x * 3).tolist() for x in xs]
    assert opaque_gpu.count("replayed") == 1
    y = mx.arange(6, dtype=mx.float32)  # another shape: traced once more
    assert scale(y).tolist() == (y * 3).tolist() and opaque_gpu.count("replayed") == 2
    with mx.stream(mx.new_stream(mx.cpu)):  # another default stream: its own trace
        assert scale(xs[0]).tolist() == (xs[0] * 3).tolist()
    assert opaque_gpu.count("replayed") == 3
    with gk.without_vjp():  # the plain launch, compiled as well: traced once, then replayed
        assert [scale(x).tolist() for x in xs] == [(x * 3).tolist() for x in xs]
    assert opaque_gpu.count("replayed") == 4


def test_plain_launches_replay_eagerly_and_trace_themselves_under_export(opaque_gpu):
    scale = scaling("plain")
    x = mx.arange(4, dtype=mx.float32)
    events = []
    with gk.without_vjp():
        assert [scale(x + i).tolist() for i in range(3)] == [((x + i) * 3).tolist() for i in range(3)]
        # the first call validates the launch and compiles its plain form; the others replay it
        assert opaque_gpu.count("plain") == 1
        mx.export_function(events.append, scale, x)  # tracers: the launch runs, not its recording
        assert mx.grad(lambda v: scale(v).sum())(x).abs().max().item() == 0.0  # plain: no gradient
    assert opaque_gpu.count("plain") == 3
    assert "Multiply" in [e["name"] for e in events if e["type"] == "primitive"]


def test_each_thread_replays_its_own_compiled_launch(opaque_gpu, two_live_threads):
    # MLX's compile cache is per thread and a compiled function erases its entries only from the
    # cache of its last caller: a form shared by two threads would leave a stale entry behind
    scale = scaling("threaded")
    x = mx.arange(4, dtype=mx.float32)

    def work():
        with backends.using_backend("cuda"):  # the backend override is per thread
            y = mx.arange(4, dtype=mx.float32)  # default streams are per thread: x is unevaluated
            values = [scale(y + i).tolist() for i in range(3)]
        [launch] = [v for v in validation.VALIDATED.values() if v.kernel.name == "threaded"]
        return values, launch_paths.thread_forms(launch)

    scale(x)
    results, _ = two_live_threads(work)
    assert [values for values, _ in results] == [[((x + i) * 3).tolist() for i in range(3)]] * 2
    [launch] = [v for v in validation.VALIDATED.values() if v.kernel.name == "threaded"]
    forms = launch_paths.thread_forms(launch) + [f for _, held in results for f in held]
    assert len(forms) == 3 and len({id(f) for f in forms}) == 3  # one a thread
    assert opaque_gpu.count("threaded") == 3  # traced once a thread, replayed after


def test_gradients_and_outer_compiles_trace_the_launch_itself(opaque_gpu):
    scale = scaling("traced")
    x = mx.arange(4, dtype=mx.float32)
    scale(x)
    assert mx.grad(lambda v: scale(v).sum())(x).tolist() == [3.0] * 4  # tracers: not a replay
    assert mx.compile(lambda v: scale(v) + 1)(x).tolist() == (x * 3 + 1).tolist()
    assert opaque_gpu.count("traced") == 3


def test_a_launch_that_fails_while_compiled_raises_and_the_next_one_runs(monkeypatch):
    def fail_once(launch, inputs):
        if not fail_once.failed:
            fail_once.failed = True
            raise gk.KernelError("launch the cuda kernel 'flaky'", "no such template argument")
        return [mx.stop_gradient(o) for o in launch_paths.run_reference(launch, inputs)]

    fail_once.failed = False
    monkeypatch.setattr(launch_paths, "run_native", fail_once)
    scale = scaling("flaky")
    x = mx.arange(4, dtype=mx.float32)
    with backends.using_backend("cuda"):
        with pytest.raises(gk.KernelError, match="no such template argument"):
            scale(x)
        assert scale(x).tolist() == (x * 3).tolist()
        assert mx.grad(lambda v: scale(v).sum())(x).tolist() == [3.0] * 4
        fail_once.failed = False
        with gk.without_vjp():  # the plain launch's first, compiling call fails the same way
            with pytest.raises(gk.KernelError, match="no such template argument"):
                scale(x)
            assert [scale(x).tolist() for _ in range(2)] == [(x * 3).tolist()] * 2


@pytest.mark.parametrize("route", ["stock", "patched", "patched, opaque kernels"])
def test_mx_grad_through_a_wrapped_model_equals_the_stock_gradients(route, request):
    """Differentiating through ``gk.wrap`` gives the stock model's loss and gradients, float32, to
    1e-5, on the first call (traced) and a steady one: on the CPU (kernels run their references),
    and on the GPU launch path (kernels opaque to ``mx.grad``), where a compiled graph's launches
    carry their backward as eager ones do."""
    opaque = request.getfixturevalue("opaque_gpu") if "opaque" in route else None
    model = tiny_model("llama")
    expected = value_and_grads(model)
    if route != "stock":
        patch(model)
    wrapped = gk.wrap(model)

    def loss(params):
        model.update(params)
        return loss_fn(wrapped, TOKENS, TARGETS)

    for _ in range(2):
        got = mx.value_and_grad(loss)(model.trainable_parameters())
        assert_same_grads(expected, (got[0], dict(tree_flatten(got[1]))))
    assert wrapped.calls["compiled"] == 2 and wrapped.graph.ok
    assert opaque is None or opaque  # the opaque kernels ran


def test_compiled_launches_carry_their_backward_unless_first_compiled_without_vjp(opaque_gpu, monkeypatch):
    """A ``gk.compile``d function's GPU launches are differentiable (``mx.grad`` gives the
    reference's gradient through them); a signature first compiled inside ``without_vjp()``
    launches plain, with no custom function around its kernels."""
    wrapped: list[str] = []
    build = launch_paths.differentiable
    monkeypatch.setattr(launch_paths, "differentiable",
                        lambda forward, *a, **kw: wrapped.append("vjp") or build(forward, *a, **kw))
    x = mx.arange(4, dtype=mx.float32)
    compiled = gk.compile(scaling("compiled_vjp"))
    assert mx.grad(lambda v: compiled(v).sum())(x).tolist() == [3.0] * 4
    assert wrapped == ["vjp"]
    plain = gk.compile(scaling("compiled_plain"))
    with gk.without_vjp():
        assert plain(x).tolist() == (x * 3).tolist()
    assert plain(x + 1).tolist() == ((x + 1) * 3).tolist()  # the same signature: replayed plain
    assert wrapped == ["vjp"]
