"""Compiled graphs: ``fn`` under ``mx.compile``, guarded by a graphkern trace per signature.

A compiled graph never runs a signature whose trace found a failed node; the ``mx.compile``d
function carries no tags; state (module parameters, closure arrays) is passed as inputs so
updates are seen; run failures are attributed to their kernel node.
"""

from __future__ import annotations

import enum
import functools
import operator
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..launching import backends, mlx_kernels
from ..launching.context import recording
from ..launching.launch_cache import LaunchCache, track
from ..launching.validation import Launch
from ..nodes import Kernel, KernelError, Status, dtype_name
from ..tracing.extensions import collectives, refuse_tracing
from ..tracing.graph import Failure, Graph, GraphError
from ..tracing.guards import AttributeGuard, modules_under, reached_places
from ..tracing.state import Flat, placeholder_window, reach, unflatten_outputs
from ..tracing.traceable import Traceable
from .extensions import describe_call, rank_sync
from .finite import all_finite, non_finite_error

__all__ = ["CompiledGraph", "FiniteCheckedGraph", "TracedSignature", "compile"]


# ----------------------------------------------------------------------------- kernels in state

_SLOT_DEPTH = 6
_SLOT_BUDGET = 20_000  # containers visited per trace, at most
_Path = tuple[tuple[Any, bool], ...]  # (key or attribute name, is it an attribute) from a root


class _KernelSlots:
    """Where the kernels a trace launched sit among the things ``fn`` reads at call time.

    ``mx.compile`` bakes each kernel (on the CPU: its reference) into the compiled function, so
    a call that would now find another kernel object there (a registry entry replaced, a
    module's kernel attribute swapped) must trace again. The places searched: what ``fn``'s code
    reaches by name (``state.reach``: closure cells, globals, attributes of imported modules and
    of the object a method is bound to), the module tree of ``fn`` (items and attributes), what
    each module class's ``__call__`` reaches, and the dicts, lists and tuples inside all of these.
    A kernel built inside ``fn`` sits in none of them and needs no watching.

    >>> _KernelSlots([]).changed()
    False
    """

    def __init__(self, slots: list[tuple[Any, _Path, Kernel]]):
        self.slots = slots  # (root, path from it, the kernel found there)
        # each slot as (read, argument, kernel), read(argument) giving what sits there now: one C
        # call for the usual one-step places (a global, a closure cell), which every steady call
        # of a compiled graph checks
        self._reads = [_reader(root, path) + (kernel,) for root, path, kernel in slots]

    def changed(self) -> bool:
        try:
            for read, argument, kernel in self._reads:
                if read(argument) is not kernel:
                    return True
        except Exception:  # the place is gone (a key deleted, an attribute removed)
            return True
        return False

    @classmethod
    def find(cls, fn: Callable[..., Any], used: list[Kernel]) -> _KernelSlots:
        wanted = {id(k) for k in used}
        slots: list[tuple[Any, _Path, Kernel]] = []
        if not wanted:
            return cls(slots)
        seen: set[int] = set()
        budget = [_SLOT_BUDGET]

        def visit(value: Any, root: Any, path: _Path, depth: int) -> None:
            if isinstance(value, Kernel):
                if id(value) in wanted:
                    slots.append((root, path, value))
                return
            if depth > _SLOT_DEPTH or budget[0] <= 0 or id(value) in seen:
                return
            if isinstance(value, dict):  # nn.Module is a dict of its children and arrays
                items: Any = list(value.items())
            elif isinstance(value, (list, tuple)):
                items = list(enumerate(value))
            else:
                return
            seen.add(id(value))
            budget[0] -= 1
            for key, item in items:
                visit(item, root, (*path, (key, False)), depth + 1)
            if isinstance(value, nn.Module):
                for key, item in list(vars(value).items()):
                    visit(item, root, (*path, (key, True)), depth + 1)
                call = getattr(type(value).__call__, "__wrapped__", type(value).__call__)
                visit_function(call)

        def visit_function(func: Any) -> None:
            reached = reach(func)
            if getattr(reached.function, "__code__", None) is None or id(reached.function) in seen:
                return
            seen.add(id(reached.function))
            for item in reached.found:
                visit(item.value, item.holder, ((item.key, item.attribute),), 1)

        root = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
        if isinstance(root, nn.Module):
            visit(root, root, (), 0)
        if not isinstance(fn, nn.Module):
            visit_function(fn)
        return cls(slots)


