"""gk.compare: where two models part ways, node by node; replaced layers matched with their kernels."""

from __future__ import annotations

import json

import mlx.core as mx
import planted_bugs as pb
import pytest
import viz_graphs as vg

import graphkern as gk
from graphkern.models.tiny import tiny_model


@pytest.fixture(scope="module")
def swiglu_off() -> gk.Comparison:
    return gk.compare(pb.llama(), pb.swiglu_off_llama(), pb.TOKENS)


def test_a_swiglu_one_percent_off_is_the_first_divergence(swiglu_off: gk.Comparison) -> None:
    c = swiglu_off
    first = c.first_divergence
    assert first is not None and not c.ok
    assert c.b.node(first.b)["kind"] == "kernel" and c.b.node(first.b)["kernel"] == "swiglu_off"
    assert first.scope == pb.SWIGLU_SCOPE and first.op == "Multiply -> swiglu_off"
    assert first.max_rel == pytest.approx(0.01, rel=1e-3)  # the planted 1%
    assert first.mismatched > 0 and first.shape == (2, 8, 128)
    # everything before it agrees: the library kernels replacing layers 0-2 match the stock ops
    before = c.rows[: c.rows.index(first)]
    assert len(before) > 200 and all(r.ok for r in before)
    # and the divergence reaches the logits
    assert next(r for r in c.rows if r.b == "output_0").ok is False


def test_replaced_layers_are_matched_with_the_kernels_that_replaced_them(swiglu_off: gk.Comparison) -> None:
    replaced = [r for r in swiglu_off.rows if r.replaced]
    # a row names the kernel behind it, also where it holds that kernel's output as a view
    kernels = {r.op.split(" -> ")[1].removeprefix("gk_") for r in replaced}
    assert {"rms_norm", "add_rms_norm", "swiglu", "swiglu_off"} <= kernels
    assert kernels == {swiglu_off.b.node(k)["kernel"].removeprefix("gk_") for k in swiglu_off.b.kernels()}
    norms = [r for r in replaced if r.scope.endswith("input_layernorm")]
    assert [r.scope for r in norms] == [f"model.layers.{i}.input_layernorm" for i in range(pb.LAYERS)]
    assert all(r.op.startswith("Multiply -> ") for r in norms)
    # a fused add + RMSNorm returns (the residual sum, the norm): the norm meets the stock norm
    fused = [r for r in replaced if r.op.endswith("add_rms_norm")]
    assert fused and all(r.b_output == 1 and r.op.startswith("Multiply -> ") for r in fused)
    # every kernel of the patched model has a row of its own output
    assert {r.b for r in replaced} & set(swiglu_off.b.kernels()) == set(swiglu_off.b.kernels())


def test_the_comparison_prints_draws_and_serialises(swiglu_off: gk.Comparison) -> None:
    text = str(swiglu_off)
    assert "first divergence: swiglu_off (Multiply -> swiglu_off) in model.layers.3.mlp" in text
    assert "DIVERGED" in text
    # the page: the patched graph in the viewer, coloured by error, the rows and the first one
    data = vg.page_data(swiglu_off.to_html())
    compared, ids = data["values"]["compare"], [n[0] for n in data["nodes"]]
    assert data["values"]["colour"] == "error_abs"
    assert data["meta"]["nodes"] == swiglu_off.b.nx.number_of_nodes()
    assert ids[compared["rows"][compared["first"]][0]] == "swiglu_off"
    assert [r[12] for r in compared["rows"]] == [r.ok for r in swiglu_off.rows]
    assert (compared["rtol"], compared["atol"]) == (swiglu_off.rtol, swiglu_off.atol)
    doc = json.loads(json.dumps(swiglu_off.to_dict(), allow_nan=False))
    assert doc["first_divergence"]["b"] == "swiglu_off" and doc["ok"] is False
    assert len(doc["rows"]) == len(swiglu_off.rows)
    # each matched node of b carries its error, for the pictures
    assert swiglu_off.b.node("swiglu_off")["comparison"]["ok"] is False
    swiglu_off.b.lint()


