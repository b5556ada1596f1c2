"""Graph diff: node matching that survives renumbering, added/removed/changed nodes and kernels,
failure cascades summarised, text and HTML."""

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
    # each input_layernorm lost its six ops and its eps constant, and kept its weight
    removed_ops = {before.nx.nodes[n]["op"] for n in d.removed}
    assert removed_ops == {"Square", "Mean", "Add", "Rsqrt", "Multiply", ""}
    assert all(before.nx.nodes[n]["scope"].endswith("input_layernorm") for n in d.removed)
    assert len(d.removed) == 2 * 7
    # only the consumers of the norm changed: q/k/v projections now read the kernel
    changed = {c.after for c in d.changed}
    assert changed == {"matmul", "matmul_1", "matmul_2", "matmul_9", "matmul_10", "matmul_11"}
    change = next(c for c in d.changed if c.after == "matmul")
    assert change.changes[0][0] == "inputs" and "rms_norm:" in change.changes[0][2]
    # renumbered ids were matched: mlp's multiply_N differ by id but are not reported
    text = str(d)
    assert "kernels: +2 added, -0 removed, ~0 changed" in text
    assert "[layers.0.input_layernorm]" in text and "+ kernel rms_norm" in text
    assert "multiply_9" not in text


def test_real_traces_before_and_after_patch() -> None:
    d = diff(vg.traced(kernel=False), vg.traced())
    assert d.kernels_added == ["scale_add", "scale_add_1"]
    assert sorted(d.removed) == ["add", "add_2", "multiply", "multiply_1"]
    assert {c.after for c in d.changed} == {"tanh", "tanh_1"}


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
    assert [ids[i] for i in data["diff"]["added"]] == ["rms_norm"]
    assert len(data["diff"]["removed"]) == 7
    assert {ids[int(i)] for i in data["diff"]["changed"]} == {"matmul", "matmul_1", "matmul_2"}
    assert "<title>diff decoder_forward -&gt; decoder_forward</title>" in page
    assert d._repr_html_().startswith("<iframe srcdoc=")


def test_diff_before_and_after_patch_of_a_tiny_llama() -> None:
    """The use case: trace, ``patch`` layers with kernels, trace again, diff."""
    import pytest

    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    import graphkern as gk
    from graphkern.models.patching import patch
    from graphkern.models.tiny import tiny_model

    model = tiny_model("llama")
    tokens = mx.array([[1, 2, 3, 4]])
    before = gk.trace(model, tokens)
    patched = patch(model)
    after = gk.trace(model, tokens)
    d = diff(before, after)
    assert d and len(d.kernels_added) >= len(patched) > 0
    assert not d.kernels_removed
    added_scopes = {after.nx.nodes[n]["scope"] for n in d.kernels_added}
    assert {p.path for p in patched} <= added_scopes | {s.rsplit(".", 1)[0] for s in added_scopes}
    text = str(d)
    assert f"kernels: +{len(d.kernels_added)} added" in text
