"""Model fusions on the CPU (reference backend): every mlx-lm RoPE layer on the rope kernel, the fused
attention prologue (rope_qk), and decoder loops whose residual adds all run inside add_rms_norm.
Patched models must equal stock ones: logits, generated tokens, gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import rope_utils  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, RTOL, STOCK_EXPERTS_DIFFERENTIATE, assert_same_gradients, same_values  # noqa: E402
from rope_layers import OFFSETS, ROPES, YARN_CALL_ARGUMENTS, needs  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.kernels as gkk  # noqa: E402
from graphkern.kernels.base import LAUNCHES  # noqa: E402
from graphkern.kernels.ops import rope as rope_module  # noqa: E402
from graphkern.kernels.ops import rope_qk as rope_qk_module  # noqa: E402
from graphkern.kernels.ops.rope_qk import stock_prologue  # noqa: E402
from graphkern.launching.backends import on_gpu_backend  # noqa: E402
from graphkern.models import check_model, kernel_names, patch, patched_layers, unpatch  # noqa: E402
from graphkern.models.launch_count import decode_launches  # noqa: E402
from graphkern.models.layers import (  # noqa: E402
    KernelAttention,
    KernelDecoderStack,
    KernelDynamicRoPE,
    KernelResidualBlock,
)
from graphkern.models.patching import PATCH  # noqa: E402
from graphkern.models.tiny import DEEPSEEK_V3_CONFIG, TINY_CONFIGS, random_model, tiny_model  # noqa: E402

TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64], [8, 8, 120, 33, 2, 0, 71, 9]])
MODELS = ["llama", "qwen2", "qwen3", "mixtral", "phi3", "gemma2", "gemma3"]
#: The architectures whose blocks have Gemma 2's layout (post-norms) and tanh GeGLU.
GEMMAS = ("gemma2", "gemma3")

# ----------------------------------------------------------------------------- RoPE layers

def _patched(layer: nn.Module) -> nn.Module:
    model = nn.Sequential(layer)
    [patched] = patch(model, route="kernel")  # the kernel itself, on a GPU too
    assert patched.kernel == "rope" and model.layers[0].original is layer
    return model.layers[0]


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_every_mlx_lm_rope_layer_equals_stock_at_positions_up_to_32k(name: str, traditional: bool) -> None:
    stock = ROPES[name](traditional)
    fast = _patched(stock)
    for d in (64, 80):  # 80: features past dims are copied
        x = mx.random.normal((2, 3, 5, d), key=mx.random.key(d))
        for offset in OFFSETS:
            assert mx.array_equal(fast(x, offset=offset), stock(x, offset=offset)).item(), (d, offset)
    per_batch = mx.array([5, 32000], dtype=mx.int32)
    if name != "dynamic_ntk":  # the stock layer cannot take an array offset
        x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(1))
        assert mx.array_equal(fast(x, offset=per_batch), stock(x, offset=per_batch)).item()


@pytest.mark.skipif(not YARN_CALL_ARGUMENTS, reason="this mlx-lm's YarnRoPE takes no scale or inverse")
@pytest.mark.parametrize("traditional", [False, True])
def test_yarn_rope_call_arguments_scale_and_inverse(traditional: bool) -> None:
    stock = ROPES["yarn"](traditional)
    assert stock.mscale != 1.0  # the input really is scaled
    fast = _patched(stock)
    x = mx.random.normal((1, 2, 4, 64), key=mx.random.key(2))
    for kwargs in ({"scale": 0.5}, {"inverse": True}, {"scale": 2.0, "inverse": True}):
        assert mx.array_equal(fast(x, 30000, **kwargs), stock(x, 30000, **kwargs)).item(), kwargs
    roundtrip = fast(fast(x, 7), 7, inverse=True)  # inverse undoes the rotation and the scale
    assert mx.allclose(roundtrip, x, atol=1e-5).item()


def test_rope_input_scale_rounds_to_the_dtype_first_as_stock_does() -> None:
    stock = ROPES["yarn"](False)
    fast = _patched(stock)
    for dtype in (mx.float16, mx.bfloat16):
        x = mx.random.normal((1, 2, 4, 64), key=mx.random.key(3)).astype(dtype)
        scaled = x.at[..., :64].multiply(stock.mscale)
        expected = gkk.rope(scaled, 64, base=None, freqs=stock._freqs, offset=9)
        assert mx.array_equal(fast(x, 9), expected).item()


@needs("dynamic_ntk")
def test_dynamic_ntk_rope_past_max_positions_runs_the_stock_layer() -> None:
    stock = rope_utils.DynamicNTKScalingRoPE(64, 64, False, 10000.0, factor=2.0)
    fast = _patched(stock)
    x = mx.random.normal((1, 2, 4, 64), key=mx.random.key(4))
    assert fast.rotary(4, 10) is not None and fast.rotary(4, 61) is None  # 65 > 64 positions
    for offset in (10, 60, 61, 500):
        assert mx.array_equal(fast(x, offset), stock(x, offset)).item()


@pytest.mark.parametrize("change, needle", [
    (lambda r: setattr(r, "dims", 63), "RoPE dims must be a positive even int, got 63"),
    (lambda r: setattr(r, "_freqs", mx.ones((5,))), "_freqs) must have shape (32,), got (5,)"),
    (lambda r: setattr(r, "mscale", float("nan")), "mscale must be a finite number > 0"),
])
def test_a_rope_layer_the_kernel_cannot_take_is_refused(change: Callable[[Any], None], needle: str) -> None:
    stock = ROPES["yarn"](False)
    change(stock)
    with pytest.raises(gk.KernelError) as info:
        patch(nn.Sequential(stock))
    assert info.value.operation == PATCH and "layers.0" in info.value.description
    assert needle in info.value.description


# ----------------------------------------------------------------------------- rope_qk


def _projections(b: int, length: int, heads: int, kv_heads: int, d: int,
                 dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
    kq, kk = mx.random.split(mx.random.key(b * 100 + length))
    return (mx.random.normal((b, length, heads * d), key=kq).astype(dtype),
            mx.random.normal((b, length, kv_heads * d), key=kk).astype(dtype))


PROLOGUES: list[dict[str, Any]] = [
    {},
    {"traditional": True, "offset": 32760},
    {"dims": 32, "scale": 0.5, "offset": 4093},
    {"base": None, "freqs": mx.exp(mx.linspace(0.0, 9.0, 32)), "input_scale": 1.1386, "offset": 30000},
    {"norm": True, "base": 1e6, "offset": 17},
    {"norm": True, "dims": 48, "traditional": True, "offset": mx.array([3, 20000], dtype=mx.int32)},
    {"norm": True, "offset": mx.array([12], dtype=mx.int64)},
]


@pytest.mark.parametrize("options", PROLOGUES, ids=lambda o: ",".join(o) or "plain")
def test_rope_qk_equals_the_stock_prologue(options: dict[str, Any]) -> None:
    options = dict(options)
    dims = options.pop("dims", 64)
    norm = options.pop("norm", False)
    q, k = _projections(2, 5, 4, 2, 64)
    if norm:
        weights = 1.0 + 0.5 * mx.random.normal((2, 64), key=mx.random.key(9))
        options.update(q_weight=weights[0], k_weight=weights[1], eps=1e-6)
    ours = gkk.rope_qk(q, k, 4, 2, dims, **options)
    with mx.stream(mx.cpu):  # mlx 0.32.4's CUDA RoPE reads a one-element offset array per batch entry
        stock = stock_prologue(q, k, 4, 2, dims, **options)
    for a, b in zip(ours, stock):
        if on_gpu_backend():
            # the kernel on a GPU against stock on the CPU: their frequencies differ by an ulp
            # (exp2 of log2 against exp of log), and a float32 angle near 32768 radians has an ulp
            # of 0.004, so positions that far rotate apart by a few 1e-3
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-2, rtol=0.0).item()
        else:
            assert a.shape == b.shape and same_values(a, b)
    assert ours[0].shape == (2, 4, 5, 64) and ours[1].shape == (2, 2, 5, 64)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_rope_qk_in_16_bits_rounds_where_stock_rounds(dtype: mx.Dtype) -> None:
    q, k = _projections(1, 6, 2, 1, 128, dtype)
    weights = (1.0 + 0.5 * mx.random.normal((2, 128), key=mx.random.key(1))).astype(dtype)
    kw: dict[str, Any] = {"q_weight": weights[0], "k_weight": weights[1], "offset": 100, "input_scale": 1.2}
    ours = gkk.rope_qk(q, k, 2, 1, 128, **kw)
    # stock on a CPU rotates in the dtype (mx.fast.rope's fallback); a GPU, as the kernel, in float32
    exact = [mx.fast.rope((o.astype(mx.float32)), 128, traditional=False, base=1e4, scale=1.0, offset=100)
             for o in _normed_scaled(q, k, weights, 1.2, dtype)]
    for a, b in zip(ours, exact):
        assert mx.array_equal(a, b.astype(dtype)).item()


def _normed_scaled(q: mx.array, k: mx.array, weights: mx.array, s: float, dtype: mx.Dtype) -> list[mx.array]:
    out = []
    for x, w, h in ((q, weights[0], 2), (k, weights[1], 1)):
        x = mx.fast.rms_norm(x.reshape(1, 6, h, -1), w, 1e-5).transpose(0, 2, 1, 3)
        out.append(x * mx.array(s, dtype))
    return out


@pytest.mark.parametrize("call, needle", [
    (lambda q, k, w: gkk.rope_qk(q, k, 3, 2, 64), "not a multiple of heads=3"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 1, 64), "expected kv_heads * D = 1 * 64"),
    (lambda q, k, w: gkk.rope_qk(q, k[:, :2], 4, 2, 64), "q and k must be"),
    (lambda q, k, w: gkk.rope_qk(q, k.astype(mx.float16), 4, 2, 64), "dtype mismatch: k is float16"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 66), "dims must be a positive even int <= x's last dimension"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, q_weight=w), "give both q_weight and k_weight"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, q_weight=w[:8], k_weight=w), "q_weight must be an array"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, offset=mx.array([1, 2, 3])), "offset must be"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, offset=mx.array([1.5])), "offset must be"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, input_scale=float("inf")), "input_scale must be"),
    (lambda q, k, w: gkk.rope_qk(q, k, 4, 2, 64, base=-1.0), "base must be a finite number > 0"),
    (lambda q, k, w: gkk.rope_qk(q.reshape(2, 5, 1, 256), k, 1, 1, 64), "q and k must be"),
    (lambda q, k, w: gkk.rope_qk(mx.zeros((1, 1, 2048)), mx.zeros((1, 1, 2048)), 1, 1, 64),
     "head dimension 2048 is outside 1..1024"),
])
def test_rope_qk_refuses_bad_arguments_naming_itself(call: Callable[..., Any], needle: str) -> None:
    q, k = _projections(2, 5, 4, 2, 64)
    for _ in range(2):  # refused on every call, never kept
        with pytest.raises(gk.KernelError) as info:
            call(q, k, mx.ones((64,)))
        assert info.value.operation == "rope_qk" and needle in info.value.description


def test_rope_and_rope_qk_launches_are_reused_across_decode_offsets(opaque_gpu: list[str]) -> None:
    """An int offset is an input array, not part of the signature: decoding token after token is
    one launch, traced once and replayed."""
    gk.clear_caches()
    x = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    q, k = _projections(1, 1, 4, 2, 64)
    for offset in range(20, 26):
        assert mx.allclose(gkk.rope(x, 64, offset=offset), mx.fast.rope(x, 64, traditional=False, base=1e4,
                           scale=1.0, offset=offset), atol=ATOL, rtol=RTOL).item()
        ours = gkk.rope_qk(q, k, 4, 2, 64, offset=offset)
        stock = stock_prologue(q, k, 4, 2, 64, offset=offset)
        assert all(mx.allclose(a, b, atol=ATOL, rtol=RTOL).item() for a, b in zip(ours, stock))
    kept = [key[0] for key in LAUNCHES]
    assert kept.count(rope_module.plan_rope) == kept.count(rope_qk_module.plan_rope_qk) == 1
    assert opaque_gpu.count("gk_rope") == opaque_gpu.count("gk_rope_qk") == 1  # traced once, replayed


# ----------------------------------------------------------------------------- whole models


def _generate(model: nn.Module, tokens: int = 16) -> list[int]:
    prompt = mx.array([3, 17, 42, 5, 99])
    steps = generate_step(prompt, model, max_tokens=tokens)
    return [int(token) for (token, _), _ in zip(steps, range(tokens))]


def _loss(model: nn.Module) -> mx.array:
    return nn.losses.cross_entropy(model(TOKENS[:, :-1]), TOKENS[:, 1:], reduction="mean")


@pytest.mark.parametrize("arch", MODELS)
def test_fused_model_equals_stock_logits_generation_and_gradients(arch: str) -> None:
    model = tiny_model(arch)
    stock_logits, stock_tokens = model(TOKENS), _generate(model)
    stock_gradients = nn.value_and_grad(model, _loss)(model)
    report = patch(model)
    assert {p.kernel for p in report} >= {"rope_qk", "add_rms_norm"}
    assert isinstance(model.model, KernelDecoderStack)
    assert all(isinstance(layer, KernelResidualBlock) and layer.chains for layer in model.layers)
    assert all(isinstance(layer.self_attn, KernelAttention) for layer in model.layers)
    assert mx.allclose(model(TOKENS), stock_logits, atol=1e-5, rtol=1e-5).item()
    assert _generate(model) == stock_tokens
    if arch != "mixtral" or STOCK_EXPERTS_DIFFERENTIATE:
        # Gemma 2's and 3's tanh GELU kernel rounds apart from stock's formula: the loss by about 1.4e-6
        assert_same_gradients(stock_gradients, nn.value_and_grad(model, _loss)(model),
                              loss_atol=1e-5 if arch in GEMMAS else 1e-6, atol=ATOL, rtol=RTOL)
    unpatch(model)
    report = check_model(model, TOKENS, dtypes=[mx.float32])  # eager and compiled (gk.wrap)
    assert report.ok, str(report)
    assert gk.check("rope_qk").ok and gk.check("rope_qk_norm").ok


@pytest.mark.parametrize("arch", MODELS)
def test_kv_cache_decode_equals_stock(arch: str) -> None:
    model = tiny_model(arch)
    stock_cache = make_prompt_cache(model)
    stock = [model(TOKENS, cache=stock_cache)]
    stock += [model(TOKENS[:, i:i + 1], cache=stock_cache) for i in range(4)]
    patch(model)
    cache = make_prompt_cache(model)
    fused = [model(TOKENS, cache=cache)] + [model(TOKENS[:, i:i + 1], cache=cache) for i in range(4)]
    for a, b in zip(fused, stock):
        assert mx.allclose(a, b, atol=ATOL, rtol=RTOL).item()
    for a, b in zip(cache, stock_cache):  # equal on the CPU; on CUDA Mixtral's router weights round apart
        assert a.offset == b.offset and mx.allclose(a.keys, b.keys, atol=ATOL, rtol=RTOL).item()


@pytest.mark.parametrize("arch", MODELS)
def test_the_trace_shows_the_fused_kernels_in_their_layers(arch: str) -> None:
    model = tiny_model(arch)
    patch(model)
    graph = gk.trace(model, TOKENS)
    scopes = sorted((graph.node(k)["scope"], graph.node(k)["kernel"]) for k in graph.kernels()
                    if graph.node(k)["kernel"] not in ("gk_swiglu", "gk_moe_route") or arch in GEMMAS)
    routers = sorted(graph.node(k)["scope"] for k in graph.kernels()
                     if graph.node(k)["kernel"] == "gk_moe_route")
    assert routers == ([f"model.layers.{i}.block_sparse_moe" for i in range(2)] if arch == "mixtral" else [])
    if arch in GEMMAS:  # post-norms on the attention's and the feed-forward's outputs, plain
        layers = [[(f"model.layers.{i}.input_layernorm", "gk_add_rms_norm" if i else "gk_rms_norm"),
                   (f"model.layers.{i}.mlp", "gk_gelu"),
                   (f"model.layers.{i}.post_attention_layernorm", "gk_rms_norm"),
                   (f"model.layers.{i}.post_feedforward_layernorm", "gk_rms_norm"),
                   (f"model.layers.{i}.pre_feedforward_layernorm", "gk_add_rms_norm"),
                   (f"model.layers.{i}.self_attn", "gk_rope_qk")] for i in range(2)]
        assert scopes == [*layers[0], *layers[1], ("model.norm", "gk_add_rms_norm")]
        return
    assert scopes == [
        ("model.layers.0.input_layernorm", "gk_rms_norm"),
        ("model.layers.0.post_attention_layernorm", "gk_add_rms_norm"),
        ("model.layers.0.self_attn", "gk_rope_qk"),
        ("model.layers.1.input_layernorm", "gk_add_rms_norm"),  # layer 0's last add, fused
        ("model.layers.1.post_attention_layernorm", "gk_add_rms_norm"),
        ("model.layers.1.self_attn", "gk_rope_qk"),
        ("model.norm", "gk_add_rms_norm"),  # layer 1's last add, fused
    ]
    ops = {graph.node(n)["op"] for n in graph.nodes("op")}
    assert not ops & {"Add", "Cos", "Sin", "Rsqrt", "Square"}  # no add, RoPE or norm left outside kernels


def test_launches_per_decoded_token_stock_against_fused() -> None:
    """Per layer: Llama saves 3 launches (two RoPEs -> one; two adds and two norms -> two
    add_rms_norm), Qwen 3 saves 5 (its q_norm and k_norm too), Mixtral 9 (its router's negation,
    argpartition, gather and softmax -> one moe_route; the experts' three row aranges)."""
    saved_per_layer = {"llama": 3, "qwen3": 5, "mixtral": 9}
    for arch, saved in saved_per_layer.items():
        model = tiny_model(arch)
        stock = decode_launches(model)
        patch(model)
        fused = decode_launches(model)
        layers = len(model.layers)
        assert stock.total - fused.total == saved * layers, (arch, str(stock), str(fused))
        assert fused.kinds["gk_rope_qk"] == layers and fused.kinds["gk_add_rms_norm"] == 2 * layers
        assert fused.kinds["gk_rms_norm"] == 1 and "Add" not in fused.kinds
        assert stock.kinds["mx_fast_rope"] == 2 * layers and stock.kinds["Add"] == 2 * layers
        if arch == "mixtral":
            assert fused.kinds["gk_moe_route"] == layers and stock.kinds["ArgPartition"] == layers
            assert not set(fused.kinds) & {"ArgPartition", "Arange", "Softmax", "Negative"}


def test_unpatch_restores_every_module_and_selection_picks_the_fusions() -> None:
    model = tiny_model("qwen3")
    before = {path: module for path, module in model.named_modules()}
    stock = model(TOKENS)
    assert "rope_qk" in kernel_names()
    report = patch(model, kernels=["rope_qk"])
    assert [p.path for p in report] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert set(patched_layers(model).values()) == {"rope_qk", "rope"}  # the attention and its RoPE
    assert mx.allclose(model(TOKENS), stock, atol=1e-5).item()
    report = patch(model, kernels=["add_rms_norm"])
    assert [p.path for p in report] == ["model", "model.layers.0", "model.layers.1"]
    assert mx.allclose(model(TOKENS), stock, atol=1e-5).item()
    unpatch(model)
    after = {path: module for path, module in model.named_modules()}
    assert after.keys() == before.keys() and all(after[p] is before[p] for p in before)
    assert mx.array_equal(model(TOKENS), stock).item()


def test_a_stack_with_a_layer_that_does_not_chain_adds_before_it() -> None:
    model = tiny_model("llama")
    stock = model(TOKENS)
    patch(model)
    model.model.layers[1] = model.model.layers[1].original  # a stock block in the middle of the loop
    assert mx.allclose(model(TOKENS), stock, atol=1e-5).item()
    cache = make_prompt_cache(model)
    model(TOKENS, cache=cache)
    assert model(TOKENS[:, :1], cache=cache).shape == (2, 1, 128)


def test_updated_weights_are_seen_through_every_fusion() -> None:
    model = tiny_model("qwen3")
    patch(model)
    model.update({"model": {"norm": {"weight": mx.full((64,), 2.0)},
                            "layers": [{"input_layernorm": {"weight": mx.full((64,), 0.5)},
                                        "self_attn": {"q_norm": {"weight": mx.full((16,), 3.0)}}}, {}]}})
    fused = model(TOKENS)
    unpatch(model)
    assert model.model.norm.weight.tolist() == [2.0] * 64  # carried back to the stock layers
    assert mx.allclose(fused, model(TOKENS), atol=1e-5).item()


def test_updates_made_after_a_second_patch_survive_unpatch() -> None:
    """The RMSNorm patched first is left in the stock block when the fused block takes its place;
    its array is the old one, and must not overwrite the update on the way back."""
    model = tiny_model("llama")
    patch(model, kernels=["rms_norm"])
    patch(model)
    new = mx.full((64,), 0.25)
    model.update({"model": {"layers": [{"input_layernorm": {"weight": new}}, {}]}})
    patched = model(TOKENS)
    unpatch(model)
    assert model.model.layers[0].input_layernorm.weight is new
    assert mx.allclose(model(TOKENS), patched, atol=1e-5).item()


@pytest.mark.parametrize("break_it, where, needle", [
    (lambda m: setattr(m.layers[0].self_attn.q_norm, "weight", mx.ones((8,))),
     "model.layers.0.self_attn.q_norm", "weight has shape (8,); expected (16,)"),
    (lambda m: setattr(m.layers[1].self_attn, "n_heads", 3),
     "model.layers.1.self_attn", "q_proj gives 64 features, not a multiple of n_heads=3"),
    (lambda m: setattr(m.layers[1].self_attn.k_norm, "eps", 1e-3),
     "model.layers.1.self_attn", "eps mismatch"),
    (lambda m: setattr(m.layers[0].self_attn.rope, "dims", 32),
     "model.layers.0.self_attn.rope", "RoPE dims 32 exceed the head dimension 16"),
])
def test_an_attention_the_kernel_cannot_take_is_refused_naming_the_layer(
        break_it: Callable[[Any], None], where: str, needle: str) -> None:
    model = tiny_model("qwen3")
    break_it(model)
    before = {id(m) for _, m in model.named_modules()}
    with pytest.raises(gk.KernelError) as info:
        patch(model)
    assert info.value.operation == PATCH and info.value.description.startswith(where + ":")
    assert needle in info.value.description
    assert {id(m) for _, m in model.named_modules()} == before and patched_layers(model) == {}


@needs("dynamic_ntk")
def test_dynamic_ntk_attention_runs_stock_past_its_max_positions() -> None:
    config = {**TINY_CONFIGS["llama"], "max_position_embeddings": 12, "rope_scaling": {"type": "dynamic",
                                                                                         "factor": 2.0}}
    model = random_model(config)
    stock_cache = make_prompt_cache(model)
    stock = [model(TOKENS, cache=stock_cache)] + [model(TOKENS[:, :1], cache=stock_cache) for _ in range(6)]
    patch(model)
    assert all(isinstance(layer.self_attn, KernelAttention) for layer in model.layers)
    assert all(isinstance(layer.self_attn.rope, KernelDynamicRoPE) for layer in model.layers)
    cache = make_prompt_cache(model)
    fused = [model(TOKENS, cache=cache)] + [model(TOKENS[:, :1], cache=cache) for _ in range(6)]
    for a, b in zip(fused, stock):  # 8 + 6 positions: past 12 the stock attention runs
        assert mx.allclose(a, b, atol=ATOL, rtol=RTOL).item()


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 0.8}