@pytest.mark.slow
def test_the_same_model_twice_agrees_exactly() -> None:
    c = gk.compare(pb.llama(), pb.llama(), pb.TOKENS)
    assert c.ok and c.first_divergence is None and not c.unmatched_a and not c.unmatched_b
    assert len(c.rows) > 900 and all(r.max_abs == 0.0 for r in c.rows)
    assert "no divergence" in str(c)


def test_float16_against_float32_compares_in_float32() -> None:
    c = gk.compare(tiny_model("llama"), tiny_model("llama", mx.float16), pb.TOKENS, rtol=3e-2, atol=3e-2)
    assert {(r.dtype_a, r.dtype_b) for r in c.rows if r.op == "Matmul"} == {("float32", "float16")}
    assert max(r.max_abs for r in c.rows) > 0
    strict = gk.compare(tiny_model("llama"), tiny_model("llama", mx.float16), pb.TOKENS)
    assert strict.first_divergence is not None  # float16 rounding, from the first op that rounds


def test_the_planted_nan_shows_as_divergence_and_root_cause() -> None:
    c = gk.compare(pb.llama(), pb.nan_llama(), pb.TOKENS)
    assert c.first_divergence.b == "nan_sqrt"
    assert c.first_divergence.max_abs == float("inf")
    assert c.b.failures()[0].node == "nan_sqrt" and c.a.ok


def test_backends_and_kernels_checked_in_place() -> None:
    model = tiny_model("qwen2")
    gk.patch(model)
    c = gk.compare(model, model, pb.TOKENS, backends=(None, "reference"), check_kernels=True)
    assert c.ok and c.b.nx.graph["backend"] == "reference"
    assert len(c.kernel_checks) == 2 * len(c.b.kernels()) and all(k.ok for k in c.kernel_checks)
    assert {k.side for k in c.kernel_checks} == {"a", "b"}


def test_keyword_arguments_reach_both_functions() -> None:
    c = gk.compare(lambda x, s: x * s, lambda x, s: x * s + 0, mx.ones((3,)), kwargs={"s": mx.array(2.0)})
    assert c.ok and any(r.op == "Multiply" for r in c.rows)


# ----------------------------------------------------------------------------- parameters first


def test_parameters_are_compared_by_name_before_any_node() -> None:
    model = pb.llama()
    c = gk.compare(model, model, pb.TOKENS)  # one model twice: every parameter is one array
    assert c.parameters and all(p.same_array and p.ok and p.max_abs == 0.0 for p in c.parameters)
    names = {p.name for p in c.parameters}
    assert "model.layers.3.mlp.down_proj.weight" in names and "model.embed_tokens.weight" in names
    assert (f"parameters: both read {len(names)} by name; {len(names)} are the same arrays in both, none are "
            "copies with equal values, none differ") in str(c)


def test_a_changed_weight_is_named_and_its_views_are_judged_by_it() -> None:
    changed = pb.llama()
    layer = changed.model.layers[pb.BAD_LAYER]
    layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 1.01
    c = gk.compare(pb.llama(), changed, pb.TOKENS)
    assert [p.name for p in c.parameters_differing] == [f"model.layers.{pb.BAD_LAYER}.mlp.down_proj.weight"]
    assert c.parameters_differing[0].max_rel == pytest.approx(0.01, rel=1e-3)
    assert not c.parameters_differing[0].same_array and not c.ok
    assert "1 differs: model.layers.3.mlp.down_proj.weight (max rel 0.01" in str(c)
    # the weight's transpose holds its values: judged by the parameter, never diffed itself
    views = [r for r in c.rows if r.note.startswith("as parameter ")]
    assert views and all(r.op in ("Transpose", "Broadcast", "Reshape", "ExpandDims") for r in views)
    bad = [r for r in views if r.ok is False]
    assert [r.note for r in bad] == [f"as parameter model.layers.{pb.BAD_LAYER}.mlp.down_proj.weight"]
    assert bad[0].scope == f"model.layers.{pb.BAD_LAYER}.mlp.down_proj" and c.first_divergence is bad[0]
    # the product reading it is where the values part ways
    product = next(r for r in c.rows if r.op == "Matmul" and r.scope == bad[0].scope)
    assert product.ok is False and product.note == ""
    assert all(r.ok for r in c.rows[: c.rows.index(bad[0])])


