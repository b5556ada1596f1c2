"""Values on the graph: ``gk.inspect`` traces a function, runs the graph node by node and records
summary statistics of every node's output; the first node that made a NaN or Inf is a failure.

The trace is ``gk.trace``'s. Then the graph runs again, node by node, from the call's own
arguments and state: every op node through the MLX op that makes its primitive
(:mod:`graphkern.tracing.replay`), every kernel node through its validated launch. Each node's output gets
``stats = {"min", "max", "mean", "absmax", "nan", "inf"}`` (min, max, mean and absmax over its
finite elements, ``None`` when it has none; ``nan`` and ``inf`` count elements), module outputs
included (``module_outputs`` names the module calls a node's output left). A node whose array
cannot be reached gets ``values_note`` saying why, never a guess.

Nothing holds every tensor: values are evaluated in chunks and dropped once their last consumer
ran. Full tensors are kept only on request, streamed to a ``.npz`` or ``.safetensors`` file.

The root-cause rule, as ``jax_debug_nans``: the first node in topological order whose output holds
a NaN or Inf while all its inputs were finite gets ``Status.NON_FINITE``; its descendants become
``UPSTREAM_FAILED`` as for every failure, so ``g.status``, ``g.failures()`` and the pictures show it.

>>> import mlx.core as mx, graphkern as gk
>>> g = gk.inspect(lambda x: mx.sqrt(x - 10) * 2, mx.arange(4, dtype=mx.float32))
>>> g.status.name, g.failures()[0].node
('NON_FINITE', 'sqrt')
>>> g.nx.nodes["subtract"]["stats"]
{'min': -10.0, 'max': -7.0, 'mean': -8.5, 'absmax': 10.0, 'nan': 0, 'inf': 0}
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import mlx.core as mx

from ..launching.fastpaths import adjacency
from ..launching.launch_paths import run_reference
from ..nodes import NodeKind, Status, dtype_name
from ..tracing import replay
from ..tracing.capture import Wiring
from ..tracing.graph import Graph
from ..tracing.recorder import TraceRecorder
from ..tracing.schema import STAT_KEYS
from ..tracing.state import Flat
from ..tracing.traceable import Traceable
from .interpreter import RUNNABLE, GraphInterpreter, Outputs
from .precision import main_float_dtype
from .progress import Progress, progress_line
from .statistics import FLOATS, StatsBatch, is_finite_stats, merge_stats
from .tolerance import errors

__all__ = ["STAT_KEYS", "GraphRun", "Inspector", "eager_anchors", "finish_values", "inspect",
           "root_causes", "trace_for_values"]


_INSPECT = "inspect a function's values"
_CHUNK_BYTES = 256 << 20  # evaluate once this many bytes of node outputs are pending
_CHUNK_NODES = 512
_ANCHOR_ROUNDS = 3  # eager runs a values run may ask for, after nodes that fail to run again
# primitives whose output holds their input's values (reordered, reshaped, repeated equally)
SAME_VALUES = frozenset({"Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Transpose",
                          "Copy", "StopGradient", "Broadcast", "BroadcastAxes"})
# primitives whose output is some of their first input's values, exactly (for _cast_reads)
_SELECTING = SAME_VALUES | {"Gather", "GatherAxis", "Slice", "AsStrided"}
_CAST_BLOCK = 1 << 22  # elements of a weight cast at once by a run with cast_inputs
_INPUT, _CONSTANT, _OUTPUT, _OP, _KERNEL = (k.value for k in (
    NodeKind.INPUT, NodeKind.CONSTANT, NodeKind.OUTPUT, NodeKind.OP, NodeKind.KERNEL))
_MARKABLE = frozenset({int(Status.OK), int(Status.UPSTREAM_FAILED), int(Status.NON_FINITE)})

NodeFilter = Callable[[str, dict[str, Any]], bool]


# ----------------------------------------------------------------------------- the values run


class GraphRun(GraphInterpreter):
    """One run of a traced graph, node by node (a :class:`GraphInterpreter`), recording
    ``stats`` on the nodes. ``anchors`` give the outputs of nodes the graph cannot run again
    (see :func:`eager_anchors`); ``cast_inputs`` casts the call's float arrays as they are
    read; ``check_kernels`` runs each kernel's reference too; ``writer`` and ``keep`` stream
    full tensors to a file."""

    def __init__(self, graph: Graph, wiring: Wiring, arrays: list[mx.array], *,
                 check_kernels: tuple[float, float] | None = None, keep: NodeFilter | None = None,
                 writer: Any = None, anchors: dict[str, list[mx.array]] | None = None,
                 more_anchors: Callable[[set[str]], dict[str, list[mx.array]]] | None = None,
                 cast_inputs: mx.Dtype | None = None, record: bool = True):
        super().__init__(graph, wiring, arrays)
        self.cast_inputs = cast_inputs  # float inputs become this dtype as they are read
        self.record = record  # False: run the values without recording their statistics
        self.uncast: set[tuple[str, int]] = set()  # outputs holding inputs not cast yet
        self.anchors = anchors or {}  # node -> its outputs from an eager run of the function
        self.more_anchors = more_anchors
        self.anchor_rounds = 0
        self.check_kernels = check_kernels
        self.keep = keep
        self.writer = writer
        self.batch = StatsBatch()
        self.to_write: list[tuple[str, mx.array]] = []
        self.checks: list[tuple[str, mx.array]] = []
        self.partial: dict[str, list[dict[str, Any] | None]] = {}
        self.sizes: dict[str, list[int]] = {}
        self.sizes_of: dict[tuple[str, int], int] = {}  # each output recorded: its size
        # statistics still wanted by views of an output (and, meanwhile, those already known)
        self.waiting: dict[tuple[str, int], list[Callable[[dict[str, Any]], None]]] = {}
        self.known: dict[tuple[str, int], dict[str, Any]] = {}

    def run_node(self, node: str, data: dict[str, Any]) -> Outputs:
        if data["kind"] not in (_INPUT, _CONSTANT, _OUTPUT) and data["status"] in RUNNABLE:
            anchored = self.anchors.pop(node, None)
            if anchored is not None:
                return anchored
        return super().run_node(node, data)

    def input(self, node: str, data: dict[str, Any]) -> Outputs:
        value: mx.array = self.arrays[self.input_index[node]]
        if self.cast_inputs is not None and value.dtype in FLOATS and value.dtype != self.cast_inputs:
            self.uncast.add((node, 0))  # cast as read (see _cast_reads)
        return [value]

    def call(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        if self.uncast:
            made = [self.wiring.producer.get(array) for array in self.wiring.args.get(node, ())]
            if data["kind"] == _OP and data["op"] == "Matmul" and made[1] in self.uncast \
                    and inputs[1].size > _CAST_BLOCK and made[0] not in self.uncast:
                return [_matmul_cast_in_blocks(inputs[0], inputs[1], self.cast_inputs or mx.float32)]
            cast = self._cast_reads(node, data, inputs, made)
            if cast is None:
                return self._uncast_op(node, data, inputs)
            inputs = cast
        return super().call(node, data, inputs)

    def kernel(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        outputs = super().kernel(node, data, inputs)
        launch = self.wiring.launches.get(node)
        if isinstance(outputs, str) or self.check_kernels is None or launch is None \
                or launch.kernel.reference is None:
            return outputs
        try:
            reference = run_reference(launch, inputs)
        except Exception as exc:
            self.nodes[node]["reference_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            rtol, atol = self.check_kernels
            self.checks.append((node, _errors(outputs, reference, rtol=rtol, atol=atol)))
        return outputs

    def not_run_again(self, node: str, why: str) -> Outputs:
        """Ask for the eager outputs that let the run go on after ``node`` (see
        ``eager_anchors``), a few times at most; its own, if a module call returned it, or why not."""
        if self.more_anchors is not None and self.anchor_rounds < _ANCHOR_ROUNDS:
            self.anchor_rounds += 1
            found = self.more_anchors({node})
            self.anchors.update({n: v for n, v in found.items() if n not in self.done})
        anchored = self.anchors.pop(node, None)
        return anchored if anchored is not None else why

    def computed(self, node: str, index: int, count: int, value: mx.array) -> None:
        if self.record:
            self._record(node, index, count, value)
        self.sizes_of[(node, index)] = value.size

    def _cast_reads(self, node: str, data: dict[str, Any], inputs: list[mx.array],
                    made: list[tuple[str, int] | None]) -> list[mx.array] | None:
        """``cast_inputs``: the call's arrays are held as given and cast as each node reads them,
        so that no cast copy of a weight outlives the node reading it. None: ``node`` reads them
        as given (an op that only selects or lays out values: its outputs are cast in turn as
        they are read)."""
        if data["kind"] == _OP and data["op"] in _SELECTING and made[0] in self.uncast \
                and not any(m in self.uncast for m in made[1:]):
            return None
        dtype = self.cast_inputs or mx.float32
        return [value.astype(dtype) if m in self.uncast else value for value, m in zip(inputs, made)]

    def _uncast_op(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> list[mx.array] | str:
        """A selecting op on an input not cast yet: its outputs stay in the input's dtype."""
        event = self.wiring.primitives.get(node)
        if event is None:
            return "no MLX primitive is recorded for it"
        specs = [(tuple(shape), inputs[0].dtype) for _, shape, _ in event["outputs"]]
        try:
            outputs = replay.run(event["name"], event["arguments"], inputs, specs)
        except replay.NotReplayable as exc:
            return str(exc)
        self.uncast.update((node, i) for i in range(len(outputs)))
        return outputs

    def _record(self, node: str, index: int, count: int, value: mx.array) -> None:
        data = self.nodes[node]
        parts = self.partial.setdefault(node, [None] * count)
        sizes = self.sizes.setdefault(node, [0] * count)
        sizes[index] = value.size

        def done(stats: dict[str, Any]) -> None:
            parts[index] = stats
            if all(p is not None for p in parts):
                full = [p for p in parts if p is not None]
                data["stats"] = merge_stats(full, sizes)
                if count > 1:
                    data["output_stats"] = full
                del self.partial[node]
            self.known[(node, index)] = stats
            for waiting in self.waiting.pop((node, index), ()):
                waiting(stats)

        source = self._same_values_as(node, data) if count == 1 else None
        if source is None:
            self.batch.add(value, done)
        else:  # a view, a broadcast or an output: its input's statistics, no reduction
            made, size = source
            scale = value.size // size if size and value.size % size == 0 else 1

            def derived(stats: dict[str, Any]) -> None:
                done({**stats, "nan": stats["nan"] * scale, "inf": stats["inf"] * scale}
                     if scale != 1 else stats)

            known = self.known.get(made)
            if known is not None:
                derived(known)
            else:
                self.waiting.setdefault(made, []).append(derived)
        if self.writer is not None and self.keep is not None and self.keep(node, data):
            self.to_write.append((node if count == 1 else f"{node}:{index}", value))

    def _same_values_as(self, node: str, data: dict[str, Any]) -> tuple[tuple[str, int], int] | None:
        """(the output whose values this node's output repeats, its size), or None: reshapes,
        transposes and copies keep the values, a broadcast repeats each one equally often, and an
        output node returns its producer's array."""
        if data["kind"] == _OUTPUT:
            made = self.wiring.producer.get(self.returned.get(node, ""))
        elif data["kind"] == _OP and data["op"] in SAME_VALUES:
            args = self.wiring.args.get(node, ())
            made = self.wiring.producer.get(args[0]) if len(args) == 1 else None
        else:
            return None
        if made is None or made not in self.sizes_of:
            return None
        return made, self.sizes_of[made]

    def flush(self, also: Sequence[mx.array] = ()) -> None:
        """Evaluate what is pending (and ``also``): statistics, kernel checks, files."""
        checks = [c for _, c in self.checks]
        self.batch.flush([*checks, *also])
        for name, value in self.to_write:
            self.writer.add(name, value)
        self.to_write = []
        nodes = self.graph.nx.nodes
        for (node, _), check in zip(self.checks, checks):
            max_abs, max_rel, beyond = cast(list[float], check.tolist())
            rtol, atol = self.check_kernels or (0.0, 0.0)
            nodes[node]["reference_check"] = {"max_abs": max_abs, "max_rel": max_rel,
                                              "mismatched": int(beyond), "rtol": rtol, "atol": atol}
        self.checks = []

    @property
    def need_flush(self) -> bool:
        """Enough node outputs are pending that they should be evaluated now."""
        return self.batch.bytes > _CHUNK_BYTES or len(self.batch) >= _CHUNK_NODES

    def run(self, progress: Progress | None = None) -> None:
        """Run every node, evaluating in chunks; ``progress`` counts the nodes."""
        progress = progress or Progress()
        progress.phase(f"values ({_main_dtype(self.arrays)})", self.graph.nx.number_of_nodes())
        for _ in self.steps():
            if self.need_flush:
                self.flush()
            progress.advance()
        self.flush()


