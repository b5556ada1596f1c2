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

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from ..nodes import NodeKind, dtype_name
from ..tracing.capture import Wiring
from ..tracing.graph import Graph
from ..tracing.state import Flat
from ..tracing.traceable import Traceable
from .interpreter import run_order
from .precision import ROUNDING_MARGIN, beyond_rounding, float32_state, is_half, main_float_dtype
from .progress import Progress, progress_line
from .tolerance import errors
from .values import SAME_VALUES, GraphRun, finish_values, trace_for_values

__all__ = ["MARGINAL_EXCESS", "Comparison", "KernelCheck", "ParameterRow", "Row", "compare",
           "compare_parameters", "match_outputs"]

Output = tuple[str, int]  # (node, output index)
_INNER = (NodeKind.OP.value, NodeKind.KERNEL.value)
_ROWS = (*_INNER, NodeKind.OUTPUT.value)  # inputs and constants are the same on both sides
_INPUT = NodeKind.INPUT.value
#: Ops that only lay out (some of) their input's values anew: a row of one names the kernel behind it.
_VIEWS = SAME_VALUES | {"AsStrided", "Slice"}
_ERRORS_PER_FLUSH = 256
#: A divergence at most this many times what the rule allows is weak (see ``Comparison.marginal``).
MARGINAL_EXCESS = 2.0


@dataclass(frozen=True, kw_only=True)
class _Errors:
    """How far ``b``'s values are from ``a``'s: largest abs and rel errors, elements beyond."""

    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None
    ok: bool | None = None
    note: str = ""


