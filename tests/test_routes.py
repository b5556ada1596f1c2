"""Routes of patched layers (graphkern.models.routes): on a GPU backend a standalone layer runs the
stock op unless a trace records or a compiled segment fuses it; ``route=`` forces either way.

The GPU decision is simulated by telling the route module the backend is CUDA while the kernels
themselves run their references on the CPU, so every comparison here is exact in float32."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import PROMPT, eval_twins, greedy_logits, spy_on_kernels  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.models.routes as routes  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, tiny_model  # noqa: E402

STANDALONE = ("rms_norm", "add_rms_norm", "rope", "swiglu", "gelu", "layer_norm", "softmax")
FUSED = ("norm_projections", "norm_swiglu", "norm_geglu", "rope_qk")


@pytest.fixture
def gpu_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes decide as on CUDA; the kernels still run their references."""
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)


def _decode(model: nn.Module, steps: int = 3) -> list[mx.array]:
    return greedy_logits(model, steps)


def _same(a: list[mx.array], b: list[mx.array], atol: float = 0.0) -> bool:
    """Equal, or within ``atol`` (float32: Gemma 2's tanh GELU kernel rounds apart from stock's)."""
    return all(mx.allclose(x, y, atol=atol, rtol=0.0).item() for x, y in zip(a, b))


