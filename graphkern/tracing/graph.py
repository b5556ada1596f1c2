"""``Graph``: one traced function as a networkx MultiDiGraph, with status codes and inspection.

The nodes, edges and their attributes are defined in :mod:`graphkern.tracing.schema`; ``Graph.lint()``
checks a graph against it.
"""

from __future__ import annotations

import importlib
import json
from collections import deque
from dataclasses import dataclass
from typing import Any

import networkx as nx

from ..errors import GraphFormatError
from ..launching.fastpaths import adjacency
from ..nodes import KernelError, NodeKind, Status
from .fields import TEXT, Spec
from .schema import EDGE_FIELDS, ROOT_FAILURES, lint

__all__ = ["Failure", "Graph", "GraphError", "SCHEMA", "SCHEMA_VERSION", "propagate_status"]

SCHEMA = "graphkern.tracing.graph"
SCHEMA_VERSION = 1
MAX_JSON_BYTES = 512 * 1024 * 1024
_LOAD = "load a graphkern graph from JSON"


#: Failures that depend on the values or shapes a node was given: downstream of another failure
#: they came from running on its placeholder output (zeros standing in for what the failed node
#: would have made), so they are ``UPSTREAM_FAILED``, not roots. A bad launch configuration,
#: kernel definition or source fails whatever its inputs, and stays a root.
_FOLLOW_ON = frozenset(int(s) for s in (Status.MODULE_ERROR, Status.INVALID_INPUT, Status.REFERENCE_ERROR,
                                        Status.RUNTIME_ERROR))


def propagate_status(g: nx.MultiDiGraph) -> list[str]:
    """Mark every descendant of a failed node ``UPSTREAM_FAILED`` with its root cause.

    A node's root cause is the earliest (in topological order) failed root among its ancestors.
    A node that failed on what it was given (``MODULE_ERROR``, ``INVALID_INPUT``,
    ``REFERENCE_ERROR``, ``RUNTIME_ERROR``) downstream of a failed node ran on a placeholder: it is
    ``UPSTREAM_FAILED`` too, its message kept after a note saying so. Also writes each node's
    ``order``. Returns the failed roots in topological order.

    >>> g = nx.MultiDiGraph()
    >>> g.add_edges_from([("a", "b"), ("b", "c"), ("x", "c")])
    [0, 0, 0]
    >>> nx.set_node_attributes(g, 0, "status"); g.nodes["a"]["status"] = int(Status.INVALID_LAUNCH)
    >>> propagate_status(g), g.nodes["c"]["status"], g.nodes["c"]["root_cause"]
    (['a'], 10, 'a')
    """
    roots: list[str] = []
    rank: dict[str, int] = {}
    earliest: dict[str, str] = {}  # the earliest failed root among a node's ancestors and itself
    node_data, pred, _ = adjacency(g)
    for order, node in enumerate(topological_order(g)):
        data = node_data[node]
        data["order"] = order
        causes = [earliest[p] for p in pred[node] if p in earliest]
        if causes and data.get("status", 0) in _FOLLOW_ON:  # it ran on a failed node's placeholder
            first = min(causes, key=rank.__getitem__)
            data["message"] = (f"failed after its input came from failed node {first!r} (a "
                               f"placeholder, not a real value): {data.get('message', '')}")
            data["status"] = int(Status.UPSTREAM_FAILED)
        if data.get("status", 0) in ROOT_FAILURES:
            data["root_cause"] = node
            rank[node] = len(roots)
            roots.append(node)
            causes.append(node)
        elif causes:
            data["status"] = int(Status.UPSTREAM_FAILED)
            data.setdefault("message", "")
        else:
            data["status"] = int(Status.OK)
            data["root_cause"] = None
        if causes:
            earliest[node] = min(causes, key=rank.__getitem__)
            if data["status"] == Status.UPSTREAM_FAILED:
                data["root_cause"] = earliest[node]
    return roots


