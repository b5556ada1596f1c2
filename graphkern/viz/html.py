"""A self-contained interactive HTML viewer for traced graphs.

One file, no network: the page inlines its CSS, its JavaScript (``static/viewer.js``), the few d3
modules it uses for pan and zoom (vendored from npm into ``static/`` by ``update-vendor.sh``) and
the graph as JSON. The layout runs in the browser, so opening or closing a module re-lays the
graph out: each open module is laid out on its own (layers by longest path, barycentric
ordering, x positions by isotonic regression) and drawn as a frame around its contents, so frames
nest and never overlap; edges leave and enter a frame through ports on its bottom and top edge.
"""

from __future__ import annotations

import html as _html
import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from graphkern.nodes import NodeKind
from graphkern.viz.common import (
    all_in_edges,
    as_nx,
    format_shape,
    graph_name,
    group_tree,
    node_status,
    node_text,
    ordered_nodes,
    pretty_numbers,
    scope_parts,
    status_names,
    template_text,
    weight_like,
)
from graphkern.viz.overlay import node_values, values_doc

__all__ = ["to_html", "repr_html", "srcdoc_iframe", "viewer_data"]

KINDS = [kind.value for kind in NodeKind]
_DETAIL_KEYS = ("message", "value", "arguments", "kernel", "backend", "grid", "threadgroup",
                "source_hash", "source", "generated_name", "reduce", "group_size", "rank", "peer",
                "on_rank")
#: node flags in the viewer's rows
WEIGHT = 1  # a weight or constant (or computed from them alone): drawn as its consumers' attribute


@cache
def _static(name: str) -> str:
    return resources.files("graphkern.viz").joinpath("static", name).read_text(encoding="utf-8")


@cache
def _vendor_js() -> str:
    manifest = json.loads(_static("vendor-manifest.json"))
    return "\n".join(_static(item["file"]) for item in manifest)


