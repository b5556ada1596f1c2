"""The graph's contract in one place: node kinds, node and edge attributes, and ``lint``.

A traced function is one ``networkx.MultiDiGraph``. Its nodes are of the kinds of
:class:`~graphkern.nodes.NodeKind`:

- ``input``: an argument of the traced function, or a piece of state it reads (a module
  parameter is named by its path, ``layers.0.mlp.gate_proj.weight``, and sits in that scope);
- ``constant``: an array MLX captured as a constant (``value`` gives its text);
- ``op``: one MLX primitive (``op`` is MLX's name, ``arguments`` its state as text);
- ``kernel``: one graphkern kernel launch, whatever primitives it ran as (the reference's ops on a
  CPU, ``CustomKernel`` on a GPU);
- ``collective``: one collective of ``mx.distributed`` (``all_sum``, ``all_gather``, ``all_max``,
  ``all_min``, ``sum_scatter``, ``send``, ``recv``) or the ``sum_gradients`` of a sharded layer
  (the identity forward whose backward sums gradients over the group), as graphkern stood it in
  while tracing (``op`` is the collective's name, ``call_index`` its position among the call's
  collectives);
- ``output``: one output of the traced function.

Every node carries the attributes of :data:`NODE_FIELDS`; kernel nodes add those of
:data:`KERNEL_FIELDS`, collective nodes those of :data:`COLLECTIVE_FIELDS`; any node may carry
those of :data:`OPTIONAL_FIELDS`. Each table gives a field's value as a checker of
:mod:`graphkern.tracing.fields` (a string, a list of ``[name, value]`` pairs, an object of numbers...),
so ``lint`` checks every field down to the items of its lists and objects, and ``Graph.from_json``
refuses a file whose fields it would not pass, naming the field. A kernel node's
launch configuration (``grid``, ``threadgroup``, ``template``) is the one it ran with, or for a
launch refused before running, the one it was given. The graph's own attributes (``g.graph``)
name the traced function (``name``), the ``backend``, ``mlx_version``, each module path's class
(``modules``) and the sources of the kernels launched by backend, keyed by source hash
(``kernel_sources``); a trace with collectives adds this process's ``rank`` and ``group_size``
(:data:`GRAPH_FIELDS`).
A graph of several ranks (``graphkern.distributed.merge``) gives every node its ``on_rank`` and
links the ranks' collectives by edges marked ``cross_rank``. Each edge is one array
flowing from its producer to one consumer, keyed by MLX's name for the array, with the
attributes of :data:`EDGE_FIELDS` (``index`` is the argument position at the consumer).
Statuses are :class:`~graphkern.nodes.Status` codes: a failed node is its own ``root_cause``;
each descendant is ``UPSTREAM_FAILED`` with the root that failed first.

>>> import mlx.core as mx, graphkern as gk
>>> lint(gk.trace(lambda x: mx.exp(x) * 2, mx.ones((3,))).nx)
[]
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import networkx as nx

from ..nodes import NodeKind, Status, dtype_from_name
from .fields import (
    COUNT,
    FLAG,
    INT,
    NUMBER,
    PAIR,
    TEXT,
    Check,
    ListOf,
    MapOf,
    Maybe,
    OneOf,
    Record,
    Spec,
    Whole,
)
from .fields import typed as _typed

__all__ = ["COLLECTIVES", "COLLECTIVE_FIELDS", "EDGE_FIELDS", "GRAPH_FIELDS", "KERNEL_FIELDS", "NODE_FIELDS",
           "OPTIONAL_EDGE_FIELDS", "OPTIONAL_FIELDS", "ROOT_FAILURES", "STAT_KEYS", "Fields",
           "field_problems", "lint", "stats_problems"]

#: The keys of a node's ``stats``.
STAT_KEYS = ("min", "max", "mean", "absmax", "nan", "inf")


def _stats_problem(stats: Any, path: str) -> str | None:
    """What is wrong with one ``stats`` object at ``path`` (the first problem), or None."""
    if not isinstance(stats, dict) or tuple(stats) != STAT_KEYS:
        return (f"{path} must have the keys {list(STAT_KEYS)} in order, got "
                f"{list(stats) if isinstance(stats, dict) else type(stats).__name__}")
    for key in ("nan", "inf"):
        if not _typed(stats[key], (int,)) or stats[key] < 0:
            return f"{path}[{key!r}] is {stats[key]!r}, not a count"
    summary = [stats[key] for key in STAT_KEYS[:4]]
    if not (all(v is None for v in summary) or all(
            _typed(v, (float, int)) and math.isfinite(v) for v in summary)):
        return f"{path} min/max/mean/absmax must be finite numbers or all None, got {summary}"
    return None


#: Name -> (what its value must be, what it means).
Fields = dict[str, tuple[Spec, str]]

STATS = Check(_stats_problem, "a stats object")
#: a grid or threadgroup as launched (ints), or as given to a launch refused before it ran (texts)
_DIMS = Maybe(ListOf(OneOf((INT, TEXT), "an int or a string")))

#: Attributes every node has.
NODE_FIELDS: Fields = {
    "kind": (TEXT, "one of NodeKind's values"),
    "label": (TEXT, "the name shown for the node"),
    "op": (TEXT, "MLX's primitive name (op nodes) or the kernel's name (kernel nodes); '' otherwise"),
    "scope": (TEXT, "the module path the node ran in ('' outside every module)"),
    "status": (INT, "a Status code"),
    "order": (COUNT, "the node's position in topological order"),
}
#: Attributes some nodes have.
OPTIONAL_FIELDS: Fields = {
    "root_cause": (Maybe(TEXT), "the failed node behind a non-OK status (itself for a root)"),
    "message": (TEXT, "what failed, for a failed node"),
    "value": (TEXT, "a constant's value as text"),
    "arguments": (TEXT, "an op's MLX state as text"),
    "call_index": (COUNT, "the launch's position among the traced call's launches"),
    "generated_name": (Maybe(TEXT), "the function name MLX generated for a GPU kernel"),
    "state": (FLAG, "an input the function reads as state (a module parameter, a closure "
                    "array) rather than takes as an argument"),
    "input_names": (ListOf(TEXT), "a kernel's names for its inputs, in order"),
    "source_hash": (TEXT, "a kernel's source hash, its key in the graph's kernel_sources"),
    "grid": (_DIMS, "a kernel's grid (as given, for a launch refused before it ran)"),
    "threadgroup": (_DIMS, "a kernel's threadgroup (as given, for a launch refused before it ran)"),
    "template": (ListOf(PAIR), "a kernel's template arguments, [name, value as text] pairs"),
    "template_floats": (MapOf(NUMBER), "a kernel's int template arguments that hold float32 bits, "
                                       "decoded ({'EPS': 1e-05})"),
    "stats": (STATS, "summary of the node's output (gk.inspect): STAT_KEYS, min/max/mean/absmax "
                     "over the finite elements (None when none), nan and inf counts"),
    "output_stats": (ListOf(Maybe(STATS)), "one stats per output, for a node of several outputs"),
    "values_note": (TEXT, "why gk.inspect could not reach the node's output"),
    "module_outputs": (ListOf(TEXT), "the module paths whose call returned this node's output"),
    "reference_check": (Record({"error": TEXT, "max_abs": NUMBER, "max_rel": NUMBER, "mismatched": COUNT,
                                "rtol": NUMBER, "atol": NUMBER}),
                        "a kernel's output against its reference on the same inputs: max_abs, "
                        "max_rel, mismatched, rtol, atol (gk.Inspector(check_kernels=True)), or "
                        "the error the reference raised"),
    "comparison": (Record({"against": TEXT, "max_abs": Maybe(NUMBER), "max_rel": Maybe(NUMBER),
                           "ok": Maybe(FLAG)}),
                   "after gk.compare, on the second graph's nodes: against (the first graph's "
                   "node), max_abs, max_rel, ok"),
    "on_rank": (COUNT, "the rank whose graph the node belongs to, in a graph of several ranks"),
}
#: Attributes of kernel nodes.
KERNEL_FIELDS: Fields = {
    "kernel": (TEXT, "the kernel's name"),
    "backend": (TEXT, "metal, cuda or reference ('' when the launch was refused before)"),
    "source": (Maybe(TEXT), "the kernel body compiled on the backend"),
}
#: What a collective node's ``op`` may be.
COLLECTIVES = frozenset({"all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv",
                         "sum_gradients"})
#: Attributes of collective nodes.
COLLECTIVE_FIELDS: Fields = {
    "reduce": (Maybe(TEXT), "sum, max or min for reductions (sum_gradients: its backward's sum)"),
    "group_size": (Whole(1, "a positive int"), "the size of the group the collective ran over"),
    "rank": (COUNT, "this process's rank in that group"),
    "peer": (Maybe(COUNT), "the destination of a send, the source of a recv; None otherwise"),
}
#: Attributes of every edge.
EDGE_FIELDS: Fields = {
    "shape": (ListOf(COUNT, expected="a list of non-negative ints"), "the array's shape"),
    "dtype": (TEXT, "the array's dtype name"),
    "index": (COUNT, "the argument position at the consumer"),
}
#: Attributes some edges have.
OPTIONAL_EDGE_FIELDS: Fields = {
    "cross_rank": (FLAG, "an array of one rank read by another rank's collective"),
    "inputs": (ListOf(TEXT), "into a kernel: the input names the array is passed as (two when one array "
                             "is passed twice)"),
}
#: Attributes of the graph itself (``g.graph``); every one is optional.
GRAPH_FIELDS: Fields = {
    "name": (TEXT, "the traced function's name"),
    "backend": (TEXT, "the backend the kernels ran on"),
    "mlx_version": (TEXT, "the MLX that traced it"),
    "modules": (MapOf(TEXT), "each module path's class name"),
    "kernel_sources": (MapOf(MapOf(TEXT)), "the launched kernels' sources by backend, keyed by "
                                           "source hash"),
    "rank": (COUNT, "this process's rank, for a trace with collectives"),
    "group_size": (Whole(1, "a positive int"), "the size of its group, for a trace with collectives"),
    "ranks": (ListOf(COUNT), "the ranks of a graph of several ranks"),
    "unmatched_collectives": (ListOf(TEXT), "collectives of a graph of several ranks that no other "
                                            "rank's match"),
    "values": (MapOf(COUNT), "after gk.inspect: how many nodes got values (nodes, unreached, "
                             "from_eager_run)"),
}
ROOT_FAILURES = frozenset(int(s) for s in Status if s not in (Status.OK, Status.UPSTREAM_FAILED))
_KINDS = frozenset(k.value for k in NodeKind)
_STATUSES = frozenset(int(s) for s in Status)


def _field_problems(where: str, data: dict[str, Any], fields: Fields, required: bool) -> list[str]:
    """Each field of ``fields`` that ``data`` lacks (when ``required``) or holds a wrong value in."""
    problems = []
    for name, (spec, _) in fields.items():
        if name not in data:
            if required:
                problems.append(f"{where} lacks {name!r}")
            continue
        found = spec.problem(data[name], name)
        if found is not None:
            problems.append(f"{where}: {found}")
    return problems


def _node_problems(g: nx.MultiDiGraph, node: Any, data: dict[str, Any]) -> list[str]:
    """The fields of one node, by its kind, and what its kind and status allow."""
    where = f"node {node!r}"
    problems = _field_problems(where, data, NODE_FIELDS, required=True)
    problems += _field_problems(where, data, OPTIONAL_FIELDS, required=False)
    kind = data.get("kind")
    if isinstance(kind, str) and kind not in _KINDS:
        problems.append(f"{where} has unknown kind {kind!r}")
    if kind == NodeKind.KERNEL.value:
        problems += _field_problems(where, data, KERNEL_FIELDS, required=True)
    if kind == NodeKind.COLLECTIVE.value:
        problems += _field_problems(where, data, COLLECTIVE_FIELDS, required=True)
        if data.get("op") not in COLLECTIVES:
            problems.append(f"{where} is a collective of unknown op {data.get('op')!r}")
    if kind in (NodeKind.INPUT.value, NodeKind.CONSTANT.value) and g.in_degree(node):
        problems.append(f"{where} is an {kind} but has predecessors")
    if kind == NodeKind.OUTPUT.value and g.out_degree(node):
        problems.append(f"{where} is an output but has successors")
    status = data.get("status")
    if _typed(status, (int,)) and status not in _STATUSES:
        problems.append(f"{where} has unknown status {status!r}")
    return problems


def _edge_problems(u: Any, v: Any, key: Any, data: dict[str, Any]) -> list[str]:
    where = f"edge {u!r} -> {v!r} ({key!r})"
    problems = [] if isinstance(key, str) else [f"{where}: the key must be the array's name"]
    problems += _field_problems(where, data, EDGE_FIELDS, required=True)
    problems += _field_problems(where, data, OPTIONAL_EDGE_FIELDS, required=False)
    dtype = data.get("dtype")
    if isinstance(dtype, str):
        try:
            dtype_from_name(dtype)
        except KeyError:
            problems.append(f"{where}: unknown dtype {dtype!r}")
    return problems


def field_problems(g: nx.MultiDiGraph) -> list[str]:
    """Every attribute of the graph, its nodes and its edges that is missing where required or
    holds a value its table does not allow (attributes no table names are left alone)."""
    problems = _field_problems("graph", g.graph, GRAPH_FIELDS, required=False)
    for node, data in g.nodes(data=True):
        problems += _node_problems(g, node, data)
    for u, v, key, data in g.edges(keys=True, data=True):
        problems += _edge_problems(u, v, key, data)
    return problems


def lint(g: nx.MultiDiGraph) -> list[str]:
    """Every way ``g`` breaks the contract above, as sentences (empty when it holds): missing or
    mistyped attributes (of the graph, its nodes and edges, down to the items of lists and
    objects), unknown kinds, statuses or dtypes, inputs with predecessors, outputs with
    successors, cycles, an ``order`` that is not a topological order, statuses that do not
    follow from their root causes."""
    problems = field_problems(g)
    if problems:
        return problems
    if not nx.is_directed_acyclic_graph(g):
        return ["the edges form a cycle"]
    nodes = g.nodes
    orders = sorted(data["order"] for _, data in nodes(data=True))
    if orders != list(range(len(orders))):
        problems.append("'order' is not 0 .. n-1, each once")
    for u, v in g.edges():
        if nodes[u]["order"] >= nodes[v]["order"]:
            problems.append(f"'order' puts {v!r} before its input {u!r}")
    return problems + _status_problems(g)


def stats_problems(where: str, stats: Any) -> list[str]:
    """What is wrong with one ``stats`` dict: its keys, the counts (non-negative ints) and the
    summaries (finite floats, or all None when no element is finite).

    >>> stats_problems("n", {"min": 0.0, "max": 1.0, "mean": 0.5, "absmax": 1.0, "nan": 0, "inf": 0})
    []
    >>> stats_problems("n", {"min": 0.0, "max": 1.0, "mean": 0.5, "absmax": 1.0, "nan": -1, "inf": 0})
    ["n: stats['nan'] is -1, not a count"]
    """
    found = _stats_problem(stats, "stats")
    return [] if found is None else [f"{where}: {found}"]


def _status_problems(g: nx.MultiDiGraph) -> list[str]:
    """Statuses that do not follow from their root causes (one walk down from each root cause,
    not one path search per failed node)."""
    problems = []
    below: dict[Any, list[Any]] = defaultdict(list)  # root cause -> the nodes UPSTREAM_FAILED from it
    for node, data in g.nodes(data=True):
        status, cause = data["status"], data.get("root_cause")
        if status in ROOT_FAILURES and cause != node:
            problems.append(f"node {node!r} failed but its root_cause is {cause!r}")
        elif status == Status.UPSTREAM_FAILED:
            if cause not in g or g.nodes[cause]["status"] not in ROOT_FAILURES:
                problems.append(f"node {node!r} is UPSTREAM_FAILED from {cause!r}, not a failed node")
            else:
                below[cause].append(node)
        elif status == Status.OK:
            failed = [p for p in g.predecessors(node) if g.nodes[p]["status"] != Status.OK]
            if failed:
                problems.append(f"node {node!r} is OK below the failed {failed[0]!r}")
    for cause, nodes in below.items():
        reached = nx.descendants(g, cause)
        problems += [f"node {node!r} is UPSTREAM_FAILED from {cause!r}, which is not upstream"
                     for node in nodes if node not in reached]
    return problems