# ----------------------------------------------------------------------------- half precision


@pytest.fixture(scope="module")
def deep_stock() -> object:
    return pb.deep_llama()


@pytest.mark.slow
def test_a_patched_bfloat16_model_is_within_rounding_where_a_plain_tolerance_fails(deep_stock) -> None:
    patched = pb.deep_llama()
    gk.patch(patched)
    c = gk.compare(deep_stock, patched, pb.TOKENS)  # bfloat16 both: judged against rounding
    assert c.rounding == 2.0 and c.ok and c.first_divergence is None, str(c)
    assert "no divergence" in str(c) and "(a32, b32: each model run again in float32" in str(c)
    assert not c.marginal and "marginal" not in str(c)
    assert len(c.rows) > 1500 and all(r.ok for r in c.rows)
    judged = [r for r in c.rows if r.rounding is not None]
    assert len(judged) > 1000 and max(r.rounding for r in judged) > 0  # bfloat16 does round
    assert max(r.excess for r in judged) <= 1 / c.rounding + 1e-3  # |a - b| <= |a - a32| + |b - b32|
    # without the float32 runs, the rounding of layer 0 already reads as a divergence
    plain = gk.compare(deep_stock, patched, pb.TOKENS, rounding=False)
    assert plain.rounding is None and plain.first_divergence.scope.startswith("model.layers.0.")


@pytest.mark.slow
def test_a_one_percent_error_in_layer_20_of_32_in_bfloat16_is_found_there(deep_stock) -> None:
    weight = "self_attn.o_proj"
    c = gk.compare(deep_stock, pb.deep_llama_scaled(weight=weight), pb.TOKENS)
    layer = f"model.layers.{pb.DEEP_BAD_LAYER}."
    assert [p.name for p in c.parameters_differing] == [f"{layer}{weight}.weight"]
    first = c.first_divergence
    assert first is not None and first.scope == f"{layer}{weight}", str(c)
    assert all(r.ok for r in c.rows[: c.rows.index(first)])  # layers 0-19 within rounding
    computed = next(r for r in c.rows if r.ok is False and not r.note)  # the first value computed
    assert computed.scope.startswith(layer) and computed.excess > 2, str(c)
    assert not c.ok and "elements beyond the rule" in str(c)
    assert not c.marginal  # the error reaches the logits, many times what rounding explains


@pytest.mark.slow
def test_a_small_error_at_a_fused_kernel_is_called_a_marginal_signal() -> None:
    """A weight 0.3% off feeding a fused kernel (norm + gate and up products + SwiGLU, as an
    evaluating block decodes): found at its layer, but under twice what rounding and tolerance
    allow, and the logits within the rule. The report says the signal is marginal and how to
    make it plain; in float32 the same error is far beyond the rule."""
    stock, changed = pb.deep_llama(), pb.deep_llama_scaled(weight="mlp.gate_proj", factor=1.003)
    gk.patch(changed)
    stock.eval()
    changed.eval()
    tokens = pb.TOKENS[:1]
    c = gk.compare(stock, changed, tokens)
    layer = f"model.layers.{pb.DEEP_BAD_LAYER}"
    first = c.first_divergence
    assert first is not None and first.scope == layer and first.op == "Multiply -> gk_norm_swiglu", str(c)
    assert 1 < first.excess <= 2 and c.marginal
    assert next(r for r in c.rows if r.a == "output_0").ok  # the logits are not flagged
    text = str(c)
    assert f"a marginal signal: the first divergence is {first.excess:.3g}x what the rule allows at " \
           f"{first.mismatched} of 2,048 elements" in text
    assert "and the outputs are within it" in text and "a.set_dtype(mx.float32)" in text
    assert c.to_dict()["marginal"] is True
    # as the report advises: both in float32, where rounding is far smaller
    for model in (stock, changed):
        model.set_dtype(mx.float32)
    c32 = gk.compare(stock, changed, tokens)
    assert c32.rounding is None and c32.first_divergence.scope.startswith(layer) and not c32.marginal
    assert next(r for r in c32.rows if r.a == "output_0").ok is False  # the logits too


