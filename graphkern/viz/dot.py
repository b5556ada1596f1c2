"""Graphviz DOT for traced graphs, and rendering it to SVG, PNG or PDF.

Module scopes become nested clusters, kernel nodes are drawn apart (violet, 3-D box), failed nodes
are red and everything downstream of a failure is marked (dashed red), and edges carry the shape
and dtype of the array they stand for. To keep a whole model readable and quick to lay out,
weights and constants are written into the node that reads them, a run of identical repeated
blocks (``layers.0`` ... ``layers.31``) is drawn once with its count, and a graph still too big is
drawn with its modules closed below a depth. The text is built directly (no Graphviz needed for
``to_dot``); ``render`` runs Graphviz's ``dot`` on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from graphkern.errors import DrawingError
from graphkern.nodes import Status
from graphkern.viz.common import (
    UPSTREAM_FAILED,
    all_in_edges,
    as_nx,
    atomic_write,
    collective_text,
    format_tensor,
    graph_name,
    is_root_failure,
    node_status,
    ordered_nodes,
    scope_parts,
    status_name,
    weight_like,
)
from graphkern.viz.stats import stats_line

__all__ = ["to_dot", "render", "to_svg", "DotError", "FORMATS"]

FONT = "Helvetica"
#: What ``render`` writes, by file suffix.
FORMATS = ("svg", "png", "pdf")
#: Above this many boxes ``to_dot`` closes modules (depth="auto"): Graphviz's layout grows
#: faster than linearly and a picture of thousands of boxes is not read anyway.
AUTO_LIMIT = 600
_RENDER = "render a graph with Graphviz"

# kind -> node attributes
_KIND_STYLE: dict[str, dict[str, str]] = {
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#dbeafe", "color": "#3b82f6"},
    "output": {"shape": "ellipse", "style": "filled", "fillcolor": "#dcfce7", "color": "#16a34a"},
    "constant": {"shape": "note", "style": "filled", "fillcolor": "#f3f4f6", "color": "#9ca3af",
                 "fontsize": "8"},
    "op": {"shape": "box", "style": "rounded,filled", "fillcolor": "#ffffff", "color": "#64748b"},
    "kernel": {"shape": "box3d", "style": "filled,bold", "fillcolor": "#ede9fe",
               "color": "#6d28d9", "fontcolor": "#3b0764"},
    "collective": {"shape": "hexagon", "style": "filled,bold", "fillcolor": "#ffedd5",
                   "color": "#c2410c", "fontcolor": "#7c2d12"},
    "module": {"shape": "box", "style": "filled,bold", "fillcolor": "#e2e8f0", "color": "#475569",
               "peripheries": "2"},
}
_CROSS_RANK = 'style="dashed", color="#ea580c", penwidth=1.4, constraint=false'
_FAILED = {"fillcolor": "#fecaca", "color": "#dc2626", "fontcolor": "#7f1d1d", "penwidth": "2.5"}
_UPSTREAM = {"color": "#dc2626", "fontcolor": "#991b1b", "penwidth": "1.2",
             "fillcolor": "#fff1f2"}
_REPEAT = re.compile(r"^(.*)\.(\d+)$")


class DotError(RuntimeError):
    """Graphviz is missing, failed, or took longer than allowed."""


def _q(text: Any) -> str:
    """A DOT double-quoted string (backslashes, quotes and newlines escaped)."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\r\n", "\n").replace("\n", "\\n") + '"'


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------- what is drawn


@dataclass
class _Plan:
    """Which nodes are drawn, as what: a node, a closed module, or nothing (a weight, a copy
    of a repeated block); and the runs of repeated blocks drawn once."""

    draw: dict[Any, str] = field(default_factory=dict)   # node -> box id it is drawn as
    block_of: dict[Any, tuple[str, str]] = field(default_factory=dict)  # node -> (run, its block)
    # box id -> ("node", n) or ("module", path)
    boxes: dict[str, tuple[str, Any]] = field(default_factory=dict)
    runs: dict[str, list[str]] = field(default_factory=dict)   # first block's path -> every block's path
    attrs: dict[Any, list[str]] = field(default_factory=dict)  # node -> the weights it reads
    depth: int | None = None
    hidden_weights: int = 0


def _scope(g: nx.MultiDiGraph, n: Any) -> str:
    return ".".join(scope_parts(g.nodes[n].get("scope")))


