"""Running a traced graph again, node by node: one overridable method per node kind.

As ``torch.fx.Interpreter.run_node`` dispatches to ``call_function`` / ``call_module``,
:meth:`GraphInterpreter.run_node` dispatches to :meth:`~GraphInterpreter.input`,
:meth:`~GraphInterpreter.constant`, :meth:`~GraphInterpreter.op`,
:meth:`~GraphInterpreter.kernel`, :meth:`~GraphInterpreter.collective` and
:meth:`~GraphInterpreter.output`. Each returns the node's outputs, or a string saying why they
cannot be had (kept on the node as ``values_note``). Arrays are held only until their last
reader ran. :class:`graphkern.debugging.values.GraphRun` adds statistics on top.

>>> import mlx.core as mx, graphkern as gk
>>> from graphkern.debugging.values import trace_for_values
>>> from graphkern.tracing.traceable import Traceable
>>> from graphkern.tracing.state import Flat
>>> fn = Traceable(lambda x: mx.exp(x) * 2)
>>> graph, wiring, arrays = trace_for_values(fn, Flat.of((mx.zeros((2,)),), {}, fn.arg_names))
>>> [(node, [v.tolist() for v in values]) for node, values in GraphInterpreter(graph, wiring, arrays).steps()
...  if node == "exp"]
[('exp', [[1.0, 1.0]])]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ..launching.autodiff import without_vjp
from ..launching.fastpaths import adjacency
from ..launching.launch_paths import run_launch
from ..nodes import Kernel, NodeKind, Status
from ..tracing import replay
from ..tracing.capture import Wiring
from ..tracing.extensions import collectives
from ..tracing.graph import Graph

__all__ = ["RUNNABLE", "GraphInterpreter", "Outputs", "run_order"]

Outputs = list[mx.array] | str  # a node's outputs, or why they cannot be had
INPUT, CONSTANT, OUTPUT, OP, KERNEL, COLLECTIVE = (k.value for k in (
    NodeKind.INPUT, NodeKind.CONSTANT, NodeKind.OUTPUT, NodeKind.OP, NodeKind.KERNEL, NodeKind.COLLECTIVE))
RUNNABLE = frozenset({int(Status.OK), int(Status.NON_FINITE)})  # statuses a node runs again with


class GraphInterpreter:
    """One run of a traced graph in :func:`run_order`, from the call's arrays (its flat
    arguments, then its state). Override a node kind's method to change how it runs, or
    :meth:`computed` to see each node's outputs."""

    def __init__(self, graph: Graph, wiring: Wiring, arrays: list[mx.array]):
        self.graph = graph
        self.wiring = wiring
        self.arrays = arrays
        self.nodes = adjacency(graph.nx)[0]
        self.done: set[str] = set()
        self.env: dict[tuple[str, int], mx.array] = {}
        self.readers: dict[tuple[str, int], int] = {}  # reads still to come
        self.returned = dict(wiring.outputs)
        self.input_index = {node: i for i, node in enumerate(wiring.inputs)}

    # ------------------------------------------------------------------ one method per node kind

    def run_node(self, node: str, data: dict[str, Any]) -> Outputs:
        """The outputs of ``node``: its kind's method, given the arrays it reads."""
        kind = data["kind"]
        if kind == INPUT:
            return self.input(node, data)
        if kind == CONSTANT:
            return self.constant(node, data)
        if kind == OUTPUT:
            return self.output(node, data)
        if data["status"] not in RUNNABLE:
            return f"the node has status {Status(data['status']).name}"
        inputs = self.read_inputs(node)
        if isinstance(inputs, str):
            return inputs
        return self.call(node, data, inputs)

    def call(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        """An op, kernel or collective node on the arrays it reads."""
        if data["kind"] == KERNEL:
            return self.kernel(node, data, inputs)
        if data["kind"] == COLLECTIVE:
            return self.collective(node, data, inputs)
        return self.op(node, data, inputs)

    def input(self, node: str, data: dict[str, Any]) -> Outputs:
        """An argument or state array of the call."""
        return [self.arrays[self.input_index[node]]]

    def constant(self, node: str, data: dict[str, Any]) -> Outputs:
        """A constant the trace captured."""
        constant = self.wiring.constants.get(node)
        return [constant] if constant is not None else "its value was not captured"

    def op(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        """An MLX primitive, made again from the export's description (:mod:`graphkern.tracing.replay`)."""
        event = self.wiring.primitives.get(node)
        if event is None:
            return "no MLX primitive is recorded for it"
        specs = [(tuple(shape), dt) for _, shape, dt in event["outputs"]]
        try:
            return replay.run(event["name"], event["arguments"], inputs, specs)
        except replay.NotReplayable as exc:
            return self.not_run_again(node, str(exc))

    def kernel(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        """A kernel node, through its recorded, validated launch."""
        launch = self.wiring.launches.get(node)
        if launch is None:
            return "its launch was not recorded"
        kernel: Kernel = launch.kernel
        if len(inputs) != len(kernel.input_names):
            return (f"kernel {kernel.name!r} takes {len(kernel.input_names)} inputs and the trace "
                    f"recorded {len(inputs)} arrays (Python scalars are not recorded)")
        try:
            with without_vjp():
                return list(run_launch(launch, inputs))
        except Exception as exc:  # the launch ran in the trace; say what failed now
            return self.not_run_again(node, f"running kernel {kernel.name!r} again raised "
                                            f"{type(exc).__name__}: {exc}")

    def collective(self, node: str, data: dict[str, Any], inputs: list[mx.array]) -> Outputs:
        """A collective, for real: every rank runs its graph at once, as the model did."""
        return collectives().run_again(data, inputs)

    def output(self, node: str, data: dict[str, Any]) -> Outputs:
        """The array an output node returns (its producer's, read once)."""
        made = self.wiring.producer.get(self.returned.get(node, ""))
        value = self.env.get(made) if made is not None else None
        if made is None or value is None:
            return "the array it returns was not reached"
        self.readers[made] -= 1
        if self.readers[made] <= 0:
            del self.env[made]
        return [value]

    def not_run_again(self, node: str, why: str) -> Outputs:
        """A node that could not run again: ``why`` (an override may find its outputs elsewhere)."""
        return why

    def computed(self, node: str, index: int, count: int, value: mx.array) -> None:
        """Output ``index`` of ``count`` of ``node`` was computed (lazily): a hook for subclasses."""

    # ------------------------------------------------------------------ the walk

    def read_inputs(self, node: str) -> list[mx.array] | str:
        """The arrays ``node`` reads, or why they cannot be had."""
        values = []
        for array in self.wiring.args.get(node, ()):
            made = self.wiring.producer.get(array)
            value = self.env.get(made) if made is not None else None
            if value is None:
                source = made[0] if made is not None else array
                return f"its input from {source!r} was not reached"
            values.append(value)
        return values

    def _count_readers(self, order: list[str]) -> None:
        producer = self.wiring.producer
        for node in order:
            for array in self.wiring.args.get(node, ()):
                made = producer.get(array)
                if made is not None:
                    self.readers[made] = self.readers.get(made, 0) + 1
        for _, array in self.wiring.outputs:
            made = producer.get(array)
            if made is not None:
                self.readers[made] = self.readers.get(made, 0) + 1

    def _release(self, node: str) -> None:
        for array in self.wiring.args.get(node, ()):
            made = self.wiring.producer.get(array)
            if made is None:
                continue
            left = self.readers.get(made, 0) - 1
            self.readers[made] = left
            if left <= 0:
                self.env.pop(made, None)

    def steps(self) -> Iterator[tuple[str, list[mx.array] | None]]:
        """Run the nodes in :func:`run_order`, yielding each with its outputs (None when they
        cannot be reached, with ``values_note`` on the node saying why)."""
        order = run_order(self.graph)
        nodes = self.nodes
        self._count_readers(order)
        for node in order:
            data = nodes[node]
            values = self.run_node(node, data)
            if data["kind"] != OUTPUT:
                self._release(node)
            self.done.add(node)
            if isinstance(values, str):
                data["values_note"] = values
                yield node, None
                continue
            for index, value in enumerate(values):
                if self.readers.get((node, index), 0) > 0:
                    self.env[(node, index)] = value
                self.computed(node, index, len(values), value)
            yield node, values
        self.env.clear()


def run_order(graph: Graph) -> list[str]:
    """A topological order that computes each node just before the first node needing it: a
    depth-first walk back from each sink (outputs first), inputs in argument order, as an eager
    call would go. Kahn's order (``graph.nodes()``) computes everything that is ready at once,
    every weight's transpose first, and holds them all until they are read.

    >>> import mlx.core as mx, graphkern as gk
    >>> run_order(gk.trace(lambda x, y: mx.exp(x) + mx.sin(y), mx.ones(2), mx.ones(2)))
    ['x', 'exp', 'y', 'sin', 'add', 'output_0']
    """
    g = graph.nx
    data, pred, succ = adjacency(g)
    sinks = [n for n in graph.nodes() if not succ[n]]
    sinks.sort(key=lambda n: data[n]["kind"] != OUTPUT)
    done: set[str] = set()
    order: list[str] = []
    for sink in sinks:
        stack: list[tuple[str, bool]] = [(sink, False)]
        while stack:
            node, expanded = stack.pop()
            if node in done:
                continue
            if expanded:
                done.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            # a node's in-edges are kept in argument order: push the first argument last
            stack.extend((u, False) for u in reversed(pred[node]) if u not in done)
    return order