def _matmul_cast_in_blocks(x: mx.array, w: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x @ w.astype(dtype)``, a block of ``w``'s columns at a time: a large weight (a tied
    embedding read as the output layer) is never cast whole: each block is evaluated at once,
    since one evaluation of them all may make every block's cast before any product."""
    step = max(1, _CAST_BLOCK // max(1, w.shape[-2]))
    blocks = []
    for j in range(0, w.shape[-1], step):
        blocks.append(x @ w[..., j:j + step].astype(dtype))
        mx.eval(blocks[-1])
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=-1)


def _errors(outputs: Sequence[mx.array], reference: Sequence[mx.array], *, rtol: float,
            atol: float) -> mx.array:
    """``tolerance.errors`` over a kernel's outputs against its reference: the worst of each."""
    rows = mx.stack([errors(o, r, rtol=rtol, atol=atol) for o, r in zip(outputs, reference)])
    return mx.stack([mx.max(rows[:, 0]), mx.max(rows[:, 1]), mx.sum(rows[:, 2])])


def _main_dtype(arrays: Sequence[mx.array]) -> str:
    """The floating dtype most elements of ``arrays`` are in ("no floats" when none is)."""
    dtype = main_float_dtype(arrays)
    return dtype_name(dtype) if dtype is not None else "no floats"


