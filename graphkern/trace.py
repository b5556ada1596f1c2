"""Trace a function into a ``Graph`` with MLX's own capture.

``trace`` runs ``fn`` once inside ``mx.export_function`` with a recorder installed: every
``apply_in_graph`` call and every ``nn.Module`` call is tagged, then ``graphkern.capture`` turns
MLX's events into the graph. ``graphkern.compiled`` builds compiled graphs on these traces.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import runtime
from .capture import MAGIC, EventLog, Record, Wiring, build_graph
from .graph import Graph, GraphError
from .nodes import Kernel, KernelError, Status, dtype_name
from .runtime import Launch, current_recorder, recording
from .state import Flat, State, argument_names, flatten_outputs, unflatten_outputs

__all__ = ["Graph", "GraphError", "TraceRecorder", "trace"]

_TRACE = "trace a function with graphkern"


class TraceRecorder:
    """Collects the kernel and module calls of one trace and tags their outputs."""

    inspects = True  # launches inside run plain: mx.export_function cannot export custom vjps

    def __init__(self, modules: dict[int, str] | None = None, tag: bool = True,
                 objects: dict[int, nn.Module] | None = None):
        self.records: dict[int, Record] = {}
        self.modules = modules or {}
        self.objects = objects or {}  # the modules by id, to place a module shared by several parents
        self._placed: dict[tuple[int, int], str] = {}
        self.stack: list[tuple[int, str]] = []
        self.tag = tag
        self.nonce = random.getrandbits(31)
        self.calls = 0
        self.last_record: int | None = None
        self.kernels: dict[int, Kernel] = {}  # the kernel objects launched, by identity
        self.launches: list[Launch | None] = []  # each kernel call's launch, in call order

    @property
    def scope(self) -> str:
        return self.stack[-1][1] if self.stack else ""

    def path_of(self, module: nn.Module) -> str | None:
        """The path of a call of ``module``: its path in the model, or, for one module object held
        by several parents (mlx-lm's MoE layers share one activation), its name under the module
        calling it."""
        path = self.modules.get(id(module))
        if path is None or not self.stack:
            return path
        top_id, top = self.stack[-1]
        if not top or path.startswith(top + "."):
            return path
        key = (top_id, id(module))
        placed = self._placed.get(key)
        if placed is None:
            parent = self.objects.get(top_id)
            children: list[tuple[str, Any]] = tree_flatten(  # type: ignore[assignment]
                parent.children(), is_leaf=lambda v: isinstance(v, nn.Module)) if parent is not None else []
            placed = next((f"{top}.{name}" for name, child in children if child is module), path)
            self._placed[key] = placed
        return placed

    def _tagged(self, record: Record, inputs: list[mx.array], outputs: list[mx.array]) -> list[mx.array]:
        self.records[record.id] = record
        self.last_record = record.id
        if not self.tag:
            return outputs
        tag = mx.array([MAGIC, record.id, self.nonce], dtype=mx.uint32)
        return list(mx.depends(outputs, [*inputs, tag]))

    def kernel_call(self, launch: Launch | None, kernel: Any, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None) -> list[mx.array]:
        name = kernel.name if isinstance(kernel, Kernel) else "invalid_kernel"
        if isinstance(kernel, Kernel):
            self.kernels[id(kernel)] = kernel
        record = Record(len(self.records), "kernel", name, self.scope, len(outputs),
                        call_index=self.calls, error=error, attrs=_kernel_attrs(launch, kernel))
        self.calls += 1
        self.launches.append(launch)
        return self._tagged(record, inputs, outputs)

    def module_call(self, path: str, module: nn.Module, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None) -> list[mx.array]:
        record = Record(len(self.records), "module", type(module).__name__, path, len(outputs),
                        error=error)
        return self._tagged(record, inputs, outputs)


def _kernel_attrs(launch: Launch | None, kernel: Any) -> dict[str, Any]:
    if not isinstance(kernel, Kernel):
        return {"kernel": repr(kernel)[:80], "backend": "", "source": None}
    attrs: dict[str, Any] = {"kernel": kernel.name, "source_hash": kernel.source_hash,
                             "source": None, "backend": "", "generated_name": None,
                             "grid": None, "threadgroup": None, "template": []}
    if launch is not None:
        attrs.update(backend=launch.backend, grid=list(launch.grid),
                     threadgroup=list(launch.threadgroup),
                     template=[[a.name, dtype_name(a.value) if isinstance(a.value, mx.Dtype)
                                else repr(a.value)] for a in launch.template],
                     source=kernel.source_for(launch.backend))
        if launch.backend != "reference":
            attrs["generated_name"] = runtime.generated_name(kernel)
    return attrs


# ----------------------------------------------------------------------------- module scopes


class _ModuleHooks:
    """Wraps ``__call__`` of the module classes in use so calls can be tagged with their path.

    Patches are reference-counted and thread-safe; a wrapper does nothing unless the calling
    thread is tracing and the module belongs to that trace.
    """

    _lock = threading.Lock()
    _patched: dict[type, tuple[Callable[..., Any], int]] = {}

    @classmethod
    def _owner(cls, module: nn.Module) -> type | None:
        for klass in type(module).__mro__:
            if "__call__" in klass.__dict__ and klass is not object:
                return klass
        return None

    @classmethod
    def install(cls, modules: list[nn.Module]) -> list[type]:
        owners = {o for o in map(cls._owner, modules) if o is not None and o is not nn.Module}
        with cls._lock:
            for owner in owners:
                original, count = cls._patched.get(owner, (owner.__dict__["__call__"], 0))
                if count == 0:
                    owner.__call__ = _hooked(original)  # type: ignore[method-assign]
                cls._patched[owner] = (original, count + 1)
        return list(owners)

    @classmethod
    def remove(cls, owners: list[type]) -> None:
        with cls._lock:
            for owner in owners:
                original, count = cls._patched[owner]
                if count == 1:
                    owner.__call__ = original  # type: ignore[method-assign]
                    del cls._patched[owner]
                else:
                    cls._patched[owner] = (original, count - 1)


def _hooked(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        recorder = current_recorder()
        if not isinstance(recorder, TraceRecorder):
            return original(self, *args, **kwargs)
        path = recorder.path_of(self)
        if path is None or (recorder.stack and recorder.stack[-1][0] == id(self)):
            return original(self, *args, **kwargs)
        inputs = Flat.of(args, kwargs, []).arrays
        recorder.stack.append((id(self), path))
        error = None
        try:
            out = original(self, *args, **kwargs)
        except Exception as exc:  # a failing module becomes a failed node, the trace goes on
            error = KernelError(f"call module {path!r} ({type(self).__name__})",
                                f"{type(exc).__name__}: {exc}", Status.MODULE_ERROR)
            out = mx.zeros_like(inputs[0]) if inputs else mx.zeros(())
        finally:
            recorder.stack.pop()
        arrays, spec = flatten_outputs(out)
        tagged = recorder.module_call(path, self, inputs, arrays, error)
        return unflatten_outputs(spec, tagged)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


# ----------------------------------------------------------------------------- tracing


class Traceable:
    """``fn`` with its arguments and state flattened to arrays, ready for MLX's transforms."""

    def __init__(self, fn: Callable[..., Any], state: Any = None):
        if not callable(fn):
            raise KernelError(_TRACE, f"expected a function or nn.Module, got {type(fn).__name__}",
                              Status.INVALID_INPUT)
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
        if not outputs:
            raise KernelError(_TRACE, f"{self.name} returned no arrays", Status.INVALID_INPUT)
        return outputs

    def call_recorded(self, flat: Flat, recorder: TraceRecorder, backend: str | None = None) -> Any:
        """Call ``fn`` eagerly on ``flat``'s arrays with ``recorder`` seeing its kernel and module
        calls (as a trace would, in the same order), on this thread."""
        owners = _ModuleHooks.install([m for _, m in self.state.modules.values()])
        try:
            with recording(recorder), runtime.using_backend(backend):
                return self.call_flat(flat, tuple(flat.arrays), {})
        finally:
            _ModuleHooks.remove(owners)

    def trace(self, flat: Flat, backend: str | None = None, used: list[Kernel] | None = None,
              wiring: Wiring | None = None) -> tuple[Graph, Any]:
        """Capture one call as a ``Graph``; returns it with the output tree spec. ``used``, if
        given, receives the kernel objects the call launched; ``wiring`` how to run the graph
        node by node (see ``capture.Wiring``)."""
        n_args = len(flat.arrays)
        state_arrays = self.state.arrays()
        recorder = self.recorder()
        out: dict[str, Any] = {}

        def flat_fn(*arrays: mx.array) -> list[mx.array]:
            with self.state.swapped(arrays[n_args:]):
                return self.call_flat(flat, arrays[:n_args], out)

        log = EventLog()
        if backend is None:  # this thread's override (thread-local) must reach the trace thread
            backend = runtime.backend_override()

        def capture() -> None:
            with recording(recorder), runtime.using_backend(backend):
                mx.export_function(log, flat_fn, *flat.arrays, *state_arrays)

        owners = _ModuleHooks.install([m for _, m in self.state.modules.values()])
        with _gc_paused():
            try:
                _on_deep_stack(capture)
            except KernelError:
                raise
            except Exception as exc:
                raise KernelError(_TRACE, f"{self.name} raised {type(exc).__name__}: {exc}",
                                  Status.MODULE_ERROR) from exc
            finally:
                _ModuleHooks.remove(owners)
            if used is not None:
                used.extend(recorder.kernels.values())
            attrs = {"name": self.name, "backend": backend or runtime.active_backend(),
                     "mlx_version": getattr(mx, "__version__", "?")}
            g = build_graph(log, flat.names + self.state.names, recorder.records,
                            recorder.nonce, attrs, wiring)
            if wiring is not None:
                launches = recorder.launches
                wiring.launches = {node: launches[data["call_index"]] for node, data in g.nodes(data=True)
                                   if data["kind"] == "kernel" and data["call_index"] < len(launches)}
            return Graph(g), out.get("spec")


_STACK_BYTES = 1 << 30
_MAX_TRACE_THREADS = 8
_stack_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)
_worker = threading.local()


