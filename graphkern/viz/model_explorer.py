"""Export to Google's Model Explorer (``ai-edge-model-explorer``, an optional extra).

``to_model_explorer`` gives a graph collection in Model Explorer's graph JSON — the format its
built-in JSON adapter loads from a ``.json`` file (``{"label", "graphs": [{"id", "nodes"}]}``, each
node with ``id``, ``label``, ``namespace``, ``attrs``, ``incomingEdges``, ``outputsMetadata``
(the array's ``tensor_shape`` and name) and ``style``). Module scopes become namespaces
(``layers.0.self_attn`` -> ``layers.0/self_attn``), so Model Explorer shows them as collapsible
layers; a layer holding a failure is drawn red even while closed (``groupNodeConfigs``).
``to_model_explorer_node_data`` gives node-data overlays by name (status as ``OK`` /
``COMPILE_ERROR`` ..., the kernels' backend, and timings when the graph was profiled) in its node
data JSON (``{"results": {node: {"value", "bgColor"}}}``); a closed layer shows how many of its
nodes have each status. ``view`` writes both and starts Model Explorer, open one level above the
repeated layers so that each decoder layer is one box.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from graphkern.launching.fastpaths import gc_paused
from graphkern.viz.common import (
    UPSTREAM_FAILED,
    all_in_edges,
    as_nx,
    atomic_write,
    format_tensor,
    graph_name,
    group_tree,
    iter_kernel_fields,
    node_status,
    ordered_nodes,
    scope_parts,
    status_name,
    weight_like,
)
from graphkern.viz.stats import stats_attrs, stats_overlays

__all__ = ["to_model_explorer", "to_model_explorer_node_data", "initial_ui_state", "view",
           "ModelExplorerMissing"]

INSTALL_HINT = ("Model Explorer is not installed; install the optional extra: "
                "pip install 'graphkern[model-explorer]' (or pip install ai-edge-model-explorer)")

_COLLECTIVE_STYLE = {"backgroundColor": "#ffedd5", "borderColor": "#c2410c",
                     "hoveredBorderColor": "#7c2d12"}
_KERNEL_STYLE = {"backgroundColor": "#ede9fe", "borderColor": "#6d28d9",
                 "hoveredBorderColor": "#4c1d95"}
_FAILED_STYLE = {"backgroundColor": "#fecaca", "borderColor": "#dc2626",
                 "hoveredBorderColor": "#7f1d1d"}
_UPSTREAM_STYLE = {"backgroundColor": "#fff1f2", "borderColor": "#ef4444",
                   "hoveredBorderColor": "#991b1b"}


class ModelExplorerMissing(RuntimeError):
    """``ai-edge-model-explorer`` is not installed."""


def _kv(key: str, value: Any) -> dict[str, str]:
    return {"key": key, "value": str(value)}


_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(name))


def to_model_explorer(graph: Any) -> dict[str, Any]:
    """The graph as a Model Explorer graph collection (a JSON-ready dict).

    Save it as ``something.json`` and open it in Model Explorer (its JSON adapter), or use
    ``graphkern view --model-explorer FILE.json``.

    >>> doc = to_model_explorer(graph)                     # doctest: +SKIP
    >>> doc["graphs"][0]["nodes"][0]["namespace"]          # doctest: +SKIP
    'layers.0/self_attn/q_proj'
    """
    # The export builds a few hundred thousand small dicts and lists and no cycles: the cyclic
    # garbage collector would only re-scan them (and a big process's heap) over and over.
    with gc_paused():
        return _to_model_explorer(as_nx(graph))


def _to_model_explorer(g: Any) -> dict[str, Any]:
    name = graph_name(g)
    order = ordered_nodes(g)
    # per node: its distinct output arrays (name -> "dtype[shape]"), numbered in natural order
    outs: dict[Any, dict[str, str]] = {}
    for u, nbrs in g.adj.items():
        arrays = outs[u] = {}
        for keyed in nbrs.values():
            for key, data in keyed.items():
                k = str(key)
                if k not in arrays:
                    arrays[k] = format_tensor(data.get("shape"), data.get("dtype"))
    out_ids: dict[Any, dict[str, str]] = {}
    for n, arrays in outs.items():
        keys = sorted(arrays, key=_natural) if len(arrays) > 1 else list(arrays)
        out_ids[n] = {k: str(i) for i, k in enumerate(keys)}
    ins = all_in_edges(g)
    status_text: dict[int, str] = {}
    nodes: list[dict[str, Any]] = []
    per_scope: dict[str, list[int]] = {}
    node_data = dict(g.nodes(data=True))
    places = placements(g, order)
    for n in order:
        d = node_data[n]
        kind = str(d.get("kind") or "op")
        status = node_status(d)
        text = status_text.get(status)
        if text is None:
            text = status_text[status] = f"{status_name(status)} ({status})"
        op = d.get("op") or ""
        attrs: list[dict[str, Any]] = [{"key": "kind", "value": kind}]
        if op:
            attrs.append({"key": "op", "value": str(op)})
        attrs.append({"key": "status", "value": text})
        if status:
            root = d.get("root_cause")
            if root is not None and root != n:
                link: dict[str, Any] = {"type": "node_ids", "nodeIds": [str(root)]}
                attrs.append({"key": "root_cause", "value": link})
            if d.get("message"):
                attrs.append(_kv("message", d["message"]))
        for key in ("value", "arguments"):
            if d.get(key):
                attrs.append(_kv(key, d[key]))
        if kind == "kernel":
            attrs += [_kv(k, v) for k, v in iter_kernel_fields(d)]
            if d.get("source"):
                attrs.append(_kv("source", d["source"]))
        elif kind == "collective":
            attrs += [_kv(k, d[k]) for k in ("reduce", "group_size", "rank", "peer")
                      if d.get(k) is not None]
        if d.get("on_rank") is not None:
            attrs.append(_kv("on_rank", d["on_rank"]))
        attrs += stats_attrs(d)
        arrays = outs[n]
        outputs_meta = [{"id": oid, "attrs": [{"key": "tensor_shape", "value": arrays[key]},
                                              {"key": "__tensor_tag", "value": key}]}
                        for key, oid in out_ids[n].items()]
        style = (_UPSTREAM_STYLE if status == UPSTREAM_FAILED else _FAILED_STYLE if status
                 else _KERNEL_STYLE if kind == "kernel"
                 else _COLLECTIVE_STYLE if kind == "collective" else None)
        for node_id, namespace in places[n]:
            incoming = [{"sourceNodeId": _placed_id(places, u, namespace),
                         "sourceNodeOutputId": out_ids[u].get(str(key), "0"),
                         "targetNodeInputId": str(data.get("index") or 0)}
                        for u, _, key, data in ins[n]]
            node: dict[str, Any] = {
                "id": node_id,
                "label": str(op if kind == "op" and op else d.get("label") or n),
                "namespace": namespace,
                "attrs": attrs if node_id == str(n) else attrs + [_kv("copy_of", n)],
                "incomingEdges": incoming,
                "outputsMetadata": outputs_meta,
            }
            if style is not None:
                node["style"] = dict(style)
            nodes.append(node)
            counts = per_scope.get(namespace)
            if counts is None:
                counts = per_scope[namespace] = [0, 0, 0]
            counts[0] += 1
            counts[1] += kind == "kernel"
            counts[2] += status != 0
    groups: dict[str, dict[str, Any]] = {}
    for namespace, (count, kernels, failed) in per_scope.items():
        parts = namespace.split("/") if namespace else []
        for depth in range(len(parts)):
            path = "/".join(parts[: depth + 1])
            info = groups.get(path)
            if info is None:
                info = groups[path] = {"nodes": 0, "kernels": 0, "failed": 0,
                                       "scope": ".".join(parts[: depth + 1])}
            info["nodes"] += count
            info["kernels"] += kernels
            info["failed"] += failed
    group_attrs: dict[str, dict[str, str]] = {
        "": {"name": name, "backend": str(g.graph.get("backend") or ""),
             "mlx_version": str(g.graph.get("mlx_version") or ""),
             "nodes": str(len(order)), "status": _graph_status(g, order),
             "status colours": STATUS_LEGEND},
    }
    classes = g.graph.get("modules") or {}
    for path, info in groups.items():
        group_attrs[path] = {k: str(v) for k, v in info.items()}
        if classes.get(info["scope"]):
            group_attrs[path]["class"] = str(classes[info["scope"]])
    graph: dict[str, Any] = {"id": name, "nodes": nodes, "groupNodeAttributes": group_attrs}
    configs = _failed_group_styles(g, order)
    if configs:
        graph["groupNodeConfigs"] = configs
    return {"label": name, "graphs": [graph]}


def placements(g: Any, order: list[Any]) -> dict[Any, list[tuple[str, str]]]:
    """Each node's Model Explorer ``(id, namespace)``: one, in its own scope; a weight or
    constant (``weight_like``) read in other modules has a copy in each (``id@namespace``), so
    an epsilon shared by every layer does not draw edges across the whole model."""
    weights = weight_like(g, order)
    own = {n: "/".join(scope_parts(g.nodes[n].get("scope"))) for n in order}
    wanted: dict[Any, dict[str, None]] = {}
    for n in reversed(order):
        if n not in weights:
            continue
        spaces: dict[str, None] = {}
        for v in g.successors(n):
            spaces.update(wanted[v] if v in weights else {own[v]: None})
        wanted[n] = spaces or {own[n]: None}
    out: dict[Any, list[tuple[str, str]]] = {}
    for n in order:
        if n in weights:
            out[n] = [(str(n) if ns == own[n] else f"{n}@{ns or 'top'}", ns) for ns in wanted[n]]
        else:
            out[n] = [(str(n), own[n])]
    return out


def _placed_id(places: dict[Any, list[tuple[str, str]]], node: Any, namespace: str) -> str:
    """The id of ``node``'s copy in ``namespace`` (its only one, for a node not copied)."""
    options = places[node]
    if len(options) == 1:
        return options[0][0]
    return next((i for i, ns in options if ns == namespace), options[0][0])


