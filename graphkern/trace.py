"""Trace a function into a ``Graph`` with MLX's own capture.

``trace`` runs ``fn`` once inside ``mx.export_function`` with a recorder installed: every
``apply_in_graph`` call and every ``nn.Module`` call is tagged, then ``graphkern.tracing.capture`` turns
MLX's events into the graph. ``graphkern.tracing.compiled`` builds compiled graphs on these traces.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import queue
import random
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .launching import backends
from .launching.context import adopted, current_recorder, recording, snapshot, state
from .launching.fastpaths import gc_paused
from .launching.validation import Launch
from .nodes import Kernel, KernelError, Status, dtype_name, float_from_bits
from .tracing.capture import MAGIC, EventLog, Record, Wiring, build_graph
from .tracing.graph import Graph, GraphError
from .tracing.state import Flat, State, argument_names, flatten_outputs, unflatten_outputs

__all__ = ["Graph", "GraphError", "ScopeWarning", "TraceRecorder", "trace"]

_TRACE = "trace a function with graphkern"


class TraceRecorder:
    """Collects the kernel, collective and module calls of one trace and tags their outputs."""

    inspects = True  # launches inside run plain: mx.export_function cannot export custom vjps
    stands_in_collectives = True  # mx.export_function cannot record collectives either

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
        self.collectives = 0
        self.group: dict[str, int] = {}  # rank and group_size of the first collective

    @property
    def scope(self) -> str:
        return self.stack[-1][1] if self.stack else ""

    def path_of(self, module: nn.Module) -> str | None:
        """The path of a call of ``module``: its path in the model, or, for one module object held
        by several parents (mlx-lm's MoE layers share one activation; tied layers), its name under
        the module calling it."""
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
            # anywhere under the caller: a block's experts may call the activation of its
            # switch layer (``block.switch_mlp.activation``) without calling the switch layer
            inside = parent.named_modules() if parent is not None else []
            placed = next((f"{top}.{name}" for name, child in inside if child is module and name), path)
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
                    outputs: list[mx.array], error: KernelError | None,
                    request: dict[str, Any] | None = None) -> list[mx.array]:
        name = kernel.name if isinstance(kernel, Kernel) else "invalid_kernel"
        if isinstance(kernel, Kernel):
            self.kernels[id(kernel)] = kernel
        record = Record(len(self.records), "kernel", name, self.scope, len(outputs),
                        call_index=self.calls, error=error,
                        attrs=_kernel_attrs(launch, kernel, request))
        self.calls += 1
        self.launches.append(launch)
        return self._tagged(record, inputs, outputs)

    def collective_call(self, op: str, attrs: dict[str, Any], inputs: list[mx.array],
                        outputs: list[mx.array]) -> list[mx.array]:
        """Record a collective's stand-in (see ``graphkern.distributed.collectives``)."""
        record = Record(len(self.records), "collective", op, self.scope, len(outputs),
                        call_index=self.collectives, attrs=attrs)
        self.collectives += 1
        self.group = self.group or {"rank": attrs["rank"], "group_size": attrs["group_size"]}
        return self._tagged(record, inputs, outputs)

    def module_call(self, path: str, module: nn.Module, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None) -> list[mx.array]:
        record = Record(len(self.records), "module", module_class_name(module), path, len(outputs),
                        error=error)
        return self._tagged(record, inputs, outputs)


def module_class_name(module: Any) -> str:
    """The class a module shows in graphs and messages: a layer ``gk.patch`` put on a kernel shows
    the class it replaced (the kernel is a detail of the user's module, not a new identity).

    >>> import mlx.nn as nn, graphkern as gk
    >>> model = nn.Sequential(nn.RMSNorm(4)); _ = gk.patch(model)
    >>> type(model.layers[0]).__name__, module_class_name(model.layers[0])
    ('KernelRMSNorm', 'RMSNorm')
    """
    shown = getattr(module, "shown_class_name", None)
    return shown() if callable(shown) else type(module).__name__


def _kernel_attrs(launch: Launch | None, kernel: Any,
                  request: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a kernel node shows: the launch, or for a launch refused before it ran, the
    configuration that was asked for (so a failed node still says which grid it was given)."""
    if not isinstance(kernel, Kernel):
        return {"kernel": repr(kernel)[:80], "backend": "", "source": None}
    attrs: dict[str, Any] = {"kernel": kernel.name, "source_hash": kernel.source_hash,
                             "source": None, "backend": "", "generated_name": None,
                             "grid": None, "threadgroup": None, "template": [],
                             "input_names": list(kernel.input_names)}
    if launch is not None:
        attrs.update(backend=launch.backend, grid=list(launch.grid),
                     threadgroup=list(launch.threadgroup),
                     template=[[a.name, _template_text(a.value)] for a in launch.template],
                     source=kernel.source_for(launch.backend))
        if launch.backend != "reference":
            attrs["generated_name"] = backends.generated_name(kernel)
    elif request is not None:
        backend = request.get("backend")
        if not isinstance(backend, str):
            with contextlib.suppress(KernelError):
                backend = backends.active_backend()
        attrs.update(backend=backend if isinstance(backend, str) else "",
                     grid=_requested_dims(request.get("grid")),
                     threadgroup=_requested_dims(request.get("threadgroup")),
                     template=_requested_template(request.get("template")))
        if attrs["backend"] in ("metal", "cuda"):
            attrs["source"] = kernel.source_for(attrs["backend"])
    return attrs


def _template_text(value: Any) -> str:
    return dtype_name(value) if isinstance(value, mx.Dtype) else repr(value)


def _requested_dims(value: Any) -> list[Any] | None:
    """A grid or threadgroup as it was given (ints kept, anything else as its repr)."""
    if not isinstance(value, (list, tuple)):
        return None if value is None else [repr(value)[:40]]
    return [v if isinstance(v, int) and not isinstance(v, bool) else repr(v)[:40]
            for v in list(value)[:8]]


def _requested_template(value: Any) -> list[list[str]]:
    out = []
    for item in value if isinstance(value, (list, tuple)) else ():
        name, arg = (item.name, item.value) if hasattr(item, "name") and hasattr(item, "value") \
            else (item if isinstance(item, (list, tuple)) and len(item) == 2 else ("?", item))
        out.append([str(name)[:40], _template_text(arg)[:80]])
    return out


_FLOAT_READ = re.compile(r"(?:__int_as_float|as_type<float>|float_from_bits)\s*\(\s*([A-Za-z_]\w*)\s*\)")


def float_template_names(kernel: Kernel) -> frozenset[str]:
    """The int template arguments ``kernel`` reads back as float32 bits (``__int_as_float(EPS)``
    in CUDA, ``as_type<float>(EPS)`` in Metal, ``float_from_bits(EPS)`` in the reference), as
    the library passes floats such as an epsilon or a scale.

    >>> k = Kernel("k", ["x"], ["y"], cuda="y[0] = x[0] * __int_as_float(SCALE);")
    >>> sorted(float_template_names(k))
    ['SCALE']
    """
    texts = [kernel.metal, kernel.cuda, kernel.header, reference_source(kernel)]
    return frozenset(m.group(1) for text in texts if text for m in _FLOAT_READ.finditer(text))


def _template_floats(template: list[list[str]], names: frozenset[str]) -> dict[str, float]:
    """``{"EPS": 1e-05}`` for the template arguments in ``names`` that hold float32 bits."""
    out = {}
    for name, text in template:
        if name in names:
            with contextlib.suppress(ValueError, OverflowError):
                out[name] = float(f"{float_from_bits(int(text)):.7g}")
    return out


def reference_source(kernel: Kernel) -> str | None:
    """The Python source of ``kernel``'s reference, or None when Python cannot find it."""
    if kernel.reference is None:
        return None
    try:
        return inspect.getsource(kernel.reference)
    except (OSError, TypeError):
        return None


def kernel_sources(kernels: list[Kernel]) -> dict[str, dict[str, str]]:
    """Each kernel's sources by backend (``metal``, ``cuda``, ``reference``: its Python),
    keyed by source hash, for the drawings to show whatever backend the trace ran on."""
    table: dict[str, dict[str, str]] = {}
    for kernel in kernels:
        sources = {"metal": kernel.metal, "cuda": kernel.cuda, "reference": reference_source(kernel)}
        table[kernel.source_hash] = {k: v for k, v in sources.items() if v}
    return table

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
            error = KernelError(f"call module {path!r} ({module_class_name(self)})",
                                f"{type(exc).__name__}: {exc}", Status.MODULE_ERROR)
            out = _stand_in(self, inputs, args, kwargs)
        finally:
            recorder.stack.pop()
        arrays, spec = flatten_outputs(out)
        tagged = recorder.module_call(path, self, inputs, arrays, error)
        return unflatten_outputs(spec, tagged)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


def _stand_in(module: nn.Module, inputs: list[mx.array], args: Any, kwargs: Any) -> Any:
    """Zeros standing in for a failed module's output, so the trace goes on: what the module's
    ``failed_output(*args, **kwargs)`` gives, for a module whose output is not one array shaped
    like its first input (a pair, say); else zeros like its first input."""
    make = getattr(module, "failed_output", None)
    if callable(make):
        return make(*args, **kwargs)
    return mx.zeros_like(inputs[0]) if inputs else mx.zeros(())


# ----------------------------------------------------------------------------- tracing


def _refuse_compiled(fn: Any) -> None:
    """A ``gk.wrap``ped model or ``gk.compile``d function runs a compiled graph, which evaluates
    inside MLX's capture ("Attempting to eval an array during function transformations"): say
    what to trace instead."""
    wrapping = sys.modules.get("graphkern.models.wrapping")
    if wrapping is not None and isinstance(fn, wrapping.WrappedModel):
        raise KernelError(_TRACE, "this is a gk.wrap()ped model, which runs a compiled graph that "
                          "cannot be traced again: trace the model itself (gk.trace(wrapped.model, "
                          "...)), or read the graph the wrapper traced: wrapped.graph",
                          Status.INVALID_INPUT)
    from graphkern.tracing.compiled import CompiledGraph

    if isinstance(fn, CompiledGraph):
        raise KernelError(_TRACE, "this is a gk.compile()d function, which runs a compiled graph "
                          "that cannot be traced again: trace the function you compiled, or read "
                          "the graph it traced: compiled.graph", Status.INVALID_INPUT)


class Traceable:
    """``fn`` with its arguments and state flattened to arrays, ready for MLX's transforms."""

    def __init__(self, fn: Callable[..., Any], state: Any = None):
        if not callable(fn):
            raise KernelError(_TRACE, f"expected a function or nn.Module, got {type(fn).__name__}",
                              Status.INVALID_INPUT)
        _refuse_compiled(fn)
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

    def refuse_foreign_arrays(self, flat: Flat) -> None:
        """A numpy array (or another library's) among the arguments is refused before tracing:
        inside the trace it would fail on some op far from the argument that caused it."""
        found = flat.foreign_arrays(self.arg_names)
        if found:
            path, kind = found[0]
            raise KernelError(_TRACE, f"argument {path!r} of {self.name} is a {kind}, not an MLX "
                              f"array: pass mx.array({path}) instead", Status.INVALID_INPUT)

    def call_recorded(self, flat: Flat, recorder: TraceRecorder, backend: str | None = None) -> Any:
        """Call ``fn`` eagerly on ``flat``'s arrays with ``recorder`` seeing its kernel and module
        calls (as a trace would, in the same order), on this thread."""
        self.refuse_foreign_arrays(flat)
        owners = _ModuleHooks.install([m for _, m in self.state.modules.values()])
        try:
            with recording(recorder), backends.using_backend(backend):
                return self.call_flat(flat, tuple(flat.arrays), {})
        finally:
            _ModuleHooks.remove(owners)

    def trace(self, flat: Flat, backend: str | None = None, used: list[Kernel] | None = None,
              wiring: Wiring | None = None) -> tuple[Graph, Any]:
        """Capture one call as a ``Graph``; returns it with the output tree spec. ``used``, if
        given, receives the kernel objects the call launched; ``wiring`` how to run the graph
        node by node (see ``capture.Wiring``)."""
        self.refuse_foreign_arrays(flat)
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
                    _watch_modules(unseen, enabled=not self.state.modules):
                mx.export_function(log, flat_fn, *flat.arrays, *state_arrays)

        from .distributed.collectives import standing_in  # loaded on the first trace, not with graphkern

        modules = [m for _, m in self.state.modules.values()]
        owners = _ModuleHooks.install(modules)
        with gc_paused():
            try:
                with standing_in(self.fn, modules):
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
                data["template_floats"] = _template_floats(data["template"], names)


class ScopeWarning(UserWarning):
    """A trace ran an ``nn.Module`` it could not see, so its nodes have no module scopes."""


@contextlib.contextmanager
def _watch_modules(seen: list[str], enabled: bool) -> Iterator[None]:
    """While tracing a function in which no module was found, note the class of the first
    ``nn.Module`` whose ``__call__`` runs (a profile hook on this thread, removed at once)."""
    if not enabled:
        yield
        return
    previous = sys.getprofile()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "__call__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                seen.append(type(owner).__name__)
                sys.setprofile(previous)

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


_STACK_BYTES = 1 << 30
_MAX_TRACE_THREADS = 8
_stack_lock = threading.Lock()


class _DaemonPool:
    """Up to ``size`` daemon threads taking work from one queue, each made when no thread is idle.

    Daemon threads, unlike ``ThreadPoolExecutor``'s, which are joined at exit: a joined thread
    frees its MLX state (its compile cache, which holds Python objects once a model's
    ``mx.compile``d function ran on it, as after a failed trace) while the interpreter finalizes,
    and taking the GIL there aborts the process ("terminate called without an active
    exception"). A daemon thread waiting on the queue is simply gone at exit. Each thread reads
    graphkern's thread state, so one that ended would release its MLX streams
    (``context.release_streams``), as every thread that used graphkern does.
    """

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self.jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]]] = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def submit(self, work: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        self.jobs.put((future, work))
        with self.lock:
            if not self.idle.acquire(blocking=False) and len(self.threads) < self.size:
                thread = threading.Thread(target=self._serve, name=f"{self.name}_{len(self.threads)}",
                                          daemon=True)
                thread.start()
                self.threads.append(thread)
        return future

    def _serve(self) -> None:
        while True:
            future, work = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    work()
                    future.set_result(None)
                except BaseException as exc:  # the caller re-raises it
                    future.set_exception(exc)
            del future, work  # nothing of the finished call stays alive while waiting
            self.idle.release()


_pool: tuple[int, _DaemonPool] | None = None  # (pid that made it, pool)


def _trace_threads() -> _DaemonPool:
    """The long-lived deep-stack threads traces run on (made again in a forked child, which
    inherits the pool but not its threads)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), _DaemonPool(_MAX_TRACE_THREADS, "graphkern-trace"))
    return _pool[1]


@contextlib.contextmanager
def _ctrl_c_when_done() -> Iterator[None]:
    """Ctrl-C (SIGINT) while the block runs is raised as ``KeyboardInterrupt`` once it has ended.

    A trace's thread cannot be stopped, and an interpreter that exits while that thread is inside
    MLX dies of SIGSEGV: so the main thread, where Python raises it, waits for the trace first.
    Only where SIGINT has Python's own handler (another one is left alone).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def _on_deep_stack(work: Callable[[], None]) -> None:
    """Run ``work`` on a thread with a 1 GiB stack (address space; pages are touched on use).

    MLX walks the graph recursively in ``export_function``: a chain of ~50,000 primitives
    overflows the default 8 MiB stack and kills the process. The caller's context variables and
    its thread's settings (``context.snapshot``: the backend override, ``without_vjp``, how patched
    layers run) go along; an exception is re-raised here.

    The threads are few and reused: MLX keeps state for every thread that ever ran MLX code (its
    per-thread streams, about 13 KiB) and never frees it, so a thread per trace leaked on every
    trace. A trace started on one of these threads (a trace inside a trace) runs in place: it has
    the deep stack already, and waiting for a free thread there could deadlock.
    """
    if state.deep_stack:
        work()
        return
    variables, settings = contextvars.copy_context(), snapshot()

    def run() -> None:
        state.deep_stack = True
        try:
            with adopted(settings):
                variables.run(work)
        finally:
            state.deep_stack = False

    with _ctrl_c_when_done():
        with _stack_lock:  # the pool starts its threads inside submit(): give them the big stack
            previous = threading.stack_size(_STACK_BYTES)
            try:
                future = _trace_threads().submit(run)
            finally:
                threading.stack_size(previous)
        error = future.exception()
    del future
    if error is not None:
        # no reference cycle (this frame -> error -> traceback -> this frame) keeps the failed
        # call's frames and MLX arrays alive until interpreter exit, where freeing them aborted
        # the process ("terminate called without an active exception")
        try:
            raise error
        finally:
            del error


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
