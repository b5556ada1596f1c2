"""Build a networkx graph from MLX's own capture (``mx.export_function``'s callback).

MLX reports inputs, outputs, constants and one event per primitive. graphkern's tracer tags each
kernel call and module call with ``mx.depends(outputs, inputs + [tag])``, where ``tag`` is a small
uint32 constant ``[MAGIC, record id, nonce]``; here each tagged ``Depends`` is found again, the
primitives between a kernel record's inputs and outputs fold into one ``kernel`` node (a collective
record's stand-in into one ``collective`` node), module records give their primitives a scope, and
the tags themselves disappear.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import networkx as nx

from ..launching.fastpaths import adjacency, bulk_multidigraph, move_out_edges
from ..launching.launch_cache import memoized
from ..nodes import KernelError, NodeKind, dtype_name

MAGIC = 0x676B7472  # "gktr"
_INNER_KINDS = (str(NodeKind.OP), str(NodeKind.KERNEL), str(NodeKind.COLLECTIVE))
_KERNEL = str(NodeKind.KERNEL)
#: folded nodes a module's walk goes through to what they read
_WALKED = (_KERNEL, str(NodeKind.COLLECTIVE))
#: the node kind a folded record becomes (a failed module: an op standing for the module)
_FOLDED_KINDS = {"kernel": _KERNEL, "collective": str(NodeKind.COLLECTIVE)}
_ARGUMENT_CHARS = 120


@dataclass
class Record:
    """One graphkern call seen while tracing: a kernel launch, a collective or a module call."""

    id: int
    kind: str  # "kernel", "collective" or "module"
    name: str  # kernel name, collective op, or the module's class name
    scope: str  # module path the call ran in (for modules: their own path)
    n_outputs: int
    call_index: int = 0
    error: KernelError | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


class EventLog:
    """The callback given to ``mx.export_function``: it only keeps the events, cheaply."""

    def __init__(self) -> None:
        self.inputs: list[tuple[str, tuple[int, ...], mx.Dtype]] = []
        self.outputs: list[tuple[str, tuple[int, ...], mx.Dtype]] = []
        self.constants: list[tuple[str, mx.array]] = []
        self.primitives: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "primitive":
            self.primitives.append(event)
        elif kind == "inputs":
            self.inputs = event["inputs"]
        elif kind == "keyword_inputs":
            self.inputs = self.inputs + [(name, shape, dt) for _, name, shape, dt in
                                         _keyword_triples(event["keywords"])]
        elif kind == "outputs":
            self.outputs = event["outputs"]
        elif kind == "constants":
            self.constants = event["constants"]


def _keyword_triples(keywords: Iterable[Any]) -> list[tuple[str, str, tuple[int, ...], mx.Dtype]]:
    triples = []
    for item in keywords:
        key, (name, shape, dt) = item
        triples.append((key, name, shape, dt))
    return triples


_SNAKE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_INPUT, _CONSTANT, _OP, _OUTPUT = (str(k) for k in (NodeKind.INPUT, NodeKind.CONSTANT, NodeKind.OP,
                                                    NodeKind.OUTPUT))


@memoized("primitive names", maxsize=256)
def _snake(op: str) -> str:
    """``AddMM`` -> ``add_mm``, ``CustomKernel`` -> ``custom_kernel``."""
    return _SNAKE.sub("_", op).lower()


class _Names:
    """torch.fx-style unique node names: ``add``, ``add_1``, ..."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}

    def __call__(self, base: str) -> str:
        base = base or "node"
        count = self.used.get(base)
        if count is None:
            self.used[base] = 0
            return base
        while True:
            count += 1
            name = f"{base}_{count}"
            if name not in self.used:
                self.used[base] = count
                self.used[name] = 0
                return name


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _ARGUMENT_CHARS else text[: _ARGUMENT_CHARS - 3] + "..."


def _constant_text(value: mx.array) -> str:
    if value.size <= 8:
        return _short(value.tolist())
    return f"<{dtype_name(value.dtype)}{list(value.shape)}>"


