"""Trace a function into a ``Graph`` with MLX's own capture: ``gk.trace``.

``trace`` runs ``fn`` once inside ``mx.export_function`` with a recorder installed
(``recorder.TraceRecorder``): every ``apply_in_graph`` call and every ``nn.Module`` call is tagged
(``module_hooks``), then ``capture`` turns MLX's events into the graph. The capture runs on a deep
stack (``deep_stack``). ``graphkern.compiling`` builds compiled graphs on these traces.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..launching import backends
from ..launching.context import recording
from ..launching.fastpaths import gc_paused
from ..nodes import Kernel, KernelError, Status
from .capture import EventLog, Wiring, build_graph
from .deep_stack import on_deep_stack
from .extensions import collectives, refusal
from .graph import Graph
from .module_hooks import ModuleHooks, watch_modules
from .recorder import TraceRecorder, float_template_names, kernel_sources, module_class_name, template_floats
from .state import Flat, State, argument_names, flatten_outputs

__all__ = ["ScopeWarning", "Traceable", "trace"]

_TRACE = "trace a function with graphkern"


class Traceable:
    """``fn`` with its arguments and state flattened to arrays, ready for MLX's transforms."""

    def __init__(self, fn: Callable[..., Any], state: Any = None):
        if not callable(fn):
            raise KernelError(_TRACE, f"expected a function or nn.Module, got {type(fn).__name__}",
                              Status.INVALID_INPUT)
        why = refusal(fn)
        if why is not None:
            raise KernelError(_TRACE, why, Status.INVALID_INPUT)
        self.fn = fn
        self.state = State.of(fn, state)
        self.arg_names = argument_names(fn)
        self.name = getattr(fn, "__name__", type(fn).__name__)

    def module_paths(self) -> dict[int, str]:
        return {mid: path for mid, (path, _) in self.state.modules.items() if path}

    def recorder(self) -> TraceRecorder:
        """A recorder for one call of ``fn``, knowing its modules."""
        return TraceRecorder(self.module_paths(),
                             objects={mid: module for mid, (_, module) in self.state.modules.items()})

    def call_flat(self, flat: Flat, arrays: tuple[mx.array, ...], out: dict[str, Any]) -> list[mx.array]:
        args, kwargs = flat.rebuild(arrays)
        result = self.fn(*args, **kwargs)
        outputs, out["spec"] = flatten_outputs(result)
        if not outputs and isinstance(result, nn.Module):  # a factory named instead of its model
            raise KernelError(_TRACE, f"{self.name} returned a {type(result).__name__} (an nn.Module) "
                              f"and no arrays: it builds a model; trace the model it returns instead "
                              f"(gk.trace({self.name}(...), x); on the command line, name a module-level "
                              "instance or the model's class)", Status.INVALID_INPUT)
        if not outputs:
            raise KernelError(_TRACE, f"{self.name} returned no arrays", Status.INVALID_INPUT)
        return outputs

    def refuse_untraceable(self, flat: Flat) -> None:
        """Arguments a trace cannot take are refused before tracing, by name: a numpy array (or
        another library's), which would fail on some op far from the argument that caused it, and
        an object holding MLX arrays (an mlx-lm KV cache), whose arrays MLX's capture cannot see."""
        for path, kind, attrs in flat.untraceable(self.arg_names)[:1]:
            if not attrs:
                raise KernelError(_TRACE, f"argument {path!r} of {self.name} is a {kind}, not an MLX "
                                  f"array: pass mx.array({path}) instead", Status.INVALID_INPUT)
            raise KernelError(_TRACE, f"argument {path!r} of {self.name} is a {kind} holding MLX arrays "
                              f"({', '.join(attrs)}), which a trace cannot take as inputs: pass arrays, or "
                              "lists, tuples and dicts of them. A model's step with an mlx-lm cache: "
                              "gk.wrap(model), call it with cache=, and read its .graph",
                              Status.INVALID_INPUT)

    def call_recorded(self, flat: Flat, recorder: TraceRecorder, backend: str | None = None) -> Any:
        """Call ``fn`` eagerly on ``flat``'s arrays with ``recorder`` seeing its kernel and module
        calls (as a trace would, in the same order), on this thread."""
        self.refuse_untraceable(flat)
        owners = ModuleHooks.install([m for _, m in self.state.modules.values()])
        try:
            with recording(recorder), backends.using_backend(backend):
                return self.call_flat(flat, tuple(flat.arrays), {})
        finally:
            ModuleHooks.remove(owners)

    def trace(self, flat: Flat, backend: str | None = None, used: list[Kernel] | None = None,
              wiring: Wiring | None = None) -> tuple[Graph, Any]:
        """Capture one call as a ``Graph``; returns it with the output tree spec. ``used``, if
        given, receives the kernel objects the call launched; ``wiring`` how to run the graph
        node by node (see ``capture.Wiring``)."""
        self.refuse_untraceable(flat)
        n_args = len(flat.arrays)
        state_arrays = self.state.arrays()
        recorder = self.recorder()
        out: dict[str, Any] = {}

        def flat_fn(*arrays: mx.array) -> list[mx.array]:
            with self.state.swapped(arrays[n_args:]):
                return self.call_flat(flat, arrays[:n_args], out)

        log = EventLog()

        unseen: list[str] = []  # nn.Modules that ran although none was found to scope

        def capture() -> None:
            with recording(recorder), backends.using_backend(backend), \
                    watch_modules(unseen, enabled=not self.state.modules):
                mx.export_function(log, flat_fn, *flat.arrays, *state_arrays)

        modules = [m for _, m in self.state.modules.values()]
        owners = ModuleHooks.install(modules)
        with gc_paused():
            try:
                with collectives().standing_in(self.fn, modules):
                    on_deep_stack(capture)
            except KernelError:
                raise
            except Exception as exc:
                raise KernelError(_TRACE, f"{self.name} raised {type(exc).__name__}: {exc}",
                                  Status.MODULE_ERROR) from exc
            finally:
                ModuleHooks.remove(owners)
            if used is not None:
                used.extend(recorder.kernels.values())
            attrs = {"name": self.name, "backend": backend or backends.active_backend(),
                     "mlx_version": getattr(mx, "__version__", "?"), **recorder.group}
            g = build_graph(log, flat.names + self.state.names, recorder.records,
                            recorder.nonce, attrs, wiring)
            self._describe(g, len(flat.names), recorder)
            if wiring is not None:
                launches = recorder.launches
                wiring.launches = {node: launches[data["call_index"]] for node, data in g.nodes(data=True)
                                   if data["kind"] == "kernel" and data["call_index"] < len(launches)}
            if unseen:
                warnings.warn(ScopeWarning(
                    f"{self.name} ran the nn.Module {unseen[0]} but graphkern found no module "
                    "where it looks (the function itself, its closure, the globals it names, "
                    "their attributes), so nodes have no module scopes and parameters are "
                    "anonymous constants: pass the model as an argument or close over it"),
                    stacklevel=3)
            return Graph(g), out.get("spec")

    def _describe(self, g: Any, n_args: int, recorder: TraceRecorder) -> None:
        """What the drawings show besides MLX's events: which inputs are state (module
        parameters, closure arrays) rather than arguments, each module's class, and the sources
        of the kernels launched."""
        inputs = [data for _, data in g.nodes(data=True) if data["kind"] == "input"]
        for data in inputs[n_args:]:  # MLX lists the arguments first, then the state
            data["state"] = True
        g.graph["modules"] = {path: module_class_name(module)
                              for path, module in self.state.modules.values() if path}
        kernels = {k.source_hash: k for k in recorder.kernels.values()}
        g.graph["kernel_sources"] = kernel_sources(list(kernels.values()))
        floats = {h: float_template_names(k) for h, k in kernels.items()}
        for data in g.nodes.values():
            names = floats.get(data.get("source_hash"))  # type: ignore[arg-type]
            if names and data.get("template"):
                data["template_floats"] = template_floats(data["template"], names)