def _runs(g: nx.MultiDiGraph, order: list[Any], shown: set[Any], plan: _Plan) -> dict[Any, Any]:
    """Runs of consecutive sibling blocks (``layers.3``, ``layers.4``...) that compute the same
    thing: each block's drawn nodes in order, with kind, op, status, relative scope, output
    shapes and which earlier node of the block feeds each input. Fills ``plan.runs`` (first
    block -> the blocks of its run) and ``plan.block_of``; returns node -> the node it stands
    for in the run's first block."""
    members: dict[str, list[Any]] = {}
    for n in order:
        if n not in shown:
            continue
        parts = scope_parts(g.nodes[n].get("scope"))
        for depth in range(len(parts)):
            if _REPEAT.match(parts[depth]):
                members.setdefault(".".join(parts[: depth + 1]), []).append(n)
    signature: dict[str, tuple[Any, ...]] = {}
    for block, nodes in members.items():
        index = {n: i for i, n in enumerate(nodes)}
        sig = []
        for n in nodes:
            d = g.nodes[n]
            ins = tuple(index.get(u, -1) for u, _, _, _ in sorted(
                ((u, v, k, e) for u, v, k, e in g.in_edges(n, keys=True, data=True)),
                key=lambda e: int(e[3].get("index") or 0)))
            outs = tuple(sorted({format_tensor(e.get("shape"), e.get("dtype"))
                                 for _, _, e in g.out_edges(n, data=True)}))
            sig.append((_scope(g, n)[len(block):], d.get("kind"), d.get("kernel") or d.get("op"),
                        node_status(d) != 0, ins, outs))
        signature[block] = tuple(sig)
    siblings: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for block in members:
        m = _REPEAT.match(block)
        if m:
            key = (m.group(1), str(len(scope_parts(block))))
            siblings.setdefault(key, []).append((int(m.group(2)), block))
    standin: dict[Any, Any] = {}
    runs: dict[str, list[str]] = {}
    for items in siblings.values():
        items.sort()
        run: list[str] = []
        for pos, (number, block) in enumerate(items + [(-1, "")]):
            if run and block and number == items[pos - 1][0] + 1 \
                    and signature[block] == signature[run[0]]:
                run.append(block)
                continue
            if len(run) > 1:
                runs[run[0]] = list(run)
                for other in run[1:]:
                    for a, b in zip(members[run[0]], members[other]):
                        standin[b] = a
            run = [block] if block else []
    for n in list(standin):  # a block repeated inside a repeated block: to the outer first one
        while standin[n] in standin:
            standin[n] = standin[standin[n]]
    for first, blocks in runs.items():
        if members[first][0] in standin:  # a run inside a copy that is not drawn
            continue
        plan.runs[first] = blocks
        for block in blocks:
            for n in members[block]:
                plan.block_of.setdefault(n, (first, block))
    return standin


def _plan(g: nx.MultiDiGraph, order: list[Any], weights: bool, repeats: bool,
          depth: int | str | None) -> _Plan:
    plan = _Plan()
    hidden = {} if weights else weight_like(g, order)
    plan.hidden_weights = len(hidden)
    shown = {n for n in order if n not in hidden}
    for n in shown:
        reads = {u: _input_names(d) for u, _, _, d in _in_edges(g, n) if u in hidden}
        if reads:  # a kernel's weight by the input it is passed as: "k_weight=model.…weight"
            plan.attrs[n] = [f"{names}={hidden[u].short}" if names else hidden[u].short
                             for u, names in reads.items()]
    standin: dict[Any, Any] = {}
    if repeats:
        standin = _runs(g, order, shown, plan)
    drawn = [n for n in order if n in shown and n not in standin]
    if depth == "auto":
        depth = _auto_depth(g, drawn)
    plan.depth = depth if isinstance(depth, int) else None
    for n in order:
        if n not in shown:
            continue
        rep = standin.get(n, n)
        parts = scope_parts(g.nodes[rep].get("scope"))
        if plan.depth is not None and len(parts) > plan.depth:
            path = ".".join(parts[: plan.depth + 1]) if plan.depth >= 0 else ".".join(parts[:1])
            box = "module:" + path
            plan.boxes.setdefault(box, ("module", path))
        else:
            box = str(rep)
            plan.boxes.setdefault(box, ("node", rep))
        plan.draw[n] = box
    return plan


