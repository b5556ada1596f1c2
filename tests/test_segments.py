"""Compiled segments (graphkern.models.segments): an evaluating patched model decodes through
mx.compile'd pieces of its blocks. They must give the stock model's logits, see replaced weights,
stay out of training, traces and long calls, keep one form a thread, and let a model be freed."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, RTOL, batch_generate  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.models import segments as segments_module  # noqa: E402
from graphkern.models.layers import KernelAttention, KernelResidualBlock  # noqa: E402
from graphkern.models.layers.rope import KernelRoPE  # noqa: E402
from graphkern.models.segments import Segments, segments_apply  # noqa: E402
from graphkern.models.tiny import tiny_model  # noqa: E402

PROMPT = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])


def _pair(arch: str) -> tuple[nn.Module, nn.Module]:
    stock, patched = tiny_model(arch), tiny_model(arch)
    gk.patch(patched)
    stock.eval()
    patched.eval()
    return stock, patched


def _forms(model: nn.Module) -> int:
    """The compiled forms of the blocks' segments and of the stack's links between them."""
    holders = [layer for layer in model.model.layers if isinstance(layer, KernelResidualBlock)]
    return sum(len(m.segments()._forms) for m in [*holders, model.model] if "_gk_segments" in m.__dict__)


def _decode(model: nn.Module, steps: int = 6) -> list[mx.array]:
    cache = make_prompt_cache(model)
    logits = [model(PROMPT, cache=cache)]
    token = mx.argmax(logits[-1][:, -1:], axis=-1)
    for _ in range(steps):
        logits.append(model(token, cache=cache))
        token = mx.argmax(logits[-1][:, -1:], axis=-1)
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "phi3", "gemma2", "gemma3"])
def test_an_evaluating_patched_model_decodes_through_segments_as_stock_does(arch: str) -> None:
    stock, patched = _pair(arch)
    for ours, theirs in zip(_decode(patched), _decode(stock)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    blocks = len(patched.model.layers)
    # one compiled call a block: the first block's enter, a link from each block to the next
    # (its leave and the next one's enter), the last block's leave
    assert _forms(patched) == blocks + 1
    assert patched.model.segments().traced() == [("link", i) for i in range(blocks - 1)]
    generated = [t for t, _ in generate_step(PROMPT[0], patched, max_tokens=8)]
    assert generated == [t for t, _ in generate_step(PROMPT[0], stock, max_tokens=8)]


def test_segments_read_the_weights_of_each_call() -> None:
    stock, patched = _pair("llama")
    _decode(patched, 2)
    traced = _forms(patched)
    new = tree_map(lambda v: v * 1.5, stock.model.layers[0].mlp.parameters())
    stock.model.layers[0].mlp.update(new)
    patched.model.layers[0].mlp.update(new)
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert _forms(patched) == traced  # same shapes: nothing traced again


def test_training_traces_and_long_calls_run_layer_by_layer() -> None:
    _, patched = _pair("llama")
    patched.train()
    _decode(patched, 2)
    assert _forms(patched) == 0
    patched.eval()
    cache = make_prompt_cache(patched)
    long = mx.zeros((1, segments_module.MAX_SEGMENT_TOKENS + 1), dtype=mx.int32)
    patched(long, cache=cache)
    assert _forms(patched) == 0
    x = mx.zeros((1, 1, 8))
    with gk.without_vjp():
        assert segments_apply(x)
    assert not segments_apply(mx.zeros((1, segments_module.MAX_SEGMENT_TOKENS + 1, 8)))
    # a trace of a decoding call records the segments' kernels, run eagerly: what decoding runs
    graph = gk.trace(lambda t: patched(t), mx.array([[1]]))
    kernels = {graph.node(n)["kernel"] for n in graph.kernels()}
    assert {"gk_norm_projections", "gk_rope_qk", "gk_norm_swiglu", "gk_add_rms_norm"} == kernels
    assert _forms(patched) == 0
    patched.train()  # training: layer by layer
    graph = gk.trace(lambda t: patched(t), mx.array([[1]]))
    layer_by_layer = {"gk_rms_norm", "gk_rope_qk", "gk_add_rms_norm", "gk_swiglu"}
    assert {graph.node(n)["kernel"] for n in graph.kernels()} == layer_by_layer


@pytest.mark.parametrize("round_", range(3))
def test_threads_decoding_one_model_at_once_each_trace_their_own_forms(round_: int) -> None:
    stock, patched = _pair("qwen3")
    expected = _decode(stock, 3)
    results: dict[int, list[mx.array]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            start.wait()  # all four trace their first segments at once
            results[i] = _decode(patched, 3)
            mx.eval(results[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got in results.values():
        for ours, theirs in zip(got, expected):
            assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert _forms(patched) == 4 * (len(patched.model.layers) + 1)


def test_a_trace_leaves_the_layer_itself_untouched() -> None:
    seen: list[bool] = []

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = mx.ones((4,))
            self.inner = nn.Linear(4, 4)

        def scaled(self, x: Any) -> Any:
            seen.append(layer.weight is weight and layer.inner.weight is inner)  # the live layer
            return self.inner(x * self.weight)

    layer = Scaled()
    weight, inner = layer.weight, layer.inner.weight
    segments = Segments(layer)
    out = segments("scaled", mx.ones((2, 4)))
    assert seen == [True] and mx.allclose(out, layer.scaled(mx.ones((2, 4)))).item()


def test_a_segment_is_handed_only_the_subtrees_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    handed: dict[str, list[int]] = {}
    compile_ = mx.compile

    def counting(fn: Any, **options: Any) -> Any:  # the forms Segments makes: count the arrays of each call
        compiled = compile_(fn, **options)  # (mlx-lm compiles its activations through here too)

        def call(trees: Any, *args: Any) -> Any:
            handed.setdefault(fn.__name__, []).append(len(tree_flatten(trees)))
            return compiled(trees, *args)

        return call

    monkeypatch.setattr(segments_module.mx, "compile", counting)
    monkeypatch.setattr(segments_module, "_traced", _named(segments_module._traced))
    stock, patched = _pair("qwen3")
    for ours, theirs in zip(_decode(patched, 2), _decode(stock, 2)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    first, second = patched.model.layers
    count = lambda module: len(tree_flatten(module.parameters()))  # noqa: E731
    projections = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")  # not o_proj, not the RoPE
    entering = 1 + sum(count(second.self_attn[name]) for name in projections)  # and the input norm
    leaving = count(first.self_attn.o_proj) + 1 + count(first.mlp)  # o_proj, the norm, the ffn
    assert set(handed["enter"]) == {entering} and set(handed["leave"]) == {leaving}
    assert set(handed["('link', 0)"]) == {leaving + entering}  # the first's leave, the second's enter
    assert max(handed["enter"]) < count(first) and max(handed["leave"]) < count(first)
    assert not first.segments()._whole and not patched.model.segments()._whole
    # a replaced weight inside a subtree handed over is read at the next call
    for model in (stock, patched):
        model.model.layers[0].self_attn.o_proj.weight = model.model.layers[0].self_attn.o_proj.weight * 2
        model.model.layers[0].input_layernorm.weight = model.model.layers[0].input_layernorm.weight + 1
    for ours, theirs in zip(_decode(patched, 2), _decode(stock, 2)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()


def _named(traced: Any) -> Any:
    def named(layer_ref: Any, name: str, *rest: Any) -> Any:
        fn = traced(layer_ref, name, *rest)
        fn.__name__ = str(name)
        return fn

    return named


def test_a_segment_reaching_past_the_subtrees_it_names_takes_the_whole_layer() -> None:
    class Declares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def segment_reads(self, name: str) -> Any:
            return (("a",),)  # but ``both`` reads b too

        def both(self, x: Any) -> Any:
            return self.b(self.a(x))

    layer = Declares()
    segments = Segments(layer)
    x = mx.ones((1, 2))
    assert mx.allclose(segments("both", x), layer.both(x)).item()
    assert segments._whole == {"both"}
    layer.b.weight = layer.b.weight * 3  # seen: the whole layer is handed over now
    assert mx.allclose(segments("both", x), layer.both(x)).item()


@pytest.mark.parametrize("unlinked", ["no rope_qk", "a stock block"])
def test_a_stack_links_its_blocks_only_when_every_block_decodes_on_segments(unlinked: str) -> None:
    stock, patched = tiny_model("llama"), tiny_model("llama")
    gk.patch(patched, kernels=["add_rms_norm", "swiglu"] if unlinked == "no rope_qk" else "all")
    if unlinked == "a stock block":
        patched.model.layers[1] = patched.model.layers[1].original
    for model in (stock, patched):
        model.eval()
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert "_gk_segments" not in patched.model.__dict__  # the blocks ran one by one


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_stack_finds_its_links_and_rotations_once_until_the_tree_changes(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding stack asks its blocks whether they link, and their RoPE layers how they rotate,
    once; again after a RoPE setting or a block changes, and the logits follow stock's."""
    stock, patched = _pair(arch)
    asked = []
    fixed = KernelRoPE.fixed_rotary
    monkeypatch.setattr(KernelRoPE, "fixed_rotary", lambda self: asked.append(self) or fixed(self))
    _decode(patched, 2)
    assert len(asked) == len(patched.model.layers)
    asked.clear()
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert asked == []  # nothing changed: nothing asked again

    replaced = patched.model.layers[1].original
    for rope in (stock.model.layers[1].self_attn.rope, patched.model.layers[1].self_attn.rope,
                 replaced.self_attn.rope):  # a plain attribute the rotation reads
        rope.base = 500.0
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert asked
    asked.clear()

    patched.model.layers[1] = replaced  # a list item: no hook sees it; a stock block, no links
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert patched.model.__dict__["_gk_links_found"].module[2] is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_generation_decodes_through_linked_blocks_as_stock_does(arch: str) -> None:
    """mlx-lm's BatchGenerator: prompts of different lengths, left-padded, per-sequence offsets."""
    prompts = [[3, 17, 42, 5], [9, 1], [7, 64, 2, 8, 11, 4]]
    stock, patched = _pair(arch)
    assert batch_generate(patched, prompts, 6) == batch_generate(stock, prompts, 6)
    assert patched.model.segments().traced() == [("link", 0)]


