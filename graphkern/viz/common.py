"""Helpers shared by the drawing back ends: reading the trace graph, scopes, statuses, shapes.

The nodes and edges they read are defined in :mod:`graphkern.tracing.schema`.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from graphkern.launching.launch_cache import memoized
from graphkern.nodes import Status

UPSTREAM_FAILED = int(Status.UPSTREAM_FAILED)
_STATUS_NAMES = {int(s): s.name for s in Status}


def status_names() -> dict[int, str]:
    """Status code -> name, from ``graphkern.nodes.Status``.

    >>> status_names()[0]
    'OK'
    """
    return _STATUS_NAMES


def status_name(code: Any) -> str:
    """``8`` -> ``"COMPILE_ERROR"``; unknown codes print as their number.

    >>> status_name(0), status_name(10), status_name(999)
    ('OK', 'UPSTREAM_FAILED', '999')
    """
    try:
        return status_names().get(int(code), str(int(code)))
    except (TypeError, ValueError):
        return str(code)


def as_nx(graph: Any) -> nx.MultiDiGraph:
    """The ``networkx.MultiDiGraph`` behind ``graph`` (a ``gk.Graph``, anything with ``.nx``, or the
    networkx graph itself).

    >>> as_nx(nx.MultiDiGraph()).number_of_nodes()
    0
    """
    if isinstance(graph, nx.Graph):
        return graph  # type: ignore[return-value]
    inner = getattr(graph, "nx", None)
    if isinstance(inner, nx.Graph):
        return inner  # type: ignore[return-value]
    raise TypeError(
        f"expected a graphkern Graph (with a networkx .nx attribute), got {type(graph).__name__}"
    )


def graph_name(g: nx.MultiDiGraph) -> str:
    return str(g.graph.get("name") or "graph")


def node_status(data: Mapping[str, Any]) -> int:
    try:
        return int(data.get("status") or 0)
    except (TypeError, ValueError):
        return 0


def is_root_failure(data: Mapping[str, Any]) -> bool:
    s = node_status(data)
    return s != 0 and s != UPSTREAM_FAILED


def ordered_nodes(g: nx.MultiDiGraph) -> list[Any]:
    """Node ids in topological position: by the ``order`` attribute, else a topological sort."""
    data = dict(g.nodes(data="order"))
    if data and all(isinstance(o, int) for o in data.values()):
        return sorted(data, key=data.__getitem__)
    nodes = list(g.nodes)
    try:
        return list(nx.lexicographical_topological_sort(g, key=str))
    except (nx.NetworkXUnfeasible, TypeError):
        return nodes


Edge = tuple[Any, Any, Any, dict[str, Any]]


def _edge_order(e: Edge) -> tuple[int, str]:
    return (_int(e[3].get("index"), 0), str(e[2]))


def in_edges_sorted(g: nx.MultiDiGraph, node: Any) -> list[Edge]:
    """Incoming edges ``(u, v, key, data)`` ordered by argument position."""
    edges = [(u, node, k, d) for u, keyed in g.pred[node].items() for k, d in keyed.items()]
    edges.sort(key=_edge_order)
    return edges


def all_in_edges(g: nx.MultiDiGraph) -> dict[Any, list[Edge]]:
    """``in_edges_sorted`` for every node at once (one pass over the edges)."""
    out: dict[Any, list[Edge]] = {n: [] for n in g.nodes}
    for u, nbrs in g.adj.items():
        for v, keyed in nbrs.items():
            target = out[v]
            for k, d in keyed.items():
                target.append((u, v, k, d))
    for edges in out.values():
        if len(edges) > 1:
            edges.sort(key=_edge_order)
    return out


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def format_shape(shape: Any) -> str:
    """``(4, 8)`` -> ``"4,8"``, ``()`` -> ``""``, ``None`` -> ``"?"``.

    >>> format_shape((4, 8)), format_shape(()), format_shape(None)
    ('4,8', '', '?')
    """
    if shape is None:
        return "?"
    if isinstance(shape, (list, tuple)):
        return ",".join(str(d) for d in shape)
    return str(shape)


def format_tensor(shape: Any, dtype: Any) -> str:
    """``float32[4,8]``: the dtype and the shape of one array.

    >>> format_tensor((4, 8), "float32"), format_tensor((), "int32")
    ('float32[4,8]', 'int32[]')
    """
    return f"{dtype or '?'}[{format_shape(shape)}]"


_NUM_PART = re.compile(r"^\d+$")


@memoized("drawing scopes", maxsize=65536)
def _scope_parts(scope: str) -> tuple[str, ...]:
    parts: list[str] = []
    for piece in scope.split("."):
        if not piece:
            continue
        if _NUM_PART.match(piece) and parts:
            parts[-1] = f"{parts[-1]}.{piece}"
        else:
            parts.append(piece)
    return tuple(parts)


def scope_parts(scope: Any) -> list[str]:
    """The nesting levels of a module scope; list indices stay with their list.

    ``"layers.0.self_attn.q_proj"`` is three levels: ``layers.0``, ``self_attn``, ``q_proj``.

    >>> scope_parts("layers.0.self_attn.q_proj")
    ['layers.0', 'self_attn', 'q_proj']
    >>> scope_parts(""), scope_parts(None)
    ([], [])
    """
    if not scope:
        return []
    return list(_scope_parts(str(scope)))


@dataclass(frozen=True)
class FailureSummary:
    """One root failure and how far it reached."""

    node: Any
    status: int
    message: str
    affected: int  # descendants marked UPSTREAM_FAILED (or failed) because of it
    scope: str = ""  # the module path it ran in


def failures(g: nx.MultiDiGraph) -> list[FailureSummary]:
    """Root failures in topological order with the number of nodes each one affects."""
    roots = [n for n in ordered_nodes(g) if is_root_failure(g.nodes[n])]
    affected: dict[Any, int] = {r: 0 for r in roots}
    for _, data in g.nodes(data=True):
        if node_status(data) == UPSTREAM_FAILED and data.get("root_cause") in affected:
            affected[data["root_cause"]] += 1
    return [
        FailureSummary(r, node_status(g.nodes[r]), str(g.nodes[r].get("message") or ""), affected[r],
                       str(g.nodes[r].get("scope") or ""))
        for r in roots
    ]


def node_text(value: Any) -> str:
    """Attribute values as display text (lists of pairs for templates, tuples for grids)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value):
            return ", ".join(f"{a}={b}" for a, b in value)
        return "(" + ", ".join(str(v) for v in value) + ")"
    return str(value)