def _auto_depth(g: nx.MultiDiGraph, drawn: list[Any]) -> int | None:
    """The deepest module depth at which the picture has at most ``AUTO_LIMIT`` boxes."""
    if len(drawn) <= AUTO_LIMIT:
        return None
    scopes = [scope_parts(g.nodes[n].get("scope")) for n in drawn]
    deepest = max((len(p) for p in scopes), default=0)
    for depth in range(deepest - 1, -1, -1):
        boxes = {".".join(p[: depth + 1]) if len(p) > depth else f"\0{i}" for i, p in enumerate(scopes)}
        if len(boxes) <= AUTO_LIMIT:
            return depth
    return 0


def _in_edges(g: nx.MultiDiGraph, n: Any) -> list[tuple[Any, Any, Any, dict[str, Any]]]:
    edges = [(u, n, k, d) for u, keyed in g.pred[n].items() for k, d in keyed.items()]
    edges.sort(key=lambda e: int(e[3].get("index") or 0))
    return edges


# ----------------------------------------------------------------------------- DOT text


def to_dot(graph: Any, *, clusters: bool = True, edge_labels: bool = True, rankdir: str = "TB",
           max_label: int = 40, title: bool = True, weights: bool = False, repeats: bool = True,
           depth: int | str | None = "auto", stats: bool = False) -> str:
    """The graph in Graphviz DOT.

    Module scopes are nested ``cluster_`` subgraphs (``layers.0.self_attn.q_proj`` sits in
    ``layers.0`` > ``self_attn`` > ``q_proj``); kernel nodes are violet 3-D boxes that show their
    backend and grid; collectives are orange hexagons, their cross-rank edges dashed orange; root
    failures are filled red with their status; nodes downstream of a failure are dashed red with
    a tooltip naming the root cause; edges are labelled ``dtype[shape]`` (``edge_labels=False``
    leaves them bare).

    Weights and constants are written into the node that reads them (``weights=True`` draws
    them as nodes); consecutive identical blocks such as a model's decoder layers are drawn once,
    titled ``layers.0 … layers.31 ×32`` (``repeats=False`` draws every one); modules deeper than
    ``depth`` are closed into one box each (``"auto"``: only when more than ``AUTO_LIMIT`` boxes
    would be drawn; ``None``: never). ``stats=True`` adds a line of each node's output
    statistics when the graph carries them (``gk.inspect``, ``gk.compare``; a repeated block drawn
    once shows its first block's, ``repeats=False`` shows every block).

    >>> dot = to_dot(graph)                               # doctest: +SKIP
    >>> dot.splitlines()[0]                               # doctest: +SKIP
    'digraph "forward" {'
    """
    g = as_nx(graph)
    order = ordered_nodes(g)
    plan = _plan(g, order, weights, repeats, depth)
    out: list[str] = [f"digraph {_q(graph_name(g))} {{"]
    gattrs = [f"rankdir={rankdir}", f'fontname="{FONT}"', "fontsize=11",
              "nodesep=0.25", "ranksep=0.35", 'bgcolor="white"']
    if title:
        gattrs += [f"label={_q(_title(g, order, plan))}", "labelloc=t"]
    out.append("  graph [" + ", ".join(gattrs) + "];")
    out.append(f'  node [fontname="{FONT}", fontsize=10, height=0.3, margin="0.12,0.04"];')
    out.append(f'  edge [fontname="{FONT}", fontsize=8, color="#64748b", arrowsize=0.6, '
               'fontcolor="#475569"];')
    status_of = _box_status(g, plan)
    classes = g.graph.get("modules") or {}

    # Scope tree of the drawn boxes: path -> (children paths, box ids)
    children: dict[str, list[str]] = {"": []}
    members: dict[str, list[str]] = {"": []}
    for box, (what, ref) in plan.boxes.items():
        parts = scope_parts(ref if what == "module" else g.nodes[ref].get("scope")) if clusters else []
        if what == "module":
            parts = parts[:-1]
        parent = ""
        for d in range(len(parts)):
            path = ".".join(parts[: d + 1])
            if path not in children:
                children[path] = []
                members[path] = []
                children[parent].append(path)
            parent = path
        members[parent].append(box)

    failed_paths = {p for p in children if p and any(
        status_of[b] for b in _all_members(p, children, members))}
    cluster_ids: dict[str, int] = {}

    def emit_boxes(boxes: list[str], indent: str) -> None:
        for box in boxes:
            what, ref = plan.boxes[box]
            if what == "node":
                attrs = _node_attrs(ref, g.nodes[ref], max_label, plan.attrs.get(ref, []), stats)
            else:
                attrs = _module_attrs(g, ref, plan, classes, status_of[box], max_label)
            out.append(f"{indent}{_q(box)} [{attrs}];")

    def emit_cluster(path: str, indent: str) -> None:
        cid = cluster_ids.setdefault(path, len(cluster_ids))
        parts = scope_parts(path)
        label = parts[-1] if parts else path
        run = plan.runs.get(path)
        if run:
            label = f"{label} … {scope_parts(run[-1])[-1]}  ×{len(run)} (identical, drawn once)"
        if classes.get(path):
            label += f"  {classes[path]}"
        failed = path in failed_paths
        out.append(f"{indent}subgraph cluster_{cid} {{")
        depth = len(parts)
        fill = ("#fef2f2" if failed else
                ["#f8fafc", "#f1f5f9", "#eef2f7", "#e9eef5"][min(depth - 1, 3)])
        border = "#fca5a5" if failed else "#94a3b8" if run else "#cbd5e1"
        extra = ' penwidth=2; style="rounded,filled,bold";' if run else ' style="rounded,filled";'
        out.append(f"{indent}  label={_q(label)}; tooltip={_q(path)};{extra} "
                   f"fillcolor=\"{fill}\"; color=\"{border}\"; fontsize=10; "
                   f"fontcolor=\"#334155\"; labeljust=l;")
        emit_boxes(members[path], indent + "  ")
        for child in children[path]:
            emit_cluster(child, indent + "  ")
        out.append(f"{indent}}}")

    emit_boxes(members[""], "  ")
    for child in children[""]:
        emit_cluster(child, "  ")

    seen: set[tuple[str, str, str, str]] = set()
    for u, v, key, data in _drawn_edges(g, order):
        a, b = plan.draw.get(u), plan.draw.get(v)
        if a is None or b is None or a == b:
            continue
        tensor = format_tensor(data.get("shape"), data.get("dtype"))
        where_u, where_v = plan.block_of.get(u), plan.block_of.get(v)
        backwards = (where_u is not None and where_v is not None
                     and where_u[0] == where_v[0] and where_u[1] != where_v[1])
        names = _input_names(data)
        mark = (a, b, tensor if not backwards else "next", names)
        if mark in seen:
            continue
        seen.add(mark)
        attrs = []
        if backwards:  # block k's output into block k+1, both drawn as the first block
            attrs += ['style="dashed"', "constraint=false", 'label=" next block"', 'color="#94a3b8"']
        elif edge_labels:  # into a kernel: the input's name first
            attrs.append(f"label={_q(' ' + (names + ' ' if names else '') + tensor)}")
        attrs.append(f"tooltip={_q(f'{key}: {tensor} ({u} -> {v})')}")
        if data.get("cross_rank"):  # one rank's array read by another rank's collective
            attrs.append(_CROSS_RANK)
        elif node_status(g.nodes[u]):
            attrs.append('color="#dc2626"')
            attrs.append("penwidth=1.5")
        out.append(f"  {_q(a)} -> {_q(b)} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _input_names(edge: dict[str, Any]) -> str:
    """The kernel input names an edge carries its array as (``q_weight, k_weight``), or ``""``."""
    return ", ".join(str(x) for x in edge.get("inputs") or ())


def _drawn_edges(g: nx.MultiDiGraph, order: list[Any]) -> list[tuple[Any, Any, Any, dict[str, Any]]]:
    ins = all_in_edges(g)
    return [e for n in order for e in ins[n]]


def _title(g: nx.MultiDiGraph, order: list[Any], plan: _Plan) -> str:
    label = f"{graph_name(g)} — {g.number_of_nodes()} nodes"
    backend = g.graph.get("backend")
    if backend:
        label += f", backend {backend}"
    notes = []
    for first, blocks in plan.runs.items():
        notes.append(f"{len(blocks)} identical blocks {first} … {scope_parts(blocks[-1])[-1]} drawn once")
    if plan.hidden_weights:
        notes.append("weights and constants shown in the nodes that read them")
    if plan.depth is not None:
        notes.append("every module closed" if plan.depth == 0 else
                     f"modules open {plan.depth} level{'s' if plan.depth > 1 else ''} deep")
    if notes:
        label += "\n" + "; ".join(notes)
    roots = [n for n in order if is_root_failure(g.nodes[n])]
    if roots:
        d = g.nodes[roots[0]]
        where = f" in {d['scope']}" if d.get("scope") else ""
        label += f"\nFAILED: {roots[0]}{where} ({status_name(node_status(d))})"
    return label


def _box_status(g: nx.MultiDiGraph, plan: _Plan) -> dict[str, int]:
    """Each box's worst status: a root failure over UPSTREAM_FAILED over OK."""
    status: dict[str, int] = {box: 0 for box in plan.boxes}
    for n, box in plan.draw.items():
        s = node_status(g.nodes[n])
        if s and (not status[box] or status[box] == UPSTREAM_FAILED):
            status[box] = s
    return status


def _all_members(path: str, children: dict[str, list[str]],
                 members: dict[str, list[str]]) -> list[str]:
    found = list(members[path])
    for child in children[path]:
        found += _all_members(child, children, members)
    return found


def _style(attrs: dict[str, str], status: int) -> None:
    if status == UPSTREAM_FAILED:
        attrs.update(_UPSTREAM)
        attrs["style"] = attrs["style"] + ",dashed"
    elif status:
        attrs.update(_FAILED)


def _module_attrs(g: nx.MultiDiGraph, path: str, plan: _Plan, classes: dict[str, str],
                  status: int, max_label: int) -> str:
    inside = [n for n, box in plan.draw.items() if box == "module:" + path]
    kernels = sum(1 for n in inside if g.nodes[n].get("kind") == "kernel")
    lines = [_short(scope_parts(path)[-1], max_label)]
    what = [classes[path]] if classes.get(path) else []
    what.append(f"{len(inside) - kernels} ops" + (f", {kernels} kernels" if kernels else ""))
    lines.append(" · ".join(what))
    attrs = dict(_KIND_STYLE["module"])
    _style(attrs, status)
    if status and status != UPSTREAM_FAILED:
        lines.append(f"✖ {status_name(status)}")
    attrs["label"] = "\n".join(lines)
    attrs["tooltip"] = path
    return ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())