# ----------------------------------------------------------------------------- root causes


def _describe(graph: Graph, node: str) -> str:
    """``kernel 'swiglu' in model.layers.0.mlp`` / ``op Sqrt in layers.3``."""
    data = graph.nx.nodes[node]
    kind = data["kind"]
    what = f"kernel {data.get('kernel', data['op'])!r}" if kind == _KERNEL else \
        f"{kind} {data['op'] or data['label']}"
    if kind == _KERNEL and data.get("backend"):
        what += f" (backend {data['backend']})"
    scope = data.get("scope") or ""
    return f"{what} in {scope}" if scope else what


def _non_finite_text(stats: dict[str, Any], size: int) -> str:
    found = " and ".join(f"{stats[key]} {text}" for key, text in (("nan", "NaN"), ("inf", "Inf"))
                         if stats[key])
    return f"{found} of {size} values"


def root_causes(graph: Graph) -> list[str]:
    """Mark the nodes where a NaN or Inf started (``Status.NON_FINITE``, see the module) and
    propagate; returns them in topological order. Needs ``stats`` on the nodes."""
    nodes, pred, _ = adjacency(graph.nx)
    found = []
    for node in graph.nodes():
        data = nodes[node]
        stats = data.get("stats")
        if is_finite_stats(stats) or data["kind"] == _OUTPUT:
            continue
        if data["status"] not in _MARKABLE:
            continue  # failed for another reason already
        if any(not is_finite_stats(nodes[p].get("stats")) for p in pred[node]):
            continue
        size = sum(math.prod(shape) for shape in _output_shapes(graph, node)) or 1
        unknown = [p for p in pred[node] if nodes[p].get("stats") is None]
        message = f"{_describe(graph, node)}: output holds {_non_finite_text(stats, size)}"
        if data["kind"] == _INPUT:
            message += " (an input of the call)"
        elif unknown:
            message += (f"; the values of its input {unknown[0]!r} were not reached, so the NaN/Inf "
                        "may come from further up")
        else:
            message += " while all its inputs are finite"
        data["status"], data["message"] = int(Status.NON_FINITE), message
        found.append(node)
    if found:
        graph.refresh()
    return found