def group_tree(scopes: Iterable[Any]) -> list[tuple[str, str, int, int]]:
    """Groups for scopes given in topological order: ``(path, label, parent index, depth)``,
    parents first, siblings in order of first appearance (``layers.2`` before ``layers.10``).

    >>> group_tree(["a.b", "a", "c"])
    [('a', 'a', -1, 0), ('a.b', 'b', 0, 1), ('c', 'c', -1, 0)]
    """
    index: dict[str, int] = {}
    out: list[tuple[str, str, int, int]] = []
    for scope in dict.fromkeys(str(s) for s in scopes if s):
        parts = scope_parts(scope)
        for depth in range(len(parts)):
            path = ".".join(parts[: depth + 1])
            if path in index:
                continue
            parent = index[".".join(parts[:depth])] if depth else -1
            index[path] = len(out)
            out.append((path, parts[depth], parent, depth))
    return out


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so a
    reader never sees half a file and a failure leaves nothing behind.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> atomic_write(p, "hi"); p.read_text()
    'hi'
    """
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".gk-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, _file_mode(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _file_mode(target: str) -> int:
    """The mode a plain ``open(target, "w")`` would give: the existing file's, else 0o666 - umask."""
    try:
        return os.stat(target).st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def template_text(data: Mapping[str, Any]) -> str:
    """A kernel node's template arguments, with those holding float32 bits shown as floats.

    >>> template_text({"template": [["T", "float32"], ["EPS", "925353388"]],
    ...                "template_floats": {"EPS": 1e-05}})
    'T=float32, EPS=1e-05'
    """
    floats = data.get("template_floats") or {}
    items = data.get("template") or []
    return ", ".join(f"{name}={floats[name]:g}" if name in floats else f"{name}={value}"
                     for name, value in items)


def collective_text(data: Mapping[str, Any]) -> str:
    """What a collective node does, in a few words.

    >>> collective_text({"op": "all_sum", "reduce": "sum", "group_size": 2, "rank": 1})
    'sum over 2 ranks (rank 1)'
    >>> collective_text({"op": "send", "group_size": 2, "rank": 1, "peer": 0})
    'to rank 0 of 2 (rank 1)'
    """
    size, rank, peer = data.get("group_size"), data.get("rank"), data.get("peer")
    if peer is not None:
        head = f"{'to' if data.get('op') == 'send' else 'from'} rank {peer} of {size}"
    elif data.get("op") == "all_gather":
        head = f"gather over {size} ranks"
    else:
        head = f"{data.get('reduce') or data.get('op')} over {size} ranks"
    return f"{head} (rank {rank})"