def _node_attrs(n: str, d: dict[str, Any], max_label: int, reads: list[str],
                stats: bool = False) -> str:
    kind = str(d.get("kind") or "op")
    label = str(d.get("label") or n)
    op = str(d.get("op") or "")
    lines = [_short(op if kind == "op" and op else label, max_label)]
    if kind == "kernel":
        grid, tg = d.get("grid"), d.get("threadgroup")
        extra = str(d.get("backend") or "")
        if grid:
            extra += f" grid {'x'.join(str(x) for x in grid)}"
        if tg:
            extra += f" tg {'x'.join(str(x) for x in tg)}"
        if extra.strip():
            lines.append(extra.strip())
    elif kind == "collective":
        lines.append(collective_text(d))
    elif kind == "constant" and d.get("value"):
        lines.append(_short(str(d["value"]), max_label))
    scope = str(d.get("scope") or "")
    if reads:
        lines.append(_short(", ".join(_relative(r, scope) for r in reads), max_label))
    values = stats_line(d) if stats else None
    if values:
        lines.append(_short(values, max_label + 10))
    status = node_status(d)
    tooltip = [f"{n} ({kind}{', ' + op if op and op != label else ''})"]
    if scope:
        tooltip.append(f"scope: {scope}")
    attrs = dict(_KIND_STYLE.get(kind, _KIND_STYLE["op"]))
    _style(attrs, status)
    if status == UPSTREAM_FAILED:
        tooltip.append(f"UPSTREAM_FAILED: root cause {d.get('root_cause')}")
    elif status:
        lines.append(f"✖ {status_name(status)}")
        tooltip.append(f"{status_name(status)}: {d.get('message') or ''}")
    attrs["label"] = "\n".join(lines)
    attrs["tooltip"] = "\n".join(tooltip)
    return ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())


