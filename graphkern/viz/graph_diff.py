"""Compare two traces — for instance before and after patching a module with a kernel.

Node ids are not stable across traces (``multiply_3`` becomes ``multiply_1`` when two multiplies
before it are replaced), so nodes are paired by where they are and what they do: within each
module scope, the two topologically ordered lists of (kind, op or kernel name) are aligned with
difflib, so the n-th ``Matmul`` of ``layers.0.mlp`` pairs with the n-th. A node of the second
graph left over in a scope (the kernel ``patch`` put there) then pairs with the left-over node of
the first that fed the same consumers (the op the kernel replaced). Paired nodes whose attributes
differ are "changed" (a replacement changes kind and op); the rest are "added" or "removed".
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from graphkern.viz.common import (
    as_nx,
    format_tensor,
    graph_name,
    in_edges_sorted,
    node_status,
    node_text,
    ordered_nodes,
    scope_parts,
    status_name,
    template_text,
)

__all__ = ["diff", "GraphDiff", "NodeChange"]

_COMPARED = ("status", "root_cause", "message", "arguments", "value", "backend", "grid",
             "threadgroup", "template", "source_hash")


@dataclass(frozen=True)
class NodeChange:
    """A node present in both graphs whose attributes, inputs or outputs differ."""

    before: str
    after: str
    kind: str
    scope: str
    changes: tuple[tuple[str, str, str], ...]  # (field, before, after)

    def describe(self) -> str:
        return "; ".join(f"{f}: {a} -> {b}" for f, a, b in self.changes)

    @property
    def replaced(self) -> bool:
        """The node became another kind or op: a layer's op replaced by a kernel, say."""
        return any(f in ("kind", "op") for f, _, _ in self.changes)

    def _field(self, name: str, side: int) -> str | None:
        return next((c[side] for c in self.changes if c[0] == name), None)


