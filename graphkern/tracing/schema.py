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
:data:`KERNEL_FIELDS`, collective nodes those of :data:`COLLECTIVE_FIELDS`. A kernel node's
launch configuration (``grid``, ``threadgroup``, ``template``) is the one it ran with, or for a
launch refused before running, the one it was given. The graph's own attributes (``g.graph``)
name the traced function (``name``), the ``backend``, ``mlx_version``, each module path's class
(``modules``) and the sources of the kernels launched by backend, keyed by source hash
(``kernel_sources``); a trace with collectives adds this process's ``rank`` and ``group_size``.
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
from typing import Any

import networkx as nx

from ..nodes import NodeKind, Status, dtype_from_name

__all__ = ["COLLECTIVES", "COLLECTIVE_FIELDS", "EDGE_FIELDS", "KERNEL_FIELDS", "NODE_FIELDS",
           "OPTIONAL_EDGE_FIELDS", "OPTIONAL_FIELDS", "ROOT_FAILURES", "STAT_KEYS", "lint",
           "stats_problems"]

_NONE = type(None)

#: Attributes every node has: name -> (JSON types allowed, meaning).
NODE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), "one of NodeKind's values"),
    "label": ((str,), "the name shown for the node"),
    "op": ((str,), "MLX's primitive name (op nodes) or the kernel's name (kernel nodes); '' otherwise"),
    "scope": ((str,), "the module path the node ran in ('' outside every module)"),
    "status": ((int,), "a Status code"),
    "order": ((int,), "the node's position in topological order"),
}
#: Attributes some nodes have.
OPTIONAL_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "root_cause": ((str, _NONE), "the failed node behind a non-OK status (itself for a root)"),
    "message": ((str,), "what failed, for a failed node"),
    "value": ((str,), "a constant's value as text"),
    "arguments": ((str,), "an op's MLX state as text"),
    "call_index": ((int,), "the launch's position among the traced call's launches"),
    "generated_name": ((str, _NONE), "the function name MLX generated for a GPU kernel"),
    "state": ((bool,), "an input the function reads as state (a module parameter, a closure "
                       "array) rather than takes as an argument"),
    "input_names": ((list,), "a kernel's names for its inputs, in order"),
    "template_floats": ((dict,), "a kernel's int template arguments that hold float32 bits, "
                                 "decoded ({'EPS': 1e-05})"),
    "stats": ((dict,), "summary of the node's output (gk.inspect): STAT_KEYS, min/max/mean/absmax "
                       "over the finite elements (None when none), nan and inf counts"),
    "output_stats": ((list,), "one stats per output, for a node of several outputs"),
    "values_note": ((str,), "why gk.inspect could not reach the node's output"),
    "module_outputs": ((list,), "the module paths whose call returned this node's output"),
    "reference_check": ((dict,), "a kernel's output against its reference on the same inputs: "
                                 "max_abs, max_rel, mismatched, rtol, atol "
                                 "(gk.Inspector(check_kernels=True))"),
    "comparison": ((dict,), "after gk.compare, on the second graph's nodes: against (the first "
                            "graph's node), max_abs, max_rel, ok"),
    "on_rank": ((int,), "the rank whose graph the node belongs to, in a graph of several ranks"),
}
#: The keys of a node's ``stats``.
STAT_KEYS = ("min", "max", "mean", "absmax", "nan", "inf")
#: Attributes of kernel nodes.
KERNEL_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kernel": ((str,), "the kernel's name"),
    "backend": ((str,), "metal, cuda or reference ('' when the launch was refused before)"),
    "source": ((str, _NONE), "the kernel body compiled on the backend"),
}
#: What a collective node's ``op`` may be.
COLLECTIVES = frozenset({"all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv",
                         "sum_gradients"})
#: Attributes of collective nodes.
COLLECTIVE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "reduce": ((str, _NONE), "sum, max or min for reductions (sum_gradients: its backward's sum)"),
    "group_size": ((int,), "the size of the group the collective ran over"),
    "rank": ((int,), "this process's rank in that group"),
    "peer": ((int, _NONE), "the destination of a send, the source of a recv; None otherwise"),
}
#: Attributes of every edge.
EDGE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "shape": ((tuple, list), "the array's shape"),
    "dtype": ((str,), "the array's dtype name"),
    "index": ((int,), "the argument position at the consumer"),
}
#: Attributes some edges have.
OPTIONAL_EDGE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "cross_rank": ((bool,), "an array of one rank read by another rank's collective"),
    "inputs": ((list,), "into a kernel: the input names the array is passed as (two when one array "
                        "is passed twice)"),
}
ROOT_FAILURES = frozenset(int(s) for s in Status if s not in (Status.OK, Status.UPSTREAM_FAILED))
_KINDS = frozenset(k.value for k in NodeKind)
_STATUSES = frozenset(int(s) for s in Status)


