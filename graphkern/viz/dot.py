"""Graphviz DOT for traced graphs, and rendering it to SVG or PNG.

Module scopes become nested clusters, kernel nodes are drawn apart (violet, 3-D box), failed nodes
are red and everything downstream of a failure is marked (dashed red), and edges carry the shape
and dtype of the array they stand for. The text is built directly (no Graphviz needed for
``to_dot``); ``render`` pipes it through the Python ``graphviz`` package and the ``dot`` program.
"""

from __future__ import annotations

import os
from typing import Any

from graphkern.viz._common import (
    UPSTREAM_FAILED,
    as_nx,
    atomic_write,
    format_tensor,
    graph_name,
    is_root_failure,
    node_status,
    ordered_nodes,
    scope_parts,
    status_name,
)
from graphkern.viz.stats import stats_line

__all__ = ["to_dot", "render", "to_svg", "DotError"]

FONT = "Helvetica"

# kind -> node attributes
_KIND_STYLE: dict[str, dict[str, str]] = {
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#dbeafe", "color": "#3b82f6"},
    "output": {"shape": "ellipse", "style": "filled", "fillcolor": "#dcfce7", "color": "#16a34a"},
    "constant": {"shape": "note", "style": "filled", "fillcolor": "#f3f4f6", "color": "#9ca3af",
                 "fontsize": "8"},
    "op": {"shape": "box", "style": "rounded,filled", "fillcolor": "#ffffff", "color": "#64748b"},
    "kernel": {"shape": "box3d", "style": "filled,bold", "fillcolor": "#ede9fe",
               "color": "#6d28d9", "fontcolor": "#3b0764"},
}
_FAILED = {"fillcolor": "#fecaca", "color": "#dc2626", "fontcolor": "#7f1d1d", "penwidth": "2.5"}
_UPSTREAM = {"color": "#dc2626", "fontcolor": "#991b1b", "penwidth": "1.2",
             "fillcolor": "#fff1f2"}


class DotError(RuntimeError):
    """Graphviz is missing or failed to render."""


