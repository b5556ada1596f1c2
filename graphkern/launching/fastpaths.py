"""The few places graphkern reaches past a library's public API for speed, kept together.

Each is a hot path (every launch, every node of a large trace) where the public route costs several
times more; each has a test (``tests/test_fastpaths.py``) that it agrees with the public route.

- ``environ_get``: CPython's raw environment mapping on POSIX, for ``GRAPHKERN_BACKEND``, read on
  every launch (``os.environ.get`` decodes and encodes on every read).
- ``bulk_multidigraph``: a networkx ``MultiDiGraph`` filled through its documented adjacency
  structure in one pass, for traces of 100,000 nodes.
- ``adjacency``: networkx's own node, predecessor and successor dicts, read without the views that
  wrap every access in an object.
- ``move_out_edges``: a node's out-edges handed to other sources and the node removed, for the
  hundreds of module tags a model's trace drops.
- ``gc_paused``: the cyclic garbage collector off while a trace or an export builds hundreds of
  thousands of small acyclic objects (it would rescan them, and the heap, dozens of times).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import networkx as nx

__all__ = ["BACKEND_VARIABLE", "adjacency", "bulk_multidigraph", "environ_get", "gc_paused", "move_out_edges"]

_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
#: ``GRAPHKERN_BACKEND`` as the key of the mapping ``environ_get`` reads (bytes on POSIX).
BACKEND_VARIABLE: Any = b"GRAPHKERN_BACKEND" if _ENVIRON is not None else "GRAPHKERN_BACKEND"
#: ``environ_get(key)``: the raw value of an environment variable (bytes on POSIX), or None.
environ_get: Callable[[Any], Any] = (_ENVIRON if _ENVIRON is not None else os.environ).get


def bulk_multidigraph(nodes: dict[str, dict[str, Any]],
                      edges: list[tuple[str, str, str, dict[str, Any]]]) -> nx.MultiDiGraph:
    """A MultiDiGraph with these nodes and keyed edges, built in one pass.

    Fills networkx's documented adjacency structure (node -> neighbour -> key -> data, shared by
    ``succ`` and ``pred``) directly, where ``add_edges_from`` checks every edge, key and data dict
    through Python calls, the bulk of building a large trace's graph. ``tests/test_fastpaths.py``
    checks the result equals the graph networkx builds through its public API.
    """
    g = nx.MultiDiGraph()
    node_data, succ, pred = g._node, g._succ, g._pred
    for node, data in nodes.items():
        node_data[node] = data
        succ[node] = {}
        pred[node] = {}
    for u, v, key, data in edges:
        keys = succ[u].get(v)
        if keys is None:
            keys = succ[u][v] = pred[v][u] = {}
        keys[key] = data
    nx._clear_cache(g)
    return g


def adjacency(g: nx.MultiDiGraph) -> tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]]:
    """networkx's own node, predecessor and successor dicts (read only here): the public views
    wrap every access in an object, which is most of the cost on graphs of 100,000 nodes."""
    return g._node, g._pred, g._succ


def move_out_edges(g: nx.MultiDiGraph, node: Any,
                   to: Callable[[Any], tuple[Any, Any] | None]) -> None:
    """Give each out-edge of ``node`` to another source (``to(key)``: ``(source, new key)``, or
    None to drop it), then remove ``node``: what ``add_edge`` for each and ``remove_node`` do,
    done on networkx's adjacency in place (the public calls copy every edge's data and check
    every node, most of the cost of dropping a model's module tags). Each edge keeps its data
    dict; ``tests/test_fastpaths.py`` checks the result equals the public route's."""
    node_data, pred, succ = g._node, g._pred, g._succ
    for dst, keyed in succ[node].items():
        del pred[dst][node]
        for key, data in keyed.items():
            moved = to(key)
            if moved is None:
                continue
            source, new_key = moved
            edges = succ[source].get(dst)
            if edges is None:
                edges = succ[source][dst] = pred[dst][source] = {}
            edges[new_key] = data
    for source in pred[node]:
        del succ[source][node]
    del succ[node], pred[node], node_data[node]
    nx._clear_cache(g)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for the block, and left as it was found afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
