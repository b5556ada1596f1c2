"""wrap(): a model's forward pass as a compiled graph: state, re-tracing, patching, KV caches."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

import graphkern as gk
from graphkern.models import patch, unpatch, wrap
from graphkern.models.cache import CACHE_OPERATION
from graphkern.models.tiny import tiny_model
from graphkern.models.wrapping import WRAP_OPERATION

X = mx.random.normal((3, 8), key=mx.random.key(0))
PROMPT = mx.array([[3, 17, 42, 5, 99, 1]])


def test_a_kernel_with_a_constant_input_inside_a_module_traces():
    """Regression: capture folded a kernel's constant input (an eps made inside the layer) into the
    kernel body and removed it, so module scoping met a deleted node (KeyError 'const_1')."""
    from kernels_fixture import scale_add

    class Scaled(nn.Module):
        def __call__(self, x):
            return scale_add(x, mx.array(3.0)).outputs[0]

    graph = gk.trace(nn.Sequential(Scaled()), X)
    assert [graph.node(k)["scope"] for k in graph.kernels()] == ["layers.0"]
    assert len(graph.inputs_of("scale_add")) == 2  # x and the constant both feed the kernel node


def test_constants_first_made_while_tracing_work_on_the_calling_thread():
    """Regression: traces run on a worker thread, and MLX streams belong to their thread. The kernel
    library's cached constants (RoPE frequencies, the stand-in for an absent weight), first made
    lazily during a trace, could then not be evaluated by the caller: "There is no Stream(cpu, 1)
    in current thread"."""
    from graphkern.kernels.base import unused_input
    from graphkern.kernels.ops.rope import _base_frequencies

    _base_frequencies.cache_clear()
    unused_input.cache_clear()
    model = tiny_model("llama")
    patch(model)
    tokens = mx.random.randint(0, 100, (1, 6), key=mx.random.key(3))  # lazy, made on this thread
    logits = wrap(model)(tokens)  # traced on the worker thread, run here
    unpatch(model)
    assert mx.allclose(logits, model(tokens), atol=1e-4).item()
    assert gk.kernels.rms_norm(X, None).shape == X.shape  # the stand-in, used from this thread


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.RMSNorm(8))


def test_wrapped_equals_eager_and_shows_the_graph():
    model = mlp()
    wrapped = wrap(model)
    assert mx.allclose(wrapped(X), model(X)).item()
    graph = wrapped.graph
    assert graph.ok and graph.kernels() == []
    scopes = {graph.node(n)["scope"] for n in graph.nodes("op")}
    assert {"layers.0", "layers.1", "layers.2", "layers.3"} <= scopes
    labels = {graph.node(n)["label"] for n in graph.nodes("input")}
    assert {"layers.0.weight", "layers.3.weight"} <= labels  # parameters are inputs, not constants


def test_weight_updates_between_calls_are_seen():
    model = mlp()
    wrapped = wrap(model)
    first = wrapped(X)
    model.layers[2].weight = mx.zeros_like(model.layers[2].weight)
    model.layers[2].bias = mx.ones((8,))
    assert mx.allclose(wrapped(X), mx.ones((3, 8)), atol=1e-5).item()  # rms_norm of ones is ones
    model.update({"layers": [{"weight": mx.ones((16, 8)) / 8}, {}, {"weight": mx.eye(8, 16)}, {}]})
    out = wrapped(X)
    assert mx.allclose(out, model(X), atol=1e-6).item() and not mx.allclose(out, first).item()
    assert wrapped.stats()["graphs"] == 1  # new values of the same shapes: no new trace


def test_new_shapes_and_dtypes_retrace():
    model = mlp()
    wrapped = wrap(model)
    wrapped(X)
    first = wrapped.graph
    wrapped(X + 1)
    assert wrapped.graph is first
    out = wrapped(mx.ones((5, 8)))
    assert out.shape == (5, 8) and wrapped.graph is not first
    model.set_dtype(mx.float16)  # parameters change dtype: a new trace, in float16
    half = wrapped(X.astype(mx.float16))
    assert half.dtype == mx.float16
    assert {d["dtype"] for _, _, d in wrapped.graph.nx.edges(data=True)} >= {"float16"}