def _reader(root: Any, path: _Path) -> tuple[Callable[[Any], Any], Any]:
    """``(read, argument)`` with ``read(argument)`` the value at ``path`` from ``root``, read
    afresh on every call (a container replaced on the way is seen too)."""
    if len(path) == 1:
        (key, attribute), = path
        return (operator.attrgetter(key), root) if attribute else (root.__getitem__, key)
    return _walk, (root, path)


def _walk(place: tuple[Any, _Path]) -> Any:
    value, path = place
    for key, attribute in path:
        value = getattr(value, key) if attribute else value[key]
    return value


def _array_signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Shapes and dtypes of ``args`` (flat: shape, dtype, shape, ...), or None when one is not an
    ``mx.array``: the key of the compiled call's fast path."""
    signature: list[Any] = []
    for a in args:
        if a.__class__ is not mx.array:
            return None
        signature.append(a.shape)
        signature.append(a.dtype)
    return tuple(signature)


# ----------------------------------------------------------------------------- compile


class _PassThrough:
    """Recorder for the compiled path: no tags, but ``launch`` behaves as inside a graph, and
    the first failing call is remembered (by call index) so it can be blamed on its node.
    With ``probe`` it also evaluates each call's outputs at once, to find evaluation failures."""

    last_record = None

    def __init__(self, probe: bool = False) -> None:
        self.probe = probe
        # a probe re-runs one rank's call alone: its collectives must not reach the other ranks
        self.stands_in_collectives = probe
        self.calls = 0
        self.failed: tuple[int, Exception] | None = None

    def kernel_call(self, launch: Launch | None, kernel: Any, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None,
                    request: dict[str, Any] | None = None) -> list[mx.array]:
        index, self.calls = self.calls, self.calls + 1
        if self.failed is None and error is not None:
            self.failed = (index, error)
        elif self.failed is None and self.probe:
            try:
                mx.eval(inputs)
            except Exception as exc:  # an op before this kernel failed: not the kernel's fault
                self.failed = (-1, exc)
                return outputs
            try:
                mx.eval(outputs)
            except Exception as exc:
                self.failed = (index, exc)
        return outputs


class _Unseen(enum.Enum):
    """What MLX's trace of a signature first met inside a steady call left in MLX's cache."""

    #: traced as usual: the long way that follows finds it in MLX's cache
    TRACED = "traced"
    #: nothing could be traced (a launch failed, ``fn`` raised): MLX cached an empty function, so
    #: the compiled functions are dropped after the call
    EMPTY = "empty"
    #: nested or static arguments, which MLX orders its own way: the long way runs them through
    #: another compiled function
    ELSEWHERE = "elsewhere"


class _CallState(threading.local):
    """What one thread's call in progress shares with MLX's trace of ``_run_flat``, which MLX
    runs on the calling thread. Per thread, so calls from several threads never see each
    other's arguments."""

    #: the structure of the long way's call, while it runs
    flat: Flat | None = None
    #: a steady call's arguments, while it runs
    steady_args: tuple[Any, ...] | None = None
    #: set when MLX traced during a steady call
    unseen: _Unseen | None = None

    def __init__(self) -> None:
        self.recorder = _PassThrough()


@dataclass(frozen=True)
class TracedSignature:
    """One input signature a compiled graph traced (see :meth:`CompiledGraph.signatures`)."""

    #: the call as it was traced: each array as its dtype and shape, other values as they were
    #: (a Python scalar is part of the signature: a new value traces again)
    call: str
    #: the trace; ``graph.ok`` False means calls with this signature are refused
    graph: Graph
    #: whether an ``mx.compile``'d function is held for its structure (it ran at least once)
    compiled: bool


class _Shown:
    """An array in a signature's description: its dtype and shape."""

    def __init__(self, array: mx.array) -> None:
        self.text = f"{dtype_name(array.dtype)}{list(array.shape)}"

    def __repr__(self) -> str:
        return self.text


def _describe(name: str, flat: Flat) -> str:
    """``f(float32[8], 2, shift=1.0)``: a call's signature as :class:`TracedSignature` shows it."""
    args, kwargs = flat.rebuild([_Shown(a) for a in flat.arrays])  # type: ignore[misc]
    return f"{name}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