def iter_kernel_fields(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of the kernel attributes worth showing, in a fixed order."""
    for key in ("kernel", "backend", "grid", "threadgroup", "template", "source_hash",
                "generated_name"):
        value = data.get(key)
        if value not in (None, "", []):
            yield key, template_text(data) if key == "template" else node_text(value)


# ----------------------------------------------------------------------------- weights and constants

#: Ops that only move or retype one array: a weight seen through them is still that weight.
_PASS_THROUGH = {"Transpose": "ᵀ", "AsType": "", "Broadcast": "", "Reshape": "", "ExpandDims": "",
                 "Squeeze": "", "Copy": "", "Contiguous": "", "Flatten": "", "Unflatten": "",
                 "StopGradient": ""}
_LONG_FLOAT = re.compile(r"-?\d+\.\d{8,}(?:e[-+]?\d+)?")
_DESCRIPTION_CHARS = 160
_SHORT_CHARS = 16


def _array_text(g: nx.MultiDiGraph, n: Any) -> str:
    """``float32[8]``: the array a node makes, for a value too long to show in place."""
    for _, _, data in g.out_edges(n, data=True):
        return format_tensor(data.get("shape"), data.get("dtype"))
    return str(n)


def pretty_numbers(text: str) -> str:
    """Floats printed from float32 values, shortened to the digits float32 has.

    >>> pretty_numbers("[9.999999747378752e-06, 0.3162277638912201, 2.0]")
    '[1e-05, 0.3162278, 2.0]'
    """
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.7g}", text)


@dataclass(frozen=True)
class WeightText:
    """How a weight-like node reads where it is used: in full (``Transpose(model.lm_head.weight)``)
    and short (``model.lm_head.weightᵀ``; a reader strips the consumer's own module path)."""

    full: str
    short: str


def is_state_input(data: Mapping[str, Any]) -> bool:
    """An input read as state (a module parameter, a closure array), not an argument. Graphs
    without the ``state`` attribute count parameters by their module scope."""
    if data.get("kind") != "input":
        return False
    state = data.get("state")
    return bool(state) if state is not None else bool(data.get("scope"))


def weight_like(g: nx.MultiDiGraph, order: list[Any] | None = None) -> dict[Any, WeightText]:
    """The nodes that only carry weights and constants, with how each reads: constants, inputs
    read as state, and ops computed from those alone (a weight's transpose, a broadcast scalar,
    a mask built from ``arange``). Kernels, outputs and failed nodes never are. Drawings show
    these as attributes of the node that uses them. Empty when nothing else would be left.

    >>> b = nx.MultiDiGraph()
    >>> b.add_node("x", kind="input", scope="", status=0); b.add_node("w", kind="input", scope="m", status=0)
    >>> b.add_node("t", kind="op", op="Transpose", status=0)
    >>> b.add_node("mm", kind="op", op="Matmul", status=0)
    >>> _ = [b.add_edge(u, v, key, index=i) for u, v, key, i in
    ...      [("w", "t", "a", 0), ("x", "mm", "b", 0), ("t", "mm", "c", 1)]]
    >>> {n: t.short for n, t in weight_like(b).items()}
    {'w': 'w', 't': 'wᵀ'}
    """
    order = ordered_nodes(g) if order is None else order
    nodes = g.nodes
    out: dict[Any, WeightText] = {}
    for n in order:
        d = nodes[n]
        kind = d.get("kind")
        if node_status(d):
            continue
        if kind == "constant":
            text = pretty_numbers(str(d.get("value") or d.get("label") or n))
            out[n] = WeightText(text, text if len(text) <= _SHORT_CHARS else _array_text(g, n))
        elif kind == "input":
            if is_state_input(d):
                label = str(d.get("label") or n)
                out[n] = WeightText(label, label)
        elif kind == "op":
            preds = [e[0] for e in in_edges_sorted(g, n)]
            if all(p in out for p in preds):
                out[n] = _derived(str(d.get("op") or d.get("label") or n),
                                  [out[p] for p in dict.fromkeys(preds)])
    shown = sum(1 for n in order if n not in out and nodes[n].get("kind") != "output")
    return out if shown else {}


def _derived(op: str, inputs: list[WeightText]) -> WeightText:
    if len(inputs) == 1 and op in _PASS_THROUGH:
        full = f"{op}({inputs[0].full})"
        short = inputs[0].short + _PASS_THROUGH[op]
    else:
        full = f"{op}({', '.join(i.full for i in inputs)})"
        short = f"{op}(…)" if inputs else op
    if len(full) > _DESCRIPTION_CHARS:
        full = full[: _DESCRIPTION_CHARS - 1] + "…"
    return WeightText(full, short)