@dataclass(frozen=True)
class Row(_Errors):
    """One matched output: node ``a`` (output ``a_output``) against node ``b``.

    ``op`` is the op or kernel name, ``"Multiply -> swiglu"`` where ``b`` replaced ``a`` by
    something else; ``mismatched`` counts the elements beyond tolerance (NaN against a number
    counts); ``ok`` is None when the values could not be compared (``note`` says why). With
    ``rounding`` (half precision, see :func:`compare`): ``rounding`` is the largest difference
    rounding explains at an element (``|a - a32| + |b - b32|``), ``excess`` the largest ratio of
    an element's difference to what is allowed there (beyond when over 1). A node holding a
    parameter's values (a transpose of a weight) is judged by the parameter (``note``).
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
    rounding: float | None = None
    excess: float | None = None

    @property
    def replaced(self) -> bool:
        return "->" in self.op


@dataclass(frozen=True)
class ParameterRow(_Errors):
    """One parameter both calls read, by name: ``a``'s against ``b``'s. ``same_array``: both
    read one array (equal without reading it); ``ok`` None: not comparable (``note``)."""

    name: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    same_array: bool = False


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
    #: each parameter both read, by name, compared before any node
    parameters: list[ParameterRow] = field(default_factory=list)
    parameters_only_a: list[str] = field(default_factory=list)
    parameters_only_b: list[str] = field(default_factory=list)
    #: the margin over rounding when nodes were judged against what rounding explains, else None
    rounding: float | None = None

    @property
    def first_divergence(self) -> Row | None:
        """The earliest matched output (in the order ``a`` runs) beyond tolerance."""
        return next((r for r in self.rows if r.ok is False), None)

    @property
    def diverged(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    @property
    def parameters_differing(self) -> list[ParameterRow]:
        return [p for p in self.parameters if p.ok is False]

    @property
    def ok(self) -> bool:
        """Every row within tolerance, every parameter and kernel check too, and no NaN/Inf
        started in ``b`` that ``a`` did not have (NaN/Inf in both is no divergence of ``b`` from
        ``a``; ``non_finite_outputs`` names them, and so does the report)."""
        return not self.diverged and not self.parameters_differing and all(k.ok for k in self.kernel_checks)

    @property
    def non_finite_outputs(self) -> list[str]:
        """Each output of ``a`` or ``b`` holding NaN or Inf values, how many: ``b output_0: 8 NaN
        and 0 Inf``. A divergence only where ``a`` is finite, but never outputs to trust."""
        return _non_finite_outputs(self.a, "a") + _non_finite_outputs(self.b, "b")

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"a": self.a.nx.graph.get("name"), "b": self.b.nx.graph.get("name"),
                "rtol": self.rtol, "atol": self.atol, "rounding": self.rounding, "ok": self.ok,
                "marginal": self.marginal,
                "first_divergence": asdict(first) if first else None,
                "parameters": [asdict(p) for p in self.parameters],
                "rows": [asdict(r) for r in self.rows],
                "kernel_checks": [asdict(k) for k in self.kernel_checks],
                "non_finite_outputs": self.non_finite_outputs,
                "unmatched": {"a": self.unmatched_a, "b": self.unmatched_b},
                "parameters_unmatched": {"a": self.parameters_only_a, "b": self.parameters_only_b}}

    def _rule(self) -> str:
        if self.rounding is not None:
            return (f"|a - b| > {self.rounding:g} * (|a - a32| + |b - b32|) + {self.atol:g} + "
                    f"{self.rtol:g} * |a32| (a32, b32: each model run again in float32, so "
                    "|a - a32| + |b - b32| is what rounding explains there)")
        return f"|a - b| > {self.atol:g} + {self.rtol:g} * |a|"

    def _backends(self) -> str:
        """Where the two sides' kernels ran, in words."""
        words = {"reference": "as their pure-MLX references", "cuda": "on CUDA", "metal": "on Metal"}
        a, b = (str(g.nx.graph.get("backend")) for g in (self.a, self.b))
        if a == b:
            return f"kernels {words.get(a, 'on ' + a)}"
        return f"a's kernels {words.get(a, 'on ' + a)}, b's {words.get(b, 'on ' + b)}"

    def _parameter_line(self) -> str:
        rows = self.parameters
        same = sum(p.same_array for p in rows)
        differing = self.parameters_differing
        unknown = sum(p.ok is None for p in rows)
        equal = len(rows) - same - len(differing) - unknown
        parts = [f"{_count(same, 'is the same array', 'are the same arrays')} in both",
                 f"{_count(equal, 'is a copy', 'are copies')} with equal values"]
        if not differing:
            parts.append("none differ")
        elif len(differing) == 1:
            only = differing[0]
            parts.append(f"1 differs: {only.name} (max rel {_num(only.max_rel)}"
                         f"{', ' + only.note if only.note else ''})")
        else:
            worst = max(differing, key=lambda p: p.max_rel if p.max_rel is not None else math.inf)
            parts.append(f"{len(differing)} differ (first: {differing[0].name}; most: {worst.name}, max rel "
                         f"{_num(worst.max_rel)}{', ' + worst.note if worst.note else ''})")
        line = f"parameters: both read {len(rows)} by name; " + ", ".join(parts)
        unmatched = len(self.parameters_only_a) + len(self.parameters_only_b)
        if unmatched:
            line += (f"; {len(self.parameters_only_a)} read only by a, {len(self.parameters_only_b)} "
                     "only by b")
        return line

    @property
    def strongest(self) -> Row | None:
        """The diverged row judged against rounding whose worst element is furthest beyond what
        the rule allows (the largest ``excess``), or None."""
        judged = [r for r in self.diverged if r.excess is not None and not r.note]
        return max(judged, key=lambda r: r.excess or 0.0) if judged else None

    def _outputs_beyond(self) -> bool | None:
        """Whether a row of the call's outputs is beyond the rule (None: no output was compared)."""
        outputs = [r for r in self.rows if self.a.nx.nodes[r.a]["kind"] == NodeKind.OUTPUT.value
                   and r.ok is not None]
        return any(r.ok is False for r in outputs) if outputs else None

    @property
    def marginal(self) -> bool:
        """A divergence found against rounding, but weakly: the first divergence at most
        :data:`MARGINAL_EXCESS` times what the rule allows and the outputs within the rule, or no
        node at all beyond that. A small real error (a weight 1% off) and rounding the float32
        runs do not account for look alike there; comparing in float32 tells them apart."""
        first, strongest = self.first_divergence, self.strongest
        if self.rounding is None or first is None or strongest is None:
            return False
        weak_first = first.excess is not None and first.excess <= MARGINAL_EXCESS
        return (weak_first and not self._outputs_beyond()) or (strongest.excess or 0.0) <= MARGINAL_EXCESS

    def _marginal_line(self) -> str:
        first, strongest = self.first_divergence, self.strongest
        assert first is not None and strongest is not None
        outputs = self._outputs_beyond()
        line = (f"a marginal signal: the first divergence is {_num(first.excess)}x what the rule allows "
                f"at {first.mismatched} of {_elements(first.shape)} elements")
        if strongest is not first:
            line += (f", the strongest {_num(strongest.excess)}x ({strongest.b} in "
                     f"{strongest.scope or 'top level'})")
        if outputs is not None:
            line += ", and the outputs are " + ("beyond the rule too, as weakly" if outputs else "within it")
        line += (". A small real error (a weight 1% off) and rounding that the float32 runs do not account "
                 "for look alike at this strength: to tell them apart, compare the two models cast to "
                 "float32 (a.set_dtype(mx.float32) and b's too, before gk.compare), where rounding is "
                 "thousands of times smaller")
        if self.parameters_differing:
            line += "; a parameter differs (above): the likely cause"
        return line

    def _head(self, verdict: bool = True) -> list[str]:
        """The report's lines; without ``verdict``, less the one naming the first divergence (or
        saying there is none), which the viewer's bar writes as a link of its own."""
        a, b = self.a.nx.graph.get("name", "a"), self.b.nx.graph.get("name", "b")
        lines = [f"compare a = {a} with b = {b} ({self._backends()}): {len(self.rows)} outputs matched, "
                 f"{len(self.diverged)} beyond the rule",
                 f"the rule: an element is beyond when {self._rule()}", self._parameter_line()]
        first = self.first_divergence
        if first is None:
            said = "no divergence"
        else:
            said = (f"first divergence: {first.b} ({first.op}) in {first.scope or 'top level'}: "
                    + (f"{first.mismatched} of {_elements(first.shape)} elements beyond the rule"
                       if first.mismatched is not None else "beyond the rule")
                    + (f", up to {_num(first.excess)}x what it allows" if first.excess else "")
                    + f" (max abs {_num(first.max_abs)}, max rel {_num(first.max_rel)})"
                    + (f" ({first.note})" if first.note else ""))
        if verdict:
            lines.append(said)
        if self.marginal:   # only with a first divergence
            lines.append(self._marginal_line())
        non_finite = self.non_finite_outputs
        if non_finite:
            lines.append(f"non-finite outputs: {'; '.join(non_finite)}")
        bad = [k for k in self.kernel_checks if not k.ok]
        if self.kernel_checks:
            lines.append(f"kernels against their references in place: {len(self.kernel_checks) - len(bad)} "
                         f"of {len(self.kernel_checks)} within tolerance"
                         + (f"; first off: {bad[0].node} ({bad[0].kernel}) in {bad[0].scope}, max abs "
                            f"{_num(bad[0].max_abs)}" if bad else ""))
        if self.unmatched_a or self.unmatched_b:
            lines.append(f"not compared: {len(self.unmatched_a)} of a's nodes and {len(self.unmatched_b)} of "
                         "b's have no counterpart on the other side (steps only one side takes, such as "
                         "the ops a kernel replaced); the layers holding them are compared by their "
                         "outputs. c.unmatched_a and c.unmatched_b list them")
        return lines

    def table(self, rows: Sequence[Row] | None = None) -> str:
        """The rows (all by default) as a text table."""
        from tabulate import tabulate

        chosen = self.rows if rows is None else rows
        body = [[r.a if r.a == r.b else f"{r.a} | {r.b}", r.op, r.scope, _shape(r.shape),
                 _num(r.max_abs), _num(r.max_rel), _num(r.rounding),
                 {True: "ok", False: "DIVERGED", None: r.note}[r.ok]] for r in chosen]
        headers = ["node (a | b)", "op", "scope", "shape", "max abs", "max rel", "rounding", ""]
        if self.rounding is None:
            body = [line[:6] + line[7:] for line in body]
            headers = headers[:6] + headers[7:]
        return tabulate(body, headers=headers)

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
        from ..viz.html import to_html  # lazy: the viewer loads only when a comparison is drawn

        first = self.first_divergence
        doc = {
            "title": f"compare {self.a.nx.graph.get('name')} / {self.b.nx.graph.get('name')}",
            "summary": self._head(verdict=False), "rtol": self.rtol, "atol": self.atol,
            "first": next((i for i, r in enumerate(self.rows) if r is first), None),
            "rows": [[r.b, r.b_output, r.a, r.a_output, r.op, r.scope, list(r.shape), r.dtype_a,
                      r.dtype_b, r.max_abs, r.max_rel, r.mismatched, r.ok, r.note] for r in self.rows],
            "kernel_checks": [[k.side, k.node, k.kernel, k.scope, k.backend, k.max_abs, k.max_rel, k.ok]
                              for k in self.kernel_checks],
        }
        options.setdefault("title", doc["title"])
        return to_html(self.b, comparison=doc, **options)

    def _repr_html_(self) -> str:
        from ..viz.html import srcdoc_iframe  # lazy: the viewer loads only when a comparison is drawn

        return srcdoc_iframe(self.to_html())