STATUS_LEGEND = ("OK green; a failed node red; downstream of a failure pink; a layer holding "
                 "a failure red, one downstream of it pink")


def _failed_group_styles(g: Any, order: list[Any]) -> list[dict[str, Any]]:
    """Group styles that mark a layer holding a failure red (pink: only downstream of one), so
    a closed layer shows it; the first matching config wins, so exact paths come first."""
    worst: dict[str, int] = {}
    for n in order:
        status = node_status(g.nodes[n])
        if not status:
            continue
        parts = scope_parts(g.nodes[n].get("scope"))
        for depth in range(len(parts)):
            path = "/".join(parts[: depth + 1])
            worst[path] = max(worst.get(path, 0), 1 if status == UPSTREAM_FAILED else 2)
    configs = []
    for path, level in worst.items():
        style = _FAILED_GROUP if level == 2 else _UPSTREAM_GROUP
        configs.append({"namespaceRegex": f"^{re.escape(path)}$", **style})
    return configs


_FAILED_GROUP = {"backgroundColor": "#fef2f2", "borderColor": "#dc2626", "textColor": "#991b1b"}
_UPSTREAM_GROUP = {"backgroundColor": "#fffafa", "borderColor": "#fca5a5", "textColor": "#991b1b"}


def _graph_status(g: Any, order: list[Any]) -> str:
    for n in order:
        s = node_status(g.nodes[n])
        if s and s != UPSTREAM_FAILED:
            return f"{status_name(s)} at {n}"
    return "OK"