def _trace_threads() -> ThreadPoolExecutor:
    """The long-lived deep-stack threads traces run on (made again in a forked child, which
    inherits the pool but not its threads)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(_MAX_TRACE_THREADS, thread_name_prefix="graphkern-trace"))
    return _pool[1]


def _on_deep_stack(work: Callable[[], None]) -> None:
    """Run ``work`` on a thread with a 1 GiB stack (address space; pages are touched on use).

    MLX walks the graph recursively in ``export_function``: a chain of ~50,000 primitives
    overflows the default 8 MiB stack and kills the process. The caller's context variables go
    along; an exception is re-raised here.

    The threads are few and reused: MLX keeps state for every thread that ever ran MLX code (its
    per-thread streams, about 13 KiB) and never frees it, so a thread per trace leaked on every
    trace. A trace started on one of these threads (a trace inside a trace) runs in place: it has
    the deep stack already, and waiting for a free thread there could deadlock.
    """
    if getattr(_worker, "active", False):
        work()
        return
    context = contextvars.copy_context()

    def run() -> None:
        _worker.active = True
        try:
            context.run(work)
        finally:
            _worker.active = False

    with _stack_lock:  # the pool starts its threads inside submit(): give them the big stack
        previous = threading.stack_size(_STACK_BYTES)
        try:
            future = _trace_threads().submit(run)
        finally:
            threading.stack_size(previous)
    future.result()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a trace allocates its many small, acyclic
    objects (it otherwise runs dozens of times and doubles the cost); restored afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Record one call of ``fn`` into a ``Graph`` built from MLX's own capture.

    Every MLX primitive becomes an ``op`` node, every ``apply_in_graph`` call one ``kernel`` node,
    and when ``fn`` is (or closes over) an ``nn.Module`` every node carries its module path.
    Trace-time kernel failures are statuses on their nodes, propagated downstream.

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.trace(lambda x, y: x @ y, mx.ones((2, 3)), mx.ones((3, 4)))
    >>> g.nodes("op"), g.nx.nodes["output_0"]["kind"]
    (['matmul'], 'output')
    """
    traceable = Traceable(fn)
    graph, _ = traceable.trace(Flat.of(args, kwargs, traceable.arg_names))
    return graph