def _tag_id(value: mx.array, nonce: int) -> int | None:
    if value.dtype != mx.uint32 or value.shape != (3,):
        return None
    magic, rid, seen_nonce = cast(list[int], value.tolist())
    return rid if magic == MAGIC and seen_nonce == nonce else None


@dataclass
class Wiring:
    """How each node of a built graph reads its inputs: what running the graph node by node needs
    (``graphkern.debugging.values``), kept only when asked for.

    ``args``: node -> the arrays it reads, in argument order (a kernel node: its launch's array
    inputs); ``producer``: array -> (node, output index); ``primitives``: op node -> MLX's event
    for it (``name``, ``arguments``, ``outputs``); ``constants``: constant node -> its value;
    ``inputs``: the input nodes in argument order; ``outputs``: (output node, array) pairs;
    ``launches``: kernel node -> the validated launch it ran (filled in by the tracer);
    ``module_calls``: each module call as (record id, path, what made each of its outputs: (node,
    output index), or None), in the order the calls returned (inner calls first).
    """

    args: dict[str, list[str]] = field(default_factory=dict)
    producer: dict[str, tuple[str, int]] = field(default_factory=dict)
    primitives: dict[str, dict[str, Any]] = field(default_factory=dict)
    constants: dict[str, mx.array] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)
    launches: dict[str, Any] = field(default_factory=dict)
    module_calls: list[tuple[int, str, list[tuple[str, int] | None]]] = field(default_factory=list)


def build_graph(log: EventLog, input_names: list[str], records: dict[int, Record],
                nonce: int, attrs: dict[str, Any], wiring: Wiring | None = None) -> nx.MultiDiGraph:
    """Turn the captured events into graphkern's MultiDiGraph (node kinds, attributes and
    invariants: ``graphkern.tracing.schema``); with ``wiring``, fill it in too."""
    names = _Names()
    nodes: dict[str, dict[str, Any]] = {}
    producer: dict[str, tuple[str, int]] = {}
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    dtype_names: dict[Any, str] = {}

    def dtype_of(dt: Any) -> str:
        known = dtype_names.get(dt)
        if known is None:
            known = dtype_names[dt] = dtype_name(dt)
        return known

    for (array, shape, dt), label in zip(log.inputs, input_names):
        node = names(label)
        nodes[node] = {"kind": _INPUT, "label": label, "op": "", "scope": _param_scope(label)}
        producer[array] = (node, 0)
        info[array] = (tuple(shape), dtype_of(dt))

    tags: dict[str, int] = {}
    for array, value in log.constants:
        rid = _tag_id(value, nonce)
        if rid is not None:
            tags[array] = rid
            continue
        node = names("const")
        nodes[node] = {"kind": _CONSTANT, "label": node, "op": "", "scope": "",
                       "value": _constant_text(value)}
        producer[array] = (node, 0)
        info[array] = (tuple(value.shape), dtype_of(value.dtype))

    depends_of: dict[int, str] = {}
    node_args: dict[str, list[str]] = {}
    node_outputs: dict[str, list[str]] = {}
    for event in log.primitives:
        op = event["name"]
        node = names(_snake(op))
        arguments = event["arguments"]
        data = {"kind": _OP, "label": node, "op": op, "scope": ""}
        if op == "CustomKernel":
            data["generated_name"] = arguments[0] if arguments else None
            data["arguments"] = _short(arguments[2:8])
        else:
            data["arguments"] = _short(arguments) if arguments else ""
        nodes[node] = data
        ins = [name for name, _, _ in event["inputs"]]
        node_args[node] = ins
        outs = node_outputs[node] = []
        for index, (array, shape, dt) in enumerate(event["outputs"]):
            outs.append(array)
            producer[array] = (node, index)
            info[array] = (shape if shape.__class__ is tuple else tuple(shape), dtype_of(dt))
        if op == "Depends" and ins and ins[-1] in tags:
            depends_of[tags[ins[-1]]] = node
    if wiring is not None:  # node_args holds the primitives' nodes in event order
        wiring.primitives = dict(zip(node_args, log.primitives))
        wiring.inputs = [producer[array][0] for array, _, _ in log.inputs]
        wiring.constants = {producer[array][0]: value for array, value in log.constants
                            if array not in tags}

    edges = []
    for node, ins in node_args.items():
        for index, array in enumerate(ins):
            if array in producer:
                shape, dtype_text = info[array]
                edges.append((producer[array][0], node, array,
                              {"shape": shape, "dtype": dtype_text, "index": index}))
    for index, (array, shape, dt) in enumerate(log.outputs):
        node = names(f"output_{index}")
        nodes[node] = {"kind": _OUTPUT, "label": node, "op": "", "scope": ""}
        if wiring is not None:
            wiring.outputs.append((node, array))
        if array in producer:
            edges.append((producer[array][0], node, array,
                          {"shape": tuple(shape), "dtype": dtype_of(dt), "index": 0}))
    g = bulk_multidigraph(nodes, edges)
    g.graph.update(attrs)

    folder = _Folder(g, node_args, node_outputs, producer, names)
    def fold_order(rid: int) -> tuple[bool, int]:  # collectives in call order, named all_sum, all_sum_1...
        record = records[rid]
        return record.kind == "module", -1 if record.kind == "collective" else len(record.scope)

    modules = []
    for rid in sorted(records, key=fold_order):
        record = records[rid]
        depends = depends_of.get(rid)
        if record.kind != "module" or record.error is not None:
            folder.fold(record, depends)
        elif depends is not None:
            modules.append((record, depends))
    # record ids follow the order calls returned in, so a module comes after the modules it called
    modules.sort(key=lambda item: item[0].id)
    for record, depends in modules:
        folder.scope_module(record, depends)
    folder.assign_scopes()
    if wiring is not None:
        wiring.args = {**node_args, **folder.launch_inputs}
        wiring.producer = producer
        wiring.module_calls = folder.module_calls
    return g