def _non_finite_outputs(graph: Graph, side: str) -> list[str]:
    """``side output_0: 8 NaN and 0 Inf`` for each output node of ``graph`` whose values hold any."""
    found = []
    for node in graph.nodes(NodeKind.OUTPUT):
        stats = graph.nx.nodes[node].get("stats")
        if isinstance(stats, dict) and (stats.get("nan") or stats.get("inf")):
            found.append(f"{side} {node}: {stats['nan']} NaN and {stats['inf']} Inf")
    return found


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _count(n: int, one: str, many: str) -> str:
    """``1 is a copy`` / ``3 are copies`` / ``none are copies``."""
    return f"{n} {one}" if n == 1 else f"{n if n else 'none'} {many}"


def _elements(shape: Sequence[int]) -> str:
    return f"{math.prod(shape):,}"


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# ----------------------------------------------------------------------------- matching


class _Side:
    """One graph with what matching needs: node order, output shapes, who reads what."""

    __slots__ = ("graph", "wiring", "nodes", "order", "outputs", "arrays", "first_state", "_views",
                 "_input_index")

    def __init__(self, graph: Graph, wiring: Wiring, arrays: Sequence[mx.array] = (), first_state: int = 0):
        self.graph = graph
        self.wiring = wiring
        self.arrays = list(arrays)  # the call's arrays: its arguments, then its state from first_state
        self.first_state = first_state
        self._views: dict[Output, str | None] = {}
        self._input_index = {node: i for i, node in enumerate(wiring.inputs)}
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

    def parameters(self) -> dict[str, mx.array]:
        """The call's state arrays (parameters) by name."""
        return {str(self.nodes[node]["label"]): self.arrays[i] for node, i in self._input_index.items()
                if self.first_state <= i < len(self.arrays)}

    def parameter_view(self, out: Output) -> str | None:
        """The parameter whose values ``out`` holds exactly (the parameter itself, or a
        transpose, reshape, broadcast... of it), or None."""
        if out in self._views:
            return self._views[out]
        found = None
        data = self.nodes[out[0]]
        if data["kind"] == _INPUT:
            found = str(data["label"]) if self._input_index.get(out[0], -1) >= self.first_state else None
        elif data["kind"] == NodeKind.OP.value and data["op"] in SAME_VALUES and out[1] == 0:
            reads = self.reads(out[0])
            if len(reads) == 1 and reads[0] is not None:
                found = self.parameter_view(reads[0])
        self._views[out] = found
        return found

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