def _typed(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _field_problems(where: str, data: dict[str, Any],
                    fields: dict[str, tuple[tuple[type, ...], str]], required: bool) -> list[str]:
    problems = []
    for name, (types, _) in fields.items():
        if name not in data:
            if required:
                problems.append(f"{where} lacks {name!r}")
        elif not _typed(data[name], types):
            problems.append(f"{where}: {name!r} is {type(data[name]).__name__}, expected "
                            f"{' or '.join(t.__name__ for t in types)}")
    return problems


def lint(g: nx.MultiDiGraph) -> list[str]:
    """Every way ``g`` breaks the contract above, as sentences (empty when it holds): missing or
    mistyped attributes, unknown kinds, statuses or dtypes, inputs with predecessors, outputs
    with successors, cycles, an ``order`` that is not a topological order, statuses that do not
    follow from their root causes."""
    problems: list[str] = []
    nodes = g.nodes
    for node, data in nodes(data=True):
        where = f"node {node!r}"
        problems += _field_problems(where, data, NODE_FIELDS, required=True)
        problems += _field_problems(where, data, OPTIONAL_FIELDS, required=False)
        kind = data.get("kind")
        if kind not in _KINDS:
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
        if status not in _STATUSES:
            problems.append(f"{where} has unknown status {status!r}")
        for stats in [data.get("stats"), *(data.get("output_stats") or [])]:
            if stats is not None:
                problems += stats_problems(where, stats)
    for u, v, key, data in g.edges(keys=True, data=True):
        where = f"edge {u!r} -> {v!r} ({key!r})"
        if not isinstance(key, str):
            problems.append(f"{where}: the key must be the array's name")
        problems += _field_problems(where, data, EDGE_FIELDS, required=True)
        problems += _field_problems(where, data, OPTIONAL_EDGE_FIELDS, required=False)
        shape = data.get("shape", ())
        if isinstance(shape, (tuple, list)) and not all(_typed(d, (int,)) and d >= 0 for d in shape):
            problems.append(f"{where}: shape {shape!r} is not non-negative ints")
        try:
            dtype_from_name(data.get("dtype", ""))
        except KeyError:
            problems.append(f"{where}: unknown dtype {data.get('dtype')!r}")
    if problems:
        return problems
    if not nx.is_directed_acyclic_graph(g):
        return ["the edges form a cycle"]
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
    """
    if not isinstance(stats, dict) or tuple(stats) != STAT_KEYS:
        return [f"{where}: stats must have the keys {list(STAT_KEYS)} in order, got "
                f"{list(stats) if isinstance(stats, dict) else type(stats).__name__}"]
    problems = [f"{where}: stats[{key!r}] is {stats[key]!r}, not a count" for key in ("nan", "inf")
                if not _typed(stats[key], (int,)) or stats[key] < 0]
    summary = [stats[key] for key in STAT_KEYS[:4]]
    if not (all(v is None for v in summary) or all(
            _typed(v, (float, int)) and math.isfinite(v) for v in summary)):
        problems.append(f"{where}: stats min/max/mean/absmax must be finite numbers or all None, "
                        f"got {summary}")
    return problems


def _status_problems(g: nx.MultiDiGraph) -> list[str]:
    problems = []
    for node, data in g.nodes(data=True):
        status, cause = data["status"], data.get("root_cause")
        if status in ROOT_FAILURES and cause != node:
            problems.append(f"node {node!r} failed but its root_cause is {cause!r}")
        elif status == Status.UPSTREAM_FAILED:
            if cause not in g or g.nodes[cause]["status"] not in ROOT_FAILURES:
                problems.append(f"node {node!r} is UPSTREAM_FAILED from {cause!r}, not a failed node")
            elif not nx.has_path(g, cause, node):
                problems.append(f"node {node!r} is UPSTREAM_FAILED from {cause!r}, which is not upstream")
        elif status == Status.OK:
            failed = [p for p in g.predecessors(node) if g.nodes[p]["status"] != Status.OK]
            if failed:
                problems.append(f"node {node!r} is OK below the failed {failed[0]!r}")
    return problems