def test_the_report_says_what_was_not_compared_in_words(swiglu_off: gk.Comparison) -> None:
    text = str(swiglu_off)
    assert (f"not compared: {len(swiglu_off.unmatched_a)} of a's nodes and {len(swiglu_off.unmatched_b)} of "
            "b's have no counterpart on the other side") in text
    assert "unmatched:" not in text and "nodes of a," not in text
    assert text.splitlines()[0].startswith("compare a = Model with b = Model (kernels as their pure-MLX "
                                           "references): ")


@pytest.mark.slow
def test_rounding_is_the_default_only_in_half_precision() -> None:
    c = gk.compare(pb.llama(), pb.llama(), pb.TOKENS)
    assert c.rounding is None and all(r.rounding is None for r in c.rows)
    half = gk.compare(pb.llama(mx.float16), pb.llama(mx.float16), pb.TOKENS)
    assert half.rounding == 2.0 and half.ok
    assert {r.dtype_a for r in half.rows if r.op == "Matmul"} == {"float16"}
    mixed = gk.compare(pb.llama(), pb.llama(mx.float16), pb.TOKENS)  # float32 against float16
    assert mixed.rounding is None and mixed.parameters_differing  # the weights were rounded


@pytest.mark.slow
def test_a_weight_read_in_float32_is_cast_a_block_at_a_time(monkeypatch) -> None:
    from graphkern.debugging import values

    model = tiny_model("qwen2", mx.bfloat16)  # tied embeddings: the output layer reads the embedding
    whole = gk.compare(model, model, pb.TOKENS)
    monkeypatch.setattr(values, "_CAST_BLOCK", 64)
    blocks = gk.compare(model, model, pb.TOKENS)
    assert whole.ok and blocks.ok
    for a, b in zip(whole.rows, blocks.rows):
        assert (a.a, a.rounding) == (b.a, b.rounding)
    logits = next(r for r in blocks.rows if r.a == "output_0")
    assert logits.rounding is not None and logits.rounding > 0


def test_a_half_precision_overflow_in_one_side_is_always_beyond() -> None:
    from graphkern.debugging.precision import beyond_rounding

    a32 = mx.array([1.0, 6e4])
    a = a32.astype(mx.float16)  # 6e4 fits float16
    b = mx.array([1.0, float("inf")], dtype=mx.float16)  # b overflowed: its own "rounding" is inf
    max_abs, _, beyond, rounding, excess = beyond_rounding(a, b, a32, a32, 1e-4, 1e-5).tolist()
    assert beyond == 1 and max_abs == float("inf") and excess == float("inf")
    assert rounding < 1e2  # the overflow is not counted as rounding


@pytest.mark.slow
def test_compare_reports_its_phases(capsys) -> None:
    gk.compare(pb.llama(mx.bfloat16), pb.llama(mx.bfloat16), pb.TOKENS, progress=True)
    err = capsys.readouterr().err  # not a terminal: one line a phase
    phases = ("tracing a", "tracing b", "parameters", "tracing a in float32", "values (bfloat16 and float32)")
    for phase in phases:
        assert f"compare: {phase}" in err
    gk.compare(pb.llama(), pb.llama(), pb.TOKENS, progress=False)
    assert capsys.readouterr().err == ""