# ----------------------------------------------------------------------------- parameters

_PARAMETER_CHUNK = 1 << 22  # elements of a parameter compared at once: bounds the float32 temporaries
_PARAMETER_BATCH = 1 << 26  # elements evaluated at once


def _pieces(x: mx.array, y: mx.array) -> list[tuple[mx.array, mx.array]]:
    fx, fy = x.reshape(-1), y.reshape(-1)
    return [(fx[i:i + _PARAMETER_CHUNK], fy[i:i + _PARAMETER_CHUNK])
            for i in range(0, max(x.size, 1), _PARAMETER_CHUNK)]


def _evaluated(lazy: list[tuple[Any, mx.array, int]]) -> Iterator[tuple[Any, list[float]]]:
    """``(key, value.tolist())`` of each lazy array, evaluated a batch of elements at a time."""
    batch: list[tuple[Any, mx.array]] = []
    size = 0
    for key, value, elements in [*lazy, (None, None, 0)]:
        if value is None or size + elements > _PARAMETER_BATCH:
            mx.eval([v for _, v in batch])
            yield from ((k, v.tolist()) for k, v in batch)  # type: ignore[misc]
            batch, size = [], 0
        if value is not None:
            batch.append((key, value))
            size += elements


_VIEWS_AS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _bits_equal(x: mx.array, y: mx.array) -> mx.array:
    """Whether two pieces of one dtype hold the same bits: equal values, read as unsigned words of
    four bytes where the piece divides into them (a quarter to a half cheaper than comparing
    16-bit floats). Bits that differ (a -0 against a 0, two NaN payloads) are then judged by
    value, as any piece that is not bitwise equal."""
    if x.dtype != y.dtype or x.dtype.size not in _VIEWS_AS:
        return mx.all(x == y)
    word = mx.uint32 if (x.size * x.dtype.size) % 4 == 0 else _VIEWS_AS[x.dtype.size]
    return mx.array_equal(x.view(word), y.view(word))


