"""Graph diff: nodes paired by scope, op and position that survive renumbering, replaced layers
paired with their kernels, added/removed/changed nodes and kernels, failure cascades summarised,
text and HTML; stock against patched real llamas."""

from __future__ import annotations

import json
import re

import viz_graphs as vg

from graphkern.viz.graph_diff import diff


def test_identical_traces_have_no_differences() -> None:
    d = diff(vg.transformer(2), vg.transformer(2))
    assert not d and d.added == d.removed == d.changed == []
    assert "no differences" in str(d)


def test_patch_norm_into_kernel() -> None:
    before, after = vg.transformer(2, kernel_norm=False), vg.transformer(2)
    d = diff(before, after)
    assert d
    assert d.kernels_added == ["rms_norm", "rms_norm_1"] and d.kernels_removed == []
    # each norm's last op is replaced by the kernel (it fed the same q/k/v projections)...
    assert {(c.before, c.after) for c in d.replaced} == {("multiply_1", "rms_norm"),
                                                         ("multiply_8", "rms_norm_1")}
    assert d.added == []
    # ... and the rest of each input_layernorm is gone, its weight kept
    removed_ops = {before.nx.nodes[n]["op"] for n in d.removed}
    assert removed_ops == {"Square", "Mean", "Add", "Rsqrt", "Multiply", ""}
    assert all(before.nx.nodes[n]["scope"].endswith("input_layernorm") for n in d.removed)
    assert len(d.removed) == 2 * 6
    # only the kernels themselves changed: the projections read the node paired with their input
    assert {c.after for c in d.changed} == {"rms_norm", "rms_norm_1"}
    text = str(d)
    assert "kernels: +2 added, -0 removed, ~0 changed" in text
    assert "[layers.0.input_layernorm]" in text
    assert ("~ op multiply_1 (Multiply) -> float32[1,16,64] replaced by kernel rms_norm "
            "-> float32[1,16,64]") in text
    assert "multiply_9" not in text   # renumbered ids were matched, not reported


def test_real_traces_before_and_after_patch() -> None:
    d = diff(vg.traced(kernel=False), vg.traced())
    assert d.kernels_added == ["scale_add", "scale_add_1"]
    assert [(c.before, c.after) for c in d.replaced] == [("add", "scale_add"), ("add_2", "scale_add_1")]
    assert sorted(d.removed) == ["multiply", "multiply_1"] and d.added == []
    assert {c.after for c in d.changed} == {"scale_add", "scale_add_1"}


def test_stock_and_patched_llama_pair_each_layer_with_its_kernel() -> None:
    """The use case on a real model: every kernel patch put in pairs with the op of the layer
    it replaced, in the same module; nothing lands at the top level or in another layer."""
    stock, patched = vg.llama(4, patched=False), vg.llama(4)
    d = diff(stock, patched)
    a, b = stock.nx, patched.nx
    kernels = patched.kernels()
    # rope_qk takes over ops of two modules (the attention's layout, its RoPE's rotation): it stays
    # in the attention, paired with the reshape of the queries it lays out (its queries come out
    # transposed, as the stock ones do) or added; its absent frequencies are a constant
    fused = {k for k in kernels if b.nodes[k]["kernel"] == "gk_rope_qk"}
    assert sorted(d.kernels_added) == sorted(kernels) and len(fused) == 4
    assert {n for n in d.added if b.nodes[n]["kind"] != "constant"} <= fused
    assert all(b.nodes[k]["scope"].endswith(".self_attn") for k in fused)
    assert set(kernels) - fused <= {c.after for c in d.replaced} <= set(kernels)
    for c in d.replaced:
        assert a.nodes[c.before]["scope"] == b.nodes[c.after]["scope"] == c.scope
        assert a.nodes[c.before]["kind"] == "op" and b.nodes[c.after]["kind"] == "kernel"
    for n, m in d.matched.items():   # pairs never cross modules
        assert a.nodes[n]["scope"] == b.nodes[m]["scope"]
    text = str(d)
    assert f"kernels: +{len(kernels)} added" in text and "[model.layers.3.mlp]" in text
    assert "replaced by kernel gk_swiglu_3 (gk_swiglu)" in text
    # the same model traced twice: nothing to report
    assert not diff(patched, vg.llama(4))


def test_kernel_changes_are_reported() -> None:
    a, b = vg.small(), vg.small()
    b.nx.nodes["scale_add"].update(source_hash="ffff00001111", grid=[64, 1, 1])
    d = diff(a, b)
    assert [c.after for c in d.kernels_changed] == ["scale_add"]
    fields = dict((f, (x, y)) for f, x, y in d.changed[0].changes)
    assert fields["source_hash"] == ("3f2a9c41d0be", "ffff00001111")
    assert fields["grid"] == ("(32, 1, 1)", "(64, 1, 1)")


def test_failure_cascade_summarised() -> None:
    d = diff(vg.small(), vg.small(failed=True))
    text = str(d)
    assert "status:  OK -> COMPILE_ERROR" in text
    assert "~ 5 nodes downstream: status OK -> UPSTREAM_FAILED (root cause scale_add)" in text
    assert re.search(r"~ kernel scale_add: status: OK -> COMPILE_ERROR", text)
    assert len(d.changed) == 6  # all of them are still in the data
    doc = d.to_dict()
    assert doc["status"] == {"before": "OK", "after": "COMPILE_ERROR"}
    json.dumps(doc)


def test_diff_html_marks_the_second_graph() -> None:
    d = diff(vg.transformer(1, kernel_norm=False), vg.transformer(1))
    page = d.to_html()
    data = json.loads(re.search(r'<script id="gk-data" type="application/json">(.*?)</script>',
                                page, re.S).group(1))
    ids = [n[0] for n in data["nodes"]]
    assert data["diff"]["added"] == []
    assert len(data["diff"]["removed"]) == 6
    assert {ids[int(i)] for i in data["diff"]["changed"]} == {"rms_norm"}
    assert "<title>diff decoder_forward -&gt; decoder_forward</title>" in page
    assert d._repr_html_().startswith("<iframe srcdoc=")