@pytest.mark.parametrize("scaling", [None, YARN], ids=["rope", "yarn"])
def test_deepseek_v3_with_only_its_rope_patched_equals_stock(scaling: dict[str, Any] | None) -> None:
    model = random_model({**DEEPSEEK_V3_CONFIG, "rope_scaling": scaling})
    stock = model(TOKENS)
    assert [p.kernel for p in patch(model, kernels=["rope"])] == ["rope", "rope"]
    assert mx.array_equal(model(TOKENS), stock).item()


def test_a_fused_norm_that_fails_in_a_trace_is_the_failed_node() -> None:
    """A fused norm returns a pair: a trace stands zeros in for both, so the failure stays on the
    norm's own node and everything after it is marked, as for a single-output layer."""
    model = tiny_model("llama")
    patch(model)
    norm = model.layers[1].post_attention_layernorm
    norm.weight = norm.weight[:-1]  # one feature short of the activations: refused
    graph = gk.trace(model, TOKENS[:1])
    [failure] = graph.failures()
    assert failure.scope == "model.layers.1.post_attention_layernorm"
    assert failure.status == gk.Status.MODULE_ERROR
    assert "has shape" in failure.message and graph.affected_outputs() == ["output_0"]


@pytest.mark.parametrize("arch", MODELS)
def test_unpatch_after_quantizing_keeps_the_quantized_layers(arch: str) -> None:
    """nn.quantize on a patched model puts QuantizedLinear layers inside the kernel layers; unpatch
    carries them back into the stock layers, so the model stays the quantized one."""
    model = tiny_model(arch)
    patch(model)
    # groups of 32, two a row: MLX 0.32.4's CUDA quantized_matmul of rows of one group gives
    # garbage on Hopper, differently from call to call
    nn.quantize(model, group_size=32, bits=4)
    quantized = model(TOKENS)
    patched_paths = {p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    unpatch(model)
    assert not patched_layers(model)
    after = {p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert after == patched_paths and len(after) > 7  # every projection, not only lm_head
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    assert mx.allclose(model(TOKENS), quantized, atol=ATOL, rtol=RTOL).item()  # float32


def test_a_layer_no_rule_matches_any_more_is_named_in_a_warning_and_the_report() -> None:
    """A forward changed by a new mlx-lm (here one argument more) stops its rule from matching:
    patch says so, once, naming every such layer, and lists them in the report."""
    model = tiny_model("llama")
    stock_attention = type(model.model.layers[0].self_attn)

    class Attention(stock_attention):  # type: ignore[misc, valid-type]
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None, position_ids: Any = None) -> Any:
            return super().__call__(x, mask, cache)

    for layer in model.model.layers:
        layer.self_attn.__class__ = Attention
    with pytest.warns(gk.PatchWarning) as caught:
        report = patch(model)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "Attention at model.layers.0.self_attn, model.layers.1.self_attn" in message
    reason = "neither its class nor its forward is one a rule knows"
    assert [(u.path, u.reason) for u in report.unmatched] == [
        (f"model.layers.{i}.self_attn", reason) for i in (0, 1)]
    assert report.unmatched[0].original.endswith("Attention")
    assert "model.layers.0.self_attn" not in patched_layers(model)
    assert "model.layers.0.self_attn.rope" in patched_layers(model)  # the rest is patched as before


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("quantized", [False, True])
def test_models_every_rule_knows_patch_without_a_warning(arch: str, quantized: bool) -> None:
    import warnings

    model = tiny_model(arch)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gk.PatchWarning)
        report = patch(model)
    assert report and report.unmatched == []


def test_a_rule_whose_condition_refuses_a_layer_gives_the_reason() -> None:
    model = tiny_model("qwen3")
    for layer in model.model.layers:
        layer.self_attn.q_norm = nn.RMSNorm(16, eps=1e-6)  # q_norm and k_norm eps differ: no fused prologue
        layer.self_attn.q_norm.__class__ = type("OffsetNorm", (nn.RMSNorm,), {
            "__call__": lambda self, x: mx.fast.rms_norm(x, 2.0 + self.weight, self.eps)})
    with pytest.warns(gk.PatchWarning, match="OffsetNorm"):
        report = patch(model, kernels=["rope_qk", "rms_norm"])
    reasons = {u.path: u.reason for u in report.unmatched}
    assert "neither its class nor its forward" in reasons["model.layers.0.self_attn.q_norm"]
    assert "whose condition on the layer's settings does not hold" in reasons["model.layers.0.self_attn"]