def compare_parameters(a: dict[str, mx.array], b: dict[str, mx.array], rtol: float, atol: float,
                       progress: Progress | None = None) -> list[ParameterRow]:
    """Each parameter name both have, ``a``'s array against ``b``'s (in ``a``'s order): one array
    shared by both is the same without reading it; others are first tested for equality, and
    only pieces that differ get their errors. Reads each parameter once, a piece at a time.

    >>> w = mx.ones((2, 2))
    >>> rows = compare_parameters({"w": w, "v": w}, {"w": w, "v": w * 2}, 1e-4, 1e-5)
    >>> [(r.name, r.same_array, r.ok) for r in rows]
    [('w', True, True), ('v', False, False)]
    """
    progress = progress or Progress()
    found: dict[str, ParameterRow] = {}
    work: list[tuple[str, mx.array, mx.array]] = []
    for name, x in a.items():
        y = b.get(name)
        if y is None:
            continue
        row = ParameterRow(name, tuple(x.shape), dtype_name(x.dtype), dtype_name(y.dtype))
        if x is y:
            found[name] = dataclasses.replace(row, max_abs=0.0, max_rel=0.0, mismatched=0, ok=True,
                                              same_array=True)
        elif x.shape != y.shape:
            found[name] = dataclasses.replace(row, ok=False, note=f"shapes differ: {tuple(x.shape)} "
                                              f"against {tuple(y.shape)}")
        else:
            work.append((name, x, y))
            found[name] = row
    progress.phase("parameters", len(found))
    progress.advance(len(found) - len(work))
    pieces = {name: _pieces(x, y) for name, x, y in work}
    equal = [((name, i), _bits_equal(px, py), px.size) for name, ps in pieces.items()
             for i, (px, py) in enumerate(ps)]
    unequal: dict[str, list[int]] = {name: [] for name in pieces}
    for (name, i), same in _evaluated(equal):
        if not same:
            unequal[name].append(i)
    differing = [((name, i), errors(pieces[name][i][1], pieces[name][i][0], rtol=rtol, atol=atol),
                  pieces[name][i][0].size) for name, indices in unequal.items() for i in indices]
    worst: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in pieces}
    for (name, _), (max_abs, max_rel, beyond) in _evaluated(differing):
        w = worst[name]
        worst[name] = [max(w[0], max_abs), max(w[1], max_rel), w[2] + beyond]
    for name in pieces:
        max_abs, max_rel, beyond = worst[name]
        found[name] = dataclasses.replace(found[name], max_abs=_finite_or_inf(max_abs),
                                          max_rel=_finite_or_inf(max_rel), mismatched=int(beyond),
                                          ok=beyond == 0)
        progress.advance()
    return [found[name] for name in a if name in found]


def _finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else float("inf")


# ----------------------------------------------------------------------------- running


class _Lockstep:
    """Runs several graphs node by node, the first leading; each group (an output of every run,
    None where a run has none) is judged once all its runs made it, and its values dropped."""

    def __init__(self, runs: Sequence[GraphRun], groups: Sequence[tuple[Output | None, ...]],
                 judge: Callable[[list[mx.array]], mx.array], progress: Progress):
        self.runs, self.groups, self.judge, self.progress = runs, groups, judge, progress
        self.waiting: list[dict[str, set[int]]] = [{} for _ in runs]  # node -> groups waiting for it
        for g, outputs in enumerate(groups):
            for r, out in enumerate(outputs):
                if out is not None:
                    self.waiting[r].setdefault(out[0], set()).add(g)
        self.values: list[dict[str, list[mx.array] | None]] = [{} for _ in runs]
        self.done: list[set[str]] = [set() for _ in runs]
        self.steps = [run.steps() for run in runs]
        self.finished = [False] * len(runs)
        self.pending: list[tuple[int, mx.array]] = []
        self.results: dict[int, list[float] | str] = {}
        self.settled: set[int] = set()

    def _seen(self, r: int, node: str, values: list[mx.array] | None) -> None:
        self.done[r].add(node)
        if node not in self.waiting[r]:
            return
        self.values[r][node] = values
        for g in list(self.waiting[r][node]):
            if all(out is None or out[0] in self.done[k] for k, out in enumerate(self.groups[g])):
                self._settle(g)

    def _settle(self, g: int) -> None:
        arrays: list[mx.array] = []
        missing = []
        for r, out in enumerate(self.groups[g]):
            if out is None:
                continue
            values = self.values[r].get(out[0])
            if values is None:
                missing.append(r)
            else:
                arrays.append(values[out[1]])
        if missing:
            self.results[g] = "not reached on " + ", ".join(_RUN_NAMES[r] for r in missing)
        else:
            self.pending.append((g, self.judge(arrays)))
        self.settled.add(g)
        for r, out in enumerate(self.groups[g]):
            if out is not None:
                left = self.waiting[r][out[0]]
                left.discard(g)
                if not left:
                    self.values[r].pop(out[0], None)

    def _step(self, r: int) -> bool:
        try:
            node, values = next(self.steps[r])
        except StopIteration:
            self.finished[r] = True
            return False
        self._seen(r, node, values)
        self._flush()
        return True

    def _flush(self, final: bool = False) -> None:
        if not (final or any(run.need_flush for run in self.runs)
                or len(self.pending) >= _ERRORS_PER_FLUSH):
            return
        errors = [e for _, e in self.pending]
        self.runs[0].flush(errors)
        for run in self.runs[1:]:
            run.flush()
        for (g, _), error in zip(self.pending, errors):
            self.results[g] = error.tolist()  # type: ignore[assignment]
        self.pending = []

    def run(self) -> None:
        for node, values in self.steps[0]:
            self.done[0].add(node)
            self._seen(0, node, values)
            for g in list(self.waiting[0].get(node, ())):  # the other runs up to its counterparts
                for r, out in enumerate(self.groups[g]):
                    while r and out is not None and out[0] not in self.done[r] and self._step(r):
                        pass
            self._flush()
            self.progress.advance()
        for r in range(1, len(self.runs)):
            while self._step(r):
                pass
        for g in range(len(self.groups)):  # counterparts never reached
            if g not in self.settled:
                for r, out in enumerate(self.groups[g]):
                    if out is not None:
                        self.values[r].setdefault(out[0], None)
                self._settle(g)
        self._flush(final=True)