def _output_shapes(graph: Graph, node: str) -> list[tuple[int, ...]]:
    """The shapes of the distinct arrays leaving ``node``."""
    seen: dict[str, tuple[int, ...]] = {}
    for _, keyed in adjacency(graph.nx)[2][node].items():
        for key, edge in keyed.items():
            seen.setdefault(key, tuple(edge["shape"]))
    return list(seen.values())


# ----------------------------------------------------------------------------- inspect


def _node_filter(nodes: Collection[str] | NodeFilter | None) -> NodeFilter:
    if nodes is None:
        return lambda name, data: data["kind"] in (_OP, _KERNEL)
    if callable(nodes):
        return nodes
    wanted = set(nodes)
    return lambda name, data: name in wanted


class Inspector:
    """``gk.inspect`` with options (``gk.inspect`` itself takes none: its keyword arguments go to
    ``fn``, as ``gk.trace``'s do).

    ``save``: a ``.npz`` or ``.safetensors`` path to stream every node's full output to (keys are
    node names, ``name:i`` for a node's i-th of several outputs); ``nodes``: which nodes to save
    (names, or ``(name, attrs) -> bool``; default: op and kernel nodes). ``check_kernels``: also
    run each kernel's reference on the exact inputs it received in the graph and record
    ``reference_check = {"max_abs", "max_rel"}`` on its node. ``progress``: a progress line on
    stderr naming the phase (tracing, values in which dtype) and the nodes done (``None``: when
    stderr is a terminal; see :mod:`graphkern.debugging.progress`). ``backend``: as
    ``gk.compile``'s.

    >>> import mlx.core as mx, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "values.npz")
    >>> g = Inspector(save=path)(lambda x: mx.exp(x) + 1, mx.zeros((2,)))
    >>> sorted(__import__("numpy").load(path).files)
    ['add', 'broadcast', 'exp']
    """

    def __init__(self, *, save: str | os.PathLike[str] | None = None,
                 nodes: Collection[str] | NodeFilter | None = None, check_kernels: bool = False,
                 progress: bool | None = None, backend: str | None = None,
                 tolerance: tuple[float, float] = (1e-4, 1e-5)):
        self.save = save
        self.tolerance = tolerance
        self.nodes = nodes
        self.check_kernels = check_kernels
        self.progress = progress
        self.backend = backend

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        traceable = Traceable(fn)
        return self.run(traceable, Flat.of(args, kwargs, traceable.arg_names))

    def run(self, traceable: Traceable, flat: Flat) -> Graph:
        """The values graph of one call already flattened (what compiled graphs use)."""
        with progress_line(self.progress, "inspect") as progress:
            return self._run(traceable, flat, progress)

    def _run(self, traceable: Traceable, flat: Flat, progress: Progress) -> Graph:
        progress.phase("tracing")
        graph, wiring, arrays = trace_for_values(traceable, flat, self.backend)
        writer = None
        if self.save is not None:
            from ..tracing.tensor_files import open_writer  # lazy: only a run that saves tensors

            writer = open_writer(self.save)
        anchored: set[str] = set()

        def anchors_for(failed: set[str]) -> dict[str, list[mx.array]]:
            found = eager_anchors(traceable, flat, graph, wiring, self.backend, failed)
            anchored.update(found)
            return found

        anchors = anchors_for(set())
        with (writer if writer is not None else contextlib.nullcontext()):
            check = self.tolerance if self.check_kernels else None
            GraphRun(graph, wiring, arrays, check_kernels=check, keep=_node_filter(self.nodes),
                     writer=writer, anchors=anchors, more_anchors=anchors_for).run(progress)
        finish_values(graph, anchored=sum(1 for n in anchored if "stats" in graph.nx.nodes[n]))
        return graph


