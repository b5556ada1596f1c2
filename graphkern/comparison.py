"""``gk.compare``: run two functions or models on the same inputs and find where they part ways.

Both calls are traced and run node by node (as ``gk.inspect`` does), side by side, so only the
values waiting for their counterpart are held. Outputs are matched, in this order: what each
module call returned, call by call (so a replaced layer's output is matched with the kernel node
that makes it now); nodes of the same kind, module scope and op or kernel name, by position
within the scope, as ``gk.diff`` matches them (where one side has more of them, by the matched
inputs they read); then, inside a module, the node feeding the same input of a matched consumer
(a kernel that replaced part of a layer). Shapes must agree. Each matched output is one
:class:`Row` (max abs and rel error, shapes), in the order ``a`` runs (a topological order that
follows the call, layer by layer); ``first_divergence`` is the earliest row beyond
``|a - b| <= atol + rtol * |a|``.

>>> import mlx.core as mx, graphkern as gk
>>> c = gk.compare(lambda x: mx.sqrt(mx.exp(x)), lambda x: mx.sqrt(mx.exp(x) * 1.01), mx.ones((4,)))
>>> c.first_divergence.op, c.ok
('Sqrt', False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from .capture import Wiring
from .graph import Graph
from .nodes import NodeKind
from .state import Flat
from .tolerance import errors
from .trace import Traceable
from .values import (
    _SAME_VALUES,
    GraphRun,
    _progress_bar,
    finish_values,
    run_order,
    trace_for_values,
)

__all__ = ["Comparison", "KernelCheck", "Row", "compare", "match_outputs"]

Output = tuple[str, int]  # (node, output index)
_INNER = (NodeKind.OP.value, NodeKind.KERNEL.value)
_ROWS = (*_INNER, NodeKind.OUTPUT.value)  # inputs and constants are the same on both sides
_INPUT = NodeKind.INPUT.value
#: Ops that only lay out (some of) their input's values anew: a row of one names the kernel behind it.
_VIEWS = _SAME_VALUES | {"AsStrided", "Slice"}
_ERRORS_PER_FLUSH = 256


@dataclass(frozen=True)
class Row:
    """One matched output: node ``a`` (output ``a_output``) against node ``b``.

    ``op`` is the op or kernel name, ``"Multiply -> swiglu"`` where ``b`` replaced ``a`` by
    something else; ``mismatched`` counts the elements beyond tolerance (NaN against a number
    counts); ``ok`` is None when the values could not be compared (``note`` says why).
    """

    a: str
    b: str
    a_output: int
    b_output: int
    scope: str
    op: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None
    ok: bool | None = None
    note: str = ""

    @property
    def replaced(self) -> bool:
        return "->" in self.op


@dataclass(frozen=True)
class KernelCheck:
    """A kernel node's output against its reference on the inputs it received in the graph."""

    side: str  # "a" or "b"
    node: str
    kernel: str
    scope: str
    backend: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class Comparison:
    """What :func:`compare` found; ``print(c)`` for a table, ``c.to_html()`` for a page.

    ``a`` and ``b`` are the two values graphs (``stats`` on their nodes; each matched node of
    ``b`` also carries ``comparison``, its error against ``a``).
    """

    a: Graph
    b: Graph
    rtol: float
    atol: float
    rows: list[Row] = field(default_factory=list)
    kernel_checks: list[KernelCheck] = field(default_factory=list)
    unmatched_a: list[str] = field(default_factory=list)
    unmatched_b: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> Row | None:
        """The earliest matched output (in the order ``a`` runs) beyond tolerance."""
        return next((r for r in self.rows if r.ok is False), None)

    @property
    def diverged(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    @property
    def ok(self) -> bool:
        """Every row within tolerance, every kernel check too, and no NaN/Inf started in ``b``
        that ``a`` did not have."""
        return not self.diverged and all(k.ok for k in self.kernel_checks)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"a": self.a.nx.graph.get("name"), "b": self.b.nx.graph.get("name"),
                "rtol": self.rtol, "atol": self.atol, "ok": self.ok,
                "first_divergence": asdict(first) if first else None,
                "rows": [asdict(r) for r in self.rows],
                "kernel_checks": [asdict(k) for k in self.kernel_checks],
                "unmatched": {"a": self.unmatched_a, "b": self.unmatched_b}}

    def _head(self) -> list[str]:
        a, b = self.a.nx.graph.get("name", "a"), self.b.nx.graph.get("name", "b")
        lines = [f"compare {a} ({self.a.nx.graph.get('backend')}) against {b} "
                 f"({self.b.nx.graph.get('backend')}): {len(self.rows)} matched outputs, "
                 f"{len(self.diverged)} beyond |a - b| <= {self.atol:g} + {self.rtol:g} * |a|"]
        first = self.first_divergence
        if first is None:
            lines.append("no divergence")
        else:
            lines.append(f"first divergence: {first.b} ({first.op}) in {first.scope or 'top level'}: "
                         f"max abs {_num(first.max_abs)}, max rel {_num(first.max_rel)}, "
                         f"{first.mismatched} elements beyond tolerance")
        bad = [k for k in self.kernel_checks if not k.ok]
        if self.kernel_checks:
            lines.append(f"kernels against their references in place: {len(self.kernel_checks) - len(bad)} "
                         f"of {len(self.kernel_checks)} within tolerance"
                         + (f"; first off: {bad[0].node} ({bad[0].kernel}) in {bad[0].scope}, max abs "
                            f"{_num(bad[0].max_abs)}" if bad else ""))
        if self.unmatched_a or self.unmatched_b:
            lines.append(f"unmatched: {len(self.unmatched_a)} nodes of a, {len(self.unmatched_b)} of b")
        return lines

    def table(self, rows: Sequence[Row] | None = None) -> str:
        """The rows (all by default) as a text table."""
        from tabulate import tabulate

        chosen = self.rows if rows is None else rows
        body = [[r.a if r.a == r.b else f"{r.a} | {r.b}", r.op, r.scope, _shape(r.shape),
                 _num(r.max_abs), _num(r.max_rel), {True: "ok", False: "DIVERGED", None: r.note}[r.ok]]
                for r in chosen]
        return tabulate(body, headers=["node (a | b)", "op", "scope", "shape", "max abs", "max rel", ""])

    def __str__(self) -> str:
        shown = self.diverged[:20]
        lines = self._head()
        if shown:
            lines.append(self.table(shown))
            if len(self.diverged) > len(shown):
                lines.append(f"... and {len(self.diverged) - len(shown)} more beyond tolerance "
                             "(c.table() lists every row)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison: {len(self.rows)} rows, {len(self.diverged)} diverged, ok={self.ok}>"

    def to_html(self, **options: Any) -> str:
        """One self-contained page: the compared graph ``b`` in the HTML viewer, each node coloured
        by its error against ``a`` (beyond tolerance in the "bad" colours, a closed layer by the
        worst inside it), the first divergence opened and selected; a bar above it with the
        summary and every row as a table (click a row to go to its node). ``options`` go to
        ``graphkern.viz.to_html`` (``colour_by="error_rel"``, ``collapse_depth=`` ...).

        >>> open("compare.html", "w").write(c.to_html())     # doctest: +SKIP
        """
        from .viz.html import to_html

        first = self.first_divergence
        doc = {
            "title": f"compare {self.a.nx.graph.get('name')} / {self.b.nx.graph.get('name')}",
            "summary": self._head(), "rtol": self.rtol, "atol": self.atol,
            "first": next((i for i, r in enumerate(self.rows) if r is first), None),
            "rows": [[r.b, r.b_output, r.a, r.a_output, r.op, r.scope, list(r.shape), r.dtype_a,
                      r.dtype_b, r.max_abs, r.max_rel, r.mismatched, r.ok, r.note] for r in self.rows],
            "kernel_checks": [[k.side, k.node, k.kernel, k.scope, k.backend, k.max_abs, k.max_rel, k.ok]
                              for k in self.kernel_checks],
        }
        options.setdefault("title", doc["title"])
        return to_html(self.b, comparison=doc, **options)

    def _repr_html_(self) -> str:
        from .viz.html import srcdoc_iframe

        return srcdoc_iframe(self.to_html())


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# ----------------------------------------------------------------------------- matching


class _Side:
    """One graph with what matching needs: node order, output shapes, who reads what."""

    __slots__ = ("graph", "wiring", "nodes", "order", "outputs")

    def __init__(self, graph: Graph, wiring: Wiring):
        self.graph = graph
        self.wiring = wiring
        self.nodes = graph.nx.nodes
        self.order = {n: i for i, n in enumerate(graph.nodes())}
        self.outputs: dict[str, dict[int, tuple[tuple[int, ...], str]]] = {}
        producer = wiring.producer
        for u, _, key, data in graph.nx.edges(keys=True, data=True):
            made = producer.get(key)
            index = made[1] if made is not None and made[0] == u else 0
            self.outputs.setdefault(u, {})[index] = (tuple(data["shape"]), data["dtype"])
        for node, array in wiring.outputs:  # an output node returns its producer's array
            made = producer.get(array)
            if made is not None and made[1] in self.outputs.get(made[0], {}):
                self.outputs[node] = {0: self.outputs[made[0]][made[1]]}

    def what(self, node: str) -> str:
        data = self.nodes[node]
        if data["kind"] == NodeKind.KERNEL.value:
            return str(data.get("kernel") or data["op"])
        if data["kind"] in (NodeKind.INPUT.value, NodeKind.OUTPUT.value):
            return str(data["label"])
        return str(data["op"])

    def maker(self, node: str) -> str:
        """What made ``node``'s values: its own op or kernel, or, for a view (a transpose, a
        reshape...) of a kernel's output, that kernel, whose values it holds in another layout."""
        data = self.nodes[node]
        if data["kind"] == NodeKind.OP.value and data["op"] in _VIEWS:
            reads = [r for r in self.reads(node) if r is not None]
            if len(reads) == 1 and self.nodes[reads[0][0]]["kind"] == NodeKind.KERNEL.value:
                return self.maker(reads[0][0])
        return self.what(node)

    def key(self, node: str) -> tuple[str, str, str]:
        data = self.nodes[node]
        return data["kind"], data["scope"], self.what(node)

    def shapes(self, node: str) -> tuple[tuple[int, ...], ...]:
        found = self.outputs.get(node, {})
        return tuple(found[i][0] for i in sorted(found))

    def reads(self, node: str) -> list[Output | None]:
        producer = self.wiring.producer
        if self.nodes[node]["kind"] == NodeKind.OUTPUT.value:
            array = dict(self.wiring.outputs).get(node)
            return [producer.get(array) if array is not None else None]
        return [producer.get(array) for array in self.wiring.args.get(node, ())]


def match_outputs(a: _Side, b: _Side) -> dict[Output, Output]:
    """Pairs of matched outputs, ``(node, index)`` of ``a`` -> of ``b`` (see the module)."""
    pairs: dict[Output, Output] = {}
    taken: set[Output] = set()

    def pair(x: Output, y: Output) -> None:
        if x in pairs or y in taken:
            return
        if x[1] not in a.outputs.get(x[0], {}) or y[1] not in b.outputs.get(y[0], {}):
            return
        if a.outputs[x[0]][x[1]][0] != b.outputs[y[0]][y[1]][0]:  # shapes must agree
            return
        pairs[x] = y
        taken.add(y)

    # 1. a module's outputs, call by call, where both sides' calls return as many arrays
    calls_a: dict[str, list[list[Output | None]]] = {}
    for _, path, made in a.wiring.module_calls:
        calls_a.setdefault(path, []).append(made)
    seen: dict[str, int] = {}
    for _, path, made_b in b.wiring.module_calls:
        at = seen[path] = seen.get(path, -1) + 1
        candidates = calls_a.get(path, [])
        if at < len(candidates) and len(candidates[at]) == len(made_b):
            for out_a, out_b in zip(candidates[at], made_b):
                if out_a is not None and out_b is not None:
                    pair(out_a, out_b)
    # 2. same kind, scope and op (or kernel), in topological order: the candidate reading the most
    # inputs matched to this node's; with none to tell them apart, the next by position, where
    # both sides have as many of them and no input says otherwise
    inputs_b = {b.nodes[n]["label"]: n for n in b.order if b.nodes[n]["kind"] == _INPUT}
    known: dict[Output, Output] = {(n, 0): (inputs_b[a.nodes[n]["label"]], 0) for n in a.order
                                   if a.nodes[n]["kind"] == _INPUT and a.nodes[n]["label"] in inputs_b}
    buckets_a: dict[tuple[str, str, str], list[str]] = {}
    buckets_b: dict[tuple[str, str, str], list[str]] = {}
    for node in a.order:
        if a.nodes[node]["kind"] in _ROWS:
            buckets_a.setdefault(a.key(node), []).append(node)
    for node in b.order:
        if b.nodes[node]["kind"] in _ROWS:
            buckets_b.setdefault(b.key(node), []).append(node)

    def evidence(node_a: str, node_b: str) -> tuple[int, bool]:
        """(inputs matched to each other, whether an input is matched elsewhere)."""
        agree, clash = 0, False
        for x, y in zip(a.reads(node_a), b.reads(node_b)):
            if x is None or y is None:
                continue
            seen_as = pairs.get(x) or known.get(x)
            if seen_as == y:
                agree += 1
            elif seen_as is not None:
                clash = True
        return agree, clash

    for node_a in a.order:
        key = a.key(node_a)
        nodes_b = buckets_b.get(key)
        if nodes_b is None or a.nodes[node_a]["kind"] not in _ROWS or (node_a, 0) in pairs:
            continue
        even = len(nodes_b) == len(buckets_a[key])
        best, best_score = None, 0
        for node_b in nodes_b:
            if (node_b, 0) in taken:
                continue
            agree, clash = evidence(node_a, node_b)
            if agree > best_score:
                best, best_score = node_b, agree
            elif best is None and even and not clash and not best_score:
                best = node_b  # by position: the first one free
        if best is not None:
            for index in sorted(a.outputs.get(node_a, {})):
                pair((node_a, index), (best, index))
    # 3. inside a module: what feeds the same input of a consumer matched above
    matched_nodes = {x[0]: y[0] for x, y in pairs.items()}
    for _ in range(2):  # a second pass reaches a replaced node feeding another replaced node
        for consumer_a in sorted(matched_nodes, key=a.order.__getitem__, reverse=True):
            consumer_b = matched_nodes[consumer_a]
            if a.key(consumer_a)[2] != b.key(consumer_b)[2]:
                continue
            for read_a, read_b in zip(a.reads(consumer_a), b.reads(consumer_b)):
                if read_a is not None and read_b is not None and read_a not in pairs \
                        and read_b not in taken and a.nodes[read_a[0]]["kind"] in _INNER \
                        and b.nodes[read_b[0]]["kind"] in _INNER:
                    pair(read_a, read_b)
                    if read_a in pairs:
                        matched_nodes.setdefault(read_a[0], read_b[0])
    return pairs




# ----------------------------------------------------------------------------- running


class _Lockstep:
    """Runs both graphs node by node; computes each row's difference once both sides have it."""

    def __init__(self, side_a: _Side, side_b: _Side, run_a: GraphRun, run_b: GraphRun,
                 pairs: dict[Output, Output], rtol: float, atol: float):
        self.run_a, self.run_b = run_a, run_b
        self.pairs = pairs
        self.rtol, self.atol = rtol, atol
        self.waiting_a: dict[str, set[str]] = {}  # a node -> b nodes it still waits for
        self.waiting_b: dict[str, set[str]] = {}
        for (node_a, _), (node_b, _) in pairs.items():
            self.waiting_a.setdefault(node_a, set()).add(node_b)
            self.waiting_b.setdefault(node_b, set()).add(node_a)
        self.values_a: dict[str, list[mx.array] | None] = {}
        self.values_b: dict[str, list[mx.array] | None] = {}
        self.by_nodes: dict[tuple[str, str], list[tuple[Output, Output]]] = {}
        for x, y in pairs.items():
            self.by_nodes.setdefault((x[0], y[0]), []).append((x, y))
        self.pending: list[tuple[Output, mx.array]] = []
        self.results: dict[Output, list[float] | str] = {}
        self.advance: Callable[[], None] = lambda: None

    def _settle(self, x: str, y: str) -> None:
        va, vb = self.values_a.get(x), self.values_b.get(y)
        for out_a, out_b in self.by_nodes.get((x, y), []):
            if va is None or vb is None:
                self.results[out_a] = "not reached on " + ("both sides" if va is None and vb is None
                                                           else "side a" if va is None else "side b")
            else:
                self.pending.append((out_a, errors(vb[out_b[1]], va[out_a[1]], rtol=self.rtol,
                                                   atol=self.atol)))
        self.waiting_a[x].discard(y)
        self.waiting_b[y].discard(x)
        if not self.waiting_a[x]:
            self.values_a.pop(x, None)
        if not self.waiting_b[y]:
            self.values_b.pop(y, None)

    def _seen_b(self, node: str, values: list[mx.array] | None) -> None:
        if node in self.waiting_b:
            self.values_b[node] = values
            for x in [x for x in self.waiting_b[node] if x in self.values_a]:
                self._settle(x, node)

    def _flush(self, final: bool = False) -> None:
        if not (final or self.run_a.need_flush or self.run_b.need_flush
                or len(self.pending) >= _ERRORS_PER_FLUSH):
            return
        errors = [e for _, e in self.pending]
        self.run_a.flush(errors)
        self.run_b.flush()
        for (out, _), error in zip(self.pending, errors):
            self.results[out] = error.tolist()  # type: ignore[assignment]
        self.pending = []

    def run(self) -> None:
        steps_b = self.run_b.steps()
        done_b: set[str] = set()
        finished_b = False

        def step_b() -> bool:
            try:
                node, values = next(steps_b)
            except StopIteration:
                return False
            done_b.add(node)
            self._seen_b(node, values)
            self._flush()
            self.advance()
            return True

        for node, values in self.run_a.steps():
            if node in self.waiting_a:
                self.values_a[node] = values
                for y in list(self.waiting_a[node]):
                    if y in done_b:
                        self._settle(node, y)
                while not finished_b and self.waiting_a[node]:  # run b up to its counterparts
                    finished_b = not step_b()
            self._flush()
            self.advance()
        while not finished_b and step_b():
            pass
        for x in list(self.waiting_a):  # counterparts b never reached
            for y in list(self.waiting_a[x]):
                self.values_a.setdefault(x, None)
                self._settle(x, y)
        self._flush(final=True)


def _row(side_a: _Side, side_b: _Side, x: Output, y: Output, result: list[float] | str) -> Row:
    (shape, dtype_a), (_, dtype_b) = side_a.outputs[x[0]][x[1]], side_b.outputs[y[0]][y[1]]
    what_a, what_b = side_a.what(x[0]), side_b.what(y[0])
    if what_a != what_b:  # b replaced a: by a kernel, maybe seen through a view of its output
        what_b = side_b.maker(y[0])
    op = what_a if what_a == what_b else f"{what_a} -> {what_b}"
    scope = str(side_b.nodes[y[0]]["scope"] or side_a.nodes[x[0]]["scope"])
    if isinstance(result, str):
        return Row(x[0], y[0], x[1], y[1], scope, op, shape, dtype_a, dtype_b, note=result)
    max_abs, max_rel, beyond = result
    mismatched = int(beyond)
    return Row(x[0], y[0], x[1], y[1], scope, op, shape, dtype_a, dtype_b,
               max_abs if math.isfinite(max_abs) else float("inf"),
               max_rel if math.isfinite(max_rel) else float("inf"), mismatched, mismatched == 0)


def _kernel_checks(side: str, graph: Graph) -> Iterator[KernelCheck]:
    for node in graph.kernels():
        data = graph.nx.nodes[node]
        check = data.get("reference_check")
        if not check or "max_abs" not in check:
            continue
        yield KernelCheck(side, node, str(data.get("kernel", data["op"])), str(data["scope"]),
                          str(data.get("backend", "")), check["max_abs"], check["max_rel"],
                          check["mismatched"] == 0)


def compare(a: Callable[..., Any], b: Callable[..., Any], *args: Any, rtol: float = 1e-4,
            atol: float = 1e-5, kwargs: dict[str, Any] | None = None,
            backends: tuple[str | None, str | None] = (None, None), check_kernels: bool = False,
            progress: bool | None = None) -> Comparison:
    """Run ``a`` and ``b`` (functions or models) on ``args`` (and ``kwargs``) node by node and
    compare every matched node's output (see the module). ``a`` is the reference.

    ``backends`` sets each side's kernel backend (``(None, "reference")``: the GPU kernels
    against their references, all else alike); ``check_kernels`` also runs each kernel node's
    reference on the exact inputs it received inside the model (``c.kernel_checks``).

    >>> import mlx.core as mx, graphkern as gk
    >>> c = gk.compare(lambda x: mx.sin(x) + 1, lambda x: mx.sin(x) + 1, mx.ones((3,)))
    >>> c.ok, [r.op for r in c.rows]
    (True, ['Sin', 'Broadcast', 'Add', 'output_0'])
    """
    kwargs = kwargs or {}
    traced = []
    for fn, backend in zip((a, b), backends):
        traceable = Traceable(fn)
        traced.append(trace_for_values(traceable, Flat.of(args, kwargs, traceable.arg_names), backend))
    (graph_a, wiring_a, arrays_a), (graph_b, wiring_b, arrays_b) = traced
    side_a, side_b = _Side(graph_a, wiring_a), _Side(graph_b, wiring_b)
    pairs = match_outputs(side_a, side_b)
    tolerance = (rtol, atol) if check_kernels else None
    run_a = GraphRun(graph_a, wiring_a, arrays_a, check_kernels=tolerance)
    run_b = GraphRun(graph_b, wiring_b, arrays_b, check_kernels=tolerance)
    lockstep = _Lockstep(side_a, side_b, run_a, run_b, pairs, rtol, atol)
    total = graph_a.nx.number_of_nodes() + graph_b.nx.number_of_nodes()
    with _progress_bar(progress, total) as advance:
        lockstep.advance = advance
        lockstep.run()
    finish_values(graph_a)
    finish_values(graph_b)
    position = {node: i for i, node in enumerate(run_order(graph_a))}  # as the call runs
    ordered = sorted(pairs.items(), key=lambda p: (position[p[0][0]], p[0][1]))
    rows = [_row(side_a, side_b, x, y, lockstep.results.get(x, "not compared")) for x, y in ordered]
    for row in rows:
        if row.ok is not None:
            graph_b.nx.nodes[row.b].setdefault("comparison", {}).update(
                {"against": row.a, "max_abs": row.max_abs, "max_rel": row.max_rel, "ok": row.ok})
    matched_a = {x[0] for x in pairs}
    matched_b = {y[0] for y in pairs.values()}
    result = Comparison(graph_a, graph_b, rtol, atol, rows)
    result.unmatched_a = [n for n in graph_a.nodes() if n not in matched_a
                          and graph_a.nx.nodes[n]["kind"] in _INNER]
    result.unmatched_b = [n for n in graph_b.nodes() if n not in matched_b
                          and graph_b.nx.nodes[n]["kind"] in _INNER]
    if check_kernels:
        result.kernel_checks = [*_kernel_checks("a", graph_a), *_kernel_checks("b", graph_b)]
    return result