def viewer_data(graph: Any, *, diff: Mapping[str, Any] | None = None,
                collapse_depth: int | None = None, show_weights: bool = False,
                comparison: Mapping[str, Any] | None = None,
                colour_by: str | None = None) -> dict[str, Any]:
    """The JSON document the viewer reads: nodes in topological order as compact rows
    ``[id, kind, label, op, group, status, root, flags]`` (flag 1: a weight or constant, drawn as
    an attribute of its consumers), module groups ``[path, label, parent, depth, class]``,
    edges ``[source, target, array, shape, dtype, index]`` (a seventh item, 1, for an edge between
    two ranks of a merged job), per-node details (``weight``: how a weight-like node reads, in
    full and short; ``output_stats``, ``values_note``, ``reference_check``), kernel sources by
    source hash, and ``values`` (see ``graphkern.viz.overlay.values_doc``) when nodes carry
    statistics or a comparison.

    >>> data = viewer_data(graph)                          # doctest: +SKIP
    >>> data["nodes"][0][:2]                               # doctest: +SKIP
    ['x', 0]
    """
    g = as_nx(graph)
    order = ordered_nodes(g)
    index = {n: i for i, n in enumerate(order)}
    groups = group_tree(g.nodes[n].get("scope") for n in order)
    gindex = {path: i for i, (path, _, _, _) in enumerate(groups)}
    classes = g.graph.get("modules") or {}
    kinds = {k: i for i, k in enumerate(KINDS)}
    weights = weight_like(g, order)
    nodes: list[list[Any]] = []
    details: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(order):
        d = g.nodes[n]
        kind = str(d.get("kind") or "op")
        if kind not in kinds:
            kinds[kind] = len(kinds)
        parts = scope_parts(d.get("scope"))
        group = gindex[".".join(parts)] if parts else -1
        root = d.get("root_cause")
        nodes.append([str(n), kinds[kind], str(d.get("label") or n), str(d.get("op") or ""),
                      group, node_status(d), index.get(root, -1) if root is not None else -1,
                      WEIGHT if n in weights else 0])
        extra: dict[str, Any] = {k: node_text(d.get(k)) if k in ("grid", "threadgroup")
                                 else str(d.get(k)) for k in _DETAIL_KEYS
                                 if d.get(k) not in (None, "", [])}
        if d.get("template"):
            extra["template"] = template_text(d)
        if kind == "constant" and "value" in extra:
            extra["value"] = pretty_numbers(extra["value"])
        if d.get("input_names"):
            extra["input_names"] = [str(x) for x in d["input_names"]]
        if n in weights:
            extra["weight"] = [weights[n].full, weights[n].short]
        extra.update(node_values(d))
        if extra:
            details[str(i)] = extra
    edges: list[list[Any]] = []
    ins = all_in_edges(g)
    for n in order:
        for u, _, key, data in ins[n]:
            row = [index[u], index[n], str(key), format_shape(data.get("shape")),
                   str(data.get("dtype") or "?"), int(data.get("index") or 0)]
            if data.get("cross_rank") or data.get("inputs"):  # [6] 1: between two ranks
                row.append(1 if data.get("cross_rank") else 0)
            if data.get("inputs"):  # [7]: the kernel input names it is passed as
                row.append(", ".join(str(x) for x in data["inputs"]))
            edges.append(row)
    roots = [n for n in order if node_status(g.nodes[n]) not in (0, 10)]
    first = g.nodes[roots[0]] if roots else None
    return {
        "meta": {
            "name": graph_name(g),
            "backend": str(g.graph.get("backend") or ""),
            "mlx_version": str(g.graph.get("mlx_version") or ""),
            "nodes": len(order),
            "edges": len(edges),
            "status": node_status(first) if first else 0,
        },
        "statusNames": {str(k): v for k, v in status_names().items()},
        "kinds": list(kinds),
        "groups": [[path, label, parent, depth, str(classes.get(path) or "")]
                   for path, label, parent, depth in groups],
        "nodes": nodes,
        "edges": edges,
        "details": details,
        "sources": dict(g.graph.get("kernel_sources") or {}),
        "diff": dict(diff) if diff is not None else None,
        "values": values_doc(g, order, comparison, colour_by),
        "options": {"collapse_depth": collapse_depth, "show_weights": bool(show_weights)},
    }


def _script_json(doc: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>`` or ``<!--`` can close it)."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="graphkern">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<div id="gk-app">
  <div id="gk-top">
    <div id="gk-title">{name}<small>{subtitle}</small></div>
    <div id="gk-search-box">
      <input id="gk-search" type="search" placeholder="Search nodes, ops, kernels, modules  ( / )"
             autocomplete="off" spellcheck="false" aria-label="Search nodes">
      <div id="gk-results" role="listbox"></div>
    </div>
    <span id="gk-search-count" aria-live="polite"></span>
    <button class="gk-btn" id="gk-modules" title="Module tree (m)">Modules</button>
    <button class="gk-btn" id="gk-fit" title="Fit to view (f)">Fit</button>
    <select class="gk-btn" id="gk-depth" title="How far module groups are expanded"></select>
    <label class="gk-btn" id="gk-weights-label" title="Draw weights and constants as nodes (w)"><input
      type="checkbox" id="gk-weights"> weights</label>
    <select class="gk-btn" id="gk-colour" title="Colour nodes by"></select>
  </div>
  <div id="gk-banner" role="alert"></div>
  <div id="gk-diffbar"></div>
  <div id="gk-comparebar"></div>
  <div id="gk-main">
    <nav id="gk-tree" aria-label="modules"></nav>
    <div id="gk-canvas-wrap">
      <canvas id="gk-canvas" aria-label="graph"></canvas>
      <canvas id="gk-minimap" aria-label="minimap"></canvas>
      <div id="gk-tip"></div>
    </div>
    <aside id="gk-panel" aria-label="details"></aside>
  </div>
  <div id="gk-foot"><div id="gk-legend"></div><div id="gk-hint">scroll to zoom · drag to pan ·
    double-click a box to open it · click a frame's title to close it</div></div>
