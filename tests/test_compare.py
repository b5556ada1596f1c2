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