@dataclass
class GraphDiff:
    """What changed between two traces. ``str(d)`` is a text report, ``d.to_html()`` the second
    graph in the viewer with added nodes green, changed amber and the removed ones listed.

    >>> d = diff(before, after)                           # doctest: +SKIP
    >>> print(d)                                          # doctest: +SKIP
    >>> bool(d), d.kernels_added                          # doctest: +SKIP
    (True, ['rms_norm'])
    """

    before: Any
    after: Any
    added: list[str] = field(default_factory=list)        # node ids in ``after``
    removed: list[str] = field(default_factory=list)      # node ids in ``before``
    changed: list[NodeChange] = field(default_factory=list)
    matched: dict[str, str] = field(default_factory=dict)  # before id -> after id

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def _kind(self, graph: Any, n: str) -> str:
        return str(as_nx(graph).nodes[n].get("kind") or "op")

    @property
    def replaced(self) -> list[NodeChange]:
        """Paired nodes that became another kind or op (an op replaced by a kernel)."""
        return [c for c in self.changed if c.replaced]

    @property
    def kernels_added(self) -> list[str]:
        """Kernel nodes of ``after`` that are new or replaced another kind of node."""
        new = {c.after for c in self.replaced if c._field("kind", 2) == "kernel"}
        order = ordered_nodes(as_nx(self.after))
        return [n for n in order if (n in new or n in self.added)
                and self._kind(self.after, n) == "kernel"]

    @property
    def kernels_removed(self) -> list[str]:
        """Kernel nodes of ``before`` that are gone or were replaced by another kind of node."""
        gone = {c.before for c in self.replaced if c._field("kind", 1) == "kernel"}
        order = ordered_nodes(as_nx(self.before))
        return [n for n in order if (n in gone or n in self.removed)
                and self._kind(self.before, n) == "kernel"]

    @property
    def kernels_changed(self) -> list[NodeChange]:
        return [c for c in self.changed if c.kind == "kernel" and not c.replaced]

    @property
    def status_before(self) -> int:
        return _graph_status(self.before)

    @property
    def status_after(self) -> int:
        return _graph_status(self.after)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "before": graph_name(as_nx(self.before)),
            "after": graph_name(as_nx(self.after)),
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": [{"before": c.before, "after": c.after, "kind": c.kind, "scope": c.scope,
                         "changes": [list(x) for x in c.changes]} for c in self.changed],
            "replaced": [[c.before, c.after] for c in self.replaced],
            "kernels": {"added": self.kernels_added, "removed": self.kernels_removed,
                        "changed": [c.after for c in self.kernels_changed]},
            "status": {"before": status_name(self.status_before),
                       "after": status_name(self.status_after)},
        }

    def __str__(self) -> str:
        head, rows = self._lines()
        return "\n".join(head + _scoped_lines(rows))

    def summary(self, max_lines: int = 60, max_modules: int = 20) -> str:
        """``str(diff)`` when it has at most ``max_lines`` lines; else its head and the number of
        nodes added, removed and changed in each module, at the deepest module level that fits
        in ``max_modules`` lines (repeated layers with the same counts on one line), ending
        with how to see every line.

        >>> print(gk.diff(stock_graph, patched_graph).summary())            # doctest: +SKIP
        """
        head, rows = self._lines()
        full = head + _scoped_lines(rows)
        if len(full) <= max_lines:
            return "\n".join(full)
        deepest = max((len(scope_parts(scope)) for scope, _, _ in rows), default=0)
        groups: list[tuple[str, str]] = []
        for depth in range(deepest, -1, -1):
            counted: dict[str, dict[str, int]] = {}
            for scope, _, text in rows:
                counts = counted.setdefault(".".join(scope_parts(scope)[:depth]), {"+": 0, "-": 0, "~": 0})
                counts[text[0]] += 1
            groups = _runs_of_layers({g: f"+{c['+']} -{c['-']} ~{c['~']}" for g, c in counted.items()})
            if len(groups) <= max_modules:
                break
        lines = head + [f"  by module ({len(rows)} nodes differ):"]
        lines += [f"  [{group or 'top level'}] {counts}" for group, counts in groups]
        lines.append(f"({len(full)} lines in full: --full prints every node)")
        return "\n".join(lines)

    def _lines(self) -> tuple[list[str], list[tuple[str, str, str]]]:
        """The head lines (counts, status, downstream cascades) and one row per node that
        differs: (scope, sort key, text starting with +, - or ~)."""
        a, b = as_nx(self.before), as_nx(self.after)
        lines = [f"diff {graph_name(a)} ({a.number_of_nodes()} nodes) -> "
                 f"{graph_name(b)} ({b.number_of_nodes()} nodes)"]
        rows: list[tuple[str, str, str]] = []  # (scope, sort key, text)
        if not self:
            lines.append("  no differences")
            return lines, rows
        lines.append(f"  kernels: +{len(self.kernels_added)} added, "
                     f"-{len(self.kernels_removed)} removed, ~{len(self.kernels_changed)} changed")
        lines.append(f"  nodes:   +{len(self.added)} added, -{len(self.removed)} removed, "
                     f"~{len(self.changed)} changed"
                     + (f" ({len(self.replaced)} replaced)" if self.replaced else ""))
        sa, sb = self.status_before, self.status_after
        if sa != sb:
            lines.append(f"  status:  {status_name(sa)} -> {status_name(sb)}")
        for n in self.added:
            d = b.nodes[n]
            rows.append((str(d.get("scope") or ""), f"{d.get('order', 0):09d}+",
                         f"+ {_describe(b, n)}"))
        for n in self.removed:
            d = a.nodes[n]
            rows.append((str(d.get("scope") or ""), f"{d.get('order', 0):09d}-",
                         f"- {_describe(a, n)}"))
        cascades: dict[tuple[str, str], int] = {}
        for c in self.changed:
            if _is_cascade(c):
                key = (c.changes[0][1], c.changes[0][2])
                root = next((x[2] for x in c.changes if x[0] == "root_cause"), "")
                cascades[(f"{key[0]} -> {key[1]}", root)] = cascades.get(
                    (f"{key[0]} -> {key[1]}", root), 0) + 1
                continue
            d = b.nodes[c.after]
            if c.replaced:
                text = f"~ {_describe(a, c.before)} replaced by {_describe(b, c.after)}"
            else:
                name = c.after if c.after == c.before else f"{c.before} -> {c.after}"
                text = f"~ {c.kind} {name}: {c.describe()}"
            rows.append((c.scope, f"{d.get('order', 0):09d}~", text))
        for (what, root), count in cascades.items():
            because = f" (root cause {root})" if root and root != "-" else ""
            lines.append(f"  ~ {count} node{'s' if count != 1 else ''} downstream: "
                         f"status {what}{because}")
        return lines, sorted(rows, key=lambda r: (r[0], r[1]))

    def to_html(self, **kw: Any) -> str:
        """The ``after`` graph in the HTML viewer with the differences marked and listed."""
        from graphkern.viz.html import to_html  # lazy: the viewer loads only when a diff is drawn

        b = as_nx(self.after)
        a = as_nx(self.before)
        index = {n: i for i, n in enumerate(ordered_nodes(b))}
        doc = {
            "title": f"diff {graph_name(a)} -> {graph_name(b)}",
            "added": [index[n] for n in self.added],
            "removed": [[n, str(a.nodes[n].get("op") or a.nodes[n].get("kind")),
                         str(a.nodes[n].get("scope") or "")] for n in self.removed],
            "changed": {str(index[c.after]): [list(x) for x in c.changes] for c in self.changed},
        }
        kw.setdefault("title", doc["title"])
        return to_html(self.after, diff=doc, **kw)

    def _repr_html_(self) -> str:
        """In a notebook: the diff viewer in a sandboxed iframe."""
        from graphkern.viz.html import srcdoc_iframe  # lazy: the viewer loads only when a diff is drawn

        return srcdoc_iframe(self.to_html())