_RUN_NAMES = ("side a", "side b", "side a in float32", "side b in float32")


def _row(side_a: _Side, side_b: _Side, x: Output, y: Output, result: Sequence[float] | str) -> Row:
    (shape, dtype_a), (_, dtype_b) = side_a.outputs[x[0]][x[1]], side_b.outputs[y[0]][y[1]]
    what_a, what_b = side_a.what(x[0]), side_b.what(y[0])
    if what_a != what_b:  # b replaced a: by a kernel, maybe seen through a view of its output
        what_b = side_b.maker(y[0])
    op = what_a if what_a == what_b else f"{what_a} -> {what_b}"
    scope = str(side_b.nodes[y[0]]["scope"] or side_a.nodes[x[0]]["scope"])
    row = Row(x[0], y[0], x[1], y[1], scope, op, shape, dtype_a, dtype_b)
    if isinstance(result, str):
        return dataclasses.replace(row, note=result)
    mismatched = int(result[2])
    found = dataclasses.replace(row, max_abs=_finite_or_inf(result[0]), max_rel=_finite_or_inf(result[1]),
                                mismatched=mismatched, ok=mismatched == 0)
    if len(result) > 3:
        found = dataclasses.replace(found, rounding=_finite_or_inf(result[3]),
                                    excess=_finite_or_inf(result[4]))
    return found


def _parameter_row(side_a: _Side, side_b: _Side, x: Output, y: Output, p: ParameterRow) -> Row:
    """A node holding a parameter's values (a transpose, a reshape): judged by the parameter."""
    row = _row(side_a, side_b, x, y, f"as parameter {p.name}")
    return dataclasses.replace(row, max_abs=p.max_abs, max_rel=p.max_rel, mismatched=p.mismatched,
                               ok=p.ok)


def _kernel_checks(side: str, graph: Graph) -> Iterator[KernelCheck]:
    for node in graph.kernels():
        data = graph.nx.nodes[node]
        check = data.get("reference_check")
        if not check or "max_abs" not in check:
            continue
        yield KernelCheck(side, node, str(data.get("kernel", data["op"])), str(data["scope"]),
                          str(data.get("backend", "")), check["max_abs"], check["max_rel"],
                          check["mismatched"] == 0)


def _counterpart(side: _Side, pairs: dict[Output, Output], out: Output) -> Output | None:
    """``out``'s output in the float32 graph of the same call: its match, or for a cast or a
    view with no match (a half-precision graph casts where the float32 one need not), its
    input's."""
    while out not in pairs:
        data = side.nodes[out[0]]
        reads = side.reads(out[0])
        if data["kind"] != _OP or data["op"] not in _CASTS or len(reads) != 1 or reads[0] is None:
            return None
        out = reads[0]
    return pairs[out]


_OP = NodeKind.OP.value
_CASTS = SAME_VALUES | {"AsType"}