class ScopeWarning(UserWarning):
    """A trace ran an ``nn.Module`` it could not see, so its nodes have no module scopes."""


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Record one call of ``fn`` into a ``Graph`` built from MLX's own capture.

    Every MLX primitive becomes an ``op`` node, every ``apply_in_graph`` call one ``kernel`` node,
    and when ``fn`` is (or closes over) an ``nn.Module`` every node carries its module path.
    Trace-time kernel failures are statuses on their nodes, propagated downstream: the trace goes
    on, and ``graph.status`` / ``graph.failures()`` say what failed. ``fn`` runs once, eagerly
    inside MLX's capture; nothing is compiled.

    Args:
        fn: a function or an ``nn.Module`` taking MLX arrays (and Python values, which the trace
            bakes in). Modules it is, is bound to, closes over or names as a global are found and
            scope the nodes; their parameters are the graph's state inputs.
        *args: the positional arguments of the call.
        **kwargs: its keyword arguments (all go to ``fn``).

    Returns:
        The :class:`Graph` of the call.

    Raises:
        KernelError: ``fn`` is not callable, is a ``gk.compile``d function or a ``gk.wrap``ped
            model (trace what they run instead), takes a numpy array, returns no arrays
            (``Status.INVALID_INPUT``), or raised outside any module (``Status.MODULE_ERROR``).

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.trace(lambda x, y: x @ y, mx.ones((2, 3)), mx.ones((3, 4)))
    >>> g.nodes("op"), g.nx.nodes["output_0"]["kind"]
    (['matmul'], 'output')
    """
    traceable = Traceable(fn)
    graph, _ = traceable.trace(Flat.of(args, kwargs, traceable.arg_names))
    return graph