def _needs_anchors(graph: Graph, wiring: Wiring, failed: Collection[str] = ()) -> set[str]:
    """The nodes a run of the graph cannot compute, known before running (ops whose primitive
    has no replay, kernels given Python scalars, and what depends on them), that an eager run
    can give instead: those whose every output a module call or kernel launch returned. Each
    such node unblocks what follows it, so only the first ones on each blocked path are listed.
    ``failed``: nodes found not to run again while running."""
    nodes, pred, _ = adjacency(graph.nx)
    primitives, launches, args = wiring.primitives, wiring.launches, wiring.args

    def cannot_run(node: str) -> bool:
        kind = nodes[node]["kind"]
        if kind == _OP:
            event = primitives.get(node)
            return event is None or event["name"] not in replay.REPLAYED
        if kind == _KERNEL:
            launch = launches.get(node)
            return launch is None or len(args.get(node, ())) != len(launch.kernel.input_names)
        return False

    if not failed and not any(map(cannot_run, nodes)):
        return set()
    anchorable = {n for n, data in nodes.items() if data["kind"] == _KERNEL}
    for _, _, made in wiring.module_calls:
        anchorable.update(m[0] for m in made if m is not None)
    blocked: set[str] = set()
    wanted: set[str] = set()
    for node in graph.nodes():
        if not (node in failed or cannot_run(node) or any(p in blocked for p in pred[node])):
            continue
        if node in anchorable and nodes[node]["status"] == Status.OK:
            wanted.add(node)
        else:
            blocked.add(node)
    return wanted


