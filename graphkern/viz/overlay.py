"""Per-node values for the HTML viewer's "colour by" control: ``gk.inspect``'s ``stats``, the
errors ``gk.compare`` found and kernels checked against their references.

``values_doc`` is the ``values`` part of the viewer's JSON: the statistics of every node as a
row aligned with the viewer's node order, the comparison rows by node, and which colouring the
page opens with. JSON has no NaN or Inf, so a non-finite number travels as the text JavaScript's
``Number()`` reads back (``"Infinity"``, ``"NaN"``).

>>> json_number(float("inf")), json_number(0.5), json_number(None)
('Infinity', 0.5, None)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from graphkern.errors import DrawingError
from graphkern.nodes import Status
from graphkern.tracing.schema import STAT_KEYS

__all__ = ["COLOURINGS", "colouring_for", "json_number", "node_values", "values_doc"]

#: The viewer's colourings: ``colour_by`` name -> what the control calls it.
COLOURINGS = {
    "kind": "kind",
    "absmax": "abs-max",
    "nonfinite": "NaN / Inf",
    "error_abs": "error (max abs)",
    "error_rel": "error (max rel)",
}
_NEEDS = {"absmax": "stats", "nonfinite": "stats", "error_abs": "compare", "error_rel": "compare"}
_TO_HTML = "to_html"


def json_number(value: Any) -> float | int | str | None:
    """A number JSON can carry: finite as itself, NaN and Inf as text, None as None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    value = float(value)
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _stats_row(stats: Any) -> list[Any] | None:
    if not isinstance(stats, Mapping):
        return None
    return [json_number(stats.get(key)) for key in STAT_KEYS]


def _plain(check: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): json_number(v) if isinstance(v, (int, float)) else str(v) for k, v in check.items()}


def node_values(data: Mapping[str, Any]) -> dict[str, Any]:
    """What the details panel shows of one node's values, beyond its ``stats`` row."""
    extra: dict[str, Any] = {}
    per_output = data.get("output_stats")
    if isinstance(per_output, list) and per_output:
        extra["output_stats"] = [_stats_row(s) for s in per_output]
    if data.get("values_note"):
        extra["values_note"] = str(data["values_note"])
    check = data.get("reference_check")
    if isinstance(check, Mapping):
        extra["reference_check"] = _plain(check)
    if data.get("module_outputs"):
        extra["module_outputs"] = [str(m) for m in data["module_outputs"]]
    return extra


def _row(index: int, row: Sequence[Any]) -> list[Any]:
    """A comparison row for the viewer: ``[b node index, b output, a node, a output, op, scope,
    shape, dtype a, dtype b, max abs, max rel, elements beyond tolerance, ok, note]``."""
    out = [index, *row[1:]]
    out[9], out[10] = json_number(out[9]), json_number(out[10])
    out[6] = [int(d) for d in out[6]] if out[6] is not None else None
    return out


def values_doc(g: Any, order: Sequence[Any], comparison: Mapping[str, Any] | None = None,
               colour_by: str | None = None) -> dict[str, Any] | None:
    """The viewer's ``values``: ``stats`` (one ``[min, max, mean, absmax, nan, inf]`` or None per
    node in ``order``), ``compare`` (the rows of ``comparison``, else those the nodes'
    ``comparison`` attributes give), ``colour`` (the colouring the page opens with). None when
    no node carries values and no comparison is given (and ``colour_by`` is None or "kind")."""
    index = {n: i for i, n in enumerate(order)}
    nodes = g.nodes
    stats = [_stats_row(nodes[n].get("stats")) for n in order]
    has_stats = any(s is not None for s in stats)
    compare = _compare_doc(g, order, index, comparison)
    has = {"stats": has_stats, "compare": compare is not None}
    if colour_by is not None:
        if colour_by not in COLOURINGS:
            raise DrawingError(_TO_HTML, f"colour_by must be one of {', '.join(map(repr, COLOURINGS))}, "
                              f"got {colour_by!r}", Status.INVALID_INPUT)
        need = _NEEDS.get(colour_by)
        if need is not None and not has[need]:
            raise DrawingError(_TO_HTML, f"cannot colour by {colour_by!r}: no node carries "
                              + ("statistics (gk.inspect records them)" if need == "stats"
                                 else "a comparison (gk.compare records it)"), Status.INVALID_INPUT)
    if not has_stats and compare is None and colour_by in (None, "kind"):
        return None
    return {"stats": stats if has_stats else None, "compare": compare,
            "colour": colour_by or colouring_for(stats, compare)}


def colouring_for(stats: Sequence[Sequence[Any] | None], compare: Mapping[str, Any] | None) -> str:
    """What a page opens coloured by: NaN/Inf where a node holds any, else the comparison's
    error, else abs-max; "kind" without values."""
    if any(s is not None and (s[4] or s[5]) for s in stats):
        return "nonfinite"
    if compare is not None:
        return "error_abs"
    return "absmax" if any(s is not None for s in stats) else "kind"


def _compare_doc(g: Any, order: Sequence[Any], index: Mapping[Any, int],
                 comparison: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if comparison is not None:
        rows = [_row(index.get(r[0], -1), r) for r in comparison.get("rows", [])]
        checks = [[c[0], c[1], index.get(c[1], -1) if c[0] == "b" else -1, *c[2:5],
                   json_number(c[5]), json_number(c[6]), c[7]]
                  for c in comparison.get("kernel_checks", [])]
        return {"title": str(comparison.get("title") or "compare"),
                "summary": [str(s) for s in comparison.get("summary", [])],
                "rtol": json_number(comparison.get("rtol")), "atol": json_number(comparison.get("atol")),
                "first": comparison.get("first"), "rows": rows, "checks": checks}
    rows = []
    for n in order:  # a graph that went through gk.compare carries its errors on its nodes
        found = g.nodes[n].get("comparison")
        if isinstance(found, Mapping) and "max_abs" in found:
            data = g.nodes[n]
            rows.append(_row(index[n], [n, 0, str(found.get("against", "")), 0,
                                        str(data.get("kernel") or data.get("op") or data.get("label") or ""),
                                        str(data.get("scope") or ""), None, "", "",
                                        found.get("max_abs"), found.get("max_rel"), None,
                                        found.get("ok"), ""]))
    if not rows:
        return None
    first = next((i for i, r in enumerate(rows) if r[12] is False), None)
    return {"title": "compared", "summary": [], "rtol": None, "atol": None, "first": first,
            "rows": rows, "checks": []}