@dataclass
class _Prepared:
    """What a call with one signature needs: its trace, output structure and compiled function."""

    key: Any
    flat: Flat
    graph: Graph
    spec: Any
    compiled: Callable[..., Any]
    slots: _KernelSlots


class CompiledGraph:
    """``fn`` compiled with ``mx.compile``, guarded by a graphkern trace per input signature.

    The first call with a new signature traces ``fn`` (``.graph``); if a node failed, the call
    raises ``GraphError`` and nothing runs. Otherwise the ``mx.compile``d function runs, with no
    tags and the state (module parameters, closure arrays) passed as inputs, so weight updates
    are always seen. A kernel replaced where ``fn`` finds it (a registry entry, a module
    attribute: see ``_KernelSlots``) makes the next call trace again, so the new source runs,
    and so does a Python value the trace read that changed since (a module's ``eps`` or training
    mode, a scalar ``fn`` closes over or names as a global: see ``guards.AttributeGuard``).
    Evaluation failures (a kernel that does not compile) are attributed to their kernel node.
    While a single signature has run, a call is MLX's compiled call plus the kernel check: MLX's
    own cache lookup stands for graphkern's, and a new signature makes MLX trace first, which
    sends the call through the full guard before anything is evaluated. Such a steady call
    schedules its outputs (``mx.async_eval``) rather than waiting for them: kernels compile and
    are encoded there, so a failure still raises from the call, and the GPU runs while Python
    returns.

    Thread safety: a compiled graph may be called from several threads at once. What a call in
    progress shares with MLX's trace (its arguments, the structure being traced, the recorder of
    failures) is kept per thread; the tables of traces and compiled functions are dicts written
    whole, so two threads meeting a new signature together may both trace it, and one trace is
    kept. MLX keeps its compile cache per thread, so a thread's first call through a compiled
    function traces it there, as a new signature would: the call then takes the long way, and
    steady calls stop, since one compiled function has now met two traces.

    >>> import mlx.core as mx, graphkern as gk
    >>> cf = gk.compile(lambda x: mx.exp(x) * 2)
    >>> cf(mx.zeros((2,)))
    array([2, 2], dtype=float32)
    >>> cf.graph.status
    <Status.OK: 0>
    """

    #: Whether calls check their outputs for NaN/Inf (``compile(check_finite=True)``).
    check_finite = False

    def __init__(self, fn: Callable[..., Any], *, state: Any = None, backend: str | None = None,
                 group: Any = None, timeout: float | None = None):
        self.fn = fn
        self.backend = backend
        self._traceable = Traceable(fn, state)
        self._state = self._traceable.state
        # several ranks: agreement before a new signature runs, and the watchdog (timeout=)
        self._sync = rank_sync([m for _, m in self._state.modules.values()], group, timeout)
        self._watched = self._sync is not None and self._sync.job is not None
        # signature -> (graph, output spec); least recently used first (``forget_oldest_trace``)
        self._graphs = LaunchCache("compiled graph traces", None, group=None)
        self._slots: dict[Any, _KernelSlots] = {}
        self._calls: dict[Any, str] = {}  # signature -> the call traced, described (signatures())
        # the Python values the traces read (module attributes, closure and global scalars)
        self._guard: AttributeGuard | None = None
        self._last: Graph | None = None
        self._call_state = _CallState()
        # one mx.compile per static structure: MLX keys its cache on array shapes only, so a
        # Python scalar argument (baked into the trace) must never share a compiled function
        self._compiled: dict[Any, Callable[..., Any]] = {}
        # the common call, positional arrays only: shapes and dtypes -> everything a call needs
        self._fast: dict[Any, _Prepared] = {}
        # signatures each mx.compile'd function has run; the one a steady call may take (__call__)
        self._served: dict[Any, set[Any]] = {}
        self._steady: _Prepared | None = None
        track(self, "compiled graphs")  # gk.cache_stats() counts its traces, gk.clear_caches() clears it

    def _run_flat(self, *arrays: mx.array) -> list[mx.array]:
        call = self._call_state
        flat = call.flat
        if flat is None:  # MLX traces inside a steady call: a signature it has not run yet
            return self._run_unseen(arrays)
        # GPU launches carry their custom vjp as eager ones do (``mx.grad`` may differentiate
        # through a compiled graph); patched layers of an evaluating model launch plain, as eagerly
        with self._state.cells_from_captured(), recording(call.recorder):
            return self._traceable.call_flat(flat, arrays, {})

    def _run_unseen(self, arrays: tuple[mx.array, ...]) -> list[mx.array]:
        """MLX's trace of a signature met in a steady call. Arrays alone are traced as usual, so
        the long way the call then takes (graph traced, a failed one refused, before anything is
        evaluated) finds the trace in MLX's cache. Nothing may raise here: MLX would leave its
        tracers in the state containers. A trace that fails is left empty, and the compiled
        functions are dropped after the call."""
        call, steady = self._call_state, self._steady
        args = call.steady_args
        call.unseen, call.recorder = _Unseen.EMPTY, _PassThrough()
        if steady is None or args is None:
            return []
        self._served[steady.key[0]].add(None)  # two signatures met: no more steady calls through it
        if _array_signature(args) is None:
            call.unseen = _Unseen.ELSEWHERE
            return []
        try:
            call.flat = Flat.of(args, {}, self._traceable.arg_names)
            outputs = self._run_flat(*arrays)
        except Exception:  # the long way traces the graph and says what is wrong
            return []
        finally:
            call.flat = None
        if call.recorder.failed is None:
            call.unseen = _Unseen.TRACED
        return outputs

    @property
    def graph(self) -> Graph | None:
        """The graph of the last traced signature."""
        return self._last

    def trace(self, *args: Any, **kwargs: Any) -> Graph:
        """The graph for these arguments (traced on first sight of their signature)."""
        self._check_guard()
        return self._entry(Flat.of(args, kwargs, self._traceable.arg_names))[0]

    def _check_guard(self) -> None:
        """Forget every trace if a Python value they read changed since (every compiled function
        baked the old one in)."""
        guard = self._guard
        if guard is not None and guard.changed():
            self.clear()

    def _new_guard(self) -> AttributeGuard:
        """A guard on what the traces can read now: the classes and plain attributes of the
        modules in ``fn``'s state, and the plain values ``fn``'s code reaches by name."""
        find = functools.partial(modules_under, self._state.roots)
        return AttributeGuard(find, reached_places(reach(self.fn).found))

    def _entry(self, flat: Flat, key: Any = None) -> tuple[Graph, Any]:
        key = flat.key() if key is None else key
        entry = self._graphs.get(key)
        if entry is not None and self._slots[key].changed():
            self.clear()  # a kernel was replaced: every compiled function baked the old one in
            entry = None
        if entry is None:
            used: list[Kernel] = []
            entry = self._traceable.trace(flat, self.backend, used)
            self._graphs.put(key, entry)
            self._slots[key] = _KernelSlots.find(self.fn, used)
            self._calls[key] = _describe(self._traceable.name, flat)
            self._guard = self._new_guard()  # the values as this trace left them
        self._last = entry[0]
        return entry

    def call_with_status(self, *args: Any, **kwargs: Any) -> tuple[Any, Status]:
        """``(outputs, Status.OK)`` or ``(None, status of the root failure)``; never raises for
        a failed node (a ``Result``, in Rust's terms)."""
        try:
            return self(*args, **kwargs), Status.OK
        except GraphError as exc:
            return None, exc.status

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_guard()
        steady = self._steady
        if steady is not None and not kwargs and not steady.slots.changed():
            # the steady call: one signature ever ran through this mx.compile'd function, so
            # MLX's own cache check (shapes, dtypes, tree, constants) stands for the signature
            # lookup; a signature it has not run makes MLX trace (_run_unseen) and the call
            # takes the long way
            state, call = self._state, self._call_state
            if state.cells:
                state.refresh_cells()
            self._last = steady.graph
            call.steady_args = args
            try:
                outputs = self._call_compiled(steady.compiled, args)
            except Exception:  # arguments MLX refuses: the long way says what is wrong
                outputs = None
            call.steady_args = None
            if call.unseen is not None:
                if call.unseen is _Unseen.EMPTY:
                    self._forget_compiled()
                call.unseen = self._steady = None
            elif outputs is not None:
                try:
                    # scheduled, not waited for: kernels compile and encode here, so a failure
                    # still raises in this call, while the GPU runs during what follows; a
                    # watchdog (timeout=) must see the collectives finish
                    if self._watched:
                        self._sync.evaluate(outputs, steady.graph, inputs=list(args))  # type: ignore[union-attr]
                    else:
                        mx.async_eval(outputs)
                except GraphError:  # the ranks aborted the job (graphkern.distributed)
                    self._steady = None
                    raise
                except Exception as exc:
                    self._steady = None  # the next call takes the long way, which refuses a
                    # graph whose node this failure marks
                    flat = Flat.of(args, kwargs, self._traceable.arg_names)
                    raise self._attribute(steady.graph, flat, exc, call.recorder) from exc
                return unflatten_outputs(steady.spec, outputs)
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The long way: signature lookup, trace and compile if new, guards."""
        signature = None if kwargs else _array_signature(args)
        plain = signature is not None
        prepared = self._fast.get(signature) if plain else None
        if prepared is None or prepared.slots.changed():  # new, or a kernel was replaced: re-trace
            prepared = self._prepare(Flat.of(args, kwargs, self._traceable.arg_names))
            if plain:
                self._fast[signature] = prepared
        graph = self._last = prepared.graph
        if not graph.ok:
            raise graph.error()  # type: ignore[misc]
        arrays = list(args) if plain else Flat.of(args, kwargs, self._traceable.arg_names).arrays
        call = self._call_state
        if call.recorder.calls:  # only an MLX trace of _run_flat uses it: then start afresh
            call.recorder = _PassThrough()
        state = self._state
        if state.cells:
            state.refresh_cells()
        call.flat = prepared.flat  # its structure, for when MLX traces _run_flat
        try:
            if self.backend is None:
                outputs = self._run_compiled(prepared.compiled, arrays, graph)
            else:
                with backends.using_backend(self.backend):
                    outputs = self._run_compiled(prepared.compiled, arrays, graph)
        except GraphError:  # the ranks aborted the job (graphkern.distributed)
            raise
        except Exception as exc:
            flat = Flat.of(args, kwargs, self._traceable.arg_names)
            raise self._attribute(prepared.graph, flat, exc, call.recorder) from exc
        finally:
            call.flat = None
        served = self._served.setdefault(prepared.key[0], set())  # signatures MLX has run
        served.add(prepared.key)
        self._steady = prepared if plain and self.backend is None and len(served) == 1 else None
        return unflatten_outputs(prepared.spec, outputs)

    def _forget_compiled(self) -> None:
        """MLX cached an empty trace (see _run_unseen): drop the compiled functions, keep the
        graphkern traces."""
        self._steady = None
        self._compiled.clear()
        self._served.clear()
        self._fast.clear()

    def _prepare(self, flat: Flat) -> _Prepared:
        """Trace (if new) and compile (if new) for this call's signature."""
        key = flat.key()
        sync = self._sync
        try:
            graph, spec = self._entry(flat, key)
        except KernelError as exc:
            if sync is not None:  # the other ranks must hear of it before anyone runs
                sync.agree(key, None, exc, describe_call(self._traceable.name, flat.arrays))
            raise
        if sync is not None:
            sync.agree(key, graph, None, describe_call(self._traceable.name, flat.arrays))
        compiled = self._compiled.get(key[0])
        if compiled is None:
            state = self._state
            # nothing to capture (no module, no closure arrays): MLX need not walk an empty
            # state tree on every call
            inputs = state.containers if state.captured else None
            compiled = self._compiled[key[0]] = mx.compile(self._run_flat, inputs=inputs)
        return _Prepared(key, flat, graph, spec, compiled, self._slots[key])

    def _call_compiled(self, compiled: Callable[..., Any], arrays: Any) -> Any:
        """Call an ``mx.compile``d function of this graph. While MLX traces one with state, its
        tracers sit in the state's containers (the model's parameters): under
        ``placeholder_window``, as a trace's placeholders are, so no other thread's trace or
        compiled call reads them or restores over them."""
        if not self._state.captured:
            return compiled(*arrays)
        with placeholder_window:
            return compiled(*arrays)

    def _run_compiled(self, compiled: Callable[..., Any], arrays: list[mx.array],
                      graph: Graph) -> list[mx.array]:
        outputs = self._call_compiled(compiled, arrays)
        failed = self._call_state.recorder.failed
        if failed is not None:  # a launch failed while MLX traced
            raise failed[1]
        if self._watched:
            self._sync.evaluate(outputs, graph, inputs=arrays)  # type: ignore[union-attr]
        else:
            mx.eval(outputs)
        return outputs  # type: ignore[no-any-return]

    def _attribute(self, graph: Graph, flat: Flat, exc: Exception,
                   recorder: _PassThrough) -> GraphError:
        """Find the kernel node behind a run failure, mark it, and build the error."""
        message, found = str(exc), exc
        kernels = graph.kernels()
        culprit = next((n for n in kernels if graph.node(n).get("generated_name")
                        and graph.node(n)["generated_name"] in message), None)
        if culprit is None and recorder.failed is None:
            recorder = _PassThrough(probe=True)
            modules = [m for _, m in self._state.modules.values()]
            try:
                with collectives().standing_in(self.fn, modules), recording(recorder):  # type: ignore[arg-type]
                    self._traceable.call_flat(flat, tuple(flat.arrays), {})
            except Exception:  # the eager re-run may fail the same way; the first error stands
                pass
        if culprit is None and recorder.failed is not None:
            index, found = recorder.failed
            message = str(found)
            culprit = next((n for n in kernels if graph.node(n).get("call_index") == index), None)
        status = found.status if isinstance(found, KernelError) else mlx_kernels.status_of_mlx_error(message)
        if culprit is None:
            outputs = tuple(graph.nodes("output"))
            error = GraphError(Failure("<eval>", status, message, outputs))
        else:
            data = graph.node(culprit)
            data["status"], data["message"] = int(status), message
            graph.refresh()
            error = graph.error() or GraphError(Failure(culprit, status, message, ()))
        if self._sync is not None:
            self._sync.failed(error)  # with a watchdog, the other ranks stop waiting for this one
        return error

    def clear(self) -> None:
        """Forget every trace (the next call re-traces)."""
        self._graphs.clear()
        self._slots.clear()
        self._calls.clear()
        self._guard = None
        self._forget_compiled()
        self._last = None
        if self._sync is not None:
            self._sync.clear()

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, int]:
        """What this compiled graph holds and how its calls found it, for a user asking why calls
        trace again or run slowly:

        - ``hits``: calls of the long way whose signature was traced already;
        - ``misses``: signatures traced anew (a new shape, dtype, tree or Python value; a replaced
          kernel; a changed module attribute);
        - ``size``: traces kept, one per signature (:meth:`signatures`);
        - ``compiled``: ``mx.compile``'d functions held, one per structure (tree and Python
          values): signatures differing only in array shapes and dtypes share one;
        - ``steady``: 1 when the next call with the last signature skips graphkern's lookup and is
          MLX's compiled call alone (one signature ever ran through its compiled function, all
          arguments positional arrays, no ``backend=``), else 0.

        >>> import mlx.core as mx, graphkern as gk
        >>> cf = gk.compile(lambda x: x * 2)
        >>> _ = cf(mx.ones((2,))); _ = cf(mx.ones((2,))); _ = cf(mx.ones((3,)))
        >>> cf.stats()
        {'hits': 0, 'misses': 2, 'size': 2, 'compiled': 1, 'steady': 0}
        """
        steady = int(self._steady is not None)
        return {**self._graphs.stats(), "compiled": len(self._compiled), "steady": steady}

    def signatures(self) -> list[TracedSignature]:
        """The input signatures traced and kept, least recently used first: each call as it was
        traced, its graph, and whether it compiled. A signature per call where one was expected
        says what differs between the calls (a Python scalar that changes, say, which should be an
        array).

        >>> import mlx.core as mx, graphkern as gk
        >>> cf = gk.compile(lambda x, n: x * n)
        >>> _ = cf(mx.ones((2, 3)), 2); _ = cf(mx.ones((2, 3)), 3)
        >>> [(s.call, s.graph.ok, s.compiled) for s in cf.signatures()]
        [('<lambda>(float32[2, 3], 2)', True, True), ('<lambda>(float32[2, 3], 3)', True, True)]
        """
        compiled = self._compiled
        return [TracedSignature(self._calls.get(key, "?"), graph, key[0] in compiled)
                for key, (graph, _) in self._graphs.items()]

    @property
    def group(self) -> Any:
        """The ``mx.distributed.Group`` whose ranks agree before a new signature runs (see
        ``graphkern.distributed``), or None when the function runs on one rank."""
        return self._sync.group if self._sync is not None else None

    def traces(self) -> Iterator[Graph]:
        """The graphs of the signatures kept, least recently used first."""
        return (g for g, _ in self._graphs.values())

    def trace_count(self) -> int:
        """How many traces (one graph per signature) this function keeps."""
        return len(self._graphs)

    def forget_oldest_trace(self) -> None:
        """Drop the trace used least recently, and the ``mx.compile``'d functions (MLX keeps a trace per
        signature inside each: they go with it, and the traces kept are compiled again when next
        called)."""
        if not self._graphs:
            return
        key = self._graphs.oldest()
        graph, _ = self._graphs.pop(key)
        self._slots.pop(key, None)
        self._calls.pop(key, None)
        self._forget_compiled()
        if self._sync is not None:
            self._sync.forget(graph)