def innermost_common_scope(scopes: set[str]) -> str:
    """The common ancestor of the innermost scopes in ``scopes``.

    >>> innermost_common_scope({"a", "a.b", "a.b.c"})
    'a.b.c'
    >>> innermost_common_scope({"layers", "layers.0.norm", "layers.1.norm"})
    'layers'
    """
    ordered = sorted(scopes)
    # module paths are identifiers, digits and dots, and "." sorts before all of those: a scope's
    # descendants ("a.b" -> "a.b.c") come right after it
    leaves = [s for s, after in zip(ordered, ordered[1:] + [""]) if not (s and after.startswith(s + "."))]
    first, last = leaves[0].split("."), leaves[-1].split(".")  # the extremes share what all share
    common: list[str] = []
    for a, b in zip(first, last):
        if a != b:
            break
        common.append(a)
    return ".".join(common)


def _param_scope(label: str) -> str:
    """``layers.0.weight`` -> ``layers.0``: parameters sit in their module's scope."""
    return label.rsplit(".", 1)[0] if "." in label and not label.startswith("args") else ""


def _named_inputs(g: nx.MultiDiGraph, depends: str, inputs: list[str],
                  names: list[str]) -> list[tuple[Any, str, dict[str, Any]]]:
    """A record's input edges in argument order, one per array: ``index`` its first position, and
    for a kernel ``inputs`` the input names it is passed as (two names when one array is passed
    twice, as ``rope_qk``'s ``q_weight`` and ``k_weight`` can be), so a picture labels it by name."""
    found = {k: (u, d) for u, _, k, d in g.in_edges(depends, keys=True, data=True) if k in inputs}
    edges: list[tuple[Any, str, dict[str, Any]]] = []
    for position, array in enumerate(inputs):
        if array not in found or any(key == array for _, key, _ in edges):
            continue
        src, data = found[array]
        data = {**data, "index": position}
        if names:
            data["inputs"] = [names[i] for i, a in enumerate(inputs) if a == array and i < len(names)]
        edges.append((src, array, data))
    return edges