</div>
<script id="gk-data" type="application/json">{data}</script>
<script>{vendor}</script>
<script>{viewer}</script>
</body>
</html>
"""


def to_html(graph: Any, *, title: str | None = None, collapse_depth: int | None = None,
            show_weights: bool = False, colour_by: str | None = None,
            diff: Mapping[str, Any] | None = None, comparison: Mapping[str, Any] | None = None) -> str:
    """One self-contained HTML page that draws the graph and lets you explore it offline.

    Module scopes are nested frames laid out one inside another, each drawn top to bottom in
    data-flow order. A model opens with one box per repeated layer (``model.layers.0`` ...);
    double-click a box to open it in place, click a frame's title to close it;
    ``collapse_depth=1`` starts with everything below the top level closed, ``-1`` with
    everything open. Weights and constants are attributes of the node that uses them (the
    "weights" toggle, or ``show_weights=True``, draws them as nodes). Search (``/``), a details
    panel on click (inputs by producer or parameter path, shapes, kernel backend, grid,
    threadgroup, template, sources, status, root cause), failures red with their blast radius
    dashed red, pan and zoom, and a minimap. ``diff`` is used by ``GraphDiff.to_html``.

    A graph from ``gk.inspect`` or ``gk.compare`` can be coloured by a node statistic (the
    "colour" control; ``colour_by`` picks the one it opens with): ``"absmax"``, ``"nonfinite"``
    (NaN + Inf count, the node where they start apart), ``"error_abs"`` or ``"error_rel"`` (the
    comparison's error, beyond tolerance in the "bad" colours, within it in the "ok" ones, both
    over one range: an error within tolerance can be larger than one beyond it), or ``"kind"``. It opens
    coloured by NaN/Inf when a node holds any, else by the comparison's error, else by abs-max;
    a closed module takes the worst value inside it, and the legend shows the scale and its
    range (logarithmic where the values span decades). ``comparison`` is used by
    ``Comparison.to_html``. An unknown ``colour_by``, or one the graph has no values for,
    raises ``KernelError``.

    >>> page = to_html(graph)                             # doctest: +SKIP
    >>> open("trace.html", "w").write(page)               # doctest: +SKIP
    >>> to_html(gk.inspect(model, tokens), colour_by="absmax")   # doctest: +SKIP
    """
    g = as_nx(graph)
    data = viewer_data(graph, diff=diff, collapse_depth=collapse_depth, show_weights=show_weights,
                       comparison=comparison, colour_by=colour_by)
    name = graph_name(g)
    meta = data["meta"]
    subtitle = f"{meta['nodes']} nodes · {meta['edges']} edges"
    if meta["backend"]:
        subtitle += f" · backend {meta['backend']}"
    if meta["mlx_version"]:
        subtitle += f" · mlx {meta['mlx_version']}"
    if meta["status"]:
        subtitle += f" · FAILED ({status_names().get(meta['status'], meta['status'])})"
    return _PAGE.format(
        title=_html.escape(title or f"{name} — graphkern"),
        name=_html.escape(name),
        subtitle=_html.escape(subtitle),
        css=_static("viewer.css"),
        data=_script_json(data),
        vendor=_vendor_js(),
        viewer=_static("viewer.js"),
    )


def repr_html(graph: Any, *, height: int = 600) -> str:
    """The viewer for a notebook cell: the page in a sandboxed ``<iframe srcdoc>``, so its
    scripts and styles cannot touch the notebook's.

    >>> graph._repr_html_()                               # doctest: +SKIP
    '<iframe ...'
    """
    return srcdoc_iframe(to_html(graph), height=height)


def srcdoc_iframe(page: str, *, height: int = 600) -> str:
    """A whole viewer page inside a sandboxed ``<iframe srcdoc>`` (for notebooks)."""
    return (f'<iframe srcdoc="{_html.escape(page, quote=True)}" '
            f'style="width:100%;height:{int(height)}px;border:1px solid #e2e8f0;border-radius:6px" '
            'sandbox="allow-scripts" loading="lazy"></iframe>')