# a compiled graph evaluates inside MLX's capture ("Attempting to eval an array during function
# transformations"): a trace of one says what to trace instead
refuse_tracing(CompiledGraph, "this is a gk.compile()d function, which runs a compiled graph that cannot be "
               "traced again: trace the function you compiled, or read the graph it traced: compiled.graph")


class FiniteCheckedGraph(CompiledGraph):
    """A compiled graph that checks every call's outputs for NaN and Inf (one reduction, and a
    wait for the outputs) and, on finding any, runs ``gk.inspect`` on the same inputs to name the
    node where they started, as ``jax_debug_nans`` re-runs op by op: the call raises
    ``GraphError`` with ``Status.NON_FINITE``, that node, its module path and kernel name, and
    the values graph as ``.graph``."""

    check_finite = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(*args, **kwargs)
        if not all_finite(out):
            raise non_finite_error(self._traceable, Flat.of(args, kwargs, self._traceable.arg_names),
                                   self.backend)
        return out


def compile(fn: Callable[..., Any], *, state: Any = None, backend: str | None = None,
            check_finite: bool = False, group: Any = None, timeout: float | None = None) -> CompiledGraph:
    """Compile ``fn`` into a ``CompiledGraph``: ``mx.compile`` guarded by a graphkern trace per input
    signature (see :class:`CompiledGraph`).

    The first call with a new signature traces ``fn`` (``.graph``); a trace with a failed node
    is refused before anything runs. ``.signatures()`` and ``.stats()`` say what was traced and
    why a call traced again.

    Args:
        fn: the function or ``nn.Module`` to compile.
        state: extra arrays, lists, dicts or modules ``fn`` reads without taking them as
            arguments; modules ``fn`` is bound to or closes over, and closure arrays, are found
            alone.
        backend: the kernel backend its launches use; None: graphkern's choice.
        check_finite: check each call's outputs for NaN/Inf and name the node where they started
            (``FiniteCheckedGraph``); off by default, since each call then waits for its outputs.
        group: across processes (``mx.distributed``, see ``graphkern.distributed``), the group
            whose ranks agree before a new signature runs; None: the group ``fn``'s sharded
            modules hold, if any.
        timeout: seconds; arms a watchdog that turns a call stuck in its collectives into an
            error on every rank.

    Returns:
        A :class:`CompiledGraph` (:class:`FiniteCheckedGraph` with ``check_finite``).

    Raises:
        KernelError: ``fn`` cannot be traced (see ``gk.trace``), or a bad ``group`` or
            ``timeout`` (``Status.INVALID_INPUT``).
        GraphError: at a call, a node of the signature's trace failed, a kernel failed to run
            (the error names its node), or with ``check_finite`` the outputs held NaN or Inf.

    >>> import mlx.core as mx, graphkern as gk
    >>> cf = gk.compile(lambda x: mx.log(x) * 2, check_finite=True)
    >>> try:
    ...     cf(mx.array([1.0, -1.0]))
    ... except gk.GraphError as exc:
    ...     print(exc.node, exc.status.name)
    log NON_FINITE
    """
    kind = FiniteCheckedGraph if check_finite else CompiledGraph
    return kind(fn, state=state, backend=backend, group=group, timeout=timeout)