def test_patching_after_wrapping_retraces_with_kernel_nodes():
    model = mlp()
    wrapped = wrap(model)
    expected = wrapped(X)
    assert wrapped.graph.kernels() == []
    patch(model)
    assert mx.allclose(wrapped(X), expected, atol=1e-5).item()
    graph = wrapped.graph
    kernels = {graph.node(k)["kernel"]: graph.node(k)["scope"] for k in graph.kernels()}
    assert kernels == {"gk_gelu": "layers.1", "gk_rms_norm": "layers.3"}
    unpatch(model)
    wrapped(X)
    assert wrapped.graph.kernels() == []


def test_a_failed_node_stops_the_call():
    model = nn.Sequential(nn.ReLU(), nn.RMSNorm(8))
    patch(model)
    wrapped = wrap(model)
    with pytest.raises(gk.GraphError) as info:
        wrapped(X[:, :7])  # 7 features into an RMSNorm kernel of 8
    assert "has shape" in str(info.value)
    assert wrapped.graph.node(info.value.node)["scope"] == "layers.1"
    out, status = wrapped.call_with_status(X[:, :7])
    assert out is None and status != gk.Status.OK
    assert wrapped(X).shape == (3, 8)  # the call of 8 features is fine


def _decode(call, model, caches, steps=3):
    outs = [call(PROMPT, cache=caches)]
    token = mx.argmax(outs[-1][:, -1:], axis=-1)
    for _ in range(steps):
        outs.append(call(token, cache=caches))
        token = mx.argmax(outs[-1][:, -1:], axis=-1)
    return outs


@pytest.mark.parametrize("make_cache", [
    lambda m: make_prompt_cache(m),
    lambda m: [RotatingKVCache(max_size=8, keep=2) for _ in m.layers],
], ids=["KVCache", "RotatingKVCache"])
def test_kv_cache_state_flows_through_the_graph(make_cache):
    model = tiny_model("llama")
    patch(model)
    wrapped = wrap(model)
    eager_caches, graph_caches = make_cache(model), make_cache(model)
    eager = _decode(model, model, eager_caches)
    compiled = _decode(wrapped, model, graph_caches)
    for e, c in zip(eager, compiled):
        assert mx.allclose(e, c, atol=1e-5).item()
    for e, c in zip(eager_caches, graph_caches):
        assert c.offset == e.offset == PROMPT.shape[1] + 3
        assert mx.array_equal(c.keys, e.keys).item() and mx.array_equal(c.values, e.values).item()
    labels = {wrapped.graph.node(n)["label"] for n in wrapped.graph.nodes("input")}
    assert {"cache[0].keys", "cache[1].values"} <= labels
    assert len(wrapped.graph.kernels()) > 0


def test_a_cache_given_positionally_is_passed_through_too():
    model = tiny_model("llama")
    eager_caches, graph_caches = make_prompt_cache(model), make_prompt_cache(model)
    wrapped = wrap(model)
    for tokens in (PROMPT, mx.array([[7]]), mx.array([[9]])):
        assert mx.allclose(wrapped(tokens, graph_caches), model(tokens, eager_caches), atol=1e-5).item()
    assert graph_caches[0].offset == eager_caches[0].offset == PROMPT.shape[1] + 2


def test_trace_does_not_touch_the_cache():
    model = tiny_model("llama")
    caches = make_prompt_cache(model)
    graph = wrap(model).trace(PROMPT, cache=caches)
    assert graph.ok and caches[0].offset == 0 and caches[0].keys is None


class _Opaque:
    """A cache-like object holding something graphkern cannot pass as arrays."""

    def __init__(self):
        self.keys = None
        self.offset = 0
        self.on_update = print

    def update_and_fetch(self, keys, values):  # pragma: no cover - never reached
        raise AssertionError


@pytest.mark.parametrize("caches, needles", [
    (lambda m: [CacheList(KVCache(), KVCache()) for _ in m.layers], ["cache[0] (CacheList)"]),
    (lambda m: [_Opaque() for _ in m.layers], ["'on_update'", "builtin_function_or_method"]),
    (lambda m: [None for _ in m.layers], ["cache[0] is None"]),
    (lambda m: KVCache(), ["must be a list"]),
], ids=["CacheList", "callable attribute", "None entries", "not a list"])
def test_caches_that_cannot_pass_through_are_refused(caches, needles):
    model = tiny_model("llama")
    wrapped = wrap(model)
    given = caches(model)
    with pytest.raises(gk.KernelError) as info:
        wrapped(PROMPT, cache=given)
    assert info.value.operation == CACHE_OPERATION
    for needle in needles:
        assert needle in info.value.description
    assert wrapped.graph is None  # refused before any trace or run