def topological_order(g: nx.MultiDiGraph) -> list[str]:
    """Kahn's algorithm, ties broken by insertion order (deterministic; it reads the adjacency
    dicts directly, where ``nx.topological_sort`` counts parallel edges through views).

    >>> g = nx.MultiDiGraph([("b", "c"), ("a", "c"), ("a", "b")])
    >>> topological_order(g)
    ['a', 'b', 'c']
    """
    _, pred, succ = adjacency(g)
    pending = {node: len(preds) for node, preds in pred.items()}
    ready = deque(node for node, count in pending.items() if count == 0)
    order = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for child in succ[node]:
            pending[child] -= 1
            if pending[child] == 0:
                ready.append(child)
    if len(order) != len(pending):
        raise nx.NetworkXUnfeasible("graph contains a cycle")
    return order


@dataclass(frozen=True)
class Failure:
    """A failed root node: what failed, with which code and message, and which outputs it reaches."""

    node: str
    status: Status
    message: str
    affected_outputs: tuple[str, ...]
    scope: str = ""  # the module path the node ran in ('' outside every module)

    @property
    def where(self) -> str:
        """The node with its module path: ``'gk_rms_norm_2' in model.layers.1.input_layernorm``."""
        return f"{self.node!r}" + (f" in {self.scope}" if self.scope else " (outside any module)")

    def __str__(self) -> str:
        outs = ", ".join(self.affected_outputs) or "no outputs"
        return f"{self.where}: {self.status.name} ({self.message}) -> {outs}"


class GraphError(KernelError):
    """A compiled graph with a failed node was called: names the root node and its module path,
    code, message and the outputs it affects (``graph``: the graph showing it, where one was made
    for the error)."""

    graph: Graph | None = None

    def __init__(self, failure: Failure):
        super().__init__("run a graphkern compiled graph",
                         f"node {failure.where} failed with {failure.status.name}: "
                         f"{failure.message}; affected outputs: {list(failure.affected_outputs)}",
                         failure.status)
        self.failure = failure
        self.node = failure.node
        self.affected_outputs = failure.affected_outputs

    def __reduce__(self) -> tuple[Any, ...]:
        return (GraphError, (self.failure,))