def test_a_dropped_model_is_freed_with_its_forms() -> None:
    _, patched = _pair("llama")
    _decode(patched, 1)
    alive = weakref.ref(patched.model.layers[0])
    del patched
    gc.collect()
    assert alive() is None


def test_a_standalone_attention_runs_project_and_output_segments() -> None:
    stock, patched = _pair("llama")
    attention = patched.model.layers[0].self_attn
    assert isinstance(attention, KernelAttention)
    x = mx.random.normal((1, 1, stock.args.hidden_size), key=mx.random.key(3))
    cs, cp = make_prompt_cache(stock), make_prompt_cache(patched)
    for _ in range(3):
        ours = attention(x, None, cp[0])
        theirs = stock.model.layers[0].self_attn(x, None, cs[0])
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert attention.segments().traced() == ["output", "project"]


def test_a_layer_that_is_not_a_tree_of_arrays_runs_its_own_forward() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = mx.ones((2,))
            self.extras = [object()]  # not something mx.compile takes

        def scaled(self, x: Any) -> Any:
            return x * self.weight

    layer = Odd()
    segments = Segments(layer)
    assert segments("scaled", mx.ones((2,))) is None and not segments.usable


def test_patch_selects_the_decoding_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.kernels as gkk

    calls: list[str] = []
    for name in ("norm_projections", "norm_swiglu"):
        real = getattr(gkk, name)
        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(gkk, name, spy)
    assert {"norm_projections", "norm_swiglu"} <= set(gk.models.kernel_names())
    stock = tiny_model("llama")
    stock.eval()
    for kernels, expected in ((["add_rms_norm", "rope_qk", "swiglu"], set()),
                              (["add_rms_norm", "rope_qk", "swiglu", "norm_swiglu"], {"norm_swiglu"}),
                              ("all", {"norm_projections", "norm_swiglu"})):
        calls.clear()
        patched = tiny_model("llama")
        gk.patch(patched, kernels=kernels)
        patched.eval()
        for ours, theirs in zip(_decode(patched, 2), _decode(stock, 2)):
            assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
        assert set(calls) == expected, kernels