def _spy_in_segments(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Each call of the kernel functions ``names``: (name, whether a compiled segment was tracing)."""
    import graphkern.kernels as gkk
    from graphkern.launching.context import state

    calls: list[tuple[str, bool]] = []
    for name in names:
        real = getattr(gkk, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, state.segment_depth > 0))
            return _real(*args, **kwargs)

        monkeypatch.setattr(gkk, name, spy)
    return calls


def test_standalone_layers_run_stock_on_a_gpu(gpu_decision: None, monkeypatch: pytest.MonkeyPatch) -> None:
    stock = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), nn.GELU(approx="tanh"), nn.LayerNorm(16))
    patched = nn.Sequential(*stock.layers)
    gk.patch(patched)
    calls = spy_on_kernels(monkeypatch, STANDALONE)
    x = mx.random.normal((2, 3, 16), key=mx.random.key(0))
    assert mx.array_equal(patched(x), stock(x)).item()
    assert calls == []


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_kernels_run_only_where_a_segment_fuses_them(arch: str, gpu_decision: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks decode through compiled segments, where their norms still run as kernels (traced
    once), and activations as stock ops ``mx.compile`` fuses; outside them (a stack's final norm)
    a standalone layer is stock's ops."""
    stock, patched = eval_twins(arch)
    calls = _spy_in_segments(monkeypatch, STANDALONE + FUSED)
    assert _same(_decode(patched), _decode(stock), atol=1e-5)
    assert calls and all(inside for _, inside in calls)
    assert not {name for name, _ in calls} & {"gelu", "swiglu"}
    if arch.startswith("gemma"):  # Gemma's GeGLU feed-forwards, Gemma 2's and 3's between post-norms
        assert "norm_geglu" in {name for name, _ in calls}


def test_a_trace_records_a_kernel_node_for_every_patched_layer(gpu_decision: None) -> None:
    _, patched = eval_twins("gemma2")
    graph = gk.trace(lambda tokens: patched(tokens), PROMPT)
    kernels = {graph.node(k)["kernel"] for k in graph.kernels()}
    # the GeGLU feed-forward's gate, up and GELU inside its block's norm_geglu launch
    assert {"gk_norm_projections", "gk_rope_qk", "gk_add_rms_norm", "gk_norm_geglu"} <= kernels


@pytest.mark.parametrize("route, kernels_run", [("kernel", True), ("stock", False)])
def test_a_route_forces_one_way(route: str, kernels_run: bool, gpu_decision: None,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    stock, patched = eval_twins("gemma2", route=route)
    calls = spy_on_kernels(monkeypatch, STANDALONE)
    assert _same(_decode(patched, 1), _decode(stock, 1), atol=1e-5)
    assert bool(calls) is kernels_run


def test_the_stock_route_decodes_a_stack_on_its_stock_layers(gpu_decision: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_route(model, "stock")`` takes every kernel out of a patched stack's calls, the fused
    blocks' too (the stack runs its stock layers), and a trace still records the kernels."""
    stock, patched = eval_twins("llama")
    gk.set_route(patched, "stock")
    calls = spy_on_kernels(monkeypatch, (*STANDALONE, *FUSED))
    assert _same(_decode(patched, 3), _decode(stock, 3))  # exact: the same ops
    assert not calls
    graph = gk.trace(lambda tokens: patched(tokens), PROMPT[:, :1])
    assert {"gk_norm_projections", "gk_norm_swiglu"} <= {graph.node(k)["kernel"] for k in graph.kernels()}


def test_set_route_changes_every_patched_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (reference backend) auto runs the kernels; "stock" then turns them off."""
    _, patched = eval_twins("gemma2")
    calls = spy_on_kernels(monkeypatch, STANDALONE)
    _decode(patched, 1)
    assert calls
    assert gk.set_route(patched, "stock") == len(gk.models.patched_layers(patched))
    calls.clear()
    _decode(patched, 1)
    assert calls == []


@pytest.mark.parametrize("call", [lambda m: gk.patch(m, route="fast"), lambda m: gk.set_route(m, None)])
def test_an_unknown_route_is_refused_by_name(call: Any) -> None:
    model = nn.Sequential(nn.RMSNorm(8))
    with pytest.raises(gk.KernelError, match="route is .*auto.*kernel.*stock"):
        call(model)
    assert type(model.layers[0]) is nn.RMSNorm


def _decode_rows(model: nn.Module, rows: int) -> list[mx.array]:
    """``rows`` sequences decoded together: the prompt, then three steps of one token each."""
    cache = make_prompt_cache(model)
    logits = [model(mx.repeat(PROMPT, rows, axis=0), cache=cache)]
    for _ in range(3):
        logits.append(model(mx.argmax(logits[-1][:, -1:], axis=-1), cache=cache))
    mx.eval(logits)
    return logits


def _quantized_twins(arch: str, **options: Any) -> tuple[nn.Module, nn.Module]:
    """:func:`eval_twins` with 4-bit weights in groups of 32, quantized before patching."""
    stock, patched = tiny_model(arch), tiny_model(arch)
    for model in (stock, patched):
        nn.quantize(model, group_size=32, bits=4)
        model.eval()
    gk.patch(patched, **options)
    return stock, patched


QUANTIZED_LIMIT = routes.FUSED_MAX_ROWS["quantized"]


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
@pytest.mark.parametrize("quantized, route, rows, fused", [
    (False, "auto", 8, True), (True, "auto", 1, True), (True, "auto", QUANTIZED_LIMIT, True),
    (True, "auto", 8, False), (True, "kernel", 8, True)])
def test_batch_decoding_past_the_fused_rows_runs_the_stock_layers(
        arch: str, quantized: bool, route: str, rows: int, fused: bool, gpu_decision: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a fused block's norm-fed projection kernels take up to FUSED_MAX_ROWS rows of their
    kind of weights; a dense stack decoding more rows than that runs its stock layers (no kernel
    at all), whose ops cost the host less than norm kernels beside stock's products."""
    stock, patched = (_quantized_twins if quantized else eval_twins)(arch, route=route)
    prefix = "quantized_" if quantized else ""
    gated = prefix + ("norm_geglu" if arch.startswith("gemma") else "norm_swiglu")
    calls = _spy_in_segments(monkeypatch, (gated, "add_rms_norm"))
    assert _same(_decode_rows(patched, rows), _decode_rows(stock, rows), atol=1e-5)
    names = {name for name, inside in calls if inside}
    assert (gated in names) is fused
    assert fused or not calls


def test_wide_plain_weights_take_the_quantized_row_limit(gpu_decision: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain weights wider than WIDE_HIDDEN decode through the fused kernels only up to the
    quantized limit of rows; past it the stack runs stock, and narrower ones still fuse."""
    stock, patched = eval_twins("llama")
    width = patched.model.layers[0].input_layernorm.weight.shape[-1]
    calls = _spy_in_segments(monkeypatch, ("norm_swiglu",))
    cases = [(width, 8, True), (width - 1, 8, False), (width - 1, QUANTIZED_LIMIT, True)]
    for wide_above, rows, fused in cases:
        monkeypatch.setattr(routes, "WIDE_HIDDEN", wide_above)
        calls.clear()
        assert _same(_decode_rows(patched, rows), _decode_rows(stock, rows), atol=1e-5)
        assert bool(calls) is fused, (wide_above, rows)


def test_a_sparse_stack_keeps_its_norm_kernels_past_the_fused_rows(gpu_decision: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack with mixture-of-experts blocks (whose router kernel pays at any row count) decodes
    more rows than the quantized kernels take through each block's norm kernel and stock's
    products, inside its compiled segments."""
    stock, patched = _quantized_twins("mixtral")
    calls = _spy_in_segments(monkeypatch, ("quantized_norm_projections", "add_rms_norm"))
    assert _same(_decode_rows(patched, 8), _decode_rows(stock, 8), atol=1e-5)
    names = {name for name, inside in calls if inside}
    assert "add_rms_norm" in names and "quantized_norm_projections" not in names


def test_the_cpu_takes_the_fused_kernels_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a GPU the kernels run their references, and every row count takes them (what the
    reference backend is for: checking the kernels' paths)."""
    stock, patched = eval_twins("llama")
    calls = _spy_in_segments(monkeypatch, ("norm_projections", "norm_swiglu"))
    assert _same(_decode_rows(patched, 8), _decode_rows(stock, 8), atol=1e-5)
    assert {name for name, _ in calls} == {"norm_projections", "norm_swiglu"}


class _Recorder:
    """A recorder that is never called: the layers below never launch."""


class _Holder(nn.Module):
    """A module whose compiled segment ``run`` calls its patched norm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def run(self, x: mx.array) -> mx.array:
        return self.norm(x)  # type: ignore[no-any-return]


def _in_segment(layer: nn.Module, x: mx.array) -> Any:
    from graphkern.models.segments import Segments

    holder = _Holder(layer)  # the segments hold it weakly
    return Segments(holder)("run", x)


def _on_a_thread(settings: Any, layer: nn.Module, x: mx.array) -> None:
    import threading

    from graphkern.launching.context import adopted

    def work() -> None:
        with adopted(settings):
            layer(x)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def _setting(name: str, layer: nn.Module, x: mx.array, monkeypatch: pytest.MonkeyPatch) -> None:
    """One call of ``layer`` under the thread setting (or route, or environment) ``name``."""
    from graphkern.launching.backends import using_backend
    from graphkern.launching.context import recording, snapshot
    from graphkern.models.prefill import stock_layers

    if name == "nothing":
        layer(x)
    elif name == "recording":
        with recording(_Recorder()):  # type: ignore[arg-type]
            layer(x)
    elif name == "stock layers":
        with stock_layers():
            layer(x)
    elif name.startswith("using_backend "):
        with using_backend(name.split()[1]):
            layer(x)
    elif name.startswith("GRAPHKERN_BACKEND="):
        with monkeypatch.context() as patch:
            patch.setenv("GRAPHKERN_BACKEND", name.split("=")[1])
            layer(x)
    elif name == "segment":
        mx.eval(_in_segment(layer, x))
    elif name == "adopted recording":
        with recording(_Recorder()):  # type: ignore[arg-type]
            settings = snapshot()
        _on_a_thread(settings, layer, x)
    elif name == "another thread":
        _on_a_thread(snapshot(), layer, x)
    elif name.startswith("route "):
        gk.set_route(nn.Sequential(layer), name.split()[1])
        layer(x)
        gk.set_route(nn.Sequential(layer), "auto")


@pytest.mark.parametrize("setting, runs", [
    ("nothing", "stock"), ("recording", "kernel"), ("stock layers", "stock"),
    ("using_backend reference", "kernel"), ("using_backend cuda", "stock"),
    ("GRAPHKERN_BACKEND=reference", "kernel"), ("GRAPHKERN_BACKEND=cuda", "stock"),
    ("segment", "kernel"), ("adopted recording", "kernel"), ("another thread", "stock"),
    ("route kernel", "kernel"), ("route stock", "stock")])
def test_with_a_gpu_detected_the_auto_route_sees_every_setting(setting: str, runs: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU backend detected (before patching: a layer reads it when it takes its route),
    a standalone layer on the auto route runs the stock forward on its own arrays unless a trace
    records, a compiled segment traces or a backend is forced, on this thread or through
    GRAPHKERN_BACKEND; inside the stock layers it runs that forward too, never the replaced module
    object (whose weights may predate a load); each setting undone, the next call runs stock again."""
    from graphkern.launching import backends
    from graphkern.launching.context import state
    from graphkern.models.layers import KernelRMSNorm

    ran: list[str] = []

    def stock_forward(self: nn.Module, x: mx.array) -> mx.array:
        ran.append("original" if type(self) is nn.RMSNorm else "stock")
        return x

    def forward(self: nn.Module, x: mx.array) -> mx.array:
        ran.append("kernel")
        return x

    monkeypatch.setattr(backends, "_detected_backend", lambda: "cuda")
    monkeypatch.setattr(nn.RMSNorm, "__call__", stock_forward)
    monkeypatch.setattr(KernelRMSNorm, "forward", forward)
    model = nn.Sequential(nn.RMSNorm(8))
    gk.patch(model)
    layer, x = model.layers[0], mx.ones((1, 1, 8))
    assert isinstance(layer, KernelRMSNorm)
    _setting(setting, layer, x, monkeypatch)
    assert state.plain
    layer(x)
    assert ran == [runs, "stock"]


def test_thread_settings_keep_plain_up_to_date() -> None:
    """``state.plain`` is whether none of the settings it sums up is set, through nested
    changes and back."""
    from graphkern.launching.backends import using_backend
    from graphkern.launching.context import recording, state
    from graphkern.models.prefill import stock_layers

    def plain() -> bool:
        return (state.recorder is None and state.backend is None and not state.stock_layers
                and not state.segment_depth)

    assert state.plain and plain()
    with using_backend("reference"):
        assert not state.plain
        with recording(_Recorder()):  # type: ignore[arg-type]
            assert not state.plain
            with stock_layers():
                assert not state.plain
            assert not state.plain
        assert not state.plain
    with using_backend(None):
        assert state.plain
    assert state.plain and plain()


def _rope_calls() -> list[tuple[str, dict[str, Any]]]:
    from rope_layers import ROPES, YARN_CALL_ARGUMENTS

    calls: list[tuple[str, dict[str, Any]]] = []
    for name in sorted(ROPES):
        calls += [(name, {}), (name, {"offset": 30}), (name, {"offset": 30, "positional": True})]
    if YARN_CALL_ARGUMENTS:
        calls += [("yarn", {"offset": 30, "scale": 0.5}), ("yarn", {"offset": 30, "inverse": True}),
                  ("yarn", {"offset": 30, "positional": True, "inverse": True})]
    return calls


@pytest.mark.parametrize("name, call", _rope_calls())
def test_with_a_gpu_detected_a_rope_runs_stock_with_the_arguments_given(
        name: str, call: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A patched RoPE names its offset (mlx-lm passes it by keyword): given by keyword, by
    position or not at all, with or without more arguments, the stock layer gets it as given."""
    from rope_layers import ROPES

    from graphkern.launching import backends

    monkeypatch.setattr(backends, "_detected_backend", lambda: "cuda")
    stock = ROPES[name](False)
    model = nn.Sequential(ROPES[name](False))
    gk.patch(model)
    calls = spy_on_kernels(monkeypatch, ("rope",))
    kwargs = dict(call)
    args = (kwargs.pop("offset"),) if kwargs.pop("positional", False) else ()

    def x() -> mx.array:  # each call its own input: older mlx-lm's scaled RoPEs scale theirs in place
        return mx.random.normal((1, 2, 4, 64), key=mx.random.key(5))

    assert mx.array_equal(model.layers[0](x(), *args, **kwargs), stock(x(), *args, **kwargs)).item()
    assert calls == []


def test_an_attention_whose_rope_the_kernels_do_not_take_runs_stock_on_its_current_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A patched attention whose RoPE no kernel takes runs the stock forward on its own items: its
    head norms' weights loaded after patching (Qwen 3's q_norm and k_norm) are the ones it uses."""
    from mlx.utils import tree_flatten

    from graphkern.models.layers import KernelRoPE

    monkeypatch.setattr(KernelRoPE, "rotary", lambda self, length, offset: None)
    stock, patched = eval_twins("qwen3")
    scaled = [(name, 1.5 * p) for name, p in tree_flatten(stock.parameters())]
    for model in (stock, patched):
        model.load_weights(scaled)
    assert mx.allclose(patched(PROMPT), stock(PROMPT), atol=1e-5, rtol=1e-5).item()


def test_a_qwen2_block_decodes_in_llamas_launches_its_biases_in_the_kernel(gpu_decision: None) -> None:
    """Qwen 2's query, key and value biases go into the norm-fed projection kernel: a decoded
    token takes the launches of a Llama of the same shape, none of them an add."""
    from graphkern.models import decode_launches

    qwen2, llama = (decode_launches(eval_twins(arch, mx.bfloat16)[1]) for arch in ("qwen2", "llama"))
    assert qwen2.total == llama.total and "Add" not in qwen2.kinds, (str(qwen2), str(llama))
    assert qwen2.kinds["gk_norm_projections"] == TINY_CONFIGS["qwen2"]["num_hidden_layers"]