def eager_anchors(traceable: Traceable, flat: Flat, graph: Graph, wiring: Wiring,
                  backend: str | None, failed: Collection[str] = ()) -> dict[str, list[mx.array]]:
    """Outputs for the nodes a run of the graph would not reach, where a module call or kernel
    launch returned them (see ``_needs_anchors``): the function runs once more, eagerly, with its
    kernel and module calls recorded in the trace's order, and the wanted calls' outputs are kept
    (lazily). Empty when every node can run, or when the eager call fails."""
    wanted = _needs_anchors(graph, wiring, failed)
    if not wanted:
        return {}
    wanted_modules = {rid: made for rid, _, made in wiring.module_calls
                      if any(m is not None and m[0] in wanted for m in made)}
    wanted_kernels = {graph.nx.nodes[n]["call_index"]: n for n in wanted
                      if graph.nx.nodes[n]["kind"] == _KERNEL}
    recorder = _AnchorRecorder(traceable, set(wanted_modules), set(wanted_kernels))
    try:
        traceable.call_recorded(flat, recorder, backend)
    except Exception:  # the eager call fails where the trace did not: no anchors
        return {}
    outputs: dict[tuple[str, int], mx.array] = {}
    for rid, made in wanted_modules.items():
        kept = recorder.kept.get(rid)
        if kept is None or len(kept) != len(made):
            continue
        for found, value in zip(made, kept):
            if found is not None and found[0] in wanted:
                outputs.setdefault(found, value)
    for index, node in wanted_kernels.items():
        for i, value in enumerate(recorder.kernel_outputs.get(index, [])):
            outputs.setdefault((node, i), value)
    anchors = {}
    for node in wanted:
        event, launch = wiring.primitives.get(node), wiring.launches.get(node)
        count = len(event["outputs"]) if event is not None else \
            len(launch.output_specs) if launch is not None else 1
        if all((node, i) in outputs for i in range(count)):
            anchors[node] = [outputs[(node, i)] for i in range(count)]
    return anchors


