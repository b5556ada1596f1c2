"""Node statistics (``gk.inspect``'s ``stats``, ``gk.compare``'s ``comparison``) for the pictures.

``stats_line`` is the one line a DOT label or tooltip shows; ``stats_attrs`` the key/value pairs of
Model Explorer's details panel; ``stats_overlays`` Model Explorer node data (``absmax``,
``non_finite``, ``compare_max_abs``), each a ``GraphNodeData`` document with a colour scale.

>>> stats_line({"stats": {"min": -2.0, "max": 1.5, "mean": 0.1, "absmax": 2.0, "nan": 0, "inf": 0}})
'[-2, 1.5] mean 0.1'
>>> stats_line({"stats": {"min": None, "max": None, "mean": None, "absmax": None, "nan": 8, "inf": 0}})
'NaN 8'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["stats_attrs", "stats_line", "stats_overlays"]


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def stats_line(data: Mapping[str, Any]) -> str | None:
    """``[min, max] mean m`` (and ``NaN n``, ``Inf n``) for a node with ``stats``, else None."""
    stats = data.get("stats")
    if not isinstance(stats, Mapping):
        return None
    parts = []
    if stats.get("min") is not None:
        parts.append(f"[{_num(stats['min'])}, {_num(stats['max'])}] mean {_num(stats['mean'])}")
    parts += [f"{text} {stats[key]}" for key, text in (("nan", "NaN"), ("inf", "Inf")) if stats.get(key)]
    compared = data.get("comparison")
    if isinstance(compared, Mapping) and compared.get("max_abs") is not None:
        parts.append(f"err {_num(compared['max_abs'])}")
    return ", ".join(parts) or None


def stats_attrs(data: Mapping[str, Any]) -> list[dict[str, str]]:
    """Model Explorer ``attrs`` entries for a node's ``stats`` and ``comparison``."""
    attrs = []
    stats = data.get("stats")
    if isinstance(stats, Mapping):
        attrs += [{"key": f"stats.{k}", "value": _num(v) if k not in ("nan", "inf") else str(v)}
                  for k, v in stats.items()]
    compared = data.get("comparison")
    if isinstance(compared, Mapping):
        attrs += [{"key": f"compare.{k}", "value": str(v)} for k, v in compared.items()]
    if data.get("values_note"):
        attrs.append({"key": "values", "value": str(data["values_note"])})
    return attrs


_GRADIENT = [{"stop": 0, "bgColor": "#f8fafc"}, {"stop": 1, "bgColor": "#f97316"}]


def stats_overlays(nodes: Iterable[tuple[Any, Mapping[str, Any]]],
                   ids: Mapping[Any, Iterable[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Model Explorer node data for the nodes that carry values: ``absmax`` (a gradient),
    ``non_finite`` (NaN + Inf count; red where any) and, after ``gk.compare``, ``compare_max_abs``
    (green within tolerance, red beyond). ``ids``: each node's Model Explorer ids (a weight drawn
    in several modules has several), by default its name. Empty when no node carries statistics."""
    absmax: dict[str, dict[str, Any]] = {}
    non_finite: dict[str, dict[str, Any]] = {}
    error: dict[str, dict[str, Any]] = {}
    for node, data in nodes:
        names = list(ids.get(node, [str(node)])) if ids is not None else [str(node)]
        stats = data.get("stats")
        if isinstance(stats, Mapping):
            bad = int(stats.get("nan") or 0) + int(stats.get("inf") or 0)
            for name in names:
                if stats.get("absmax") is not None:
                    absmax[name] = {"value": float(stats["absmax"])}
                non_finite[name] = {"value": bad, "bgColor": "#fecaca" if bad else "#dcfce7"}
        compared = data.get("comparison")
        if isinstance(compared, Mapping) and compared.get("max_abs") is not None:
            for name in names:
                error[name] = {"value": float(compared["max_abs"]),
                               "bgColor": "#dcfce7" if compared.get("ok") else "#fecaca"}
    out: dict[str, dict[str, Any]] = {}
    if absmax:
        out["absmax"] = {"name": "absmax", "results": absmax, "gradient": _GRADIENT}
    if non_finite:
        out["non_finite"] = {"name": "NaN + Inf", "results": non_finite}
    if error:
        out["compare_max_abs"] = {"name": "compare: max abs error", "results": error}
    return out