@pytest.mark.parametrize("not_a_model", [lambda x: x, None, tiny_model])
def test_wrap_refuses_what_is_not_a_module(not_a_model):
    with pytest.raises(gk.KernelError) as info:
        wrap(not_a_model)
    assert info.value.operation == WRAP_OPERATION
    assert info.value.status == gk.Status.INVALID_INPUT
    assert "expects an mlx.nn.Module, got " in info.value.description


def test_many_offsets_keep_a_bounded_number_of_traces():
    model = tiny_model("llama")
    wrapped = wrap(model, max_traces=2, trace_each_offset=True)
    caches = make_prompt_cache(model)
    _decode(wrapped, model, caches, steps=3)
    assert wrapped.calls == {"compiled": 4, "eager": 0}
    assert wrapped.stats()["graphs"] == 2 and caches[0].offset == PROMPT.shape[1] + 3


def test_max_traces_bounds_the_traces_kept_over_prompt_lengths():
    model = tiny_model("llama")
    wrapped = wrap(model, max_traces=3)
    for length in range(1, 7):  # six prompt lengths: one static structure, six signatures
        tokens = mx.arange(length, dtype=mx.int32)[None] % 128
        assert mx.allclose(wrapped(tokens), model(tokens), atol=1e-5).item()
        assert wrapped.stats()["traces"] == len(wrapped.signatures()) == min(length, 3)
    tokens = mx.array([[1, 2]])  # dropped long ago: traced again, and still right
    assert mx.allclose(wrapped(tokens), model(tokens), atol=1e-5).item()
    assert wrapped.stats()["traces"] == 3
    assert mx.allclose(wrapped(mx.arange(6)[None]), model(mx.arange(6)[None]), atol=1e-5).item()
    for bad in (0, -1, 2.0, True):
        with pytest.raises(gk.KernelError, match="max_traces must be a positive int"):
            wrap(model, max_traces=bad)


def test_decode_traces_prefill_and_one_step_then_runs_new_offsets_eagerly():
    model = tiny_model("llama")
    patch(model)
    wrapped = wrap(model)
    eager_caches, graph_caches = make_prompt_cache(model), make_prompt_cache(model)
    expected = _decode(model, model, eager_caches, steps=4)
    got = _decode(wrapped, model, graph_caches, steps=4)
    assert wrapped.calls == {"compiled": 2, "eager": 3}  # prefill and the first step were traced
    assert wrapped.stats()["graphs"] == 2
    for e, g in zip(expected, got):
        assert mx.allclose(e, g, atol=1e-5).item()
    assert graph_caches[0].offset == eager_caches[0].offset == PROMPT.shape[1] + 4
    assert mx.array_equal(graph_caches[1].keys, eager_caches[1].keys).item()
    token = mx.array([[5]])
    out, status = wrapped.call_with_status(token, cache=graph_caches)  # eager, with a status
    assert status == gk.Status.OK and mx.allclose(out, model(token, cache=eager_caches), atol=1e-5).item()
    graph = wrapped.trace(token, cache=graph_caches)  # still traceable on demand, cache untouched
    assert graph.ok and graph_caches[0].offset == PROMPT.shape[1] + 5
    unpatch(model)  # a structure change forgets the traces: the next step is traced again
    wrapped(token, cache=graph_caches)
    assert wrapped.calls["compiled"] == 3 and wrapped.graph.kernels() == []


class _CachedAttention(nn.Module):
    """Writes its keys to the cache, then fails when told to: after the cache was updated."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fail = False

    def __call__(self, x, cache=None):
        keys, _ = cache[0].update_and_fetch(self.proj(x)[:, None], x[:, None])
        if self.fail:
            raise RuntimeError("boom after the cache update")
        return keys.sum(axis=2)


def test_a_failed_eager_step_leaves_the_cache_as_it_was():
    model = _CachedAttention()
    wrapped = wrap(model)
    caches = [KVCache()]
    for length in (3, 1, 1):  # prefill and first step traced, the second step eager
        wrapped(mx.ones((1, length, 4)), cache=caches)
    assert wrapped.calls == {"compiled": 2, "eager": 1}
    keys, offset = mx.array(caches[0].keys), caches[0].offset
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(mx.ones((1, 1, 4)), cache=caches)
    assert caches[0].offset == offset == 5 and mx.array_equal(caches[0].keys, keys).item()
    model.fail = False
    assert wrapped(mx.ones((1, 1, 4)), cache=caches).shape == (1, 1, 4) and caches[0].offset == 6