def _is_cascade(c: NodeChange) -> bool:
    """A change that only says "now (or no longer) downstream of a failure"."""
    fields = {f for f, _, _ in c.changes}
    return (fields <= {"status", "root_cause"} and "status" in fields
            and "UPSTREAM_FAILED" in (c.changes[0][1], c.changes[0][2]))


def _graph_status(graph: Any) -> int:
    g = as_nx(graph)
    for n in ordered_nodes(g):
        s = node_status(g.nodes[n])
        if s and s != 10:
            return s
    return 0


def _describe(g: Any, n: str) -> str:
    d = g.nodes[n]
    kind = str(d.get("kind") or "op")
    what = str(d.get("kernel") or d.get("op") or "")
    outs = sorted({format_tensor(e[3].get("shape"), e[3].get("dtype"))
                   for e in g.out_edges(n, keys=True, data=True)})
    text = f"{kind} {n}"
    if what and what != n:
        text += f" ({what})"
    if outs:
        text += " -> " + ", ".join(outs)
    return text


def _what(d: dict[str, Any]) -> str:
    return str(d.get("kernel") or d.get("op") or "")


def _token(g: Any, n: Any) -> tuple[str, str]:
    """What a node is, for pairing within a scope: kind and op (or kernel name); inputs by
    name, constants by value."""
    d = g.nodes[n]
    kind = str(d.get("kind") or "op")
    if kind == "input":
        return kind, str(d.get("label") or n)
    if kind == "constant":
        return kind, str(d.get("value") or "")
    return kind, _what(d)


def _signature(g: Any, n: str) -> tuple[Any, ...]:
    """What a node looks like locally: where its inputs come from (kind and op of the producer,
    shape and dtype) and the shapes and dtypes it produces."""
    ins = tuple((str(g.nodes[e[0]].get("kind") or "op"), _what(g.nodes[e[0]]),
                 format_tensor(e[3].get("shape"), e[3].get("dtype")))
                for e in in_edges_sorted(g, n))
    outs = tuple(sorted({format_tensor(e[3].get("shape"), e[3].get("dtype"))
                         for e in g.out_edges(n, keys=True, data=True)}))
    return ins, outs


