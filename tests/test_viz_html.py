"""The HTML viewer as a document: self-contained, safe embedding, the data it carries, notebooks.
(What it does in a browser is tests/test_viz_browser.py.)"""

from __future__ import annotations

import html
import re

import mlx.core as mx
import pytest
import viz_graphs as vg

import graphkern as gk
from graphkern import KernelError
from graphkern.tracing.schema import STAT_KEYS
from graphkern.viz.html import repr_html, to_html, viewer_data
from graphkern.viz.overlay import json_number

_data = vg.page_data


def test_page_is_self_contained() -> None:
    page = to_html(vg.small(failed=True))
    assert page.startswith("<!DOCTYPE html>")
    # nothing is fetched: no external scripts, stylesheets, images or fonts
    assert not re.search(r'<script[^>]+src=', page)
    assert not re.search(r'<link[^>]+href=', page)
    assert not re.search(r'(src|href)=["\']?(https?:)?//', page)
    assert "@import" not in page and "url(http" not in page
    # the vendored d3-zoom is inlined
    assert "d3-zoom" in page and "zoomIdentity" in page


def test_embedded_data_cannot_break_out_of_its_script() -> None:
    b = vg.Builder("evil")
    x = b.input("x", (2,))
    c = b.const((), "</script><script>alert(1)</script><!--")
    b.output(b.op("Add", [x, c], scope="a</script>"))
    page = to_html(b.done())
    body = page.split('<script id="gk-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert "<" not in body
    data = _data(page)
    assert data["details"]["1"]["value"] == "</script><script>alert(1)</script><!--"
    assert data["groups"][0][0] == "a</script>"


def test_viewer_data_schema() -> None:
    g = vg.small(failed=True)
    d = viewer_data(g)
    ids = [n[0] for n in d["nodes"]]
    assert ids[0] == "x" and len(ids) == 9
    kinds = d["kinds"]
    row = d["nodes"][ids.index("scale_add")]
    assert kinds[row[1]] == "kernel" and row[5] == 8 and row[6] == ids.index("scale_add")
    down = d["nodes"][ids.index("sum")]
    assert down[5] == 10 and down[6] == ids.index("scale_add")
    assert [gr[0] for gr in d["groups"]] == ["mlp", "mlp.up", "mlp.act"]  # as they first appear
    assert d["groups"][row[4]][0] == "mlp"
    edge = next(e for e in d["edges"] if ids[e[0]] == "matmul")
    assert edge[3:5] == ["4,8", "float32"] and ids[edge[1]] == "scale_add"
    det = d["details"][str(ids.index("scale_add"))]
    assert det["grid"] == "(32, 1, 1)" and det["template"] == "T=float32"
    assert "thread_position_in_grid" in det["source"] and "undeclared" in det["message"]
    assert d["meta"]["status"] == 8 and d["statusNames"]["10"] == "UPSTREAM_FAILED"


def test_real_trace_html_and_title() -> None:
    g = vg.traced(failed=True)
    page = g.to_html()
    assert "<title>Model — graphkern</title>" in page
    assert "FAILED (INVALID_LAUNCH)" in page
    d = _data(page)
    assert {gr[0] for gr in d["groups"]} >= {"layers.0", "layers.1", "layers.0.proj", "head"}


def test_collapse_depth_option_reaches_the_page() -> None:
    assert _data(to_html(vg.transformer(1), collapse_depth=1))["options"]["collapse_depth"] == 1


def test_notebook_repr_is_a_sandboxed_iframe() -> None:
    g = vg.traced()
    out = g._repr_html_()
    assert out.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in out
    inner = html.unescape(re.search(r'srcdoc="(.*?)" style=', out, re.S).group(1))
    assert inner == to_html(g)
    assert repr_html(g, height=300).count("height:300px") == 1


def test_big_graph_page_size() -> None:
    page = to_html(vg.big())
    assert len(page) < 6_000_000  # compact rows keep 10,000 nodes at a few MB


def _row(data: dict, node: str) -> list:
    return next(r for r in data["nodes"] if r[0] == node)


def _details(data: dict, node: str) -> dict:
    ids = [r[0] for r in data["nodes"]]
    return data["details"].get(str(ids.index(node)), {})


def test_real_llama_details_speak_the_users_terms() -> None:
    g = vg.llama(2)
    data = viewer_data(g)
    kernel = next(n for n, d in g.nx.nodes(data=True) if d["kind"] == "kernel"  # an RMSNorm kernel
                  and d["scope"] == "model.layers.0.input_layernorm")
    det = _details(data, kernel)
    assert "EPS=1e-05" in det["template"] and "925353388" not in det["template"]
    assert det["input_names"] == ["x", "w"]
    assert det["backend"] == "reference" and det["grid"] and det["threadgroup"]
    sources = data["sources"][det["source_hash"]]
    assert set(sources) == {"metal", "cuda", "reference"}
    assert sources["reference"].startswith("def rms_norm_reference")
    # modules carry their class; parameters and MLX's shared constants are weights
    groups = {gr[0]: gr for gr in data["groups"]}
    assert groups["model.layers.1"][4] and groups["model.layers.1.self_attn"][4] == "Attention"
    weight = "model.layers.1.input_layernorm.weight"
    assert _row(data, weight)[7] == 1 and _details(data, weight)["weight"][0] == weight
    transposed = next(n for n, d in g.nx.nodes(data=True)
                      if d["op"] == "Transpose" and d["scope"] == "model.layers.0.self_attn.q_proj")
    assert _details(data, transposed)["weight"] == [
        "Transpose(model.layers.0.self_attn.q_proj.weight)", "model.layers.0.self_attn.q_proj.weightᵀ"]
    shared = [n for n, d in g.nx.nodes(data=True) if d["scope"] == "model.layers"]
    assert shared and all(_row(data, n)[7] == 1 for n in shared)
    assert all(_row(data, n)[7] == 0 for n in g.kernels())
    assert _row(data, "inputs")[7] == 0                      # an argument, not a weight


def test_a_failed_launch_keeps_its_configuration() -> None:
    data = viewer_data(vg.traced(failed=True))
    det = _details(data, "scale_add_1")
    assert det["threadgroup"] == "(0, 1, 1)" and det["grid"] == "(32, 1, 1)"
    assert det["backend"] == "reference" and det["template"] == "T=float32"
    assert "threadgroup" in det["message"]
    assert data["sources"][det["source_hash"]]["metal"].startswith("uint i")


def test_options_reach_the_page() -> None:
    page = to_html(vg.llama(2), collapse_depth=-1, show_weights=True)
    assert _data(page)["options"] == {"collapse_depth": -1, "show_weights": True}
    assert 'id="gk-weights"' in page and 'id="gk-search-count"' in page and 'id="gk-foot"' in page


# ----------------------------------------------------------------------------- values


def test_statistics_reach_the_page_as_rows_by_node() -> None:
    g = vg.nan_values()
    data = _data(g.to_html())
    ids = [r[0] for r in data["nodes"]]
    values = data["values"]
    assert values["colour"] == "nonfinite" and values["compare"] is None   # NaN: opens on it
    assert len(values["stats"]) == len(ids)
    for node in ("nan_sqrt", "output_0", ids[0]):
        assert values["stats"][ids.index(node)] == [g.node(node)["stats"][k] for k in STAT_KEYS]
    assert _details(data, "nan_sqrt")["module_outputs"] == ["model.layers.3.post_attention_layernorm"]
    assert _data(to_html(vg.nan_values(), colour_by="absmax"))["values"]["colour"] == "absmax"


def test_a_plain_trace_carries_no_values() -> None:
    assert viewer_data(vg.llama(2))["values"] is None
    assert viewer_data(vg.llama(2), colour_by="kind")["values"] is None


def test_colour_by_must_name_a_colouring_the_graph_has_values_for() -> None:
    with pytest.raises(KernelError, match=r"to_html.*colour_by must be one of 'kind', 'absmax'.*got 'abs'"):
        to_html(vg.nan_values(), colour_by="abs")
    with pytest.raises(KernelError, match=r"'absmax': no node carries statistics \(gk.inspect"):
        to_html(vg.llama(2), colour_by="absmax")
    with pytest.raises(KernelError, match=r"cannot colour by 'error_rel': no node carries a comparison"):
        to_html(vg.nan_values(), colour_by="error_rel")


def test_infinite_errors_travel_as_text_the_browser_reads_back() -> None:
    c = gk.compare(lambda x: mx.log(x), lambda x: mx.log(x * 0), mx.ones((3,)))
    assert c.first_divergence.max_abs == float("inf")
    data = _data(c.to_html())       # strict JSON: no bare Infinity
    rows = data["values"]["compare"]["rows"]
    first = rows[data["values"]["compare"]["first"]]
    assert first[9] == "Infinity" and first[12] is False
    assert data["values"]["colour"] == "nonfinite"   # b holds -Inf: the NaN/Inf colouring first
    assert json_number(float("nan")) == "NaN" and json_number(-float("inf")) == "-Infinity"


def test_a_compared_graph_alone_draws_its_errors_from_its_nodes() -> None:
    c = vg.swiglu_comparison()
    data = _data(c.b.to_html())
    ids = [r[0] for r in data["nodes"]]
    compared = data["values"]["compare"]
    assert data["values"]["colour"] == "error_abs"
    assert ids[compared["rows"][compared["first"]][0]] == "swiglu_off"
    assert {ids[r[0]] for r in compared["rows"]} == {n for n in ids if "comparison" in c.b.node(n)}
    row = next(r for r in compared["rows"] if ids[r[0]] == "swiglu_off")
    assert row[2] == c.first_divergence.a and row[10] == pytest.approx(0.01, rel=1e-3)


def test_kernels_checked_in_place_show_their_check() -> None:
    model = vg.llama_model(1)
    g = gk.Inspector(check_kernels=True)(model, mx.array([[1, 2, 3, 4]]))
    data = viewer_data(g)
    kernel = g.kernels()[0]
    check = _details(data, kernel)["reference_check"]
    assert check == {k: v for k, v in g.node(kernel)["reference_check"].items()}
    assert check["mismatched"] == 0


def test_a_comparison_in_a_notebook_is_a_sandboxed_viewer() -> None:
    c = gk.compare(lambda x: x * 2, lambda x: x * 2, mx.ones((3,)))
    out = c._repr_html_()
    assert out.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in out
    assert html.unescape(re.search(r'srcdoc="(.*?)" style=', out, re.S).group(1)) == c.to_html()