class _Folder:
    """Folds tagged records into the graph built from MLX's events."""

    def __init__(self, g: nx.MultiDiGraph, node_args: dict[str, list[str]],
                 node_outputs: dict[str, list[str]], producer: dict[str, tuple[str, int]],
                 names: _Names):
        self.g = g
        self.node_args = node_args
        self.node_outputs = node_outputs
        self.scopes: dict[str, set[str]] = {}
        self.producer = producer
        self.names = names
        # arrays a scoped module call returned (tagged) -> the arrays its body reads from
        # outside: a caller's walk jumps over the call's body from the one to the other
        self.reads: dict[str, list[str]] = {}
        self.folded: set[str] = set()
        self.raw_name: dict[str, str] = {}  # a scoped module's tagged output -> the array's name
        self.launch_inputs: dict[str, list[str]] = {}  # kernel node -> its launch's array inputs
        self.module_calls: list[tuple[int, str, list[tuple[str, int] | None]]] = []  # see Wiring

    def _record_arrays(self, record: Record, depends: str) -> tuple[list[str], list[str]]:
        ins = self.node_args[depends]
        return ins[: record.n_outputs], ins[record.n_outputs: -1]

    def _body(self, outputs: list[str], stop_arrays: set[str], depends: str,
              exclusive: bool = False) -> set[str]:
        """Nodes between a record's inputs and its raw outputs, found walking back from the outputs.

        With ``exclusive``, only nodes whose every consumer is inside too: MLX merges identical
        primitives across calls (two references scaling by 2 share one Broadcast), and a shared
        node must stay in the graph for the other call.
        """
        g = self.g
        body: set[str] = set()
        seeds = [self.producer[a][0] for a in outputs if a not in stop_arrays and a in self.producer]
        queue = deque(seeds)
        while queue:
            node = queue.popleft()
            if node in body or g.nodes[node]["kind"] not in _INNER_KINDS:
                continue
            body.add(node)
            for array in self.node_args.get(node, ()):
                if array not in stop_arrays and array in self.producer:
                    queue.append(self.producer[array][0])
        candidates = {pred for node in body for pred in g.predecessors(node)}.union(seeds)
        body.update(n for n in candidates if g.nodes[n]["kind"] == str(NodeKind.CONSTANT))
        if exclusive:
            changed = True
            while changed:
                shared = {n for n in body if any(s not in body and s != depends for s in g.successors(n))}
                body -= shared
                changed = bool(shared)
        else:
            body = {n for n in body if g.nodes[n]["kind"] in _INNER_KINDS or all(
                s in body or s == depends for s in g.successors(n))}
        return body

    def fold(self, record: Record, depends: str | None) -> None:
        """Replace a kernel or collective record's primitives (or a failed module's placeholders)
        by one node."""
        g = self.g
        node = self.names(record.name)
        attrs = dict(record.attrs)
        attrs.update(kind=_FOLDED_KINDS.get(record.kind, _OP),
                     label=node, op=record.name, scope=record.scope, call_index=record.call_index)
        if record.error is not None:
            attrs.update(status=int(record.error.status), message=str(record.error))
        if depends is None:  # its outputs are unused: keep it visible, unconnected
            g.add_node(node, **attrs)
            return
        raw_outputs, inputs = self._record_arrays(record, depends)
        self.launch_inputs[node] = inputs
        body = self._body(raw_outputs, set(inputs), depends, exclusive=True)
        body -= {self.producer[a][0] for a in inputs if a in self.producer}  # inputs stay outside
        generated = [g.nodes[n].get("generated_name") for n in body if g.nodes[n]["op"] == "CustomKernel"]
        if generated and generated[0]:
            attrs["generated_name"] = generated[0]
        g.add_node(node, **attrs)
        # inputs: the record's own, in order, then whatever else the body reads (shared nodes)
        in_edges = _named_inputs(g, depends, inputs, list(attrs.get("input_names") or ()))
        shared = list({(u, k): (u, k, d) for member in body
                       for u, _, k, d in g.in_edges(member, keys=True, data=True)
                       if u not in body and k not in inputs}.values())
        in_edges += [(u, k, {**d, "index": len(inputs) + i}) for i, (u, k, d) in enumerate(shared)]
        for src, key, data in in_edges:
            if not g.has_edge(src, node, key=key):
                g.add_edge(src, node, key=key, **data)
        self.node_args[node] = [key for _, key, _ in in_edges]
        for _, dst, key, data in list(g.out_edges(depends, keys=True, data=True)):
            g.add_edge(node, dst, key=key, **data)
        g.remove_nodes_from(body | {depends})
        self.folded.add(node)
        for index, (raw, tagged) in enumerate(zip(raw_outputs, self.node_outputs[depends])):
            self.producer[tagged] = (node, index)
            # a raw output made outside the body keeps its producer: an input returned as it is,
            # or a node MLX merged across calls (the identical placeholders of two failed
            # launches), which another record's body still starts from
            if self.producer.get(raw, ("",))[0] in body:
                self.producer[raw] = (node, index)

    def assign_scopes(self) -> None:
        """Each op's scope: its innermost module, or the common ancestor of the innermost modules
        when MLX merged identical primitives of several calls into one node."""
        nodes = adjacency(self.g)[0]
        for node, scopes in self.scopes.items():
            if node in nodes:
                nodes[node]["scope"] = (next(iter(scopes)) if len(scopes) == 1
                                        else innermost_common_scope(scopes))

    def _members(self, outputs: list[str], stop: set[str]) -> tuple[list[str], list[str]]:
        """The op nodes of one module call and the arrays its body reads from outside.

        Walks back from the call's raw outputs to its inputs (``stop``). The body of a module it
        called, scoped before, is jumped over (from that call's outputs to what it read), so each
        node is walked by its innermost call alone, not once per enclosing module.
        """
        nodes, producer, node_args, reads = adjacency(self.g)[0], self.producer, self.node_args, self.reads
        members: list[str] = []
        outside: list[str] = []
        seen_arrays: set[str] = set()
        seen: set[str] = set()
        queue = list(outputs)
        while queue:
            array = queue.pop()
            if array in seen_arrays:
                continue
            seen_arrays.add(array)
            if array in stop:
                outside.append(array)
                continue
            jumped = reads.get(array)
            if jumped is not None:
                queue.extend(jumped)
                continue
            made = producer.get(array)
            if made is None:
                continue
            node = made[0]
            if node in seen:
                continue
            seen.add(node)
            kind = nodes[node]["kind"]
            if kind == _OP:
                if node not in self.folded:
                    members.append(node)
            elif kind not in _WALKED:
                outside.append(array)  # an input or constant
                continue
            queue.extend(node_args.get(node, ()))
        return members, outside

    def scope_module(self, record: Record, depends: str) -> None:
        """Give the primitives of one module call its path; then drop its tag."""
        g = self.g
        raw_outputs, inputs = self._record_arrays(record, depends)
        members, outside = self._members(raw_outputs, set(inputs))
        scopes = self.scopes
        for member in members:
            found = scopes.get(member)
            if found is None:
                scopes[member] = {record.scope}
            else:
                found.add(record.scope)
        tagged_outputs = self.node_outputs[depends]
        # an array a module returned from a module it called is keyed by its innermost name
        raw_names = [self.raw_name.get(raw, raw) for raw in raw_outputs]
        at = {tagged: i for i, tagged in enumerate(tagged_outputs)}
        producer = self.producer

        def moved(key: str) -> tuple[str, str] | None:  # the tag's edge, from what made the array
            made = producer.get(raw_outputs[at[key]])
            return (made[0], raw_names[at[key]]) if made is not None else None

        move_out_edges(g, depends, moved)
        for raw, name, tagged in zip(raw_outputs, raw_names, tagged_outputs):
            if raw in producer:
                producer[tagged] = producer[raw]
            self.raw_name[tagged] = name
            self.reads[tagged] = outside
        self.module_calls.append((record.id, record.scope, [producer.get(raw) for raw in raw_outputs]))