def _relative(path: str, scope: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` read in ``model.layers.0.mlp`` is ``up_proj.weight``."""
    a, b = path.split("."), scope.split(".") if scope else []
    q = 0
    while q < len(a) - 1 and q < len(b) and a[q] == b[q]:
        q += 1
    return ".".join(a[q:])


# ----------------------------------------------------------------------------- rendering


Progress = Callable[[str], None]


def run_dot(dot: str, fmt: str, *, progress: Progress | None = None,
             timeout: float | None = None, what: str = "graph") -> bytes:
    """``dot -T<fmt>`` on ``dot``; ``progress`` hears how long it has run every second after the
    first two, and a run past ``timeout`` seconds is stopped."""
    exe = shutil.which("dot")
    if exe is None:
        raise DotError("rendering needs Graphviz's 'dot' program: apt-get install graphviz "
                       "(or brew install graphviz)")
    # its own process group, so that stopping it stops whatever it started too
    proc = subprocess.Popen([exe, f"-T{fmt}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=os.name == "posix")
    result: dict[str, bytes] = {}

    def communicate() -> None:
        result["out"], result["err"] = proc.communicate(dot.encode("utf-8"))

    worker = threading.Thread(target=communicate, daemon=True)
    start = time.monotonic()
    worker.start()
    try:
        while worker.is_alive():
            worker.join(1.0)
            elapsed = time.monotonic() - start
            if worker.is_alive() and timeout is not None and elapsed > timeout:
                raise DotError(f"Graphviz took more than {timeout:g} s to lay out {what}; draw "
                               "fewer boxes (depth=1, or leave repeats on)")
            if worker.is_alive() and progress is not None and elapsed >= 2:
                progress(f"Graphviz: laying out {what}, {elapsed:.0f} s")
    except BaseException:
        _stop(proc)
        worker.join()
        raise
    if proc.returncode:
        err = result.get("err", b"").decode(errors="replace").strip()
        raise DotError(f"Graphviz failed: {err or f'exit status {proc.returncode}'}")
    return result["out"]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if os.name == "posix":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()


def _stderr_progress() -> Progress | None:
    """Progress lines on stderr, rewritten in place on a terminal; None when stderr is gone."""
    stream = sys.stderr
    if stream is None:
        return None
    tty = stream.isatty()

    def show(text: str) -> None:
        stream.write(("\r" + text + "   ") if tty else text + "\n")
        stream.flush()

    return show


def to_svg(graph: Any, **kw: Any) -> str:
    """The graph drawn by Graphviz, as SVG text (``**kw`` go to ``to_dot``).

    >>> svg = to_svg(graph)                               # doctest: +SKIP
    >>> svg.lstrip().startswith("<?xml")                  # doctest: +SKIP
    True
    """
    return run_dot(to_dot(graph, **kw), "svg").decode("utf-8")


def format_for(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The format ``render`` writes ``path`` in: its suffix, which must be one of ``FORMATS``
    (and agree with ``format`` when both are given); raises ``DrawingError`` otherwise.

    >>> format_for("graph.PNG"), format_for("graph", "pdf")
    ('png', 'pdf')
    """
    name = os.fspath(path)
    suffix = os.path.splitext(name)[1].lstrip(".").lower()
    wanted = format.lower().lstrip(".") if format else None
    if wanted is not None and wanted not in FORMATS:
        raise DrawingError(_RENDER, f"format must be one of {', '.join(FORMATS)}, got {format!r}",
                          Status.INVALID_INPUT)
    if suffix and suffix not in FORMATS:
        raise DrawingError(_RENDER, f"cannot write {name!r}: the suffix .{suffix} is not one of "
                          f"{', '.join('.' + f for f in FORMATS)}", Status.INVALID_INPUT)
    if suffix and wanted and suffix != wanted:
        raise DrawingError(_RENDER, f"cannot write {name!r} as {wanted}: its suffix says {suffix}",
                          Status.INVALID_INPUT)
    fmt = suffix or wanted
    if fmt is None:
        raise DrawingError(_RENDER, f"cannot tell the format of {name!r}: end it in "
                          f"{', '.join('.' + f for f in FORMATS)} or pass format=",
                          Status.INVALID_INPUT)
    return fmt


def render(graph: Any, path: str | os.PathLike[str], format: str | None = None, *,
           progress: Progress | bool | None = None, timeout: float | None = None,
           **kw: Any) -> str:
    """Draw the graph with Graphviz into ``path`` as SVG, PNG or PDF, as its suffix says (an
    unknown suffix raises ``DrawingError``). The file appears whole or not at all. A layout that
    runs past two seconds reports its progress on stderr (``progress=False`` silences it, or
    pass a callable taking a line of text); ``timeout`` stops it after that many seconds.
    ``**kw`` go to ``to_dot``. Returns the path.

    >>> render(graph, "trace.svg")                        # doctest: +SKIP
    'trace.svg'
    """
    fmt = format_for(path, format)
    report = _stderr_progress() if progress is None or progress is True else progress or None
    g = as_nx(graph)
    what = f"{graph_name(g)} ({g.number_of_nodes()} nodes) for {os.fspath(path)}"
    atomic_write(path, run_dot(to_dot(graph, **kw), fmt, progress=report, timeout=timeout,
                                what=what))
    return os.fspath(path)