def compare(a: Callable[..., Any], b: Callable[..., Any], *args: Any, rtol: float = 1e-4,
            atol: float = 1e-5, kwargs: dict[str, Any] | None = None,
            backends: tuple[str | None, str | None] = (None, None), check_kernels: bool = False,
            progress: bool | None = None, rounding: bool | None = None,
            margin: float = ROUNDING_MARGIN) -> Comparison:
    """Run ``a`` and ``b`` (functions or models) on the same arguments node by node and compare every
    matched node's output (see the module); ``a`` is the reference.

    Parameters are compared by name first; then nodes are matched across the two graphs and an
    element is beyond when ``|a - b| > atol + rtol * |a|``, or, judging by rounding, when it
    exceeds ``margin`` times what rounding explains there plus that.

    Args:
        a: the reference function or model.
        b: the function or model compared with it.
        *args: the positional arguments both are called with.
        rtol: relative tolerance.
        atol: absolute tolerance.
        kwargs: keyword arguments both are called with.
        backends: each side's kernel backend (``(None, "reference")``: the GPU kernels against
            their references, all else alike).
        check_kernels: also run each kernel node's reference on the exact inputs it received
            inside the model (``c.kernel_checks``).
        progress: a progress line on stderr; None: when stderr is a terminal.
        rounding: judge each node against what rounding explains there, from float32 runs of
            both (see :mod:`graphkern.debugging.precision`); None: when both compute in float16
            or bfloat16 (it doubles the work).
        margin: how many times what rounding explains a difference must exceed to count.

    Returns:
        A :class:`Comparison`: ``rows`` (one per matched output), ``first_divergence``, ``ok``,
        both values graphs (``a``, ``b``) and ``to_html()``.

    Raises:
        KernelError: ``a`` or ``b`` cannot be traced (see ``gk.trace``).

    >>> import mlx.core as mx, graphkern as gk
    >>> c = gk.compare(lambda x: mx.sin(x) + 1, lambda x: mx.sin(x) + 1, mx.ones((3,)))
    >>> c.ok, [r.op for r in c.rows]
    (True, ['Sin', 'Broadcast', 'Add', 'output_0'])
    """
    with progress_line(progress, "compare") as line:
        return _compare(a, b, args, kwargs or {}, rtol, atol, backends, check_kernels, rounding,
                        margin, line)


def _traced(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: str | None,
            what: str, progress: Progress) -> tuple[Traceable, Flat, _Side]:
    progress.phase(f"tracing {what}")
    traceable = Traceable(fn)
    flat = Flat.of(args, kwargs, traceable.arg_names)
    graph, wiring, arrays = trace_for_values(traceable, flat, backend)
    return traceable, flat, _Side(graph, wiring, arrays, len(flat.arrays))


def _float32_side(traceable: Traceable, flat: Flat, backend: str | None, what: str,
                  progress: Progress) -> tuple[_Side, GraphRun]:
    """The call traced again in float32, and a run of it casting the call's arrays as read."""
    progress.phase(f"tracing {what} in float32")
    with float32_state(traceable, flat) as flat32:
        graph, wiring, _ = trace_for_values(traceable, flat32, backend)
    arrays = list(flat.arrays) + traceable.state.arrays()
    return _Side(graph, wiring), GraphRun(graph, wiring, arrays, cast_inputs=mx.float32, record=False)