def _q(text: Any) -> str:
    """A DOT double-quoted string (backslashes, quotes and newlines escaped)."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\r\n", "\n").replace("\n", "\\n") + '"'


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def to_dot(graph: Any, *, clusters: bool = True, edge_labels: bool = True,
           rankdir: str = "TB", max_label: int = 40, title: bool = True, stats: bool = False) -> str:
    """The graph in Graphviz DOT.

    Module scopes are nested ``cluster_`` subgraphs (``layers.0.self_attn.q_proj`` sits in
    ``layers.0`` > ``self_attn`` > ``q_proj``); kernel nodes are violet 3-D boxes that show their
    backend and grid; root failures are filled red with their status; nodes downstream of a
    failure are dashed red with a tooltip naming the root cause; edges are labelled
    ``dtype[shape]`` (``edge_labels=False`` leaves them bare). ``stats=True`` adds a line of
    each node's output statistics when the graph carries them (``gk.inspect``, ``gk.compare``).

    >>> dot = to_dot(graph)                               # doctest: +SKIP
    >>> dot.splitlines()[0]                               # doctest: +SKIP
    'digraph "forward" {'
    """
    g = as_nx(graph)
    order = ordered_nodes(g)
    ids = {n: _q(n) for n in order}
    out: list[str] = [f"digraph {_q(graph_name(g))} {{"]
    gattrs = [f"rankdir={rankdir}", f'fontname="{FONT}"', "fontsize=11", "newrank=true",
              "nodesep=0.25", "ranksep=0.35", 'bgcolor="white"']
    if title:
        label = f"{graph_name(g)} — {g.number_of_nodes()} nodes"
        backend = g.graph.get("backend")
        if backend:
            label += f", backend {backend}"
        roots = [n for n in order if is_root_failure(g.nodes[n])]
        if roots:
            d = g.nodes[roots[0]]
            label += f"\nFAILED: {roots[0]} ({status_name(node_status(d))})"
        gattrs += [f"label={_q(label)}", "labelloc=t"]
    out.append("  graph [" + ", ".join(gattrs) + "];")
    out.append(f'  node [fontname="{FONT}", fontsize=10, height=0.3, margin="0.12,0.04"];')
    out.append(f'  edge [fontname="{FONT}", fontsize=8, color="#64748b", arrowsize=0.6, '
               'fontcolor="#475569"];')

    # Scope tree: path -> (children paths, node ids)
    children: dict[str, list[str]] = {"": []}
    members: dict[str, list[str]] = {"": []}
    if clusters:
        for n in order:
            parts = scope_parts(g.nodes[n].get("scope"))
            parent = ""
            for depth in range(len(parts)):
                path = ".".join(parts[: depth + 1])
                if path not in children:
                    children[path] = []
                    members[path] = []
                    children[parent].append(path)
                parent = path
            members[parent].append(n)
    else:
        members[""] = list(order)

    cluster_ids: dict[str, int] = {}

    def emit_nodes(nodes: list[str], indent: str) -> None:
        for n in nodes:
            out.append(f"{indent}{ids[n]} [{_node_attrs(n, g.nodes[n], max_label, stats)}];")

    def emit_cluster(path: str, indent: str) -> None:
        cid = cluster_ids.setdefault(path, len(cluster_ids))
        parts = scope_parts(path)
        label = parts[-1] if parts else path
        failed = any(node_status(g.nodes[n]) for n in _all_members(path, children, members))
        out.append(f"{indent}subgraph cluster_{cid} {{")
        depth = len(parts)
        fill = ("#fef2f2" if failed else
                ["#f8fafc", "#f1f5f9", "#eef2f7", "#e9eef5"][min(depth - 1, 3)])
        border = "#fca5a5" if failed else "#cbd5e1"
        out.append(f"{indent}  label={_q(label)}; tooltip={_q(path)}; style=\"rounded,filled\"; "
                   f"fillcolor=\"{fill}\"; color=\"{border}\"; fontsize=10; "
                   f"fontcolor=\"#334155\"; labeljust=l;")
        emit_nodes(members[path], indent + "  ")
        for child in children[path]:
            emit_cluster(child, indent + "  ")
        out.append(f"{indent}}}")

    emit_nodes(members[""], "  ")
    for child in children[""]:
        emit_cluster(child, "  ")

    for u, v, key, data in g.edges(keys=True, data=True):
        attrs = []
        tensor = format_tensor(data.get("shape"), data.get("dtype"))
        if edge_labels:
            attrs.append(f"label={_q(' ' + tensor)}")
        attrs.append(f"tooltip={_q(f'{key}: {tensor} ({u} -> {v})')}")
        if node_status(g.nodes[u]):
            attrs.append('color="#dc2626"')
            attrs.append("penwidth=1.5")
        out.append(f"  {ids[u]} -> {ids[v]} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _all_members(path: str, children: dict[str, list[str]],
                 members: dict[str, list[str]]) -> list[str]:
    found = list(members[path])
    for child in children[path]:
        found += _all_members(child, children, members)
    return found


def _node_attrs(n: str, d: dict[str, Any], max_label: int, stats: bool = False) -> str:
    kind = str(d.get("kind") or "op")
    label = str(d.get("label") or n)
    op = str(d.get("op") or "")
    lines = [_short(label, max_label)]
    if kind == "op" and op and op != label:
        lines.append(_short(op, max_label))
    if kind == "kernel":
        grid, tg = d.get("grid"), d.get("threadgroup")
        extra = str(d.get("backend") or "")
        if grid:
            extra += f" grid {'x'.join(str(x) for x in grid)}"
        if tg:
            extra += f" tg {'x'.join(str(x) for x in tg)}"
        if extra.strip():
            lines.append(extra.strip())
    elif kind == "constant" and d.get("value"):
        lines.append(_short(str(d["value"]), max_label))
    values = stats_line(d) if stats else None
    if values:
        lines.append(_short(values, max_label + 10))
    status = node_status(d)
    tooltip = [f"{n} ({kind}{', ' + op if op and op != label else ''})"]
    if d.get("scope"):
        tooltip.append(f"scope: {d['scope']}")
    attrs = dict(_KIND_STYLE.get(kind, _KIND_STYLE["op"]))
    if status == UPSTREAM_FAILED:
        attrs.update(_UPSTREAM)
        attrs["style"] = attrs["style"] + ",dashed"
        tooltip.append(f"UPSTREAM_FAILED: root cause {d.get('root_cause')}")
    elif status:
        attrs.update(_FAILED)
        lines.append(f"✖ {status_name(status)}")
        tooltip.append(f"{status_name(status)}: {d.get('message') or ''}")
    attrs["label"] = "\n".join(lines)
    attrs["tooltip"] = "\n".join(tooltip)
    return ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())


def _pipe(dot: str, fmt: str) -> bytes:
    try:
        import graphviz
    except ImportError as e:  # pragma: no cover - graphviz is a declared dependency
        raise DotError("rendering needs the Python package 'graphviz': pip install graphviz") from e
    try:
        data: bytes = graphviz.pipe("dot", fmt, dot.encode("utf-8"), quiet=True)
        return data
    except graphviz.ExecutableNotFound as e:
        raise DotError("rendering needs Graphviz's 'dot' program: apt-get install graphviz "
                       "(or brew install graphviz)") from e
    except graphviz.CalledProcessError as e:
        raise DotError(f"Graphviz failed: {e.stderr.decode(errors='replace') if e.stderr else e}") \
            from e


def to_svg(graph: Any, **kw: Any) -> str:
    """The graph drawn by Graphviz, as SVG text (``**kw`` go to ``to_dot``).

    >>> svg = to_svg(graph)                               # doctest: +SKIP
    >>> svg.lstrip().startswith("<?xml")                  # doctest: +SKIP
    True
    """
    return _pipe(to_dot(graph, **kw), "svg").decode("utf-8")


def render(graph: Any, path: str | os.PathLike[str], format: str | None = None,
           **kw: Any) -> str:
    """Draw the graph with Graphviz into ``path`` as ``svg`` or ``png`` (from the suffix when
    ``format`` is None). The file appears whole or not at all. Returns the path.

    >>> render(graph, "trace.svg")                        # doctest: +SKIP
    'trace.svg'
    """
    fmt = (format or os.path.splitext(os.fspath(path))[1].lstrip(".") or "svg").lower()
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"format must be 'svg', 'png' or 'pdf', got {fmt!r}")
    atomic_write(path, _pipe(to_dot(graph, **kw), fmt))
    return os.fspath(path)