class Graph:
    """One traced function: ``.nx`` is the networkx MultiDiGraph, the rest inspects it.

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.trace(lambda x: mx.exp(x) + 1, mx.ones((2, 2)))
    >>> [g.nx.nodes[n]["op"] for n in g.nodes("op")]
    ['Exp', 'Broadcast', 'Add']
    >>> g.status
    <Status.OK: 0>
    """

    def __init__(self, graph: nx.MultiDiGraph):
        self.nx = graph
        self._roots = propagate_status(graph)

    # ------------------------------------------------------------------ status

    def refresh(self) -> None:
        """Re-run status propagation after node statuses were changed by hand or by a run."""
        for _, data in self.nx.nodes(data=True):
            if data.get("status") == Status.UPSTREAM_FAILED:
                data["status"] = int(Status.OK)
        self._roots = propagate_status(self.nx)

    @property
    def status(self) -> Status:
        """The status of the first failed root in topological order, or OK."""
        return Status(self.nx.nodes[self._roots[0]]["status"]) if self._roots else Status.OK

    @property
    def ok(self) -> bool:
        return not self._roots

    def failures(self) -> list[Failure]:
        """Every failed root, in topological order, with the outputs it affects."""
        return [self._failure(root) for root in self._roots]

    def _failure(self, root: str) -> Failure:
        data = self.nx.nodes[root]
        reached = nx.descendants(self.nx, root)
        outputs = tuple(n for n in self.nodes("output") if n in reached)
        return Failure(root, Status(data["status"]), data.get("message", ""), outputs,
                       str(data.get("scope") or ""))

    def affected_outputs(self) -> list[str]:
        """Output nodes reached by any failure."""
        return [n for n in self.nodes("output") if self.nx.nodes[n]["status"] != Status.OK]

    def error(self) -> GraphError | None:
        """The ``GraphError`` a call of this graph raises, or None when it is OK."""
        return GraphError(self._failure(self._roots[0])) if self._roots else None

    # ------------------------------------------------------------------ inspection

    def nodes(self, kind: str | NodeKind | None = None) -> list[str]:
        """Node names in topological order, optionally of one kind."""
        order = self.topological_order()
        if kind is None:
            return order
        return [n for n in order if self.nx.nodes[n]["kind"] == str(kind)]

    def topological_order(self) -> list[str]:
        data = adjacency(self.nx)[0]  # networkx's own dict: its NodeView costs most of the sort
        return sorted(data, key=lambda n: data[n]["order"])

    def kernels(self) -> list[str]:
        """Names of the kernel nodes, in topological order."""
        return self.nodes(NodeKind.KERNEL)

    def node(self, name: str) -> dict[str, Any]:
        """The attributes of one node."""
        return self.nx.nodes[name]

    def inputs_of(self, name: str) -> list[str]:
        edges = sorted(self.nx.in_edges(name, data=True), key=lambda e: e[2].get("index", 0))
        return [src for src, _, _ in edges]

    def output_types(self, name: str) -> list[str]:
        """``float32[2, 3]`` for each distinct array leaving ``name``."""
        seen: dict[str, str] = {}
        for _, _, key, data in self.nx.out_edges(name, keys=True, data=True):
            seen.setdefault(key, f"{data['dtype']}{list(data['shape'])}")
        return list(seen.values())

    def summary(self) -> str:
        """A table of every node, in the spirit of torch.fx's ``print_tabular``."""
        from tabulate import tabulate

        rows = []
        for n in self.topological_order():
            d = self.nx.nodes[n]
            status = Status(d["status"]).name
            if d.get("root_cause") not in (None, n):
                status += f" <- {d['root_cause']}"
            rows.append([d["kind"], n, d["op"], d["scope"], ", ".join(self.inputs_of(n)),
                         ", ".join(self.output_types(n)), status])
        table = tabulate(rows, headers=["kind", "name", "op", "scope", "inputs", "outputs",
                                        "status"])
        name = self.nx.graph.get("name", "graph")
        counts = {k: len(self.nodes(k)) for k in ("op", "kernel")}
        head = (f"graph {name}: {counts['op']} ops, {counts['kernel']} kernels, "
                f"backend {self.nx.graph.get('backend', '?')}, status {self.status.name}")
        return head + "\n" + table

    def print_tabular(self) -> None:
        print(self.summary())

    def __repr__(self) -> str:
        return (f"<Graph {self.nx.graph.get('name', '')!r}: {self.nx.number_of_nodes()} nodes, "
                f"{len(self.kernels())} kernels, status {self.status.name}>")

    def collapse(self, depth: int) -> nx.MultiDiGraph:
        """Group nodes by the first ``depth`` parts of their module scope.

        Each group becomes one node (attributes: ``scope``, ``members``, ``status`` — the worst
        in the group, root failures over UPSTREAM_FAILED); edges between groups keep their
        arrays' shapes and dtypes.
        """
        def group(n: str) -> str:
            d = self.nx.nodes[n]
            if d["kind"] in ("input", "output", "constant") or not d["scope"]:
                return n
            return ".".join(d["scope"].split(".")[:depth]) if depth > 0 else d["scope"]

        out = nx.MultiDiGraph()
        out.graph.update(self.nx.graph)
        for n, d in self.nx.nodes(data=True):
            key = group(n)
            if key not in out:
                out.add_node(key, scope=key if key != n else d["scope"], members=[],
                             status=int(Status.OK), kind=d["kind"] if key == n else "group")
            g = out.nodes[key]
            g["members"].append(n)
            g["status"] = _worse(g["status"], d["status"])
        for u, v, k, d in self.nx.edges(keys=True, data=True):
            gu, gv = group(u), group(v)
            if gu != gv and not out.has_edge(gu, gv, key=k):
                out.add_edge(gu, gv, key=k, **d)
        return out

    def lint(self) -> None:
        """Check the graph against its contract (:mod:`graphkern.tracing.schema`), as ``torch.fx``'s
        ``Graph.lint()`` does; raises ``KernelError`` listing every problem.

        >>> import mlx.core as mx, graphkern as gk
        >>> gk.trace(lambda x: x + 1, mx.ones((2,))).lint()
        """
        problems = lint(self.nx)
        if problems:
            raise GraphFormatError("lint a graphkern graph", _listed(problems), Status.INVALID_INPUT)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        nodes = [{"id": n, **self.nx.nodes[n]} for n in self.topological_order()]
        order = {n: d["order"] for n, d in self.nx.nodes(data=True)}
        edges = [{"source": u, "target": v, "key": k, **{**d, "shape": list(d["shape"])}}
                 for u, v, k, d in sorted(self.nx.edges(keys=True, data=True),
                                          key=lambda e: (order[e[0]], order[e[1]], e[2]))]
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "graph": dict(self.nx.graph),
                "nodes": nodes, "edges": edges}

    def to_json(self, indent: int | None = None) -> str:
        """The versioned JSON form; ``Graph.from_json`` reads it back exactly.

        >>> import mlx.core as mx, graphkern as gk
        >>> g = gk.trace(lambda x: x * 2, mx.ones((3,)))
        >>> gk.Graph.from_json(g.to_json()) == g
        True
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Graph:
        """Load a graph written by ``to_json`` (plain JSON, never pickle); raises ``GraphFormatError``
        naming what is wrong with a corrupt, truncated, oversized or wrong-version document, and
        with one whose graph breaks the contract of :mod:`graphkern.tracing.schema` (every field,
        down to the items of its lists and objects: ``node 'k': template_floats['EPS'] must be a
        number, got str``). What loads passes ``lint``, so every drawing can be made of it."""
        if isinstance(text, (bytes, bytearray)):
            if len(text) > MAX_JSON_BYTES:
                raise _load_error(f"document is {len(text)} bytes, over {MAX_JSON_BYTES}")
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _load_error(f"not UTF-8 text ({exc.reason} at byte {exc.start}); the file "
                                  f"may be corrupt") from None
        if not isinstance(text, str):
            raise _load_error(f"expected str or bytes, got {type(text).__name__}")
        if len(text) > MAX_JSON_BYTES:
            raise _load_error(f"document is {len(text)} characters, over {MAX_JSON_BYTES}")
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, over-long numbers
            raise _load_error(f"not valid JSON ({exc}); the file may be truncated or corrupt") from exc
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Any) -> Graph:
        """The graph of a parsed document (see ``from_json``)."""
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise _load_error(f"not a graphkern graph (expected schema {SCHEMA!r})")
        version = doc.get("version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise _load_error(f"unsupported schema version {version!r}; "
                              f"this graphkern reads version {SCHEMA_VERSION}")
        nodes, edges = doc.get("nodes"), doc.get("edges")
        if not isinstance(nodes, list) or not isinstance(edges, list) or not isinstance(
                doc.get("graph"), dict):
            raise _load_error("'graph', 'nodes' and 'edges' must be an object and two lists")
        g = nx.MultiDiGraph()
        g.graph.update(doc["graph"])
        for item in nodes:
            _require(item, _NODE_KEYS, "node")
            name = item["id"]
            if name in g:
                raise _load_error(f"node {name!r} appears twice")
            g.add_node(name, **{k: v for k, v in item.items() if k != "id"})
        for item in edges:
            _require(item, _EDGE_KEYS, "edge")
            source, target, key = item["source"], item["target"], item["key"]
            if source not in g or target not in g:
                raise _load_error(f"edge {source!r} -> {target!r} names a missing node")
            if g.has_edge(source, target, key=key):
                raise _load_error(f"edge {source!r} -> {target!r} ({key!r}) appears twice")
            data = {k: v for k, v in item.items() if k not in ("source", "target", "key")}
            data["shape"] = tuple(item["shape"])
            g.add_edge(source, target, key=key, **data)
        problems = lint(g)  # every field, down to the items of lists and objects, and the structure
        if problems:
            raise _load_error(_listed(problems))
        graph = cls.__new__(cls)
        graph.nx = g
        graph._roots = [n for n in sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
                        if g.nodes[n]["status"] in ROOT_FAILURES]
        return graph

    # ------------------------------------------------------------------ pictures

    #: The module that draws graphs, imported by name at the first picture, as pandas finds its
    #: plotting backend: the graph does not depend on its drawing (``graphkern.viz`` uses the
    #: graph, not the reverse). It provides ``to_dot(graph, **options)``, ``render(graph, path,
    #: format, **options)``, ``to_html(graph, **options)``, ``to_model_explorer(graph)`` and
    #: ``repr_html(graph)``; set this (on the class or one graph) to draw another way.
    drawing_backend = "graphkern.viz"

    def _drawing(self) -> Any:
        return importlib.import_module(self.drawing_backend)

    def to_dot(self, **options: Any) -> str:
        """Graphviz DOT source: scopes as clusters, kernels styled apart, failures in red."""
        return self._drawing().to_dot(self, **options)  # type: ignore[no-any-return]

    def render(self, path: str, format: str | None = None, **options: Any) -> str:
        """Render through Graphviz to ``path`` in the format its suffix names (.svg, .png,
        .pdf); returns the written path. ``options`` go to ``graphkern.viz.dot.render``."""
        return self._drawing().render(self, path, format, **options)  # type: ignore[no-any-return]

    def to_html(self, **options: Any) -> str:
        """A self-contained interactive HTML viewer (works offline)."""
        return self._drawing().to_html(self, **options)  # type: ignore[no-any-return]

    def to_model_explorer(self) -> dict[str, Any]:
        """The graph in Model Explorer's graph JSON format."""
        return self._drawing().to_model_explorer(self)  # type: ignore[no-any-return]

    def _repr_html_(self) -> str:
        return self._drawing().repr_html(self)  # type: ignore[no-any-return]