_STATUS_COLORS = {0: "#dcfce7", UPSTREAM_FAILED: "#fee2e2"}
_FAILED_COLOR = "#f87171"
_BACKEND_COLORS = {"metal": "#dbeafe", "cuda": "#dcfce7", "reference": "#fef9c3"}
#: overlays of names, not numbers: no averages, a count of each name on every layer instead
_LABELS = {"showExpandedSummaryOnGroupNode": True, "showLabelCountColumnsInChildrenStatsTable": True,
           "hideInAggregatedStatsTable": True}


def to_model_explorer_node_data(graph: Any, timings: Mapping[str, float] | None = None
                                ) -> dict[str, dict[str, Any]]:
    """Node-data overlays for Model Explorer, by name: ``status`` (every node's status by name,
    ``OK`` green, a failure red, ``UPSTREAM_FAILED`` pink; each layer shows how many of its nodes
    have each), ``backend`` (kernel nodes: ``metal``, ``cuda`` or ``reference``) and, when
    ``timings`` (node -> milliseconds) is given or nodes carry ``time_ms``, ``time_ms`` with a
    gradient; on a values graph (``gk.inspect``, ``gk.compare``) also ``absmax``, ``non_finite``
    and ``compare_max_abs`` (``graphkern.viz.stats``). Each value is one ``GraphNodeData``
    document; wrap it as ``{graph_id: data}`` for a model with several graphs.

    >>> overlays = to_model_explorer_node_data(graph)      # doctest: +SKIP
    >>> overlays["status"]["results"]["rms_norm"]          # doctest: +SKIP
    {'value': 'COMPILE_ERROR', 'bgColor': '#f87171'}
    """
    g = as_nx(graph)
    status_results: dict[str, dict[str, Any]] = {}
    backend_results: dict[str, dict[str, Any]] = {}
    time_results: dict[str, dict[str, Any]] = {}
    order = ordered_nodes(g)
    places = placements(g, order)
    for n in order:
        d = g.nodes[n]
        s = node_status(d)
        for node_id, _ in places[n]:
            status_results[node_id] = {"value": status_name(s),
                                       "bgColor": _STATUS_COLORS.get(s, _FAILED_COLOR)}
        if d.get("kind") == "kernel" and d.get("backend"):
            b = str(d["backend"])
            backend_results[str(n)] = {"value": b, "bgColor": _BACKEND_COLORS.get(b, "#f1f5f9")}
        t = (timings or {}).get(str(n), d.get("time_ms"))
        if isinstance(t, (int, float)):
            time_results[str(n)] = {"value": float(t)}
    out: dict[str, dict[str, Any]] = {
        "backend": {"name": "kernel backend", "results": backend_results, **_LABELS},
        "status": {"name": "status", "results": status_results, **_LABELS},
    }
    if time_results:
        out["time_ms"] = {"name": "time (ms)", "results": time_results,
                          "gradient": [{"stop": 0, "bgColor": "#f8fafc"},
                                       {"stop": 1, "bgColor": "#f97316"}]}
    out.update(stats_overlays(((n, g.nodes[n]) for n in order),
                              {n: [i for i, _ in places[n]] for n in order}))
    return out