@pytest.mark.parametrize("call, says", [
    (lambda x, w, m: gk.kernels.norm_projections(x, w, []), "1 to 3 weight matrices"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w, [m, m, m, m]), "1 to 3 weight matrices"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w, [m.T]), "expected (N, 16)"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w, [m.astype(mx.float16)]), "dtype mismatch"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w, ["W"]), "must be an mx.array"),
    (lambda x, w, m: gk.kernels.norm_projections(mx.ones((9, 16)), w, [m]), "1 to 8 rows"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w[:8], [m]), "weight has shape"),
    (lambda x, w, m: gk.kernels.norm_projections(x, w, [m], residual=x[:1]), "residual is"),
    (lambda x, w, m: gk.kernels.norm_swiglu(x, w, m, m[:4]), "up has shape"),
    (lambda x, w, m: gk.kernels.norm_swiglu(x, w, m, m, eps=-1.0), "eps must be"),
])
def test_projection_kernels_refuse_bad_arguments_by_name(call: Any, says: str) -> None:
    x, w, m = mx.ones((2, 16)), mx.ones((16,)), mx.ones((8, 16))
    with pytest.raises(gk.KernelError) as raised:
        call(x, w, m)
    assert raised.value.operation in ("norm_projections", "norm_swiglu") and says in str(raised.value)
    assert mx.allclose(gk.kernels.norm_projections(x, w, [m])[0], mx.full((2, 8), 16.0), atol=1e-3).item()


