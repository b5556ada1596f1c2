"""Drawing traced graphs: DOT/SVG, Model Explorer, a self-contained HTML viewer and graph diffs.

Everything here is imported lazily (``import graphkern`` does not import this package) and heavy
dependencies — the ``graphviz`` package, ``rich``, ``playwright`` — are imported only when the
function that needs them runs. The functions accept a ``graphkern.Graph`` or anything with an
``.nx`` attribute holding the trace's ``networkx.MultiDiGraph`` (or that graph itself).

>>> from graphkern.viz import to_dot  # doctest: +SKIP
>>> print(to_dot(graph))              # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GraphDiff",
    "diff",
    "render",
    "repr_html",
    "to_dot",
    "to_html",
    "to_model_explorer",
    "to_model_explorer_node_data",
]

_WHERE = {
    "to_dot": "dot",
    "render": "dot",
    "to_html": "html",
    "repr_html": "html",
    "to_model_explorer": "model_explorer",
    "to_model_explorer_node_data": "model_explorer",
    "diff": "graph_diff",
    "GraphDiff": "graph_diff",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'graphkern.viz' has no attribute {name!r}")
    return getattr(importlib.import_module(f"graphkern.viz.{module}"), name)