def _by_scope(g: Any, order: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in order:
        out.setdefault(str(g.nodes[n].get("scope") or ""), []).append(n)
    return out


def _pair_in_scope(a: Any, b: Any, la: list[str], lb: list[str], matched: dict[str, str]) -> None:
    """Align the scope's two node lists by (kind, op): equal runs pair up, and inside a run
    that differs, nodes of one kind and op pair in order."""
    ta, tb = [_token(a, n) for n in la], [_token(b, n) for n in lb]
    sm = difflib.SequenceMatcher(a=ta, b=tb, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            matched.update(zip(la[i1:i2], lb[j1:j2]))
    # what the alignment left (a node MLX ordered differently): same kind and op, in order
    taken = set(matched.values())
    waiting: dict[tuple[str, str], list[str]] = {}
    for n, t in zip(lb, tb):
        if n not in taken:
            waiting.setdefault(t, []).append(n)
    for n, t in zip(la, ta):
        same = waiting.get(t)
        if n not in matched and same:
            matched[n] = same.pop(0)


def _pair_replacements(a: Any, b: Any, la: list[str], lb: list[str],
                       matched: dict[str, str]) -> None:
    """A node of ``b`` left unpaired in its scope pairs with the unpaired node of ``a`` in the
    same scope whose consumers are (paired with) its consumers: the op a kernel replaced."""
    back = {v: k for k, v in matched.items()}
    free_a = [n for n in la if n not in matched]
    for n in lb:
        if n in back or not free_a:
            continue
        consumers = set(b.successors(n))
        outs = _signature(b, n)[1]
        best, score = None, (0, False)
        for m in free_a:
            shared = sum(1 for s in a.successors(m) if matched.get(s) in consumers)
            key = (shared, _signature(a, m)[1] == outs)
            if shared and key > score:
                best, score = m, key
        if best is not None:
            matched[best] = n
            back[n] = best
            free_a.remove(best)


def diff(before: Any, after: Any) -> GraphDiff:
    """Compare two traces: nodes and kernels added, removed, changed or replaced.

    Nodes are paired by module scope, kind and op (or kernel name) and their position in the
    scope; a node left over in a scope of ``after`` pairs with the one of ``before`` that fed the
    same consumers, so stock vs patched pairs each replaced layer's op with its kernel (a
    change of kind and op). Compared on paired nodes: kind, op, status, root cause, message,
    arguments, constant value, kernel backend, grid, threadgroup, template, source hash, the
    shapes and dtypes of inputs and outputs, and which (paired) node feeds each input.

    >>> d = diff(gk.trace(model, x), gk.trace(patched, x))  # doctest: +SKIP
    >>> print(d)                                            # doctest: +SKIP
    """
    a, b = as_nx(before), as_nx(after)
    order_a, order_b = ordered_nodes(a), ordered_nodes(b)
    scopes_a, scopes_b = _by_scope(a, order_a), _by_scope(b, order_b)
    matched: dict[str, str] = {}
    for scope, la in scopes_a.items():
        _pair_in_scope(a, b, la, scopes_b.get(scope, []), matched)
    for _ in range(3):  # a replacement can feed the next: pair until nothing changes
        before_count = len(matched)
        for scope, la in scopes_a.items():
            _pair_replacements(a, b, la, scopes_b.get(scope, []), matched)
        if len(matched) == before_count:
            break
    back = {v: k for k, v in matched.items()}
    result = GraphDiff(before, after)
    result.matched = matched
    result.removed = [n for n in order_a if n not in matched]
    result.added = [n for n in order_b if n not in back]
    for n in order_a:
        if n not in matched:
            continue
        m = matched[n]
        da, db = a.nodes[n], b.nodes[m]
        changes: list[tuple[str, str, str]] = []
        for f in ("kind", "op"):
            if str(da.get(f) or "") != str(db.get(f) or ""):
                changes.append((f, str(da.get(f) or "-"), str(db.get(f) or "-")))
        for f in _COMPARED:
            va, vb = da.get(f), db.get(f)
            if f == "root_cause":
                if va is not None and matched.get(va, va) == vb:
                    continue
                if va == n and vb == m:
                    continue
            if f == "status":
                va, vb = status_name(node_status(da)), status_name(node_status(db))
            elif f == "template":
                va, vb = template_text(da), template_text(db)
            if _norm(va) != _norm(vb):
                changes.append((f, node_text(va) or "-", node_text(vb) or "-"))
        ins_a = [(int(e[3].get("index") or 0), e[0], format_tensor(e[3].get("shape"), e[3].get("dtype")))
                 for e in in_edges_sorted(a, n)]
        ins_b = [(int(e[3].get("index") or 0), e[0], format_tensor(e[3].get("shape"), e[3].get("dtype")))
                 for e in in_edges_sorted(b, m)]
        if [(i, matched.get(s, "?" + s), t) for i, s, t in ins_a] != ins_b:
            changes.append(("inputs",
                            ", ".join(f"{s}:{t}" for _, s, t in ins_a) or "-",
                            ", ".join(f"{s}:{t}" for _, s, t in ins_b) or "-"))
        outs_a, outs_b = _signature(a, n)[1], _signature(b, m)[1]
        if outs_a != outs_b:
            changes.append(("outputs", ", ".join(outs_a) or "-", ", ".join(outs_b) or "-"))
        if changes:
            result.changed.append(NodeChange(n, m, str(db.get("kind") or "op"),
                                             str(db.get("scope") or ""), tuple(changes)))
    return result


def _norm(v: Any) -> Any:
    """What is compared: sequences as tuples, and no value the same as an empty one."""
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v) or None
    return None if v == "" else v


def _scoped_lines(rows: list[tuple[str, str, str]]) -> list[str]:
    """The rows under a ``[scope]`` line for each module."""
    lines, current = [], None
    for scope, _, text in rows:
        if scope != current:
            current = scope
            lines.append(f"[{scope or 'top level'}]")
        lines.append("  " + text)
    return lines


_LAYER = re.compile(r"^(.*?)(\d+)$")


def _runs_of_layers(counts: dict[str, str]) -> list[tuple[str, str]]:
    """``{module: counts}`` in the order of the model (``layers.2`` before ``layers.10``), each run
    of numbered modules with the same counts on one line: ``("layers.0 … layers.31", "... each")``."""
    def key(group: str) -> list[Any]:
        return [(0, int(p)) if p.isdigit() else (1, p) for p in group.split(".")]

    out: list[tuple[str, str]] = []
    run: list[str] = []

    def close() -> None:
        if len(run) > 1:
            out.append((f"{run[0]} … {run[-1]}", f"{counts[run[0]]} each ({len(run)} modules)"))
        elif run:
            out.append((run[0], counts[run[0]]))
        run.clear()

    for group in sorted(counts, key=key):
        if run:
            last, this = _LAYER.match(run[-1]), _LAYER.match(group)
            if not (last and this and last[1] == this[1] and int(this[2]) == int(last[2]) + 1
                    and counts[group] == counts[run[0]]):
                close()
        run.append(group)
    close()
    return out