def test_a_quantized_model_decodes_through_segments_with_its_own_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.kernels as gkk

    stock, patched = tiny_model("llama"), tiny_model("llama")
    for model in (stock, patched):
        nn.quantize(model, group_size=32, bits=4)
        model.eval()
    gk.patch(patched)
    monkeypatch.setattr(gkk, "norm_projections", None)  # quantized projections are not plain Linears
    monkeypatch.setattr(gkk, "norm_swiglu", None)
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=1e-4, rtol=1e-4).item()
    assert patched.model.layers[0].segments().traced() == ["enter"]
    assert patched.model.layers[-1].segments().traced() == ["leave"]
    assert patched.model.segments().traced() == [("link", 0)]


def test_a_nan_from_a_decoding_kernel_is_found_by_inspect_and_check_finite(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.kernels as gkk

    real = gkk.norm_swiglu
    broken = gk.Kernel("nan_swiglu", ["x"], ["out"], reference=lambda x: [mx.sqrt(-1.0 - mx.abs(x))])

    def planted(x: Any, weight: Any, gate: Any, up: Any, eps: float = 1e-5, residual: Any = None) -> Any:
        h, out = real(x, weight, gate, up, eps, residual=residual)
        if gate is patched.model.layers[1].mlp.gate_proj.weight:  # layer 1 only
            out = gk.launch(broken, [out], [gk.OutputSpec(out.shape, out.dtype)], grid=(out.size, 1, 1),
                            threadgroup=(32, 1, 1))[0]
        return h, out

    _, patched = _pair("llama")
    monkeypatch.setattr(gkk, "norm_swiglu", planted)
    token = mx.array([[5]])
    graph = gk.inspect(patched, token)
    [failure] = graph.failures()
    assert graph.node(failure.node)["kernel"] == "nan_swiglu"
    assert graph.node(failure.node)["scope"].startswith("model.layers.1")
    with pytest.raises(gk.GraphError) as raised:
        gk.wrap(patched, check_finite=True)(token)
    assert raised.value.node == failure.node


class _FusedPair(nn.Module):
    """A fused weight whose two row ranges one segment multiplies by ``x``: ``segment_views``
    declares them, so the segment is handed the ranges instead of slicing them at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Linear(4, 6, bias=False)

    def segment_views(self, name: str) -> Any:
        return ((("fused", "weight"), (2, 4)),) if name == "split" else ()

    def split(self, x: mx.array) -> tuple[mx.array, mx.array]:
        first, second = segments_module.row_ranges(self.fused.weight, (2, 4))
        return x @ first.T, x @ second.T


def _slices(outputs: Any) -> int:
    """The Slice primitives in the graph of ``outputs`` (up to arrays already evaluated)."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return len(re.findall(r'label ="Slice"', dot.getvalue()))


def test_a_segment_is_handed_the_row_ranges_it_declares_made_once() -> None:
    layer = _FusedPair()
    mx.eval(layer.parameters())
    x = mx.random.normal((1, 4), key=mx.random.key(0))
    segments = Segments(layer)
    for call in range(3):
        outputs = segments("split", x)
        # the ranges are inputs: sliced at the first call, after it arrays already made
        assert _slices(outputs) == (2 if call == 0 else 0)
        mx.eval(outputs)
        for got, want in zip(outputs, layer.split(x)):
            assert mx.array_equal(got, want).item()
    made = segments._views["split"][1]
    assert segments("split", x) and segments._views["split"][1] is made
    layer.fused.weight = layer.fused.weight * 3  # replaced: the next call slices the new weight
    for got, want in zip(segments("split", x), (x @ layer.fused.weight[:2].T, x @ layer.fused.weight[2:].T)):
        assert mx.allclose(got, want).item()
    assert segments._views["split"][1] is not made


def test_phi3_blocks_take_their_fused_weights_row_ranges_as_inputs() -> None:
    """A 4-bit Phi-3 decodes as stock with its fused qkv_proj and gate_up_proj handed to each
    link in row ranges made once, not sliced at every token."""
    stock, patched = tiny_model("phi3"), tiny_model("phi3")
    for model in (stock, patched):
        nn.quantize(model, group_size=32, bits=4)
        model.eval()
    gk.patch(patched)
    for ours, theirs in zip(_decode(patched, 4), _decode(stock, 4)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    first, second = patched.model.layers
    views = patched.model.segment_views(("link", 0))
    assert [path[2:] for path, _ in views] == [
        ("mlp", "gate_up_proj", part) for part in ("weight", "scales", "biases")] + [
        ("self_attn", "qkv_proj", part) for part in ("weight", "scales", "biases")]
    handed = patched.model.segments()._views[("link", 0)][1]
    assert handed[0][0].shape[0] == first.mlp.gate_up_proj.weight.shape[0] // 2
    made = [id(v) for ranges in handed for v in ranges]
    _decode(patched, 2)
    assert [id(v) for ranges in patched.model.segments()._views[("link", 0)][1] for v in ranges] == made


def test_a_segment_call_reuses_what_it_found_in_the_tree_until_the_tree_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding call hands each segment what an earlier call found (the subtrees it reads, the
    fused weights' row ranges) without asking the layer again, and finds them anew after blocks
    are swapped in the decoder's list or fused weights are loaded: the logits follow stock's."""
    stock, patched = tiny_model("phi3"), tiny_model("phi3")
    for model in (stock, patched):
        nn.quantize(model, group_size=32, bits=4)
        model.eval()
    gk.patch(patched)
    found = []
    plan = Segments._plan
    monkeypatch.setattr(Segments, "_plan", lambda self, *a: found.append(a[1]) or plan(self, *a))
    _decode(patched, 2)
    assert found  # the first calls found what they hand
    found.clear()
    for ours, theirs in zip(_decode(patched, 3), _decode(stock, 3)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert found == []  # nothing changed: nothing looked up again

    for model in (stock, patched):  # a list's items: no hook sees them, the plan checks them
        model.model.layers[0], model.model.layers[1] = model.model.layers[1], model.model.layers[0]
    for ours, theirs in zip(_decode(patched, 2), _decode(stock, 2)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert ("link", 0) in found
    found.clear()

    fused = {k: v for k, v in tree_flatten(stock.parameters()) if "qkv_proj" in k or "gate_up_proj" in k}
    loaded = [(k, v[::-1] if v.dtype == mx.uint32 else v * 0.5) for k, v in fused.items()]
    for model in (stock, patched):
        model.load_weights(loaded, strict=False)
    for ours, theirs in zip(_decode(patched, 2), _decode(stock, 2)):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert ("link", 0) in found


class _Chain(nn.Module):
    """Two linear layers in a list, of which segment ``"first"`` reads only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def segment_reads(self, name: str) -> Any:
        return (("steps", 0),)

    def first(self, x: mx.array) -> mx.array:
        return self.steps[0](x)


def test_a_segment_sees_the_items_of_a_list_on_its_paths_replaced() -> None:
    """No hook sees a list's items set: the segment checks the list items on its paths."""
    chain = _Chain()
    segments = Segments(chain)
    x = mx.ones((1, 4))
    assert mx.allclose(segments("first", x), chain.steps[0](x)).item()
    chain.steps[0], chain.steps[1] = chain.steps[1], chain.steps[0]
    assert mx.allclose(segments("first", x), chain.steps[0](x)).item()
    chain.steps[0].weight = chain.steps[0].weight * 2  # a weight set: read at the next call
    assert mx.allclose(segments("first", x), chain.steps[0](x)).item()


class _Pair(nn.Module):
    """Two linear layers of one shape, a segment reading both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def difference(self, x: mx.array) -> mx.array:
        return self.a(x) - self.b(x)


def test_a_segment_handed_the_same_shapes_from_other_places_traces_anew() -> None:
    """A segment's arrays go to MLX as one flat tuple, whose shapes alone would not tell two trees
    apart: a tree whose items now come in another order is traced for that order."""
    pair = _Pair()
    segments = Segments(pair)
    x = mx.ones((1, 4))
    assert mx.allclose(segments("difference", x), pair.difference(x)).item()
    a = pair["a"]
    del pair["a"]
    pair["a"] = a  # the same items, now after "b"
    assert list(pair) == ["b", "a"]
    assert mx.allclose(segments("difference", x), pair.difference(x)).item()
    assert len(segments._forms) == 2


class _Steps(nn.Module):
    """Linear layers in a list, which segment ``"chained"`` reads whole."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def segment_reads(self, name: str) -> Any:
        return (("steps",),)

    def chained(self, x: mx.array) -> mx.array:
        for step in self.steps:
            x = step(x) - x
        return x


def test_a_segment_sees_the_items_of_a_list_inside_what_it_reads_replaced_or_added() -> None:
    """A list inside a segment's subtrees: its items swapped, or one more appended (no module item
    written either way), are what the next call reads."""
    layer = _Steps()
    segments = Segments(layer)
    x = mx.ones((1, 4))
    assert mx.allclose(segments("chained", x), layer.chained(x)).item()
    layer.steps[0], layer.steps[1] = layer.steps[1], layer.steps[0]
    assert mx.allclose(segments("chained", x), layer.chained(x)).item()
    layer.steps.append(layer.steps[0])
    assert mx.allclose(segments("chained", x), layer.chained(x)).item()


def test_a_segment_keeps_no_replaced_weight_alive() -> None:
    """What a segment's calls are handed is let go at the next module item write: a weight
    replaced is freed at once, not at the segment's next call, and the call reads the new one."""
    layer = _Chain()
    layer.steps[0] = nn.Linear(512, 512)
    segments = Segments(layer)
    x = mx.ones((1, 512))
    mx.eval(segments("first", x), layer.parameters())
    gc.collect()
    held = mx.get_active_memory()
    layer.steps[0].weight = layer.steps[0].weight + 1  # a 1 MiB weight replaced
    mx.eval(layer.steps[0].weight)
    gc.collect()
    assert mx.get_active_memory() <= held + 1024  # the one it replaced went
    assert mx.allclose(segments("first", x), layer.steps[0](x)).item()