_SEVERITY = {int(Status.OK): 0, int(Status.UPSTREAM_FAILED): 1}


def _worse(a: int, b: int) -> int:
    return max(a, b, key=lambda s: (_SEVERITY.get(s, 2), s))


def _load_error(description: str) -> GraphFormatError:
    return GraphFormatError(_LOAD, description, Status.INVALID_INPUT)


def _listed(problems: list[str], shown: int = 10) -> str:
    """The first ``shown`` problems in one line, and how many more there are."""
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


#: what a document's node and edge must hold before the graph can be built (lint checks the rest)
_NODE_KEYS: dict[str, Spec] = {"id": TEXT}
_EDGE_KEYS: dict[str, Spec] = {"source": TEXT, "target": TEXT, "key": TEXT,
                               "shape": EDGE_FIELDS["shape"][0]}


def _require(item: Any, fields: dict[str, Spec], what: str) -> None:
    """``item`` is an object holding every field of ``fields``, each a value its spec accepts."""
    if not isinstance(item, dict):
        raise _load_error(f"each {what} must be an object, got {type(item).__name__}")
    name = item.get("id", item.get("source", "?"))
    missing = [k for k in fields if k not in item]
    if missing:
        raise _load_error(f"{what} {name!r} lacks {missing}")
    for key, spec in fields.items():
        found = spec.problem(item[key], key)
        if found is not None:
            raise _load_error(f"{what} {name!r}: {found}")