def _compare(a: Callable[..., Any], b: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             rtol: float, atol: float, backends: tuple[str | None, str | None], check_kernels: bool,
             rounding: bool | None, margin: float, progress: Progress) -> Comparison:
    traceable_a, flat_a, side_a = _traced(a, args, kwargs, backends[0], "a", progress)
    traceable_b, flat_b, side_b = _traced(b, args, kwargs, backends[1], "b", progress)
    dtypes = (main_float_dtype(side_a.arrays), main_float_dtype(side_b.arrays))
    if rounding is None:
        rounding = is_half(dtypes[0]) and is_half(dtypes[1])
    parameters = compare_parameters(side_a.parameters(), side_b.parameters(), rtol, atol, progress)
    pairs = match_outputs(side_a, side_b)
    views = _parameter_views(side_a, side_b, pairs, parameters)
    tolerance = (rtol, atol) if check_kernels else None
    runs = [GraphRun(side_a.graph, side_a.wiring, side_a.arrays, check_kernels=tolerance),
            GraphRun(side_b.graph, side_b.wiring, side_b.arrays, check_kernels=tolerance)]
    judged = {x: y for x, y in pairs.items() if x not in views}
    notes: dict[Output, str] = {}
    if rounding:
        side_a32, run_a32 = _float32_side(traceable_a, flat_a, backends[0], "a", progress)
        side_b32, run_b32 = _float32_side(traceable_b, flat_b, backends[1], "b", progress)
        runs += [run_a32, run_b32]
        groups, notes = _with_float32(judged, side_a, side_b, match_outputs(side_a, side_a32),
                                      match_outputs(side_b, side_b32))
    else:
        groups = [(x, y) for x, y in judged.items()]

    def judge(arrays: list[mx.array]) -> mx.array:
        if len(arrays) == 4:
            return beyond_rounding(arrays[0], arrays[1], arrays[2], arrays[3], rtol, atol, margin)
        return errors(arrays[1], arrays[0], rtol=rtol, atol=atol)

    names = {dtype_name(d) for d in dtypes if d is not None} | ({"float32"} if rounding else set())
    progress.phase(f"values ({' and '.join(sorted(names))})", side_a.graph.nx.number_of_nodes())
    lockstep = _Lockstep(runs, groups, judge, progress)
    lockstep.run()
    finish_values(side_a.graph)
    finish_values(side_b.graph)
    results: dict[Output, Sequence[float] | str] = {**notes}
    results.update((group[0], lockstep.results.get(g, "not compared")) for g, group in enumerate(groups))
    position = {node: i for i, node in enumerate(run_order(side_a.graph))}  # as the call runs
    ordered = sorted(pairs.items(), key=lambda p: (position[p[0][0]], p[0][1]))
    rows = [_parameter_row(side_a, side_b, x, y, views[x]) if x in views
            else _row(side_a, side_b, x, y, results.get(x, "not compared")) for x, y in ordered]
    result = Comparison(side_a.graph, side_b.graph, rtol, atol, rows, parameters=parameters,
                        rounding=margin if rounding else None)
    _finish(result, side_a, side_b, pairs, check_kernels)
    return result


def _parameter_views(side_a: _Side, side_b: _Side, pairs: dict[Output, Output],
                     parameters: list[ParameterRow]) -> dict[Output, ParameterRow]:
    """The matched outputs holding one parameter's values on both sides, with its row."""
    by_name = {p.name: p for p in parameters}
    views = {}
    for x, y in pairs.items():
        name = side_a.parameter_view(x)
        if name is not None and name == side_b.parameter_view(y) and name in by_name:
            views[x] = by_name[name]
    return views


def _with_float32(judged: dict[Output, Output], side_a: _Side, side_b: _Side, pairs_a: dict[Output, Output],
                  pairs_b: dict[Output, Output]) -> tuple[list[tuple[Output, ...]], dict[Output, str]]:
    """Each matched pair with its outputs in the float32 graphs; a note where there are none."""
    groups: list[tuple[Output, ...]] = []
    notes = {}
    for x, y in judged.items():
        x32, y32 = _counterpart(side_a, pairs_a, x), _counterpart(side_b, pairs_b, y)
        if x32 is None or y32 is None:
            notes[x] = "no float32 counterpart to tell rounding by"
        else:
            groups.append((x, y, x32, y32))
    return groups, notes


def _finish(result: Comparison, side_a: _Side, side_b: _Side, pairs: dict[Output, Output],
            check_kernels: bool) -> None:
    """Each judged node of ``b`` gets its ``comparison``; what is unmatched; the kernel checks."""
    graph_a, graph_b = side_a.graph, side_b.graph
    for row in result.rows:
        if row.ok is not None:
            graph_b.nx.nodes[row.b].setdefault("comparison", {}).update(
                {"against": row.a, "max_abs": row.max_abs, "max_rel": row.max_rel, "ok": row.ok})
    names_a, names_b = side_a.parameters(), side_b.parameters()
    result.parameters_only_a = [n for n in names_a if n not in names_b]
    result.parameters_only_b = [n for n in names_b if n not in names_a]
    matched_a = {x[0] for x in pairs}
    matched_b = {y[0] for y in pairs.values()}
    result.unmatched_a = [n for n in graph_a.nodes() if n not in matched_a
                          and graph_a.nx.nodes[n]["kind"] in _INNER]
    result.unmatched_b = [n for n in graph_b.nodes() if n not in matched_b
                          and graph_b.nx.nodes[n]["kind"] in _INNER]
    if check_kernels:
        result.kernel_checks = [*_kernel_checks("a", graph_a), *_kernel_checks("b", graph_b)]
