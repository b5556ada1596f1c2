"""patch/unpatch on mlx.nn layers and on layers recognised by their forward (CPU, reference backend)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import graphkern as gk
from graphkern.models import Forward, KernelLayer, kernel_names, patch, patched_layers, unpatch
from graphkern.models.patching import PATCH

X = mx.random.normal((2, 3, 8), key=mx.random.key(0))


def swiglu_stock(gate, x):
    return nn.silu(gate) * x


class MLP(nn.Module):
    """A Llama MLP written by someone else: other names, same computation."""

    def __init__(self, dims=8, hidden=16, dtype=mx.float32):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)
        self.set_dtype(dtype)

    def __call__(self, h):
        """Docstrings, comments and parameter names do not matter."""
        return self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))  # the stock form


class AlmostMLP(MLP):
    def __call__(self, h):
        return self.down_proj(nn.silu(self.up_proj(h)) * self.gate_proj(h))  # gate and up swapped


def params(model):
    return dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("layer, kernel", [
    (nn.RMSNorm(8), "rms_norm"),
    (nn.LayerNorm(8), "layer_norm"),
    (nn.LayerNorm(8, bias=False), "layer_norm"),
    (nn.LayerNorm(8, affine=False), "layer_norm"),
    (nn.RoPE(8), "rope"),
    (nn.RoPE(4, traditional=True, base=500.0, scale=0.5), "rope"),
    (nn.GELU(), "gelu"),
    (nn.GELU(approx="precise"), "gelu"),
    (nn.Softmax(), "softmax"),
    (MLP(), "swiglu"),
])
def test_patched_layer_matches_stock_and_keeps_its_parameters(layer, kernel):
    model = nn.Sequential(layer)
    before = params(model)
    expected = model(X)
    report = patch(model)
    assert [(p.path, p.kernel) for p in report] == [("layers.0", kernel)]
    replacement = model.layers[0]
    assert isinstance(replacement, KernelLayer) and replacement.original is layer
    after = params(model)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert mx.allclose(model(X), expected, atol=1e-6).item()
    g = gk.trace(model, X)
    assert [g.node(k)["scope"] for k in g.kernels()] == ["layers.0"]
    assert unpatch(model) == ["layers.0"] and model.layers[0] is layer


def test_rope_offset_and_array_offset():
    rope = nn.RoPE(8)
    model = nn.Sequential(rope)
    patch(model)
    x = mx.random.normal((2, 2, 5, 8), key=mx.random.key(1))
    assert mx.allclose(model.layers[0](x, offset=7), rope(x, offset=7), atol=1e-5).item()
    offset = mx.array(3)
    assert mx.allclose(model.layers[0](x, offset=offset), rope(x, offset=offset), atol=1e-5).item()


def test_layers_patch_has_no_rule_for_are_left_alone():
    model = nn.Sequential(nn.GELU(approx="fast"), nn.ReLU(), nn.Linear(8, 8))
    assert patch(model) == [] and patched_layers(model) == {}


def test_kernel_selection():
    model = nn.Sequential(nn.RMSNorm(8), nn.LayerNorm(8), nn.GELU())
    assert [p.kernel for p in patch(model, kernels=["layer_norm"])] == ["layer_norm"]
    assert patched_layers(model) == {"layers.1": "layer_norm"}
    assert sorted(p.kernel for p in patch(model, kernels="all")) == ["gelu", "rms_norm"]
    assert patch(model) == []  # patching twice changes nothing
    assert set(kernel_names()) >= {"rms_norm", "layer_norm", "rope", "swiglu", "gelu", "softmax",
                                   "add_rms_norm"}
    with pytest.raises(gk.KernelError) as info:
        patch(model, kernels=["flash_attention"])
    assert info.value.operation == PATCH and "flash_attention" in info.value.description
    with pytest.raises(gk.KernelError):
        patch(model, kernels="rms_norm")  # a string other than "all" is a mistake, not a name


def _refused(model, *needles):
    before = {id(m) for _, m in model.named_modules()}
    with pytest.raises(gk.KernelError) as info:
        patch(model)
    assert info.value.operation == PATCH and info.value.status == gk.Status.INVALID_INPUT
    for needle in needles:
        assert needle in info.value.description
    assert {id(m) for _, m in model.named_modules()} == before  # nothing was replaced
    assert patched_layers(model) == {}


def test_refuses_parameters_the_kernels_cannot_take_before_changing_anything():
    bad_rank = nn.RMSNorm(8)
    bad_rank.weight = mx.ones((2, 8))
    _refused(nn.Sequential(nn.LayerNorm(8), bad_rank), "layers.1", "weight has shape (2, 8)")

    int_weight = nn.RMSNorm(8)
    int_weight.weight = mx.ones((8,), dtype=mx.int32)
    _refused(nn.Sequential(int_weight), "weight is int32", "float32, float16 and bfloat16")

    mixed_norm = nn.LayerNorm(8)
    mixed_norm.bias = mx.zeros((8,), dtype=mx.float16)
    _refused(nn.Sequential(mixed_norm), "dtype mismatch", "weight gives float32", "bias gives float16")

    short_bias = nn.LayerNorm(8)
    short_bias.bias = mx.zeros((4,))
    _refused(nn.Sequential(short_bias), "bias has shape (4,); expected (8,)")

    _refused(nn.Sequential(nn.RoPE(7)), "RoPE dims must be a positive even int, got 7")


def test_refuses_mismatched_mlp_projections():
    narrow_up = MLP()
    narrow_up.up_proj = nn.Linear(8, 12, bias=False)
    _refused(nn.Sequential(narrow_up), "output size mismatch", "gate_proj gives 16", "up_proj gives 12")

    half_up = MLP()
    half_up.up_proj.set_dtype(mx.float16)
    _refused(nn.Sequential(half_up), "dtype mismatch", "up_proj gives float16")

    wide_down = MLP()
    wide_down.down_proj = nn.Linear(32, 8, bias=False)
    _refused(nn.Sequential(wide_down), "hidden size mismatch", "down_proj (input) gives 32")


@pytest.mark.parametrize("norm", [nn.RMSNorm(8), nn.LayerNorm(8)], ids=["rms_norm", "layer_norm"])
def test_a_norm_whose_weight_dtype_differs_from_x_promotes_as_stock(norm):
    """A float32 norm weight under float16 activations: ``mx.fast`` promotes the output to float32
    and the patched norm gives the same (the stock forward), where the kernel takes one dtype."""
    model = nn.Sequential(norm)
    x = X.astype(mx.float16)
    expected = model(x)
    patch(model)
    out = model(x)
    assert out.dtype == expected.dtype == mx.float32
    assert mx.array_equal(out, expected).item()


def test_a_model_with_float32_norms_over_bfloat16_weights_runs_as_stock():
    from graphkern.models.tiny import tiny_model

    model = tiny_model("llama", mx.bfloat16)
    for _, module in model.named_modules():
        if isinstance(module, nn.RMSNorm):
            module.weight = module.weight.astype(mx.float32)
    model.eval()
    tokens = mx.array([[1, 5, 9, 2]])
    expected = model(tokens)
    patch(model)
    out = model(tokens)
    assert out.dtype == expected.dtype
    assert mx.allclose(out, expected, atol=1e-2, rtol=1e-2).item()


def test_low_precision_layers():
    for dtype in (mx.float16, mx.bfloat16):
        model = nn.Sequential(nn.RMSNorm(8), MLP(dtype=dtype))
        model.set_dtype(dtype)
        x = X.astype(dtype)
        expected = model(x)
        patch(model)
        out = model(x)
        assert out.dtype == dtype
        assert mx.allclose(out, expected, atol=2e-2, rtol=2e-2).item()


def test_unpatch_restores_the_same_objects_and_keeps_updates():
    norm, mlp = nn.RMSNorm(8), MLP()
    model = nn.Sequential(norm, mlp)
    weight = norm.weight
    patch(model)
    assert unpatch(model) == ["layers.0", "layers.1"]
    assert model.layers[0] is norm and model.layers[1] is mlp and norm.weight is weight
    assert unpatch(model) == []

    patch(model)
    new_weight = mx.full((8,), 3.0)
    model.update({"layers": [{"weight": new_weight}, {}]})  # e.g. an optimizer step while patched
    assert model.layers[0].weight is new_weight and norm.weight is weight
    unpatch(model)
    assert model.layers[0] is norm and norm.weight is new_weight


def test_frozen_parameters_stay_frozen():
    model = nn.Sequential(nn.LayerNorm(8), MLP())
    model.layers[0].freeze(keys=["bias"])
    trainable = sorted(k for k, _ in tree_flatten(model.trainable_parameters()))
    patch(model)
    assert sorted(k for k, _ in tree_flatten(model.trainable_parameters())) == trainable


def test_forward_patterns_match_by_computation_not_by_name():
    assert patch(nn.Sequential(MLP())) != []
    assert patch(nn.Sequential(AlmostMLP())) == []  # a different computation is never replaced
    stock_mlp = Forward("def __call__(self, x):\n"
                        "    return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))",
                        {"nn": "mlx.nn"})
    assert stock_mlp.matches(MLP) and not stock_mlp.matches(AlmostMLP)
    wrong_global = Forward(stock_mlp.source, {"nn": "mlx.core"})  # `nn` must be mlx.nn
    assert not wrong_global.matches(MLP)


def test_a_module_at_two_places_gets_one_replacement_and_unpatch_puts_back_the_one_original():
    norm = nn.RMSNorm(8)
    model = nn.Sequential(norm, MLP(), norm)
    assert [p.path for p in patch(model)] == ["layers.0", "layers.1", "layers.2"]
    assert isinstance(model.layers[0], KernelLayer) and model.layers[0] is model.layers[2]
    model.layers[0].weight = mx.full((8,), 2.0)  # through one place: the other sees it
    assert model.layers[2].weight.tolist() == [2.0] * 8
    assert unpatch(model) == ["layers.0", "layers.1", "layers.2"]
    assert model.layers[0] is norm and model.layers[2] is norm
    assert norm.weight.tolist() == [2.0] * 8


def test_tied_layers_stay_tied_when_patched():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    from graphkern.models.tiny import tiny_model

    stock, patched = tiny_model("llama"), tiny_model("llama")
    for model in (stock, patched):
        model.model.layers[1] = model.model.layers[0]  # one block at two places
        model.eval()
    patch(patched)
    block = patched.model.layers[0]
    assert patched.model.layers[1] is block and isinstance(block, KernelLayer)
    assert block.self_attn is patched.model.layers[1].self_attn
    weight = mx.random.normal((64,), key=mx.random.key(1))
    for model in (stock, patched):  # assigned through the first place: the second sees it
        model.model.layers[0].input_layernorm.weight = weight
        model.model.layers[0].mlp.down_proj.weight = model.model.layers[0].mlp.down_proj.weight * 2
    prompt, token = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]]), mx.array([[5]])
    caches = make_prompt_cache(stock), make_prompt_cache(patched)
    assert mx.allclose(patched(prompt, cache=caches[1]), stock(prompt, cache=caches[0]), atol=1e-5).item()
    assert mx.allclose(patched(token, cache=caches[1]), stock(token, cache=caches[0]), atol=1e-5).item()
    unpatch(patched)
    assert patched.model.layers[0] is patched.model.layers[1]
    assert not isinstance(patched.model.layers[0], KernelLayer)
    assert mx.allclose(patched(prompt), stock(prompt), atol=1e-5).item()


def test_a_norm_shared_by_two_blocks_gets_one_fused_replacement():
    pytest.importorskip("mlx_lm")
    from graphkern.models.tiny import tiny_model

    stock, patched = tiny_model("llama"), tiny_model("llama")
    for model in (stock, patched):
        layers = model.model.layers
        layers[1].post_attention_layernorm = layers[0].post_attention_layernorm
        model.eval()
    patch(patched)
    layers = patched.model.layers
    assert layers[0].post_attention_layernorm is layers[1].post_attention_layernorm
    weight = mx.random.normal((64,), key=mx.random.key(2))
    for model in (stock, patched):
        model.model.layers[1].post_attention_layernorm.weight = weight
    prompt = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])
    assert mx.allclose(patched(prompt), stock(prompt), atol=1e-5).item()


def _attribute_story(layer, new_bias, new_weight, newer_weight, projection):
    """What reading, setting and deleting item names as attributes does to ``layer``: after each
    step, each name's value (an object's identity), whether it is an item, and what raised."""
    steps = [
        lambda: None,
        lambda: setattr(layer, "bias", None),
        lambda: delattr(layer, "bias"),
        lambda: delattr(layer, "bias"),
        lambda: setattr(layer, "bias", new_bias),
        lambda: setattr(layer, "weight", new_weight),
        lambda: layer.update({"weight": newer_weight}),
        lambda: setattr(layer, "down_proj", projection),
        lambda: setattr(layer, "eps", 0.5),
    ]
    story = []
    for step in steps:
        try:
            step()
            raised = None
        except Exception as exc:
            raised = type(exc).__name__
        seen = []
        for name in ("weight", "bias", "down_proj", "up_proj", "eps"):
            value = getattr(layer, name, "absent")
            seen.append((name, value if value is None or isinstance(value, (str, float)) else id(value),
                         name in layer, hasattr(layer, name)))
        story.append((raised, seen))
    return story


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(8), lambda: nn.LayerNorm(8, bias=False),
                                  lambda: nn.LayerNorm(8, affine=False), MLP, nn.GELU, lambda: nn.RMSNorm(8)])
def test_item_names_read_and_written_as_attributes_behave_as_on_the_stock_layer(make):
    """A patched layer answers the item names stock forwards read as attributes (``self.weight``,
    ``self.down_proj``) from its items first: reads, writes and deletions of them (arrays,
    modules, plain values) end as on the stock layer, and the stock route computes with what
    is there now."""
    stock = make()
    model = nn.Sequential(make())
    patch(model, route="stock")
    patched = model.layers[0]
    assert isinstance(patched, KernelLayer)
    patched.update(stock.parameters())  # the same arrays as the stock layer
    patched.update_modules({k: v for k, v in stock.items() if isinstance(v, nn.Module)})
    new = (mx.full((8,), 2.0), mx.full((8,), 3.0), mx.full((8,), 4.0), nn.Linear(16, 8, bias=False))
    assert _attribute_story(patched, *new) == _attribute_story(stock, *new)
    x = mx.random.normal((2, 3, 8), key=mx.random.key(1))
    assert mx.array_equal(patched(x), stock(x)).item()