class _AnchorRecorder(TraceRecorder):
    """Sees an eager call's kernel and module calls without tagging them; keeps the outputs of
    the wanted module records (by record id) and kernel calls (by call index)."""

    def __init__(self, traceable: Traceable, wanted: set[int], wanted_kernels: set[int]):
        base = traceable.recorder()
        super().__init__(base.modules, tag=False, objects=base.objects)
        self.wanted = wanted
        self.wanted_kernels = wanted_kernels
        self.kept: dict[int, list[mx.array]] = {}
        self.kernel_outputs: dict[int, list[mx.array]] = {}

    def kernel_call(self, launch: Any, kernel: Any, inputs: list[mx.array], outputs: list[mx.array],
                    error: Any, request: dict[str, Any] | None = None) -> list[mx.array]:
        if self.calls in self.wanted_kernels:
            self.kernel_outputs[self.calls] = list(outputs)
        return super().kernel_call(launch, kernel, inputs, outputs, error, request)

    def module_call(self, path: str, module: Any, inputs: list[mx.array], outputs: list[mx.array],
                    error: Any) -> list[mx.array]:
        if len(self.records) in self.wanted:
            self.kept[len(self.records)] = list(outputs)
        return super().module_call(path, module, inputs, outputs, error)


def trace_for_values(traceable: Traceable, flat: Flat,
                     backend: str | None = None) -> tuple[Graph, Wiring, list[mx.array]]:
    """The graph of one call, how to run it, and the arrays it starts from."""
    wiring = Wiring()
    graph, _ = traceable.trace(flat, backend, wiring=wiring)
    nodes = graph.nx.nodes
    for _, path, made in wiring.module_calls:
        for found in made:
            if found is not None and found[0] in nodes:
                paths = nodes[found[0]].setdefault("module_outputs", [])
                if path not in paths:
                    paths.append(path)
    return graph, wiring, list(flat.arrays) + traceable.state.arrays()


def finish_values(graph: Graph, anchored: int = 0) -> None:
    """After a run: count the nodes reached (``anchored``: of them, from an eager run's module or
    kernel outputs) and mark where NaN/Inf started."""
    reached = sum(1 for _, d in graph.nx.nodes(data=True) if "stats" in d)
    graph.nx.graph["values"] = {"nodes": reached, "unreached": graph.nx.number_of_nodes() - reached,
                                "from_eager_run": anchored}
    root_causes(graph)


def inspect(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Trace ``fn`` on these arguments and run it node by node, recording each node's output
    statistics (``stats``) and naming the node where a NaN or Inf started (``Status.NON_FINITE``,
    ``g.failures()[0]``).

    The graph is ``gk.trace``'s; every op node then runs again through the MLX op of its
    primitive and every kernel node through its recorded launch, from the call's own arguments
    and state. Options (saving every tensor, checking kernels against their references, a
    progress line, the backend) are :class:`Inspector`'s.

    Args:
        fn: a function or ``nn.Module``, as ``gk.trace`` takes it.
        *args: the positional arguments of the call.
        **kwargs: its keyword arguments (all go to ``fn``).

    Returns:
        The :class:`Graph` with ``stats`` on every node whose output could be reached (a node
        that could not gets ``values_note`` saying why).

    Raises:
        KernelError: ``fn`` cannot be traced (see ``gk.trace``).

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.inspect(lambda x: mx.log(x), mx.array([1.0, 0.0]))
    >>> g.status.name, g.nx.nodes["log"]["stats"]["inf"]
    ('NON_FINITE', 1)
    """
    return Inspector()(fn, *args, **kwargs)
