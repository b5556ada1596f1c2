"""Real models nobody here wrote: tiny random-weight mlx-lm models of nine architectures, wrapped and
patched. Logits match the stock model, compiled equals eager, and every layer has its kernel nodes
in the right scope."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from graphkern.models import MODEL_TOLERANCES, check_model, patch, patched_layers, unpatch, wrap
from graphkern.models.model_checks import model_dtype
from graphkern.models.tiny import TINY_CONFIGS, tiny_model

TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64], [8, 8, 120, 33, 2, 0, 71, 9]])

RMS, ADD_RMS, ROPE, ROPE_QK, SWIGLU, GELU = ("gk_rms_norm", "gk_add_rms_norm", "gk_rope", "gk_rope_qk",
                                           "gk_swiglu", "gk_gelu")
LLAMA_LAYER = {"input_layernorm": RMS, "post_attention_layernorm": ADD_RMS, "self_attn": ROPE_QK,
               "mlp": SWIGLU}
#: The kernel nodes each layer must have, by scope below ``model.layers.<i>``. Where the decoder loop
#: is fused (``STACKS``), every layer after the first takes the residual add in its input norm.
EXPECTED_PER_LAYER = {
    "llama": LLAMA_LAYER,
    "mistral": LLAMA_LAYER,
    "qwen2": LLAMA_LAYER,
    "phi3": LLAMA_LAYER,
    "qwen3": LLAMA_LAYER,  # q_norm and k_norm run inside rope_qk
    "gemma": {**LLAMA_LAYER, "mlp": GELU},
    "gemma2": {"input_layernorm": RMS, "post_attention_layernorm": RMS, "pre_feedforward_layernorm": ADD_RMS,
               "post_feedforward_layernorm": RMS, "self_attn": ROPE_QK, "mlp": GELU},
    "gemma3": {"input_layernorm": RMS, "post_attention_layernorm": RMS, "pre_feedforward_layernorm": ADD_RMS,
               "post_feedforward_layernorm": RMS, "self_attn": ROPE_QK, "mlp": GELU},  # q/k norms in rope_qk
    "mixtral": {"input_layernorm": RMS, "post_attention_layernorm": ADD_RMS, "self_attn": ROPE_QK,
                "block_sparse_moe": "gk_moe_route", "block_sparse_moe.switch_mlp.activation": SWIGLU},
}
#: Architectures whose decoder loop is fused: each residual add into the next RMSNorm.
STACKS = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "phi3", "gemma", "gemma2", "gemma3"}


def close(a, b, dtype=mx.float32):
    atol, rtol = MODEL_TOLERANCES[dtype]
    return mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=atol, rtol=rtol).item()


def test_every_architecture_is_covered():
    assert set(EXPECTED_PER_LAYER) == set(TINY_CONFIGS)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_wrap_and_patch(arch):
    model = tiny_model(arch)
    stock = model(TOKENS)
    assert stock.shape == (2, 8, 128)
    wrapped = wrap(model)
    assert mx.allclose(wrapped(TOKENS), stock, atol=1e-5).item()  # compiled stock == eager stock
    assert wrapped.graph.kernels() == []

    patch(model)
    eager = model(TOKENS)
    assert close(eager, stock)  # patched == stock
    compiled = wrapped(TOKENS)
    assert mx.allclose(compiled, eager, atol=1e-5).item()  # compiled == eager
    graph = wrapped.graph
    assert graph.ok

    found: dict[str, list[str]] = {}
    for node in graph.kernels():
        found.setdefault(graph.node(node)["scope"], []).append(graph.node(node)["kernel"])
    expected = {"model.norm": [ADD_RMS if arch in STACKS else RMS]}
    for layer in range(model.args.num_hidden_layers):
        for scope, kernel in EXPECTED_PER_LAYER[arch].items():
            if scope == "input_layernorm" and layer > 0 and arch in STACKS:
                kernel = ADD_RMS
            expected[f"model.layers.{layer}.{scope}"] = [kernel] * (2 if kernel == ROPE else 1)
    assert found == expected  # every layer, the right kernel, the right scope, nothing else

    unpatch(model)
    assert patched_layers(model) == {}
    assert mx.array_equal(model(TOKENS), stock).item()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_low_precision_logits_within_tolerance(arch):
    model = tiny_model(arch)
    report = check_model(model, TOKENS, dtypes=[mx.float16, mx.bfloat16])
    assert report.ok, str(report)
    assert [(c.dtype, c.layout) for c in report.cases] == [
        ("float16", "eager"), ("float16", "compiled"), ("bfloat16", "eager"), ("bfloat16", "compiled")]
    assert model.model.norm.weight.dtype == mx.float32 and patched_layers(model) == {}  # left as it was


def test_check_model_reports_a_failing_run_and_restores_the_model():
    model = tiny_model("mixtral")
    patch(model, kernels=["rope"])
    weight = model.model.norm.weight
    report = check_model(model, TOKENS, dtypes=[mx.float32, mx.float16])
    float32, float16 = report.cases[:2], report.cases[2:]
    assert all(c.passed for c in float32)
    # MLX's CPU GatherMM (Mixtral's experts) has no float16: the stock model cannot run; said so
    assert not any(c.passed for c in float16) and "GatherMM" in float16[0].error
    assert model.model.norm.weight is weight
    assert set(patched_layers(model).values()) == {"rope"}  # patched before, patched after


def test_check_model_runs_the_dtype_of_the_weights_and_says_which(capsys):
    model = tiny_model("llama", mx.bfloat16)
    report = check_model(model, TOKENS, progress=True)  # not a terminal: a line a run
    assert report.ok and {c.dtype for c in report.cases} == {"bfloat16"}
    err = capsys.readouterr().err
    assert "check_model: bfloat16: stock model" in err
    assert "check_model: bfloat16: patched model, compiled" in err
    quantized = tiny_model("llama", mx.float16)
    nn.quantize(quantized, group_size=32, bits=4)  # uint32 weights, float16 scales
    assert model_dtype(quantized) == mx.float16 and model_dtype(tiny_model("llama")) == mx.float32


def test_quantized_model_patches_and_matches():
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    stock = model(TOKENS)
    assert "model.layers.0.mlp" in {p.path for p in patch(model)}  # QuantizedLinear projections
    assert close(model(TOKENS), stock) and close(wrap(model)(TOKENS), stock)