def initial_ui_state(graph: Any) -> dict[str, Any]:
    """Model Explorer's UI state that opens ``graph`` one level above its repeated blocks (each
    ``model.layers.N`` one closed box), or at its top level when it has none.

    >>> initial_ui_state(graph)["paneStates"][0]["deepestExpandedGroupNodeIds"]   # doctest: +SKIP
    ['model___group___']
    """
    g = as_nx(graph)
    parents = set()
    for path, label, _, depth in group_tree(g.nodes[n].get("scope") for n in ordered_nodes(g)):
        if re.search(r"\.\d+$", label) and depth:
            parents.add("/".join(scope_parts(path)[:-1]))
    name = graph_name(g)
    return {"paneStates": [{"deepestExpandedGroupNodeIds": sorted(f"{p}___group___" for p in parents),
                            "selectedNodeId": "", "selectedGraphId": name,
                            "selectedCollectionLabel": "", "widthFraction": 1}]}


def view(graph: Any, *, port: int = 8080, host: str = "localhost", folder: str | None = None,
         open_browser: bool = True) -> str:
    """Write the graph and its overlays as JSON files and open them in Model Explorer, each
    repeated layer one closed box (``initial_ui_state``).

    Raises ``ModelExplorerMissing`` (with the pip command) when ``ai-edge-model-explorer`` is
    not installed. Returns the path of the graph JSON. Blocks while the server runs.

    >>> view(graph)                                         # doctest: +SKIP
    """
    import json
    from urllib.parse import quote, unquote

    try:
        import model_explorer  # type: ignore[import-not-found]
    except ImportError as e:
        raise ModelExplorerMissing(INSTALL_HINT) from e

    folder = folder or tempfile.mkdtemp(prefix="graphkern-me-")
    name = graph_name(as_nx(graph))
    path = os.path.join(folder, f"{name}.json")
    atomic_write(path, json.dumps(to_model_explorer(graph), separators=(",", ":")))
    overlays = []
    for key, data in to_model_explorer_node_data(graph).items():
        p = os.path.join(folder, f"{name}.{key}.node_data.json")
        atomic_write(p, json.dumps({name: data}))
        overlays.append({"name": key, "node_data_path": p})
    state = initial_ui_state(graph)

    class Config(type(model_explorer.config())):  # type: ignore[misc]
        """Model Explorer's config, with the UI state the page opens in added to its URL."""

        def to_url_param_value(self) -> str:
            data = json.loads(unquote(super().to_url_param_value()))
            data["uiState"] = state
            return quote(json.dumps(data))

    config = Config().add_model_from_path(path)
    for item in overlays:
        config.add_node_data_from_path(item["node_data_path"])
    model_explorer.visualize_from_config(config=config, host=host, port=port,
                                         no_open_in_browser=not open_browser)
    return path
