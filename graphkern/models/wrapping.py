"""``wrap(model)``: a model's forward pass as a graphkern compiled graph.

The wrapped model runs through ``gk.compile``: traced once per input signature (``.graph`` shows it,
layer by layer, with module scopes), refused if a node failed, and otherwise run by ``mx.compile``
with the parameters passed as state, so weight updates are always seen. mlx-lm KV caches pass
through as inputs and outputs (see ``graphkern.models.cache``). Decoding is the exception that
torch.compile users know from its recompile limit: a cache offset is static (mlx-lm slices with
it), so once a call was traced at one offset, the same call at a new offset runs eagerly.

>>> import mlx.core as mx, mlx.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4))
>>> wrapped = wrap(model)
>>> bool(mx.allclose(wrapped(mx.ones((2, 4))), model(mx.ones((2, 4)))))
True
>>> sorted({wrapped.graph.node(n)["scope"] for n in wrapped.graph.nodes("op")})
['layers.0', 'layers.1']
"""

from __future__ import annotations

import inspect
import types
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.compiling import CompiledGraph, TracedSignature, all_finite, non_finite_error
from graphkern.compiling import compile as compile_graph
from graphkern.distributed.sync import rank_sync
from graphkern.errors import ModelError
from graphkern.launching import backends
from graphkern.models.cache import cache_states, snapshot, stand_ins, states_of, write_back
from graphkern.models.structure import StructureWatch
from graphkern.nodes import KernelError, Status
from graphkern.tracing.extensions import refuse_tracing
from graphkern.tracing.graph import Graph
from graphkern.tracing.state import Flat, argument_names, static_key
from graphkern.tracing.traceable import Traceable

__all__ = ["WRAP_OPERATION", "WrappedModel", "wrap"]

WRAP_OPERATION = "wrap a model as a graphkern compiled graph"


def _offsets_erased(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cache states with every int attribute (offset, ring index, also fixed sizes) blanked: what
    calls that differ only in where the cache stands have in common."""
    return [{k: int if v.__class__ is int else v for k, v in state.items()} for state in states]


def _forward(model: nn.Module) -> Any:
    """``model``'s call as a method bound to it (so graphkern finds its parameters and module paths
    with no prefix), taking cache state trees instead of cache objects."""

    def forward(self: nn.Module, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        if cache is None:
            return self(*args, **kwargs)
        caches = stand_ins(cache)
        out = self(*args, cache=caches, **kwargs)
        return out, states_of(caches)

    forward.__name__ = forward.__qualname__ = type(model).__name__
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(name, positional) for name in ["self", *argument_names(model)]
              if name != "cache"]
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # input names
    return types.MethodType(forward, model)


class WrappedModel:
    """A model whose forward pass runs as a graphkern compiled graph (see :func:`wrap`)."""

    def __init__(self, model: nn.Module, *, backend: str | None = None, max_traces: int = 16,
                 trace_each_offset: bool = False, check_finite: bool = False,
                 group: Any = None, timeout: float | None = None):
        if not isinstance(model, nn.Module):
            raise ModelError(WRAP_OPERATION, f"wrap expects an mlx.nn.Module, got {type(model).__name__}",
                              Status.INVALID_INPUT)
        self.model = model
        self.backend = backend
        # several ranks (graphkern.distributed): the group and watchdog every compiled graph shares
        self._sync = rank_sync([m for _, m in model.named_modules()], group, timeout)
        self._group = self._sync.group if self._sync is not None else None
        self.timeout = timeout
        if isinstance(max_traces, bool) or not isinstance(max_traces, int) or max_traces < 1:
            raise ModelError(WRAP_OPERATION, f"max_traces must be a positive int, got {max_traces!r}",
                              Status.INVALID_INPUT)
        self.max_traces = max_traces
        self._graphs: OrderedDict[Any, CompiledGraph] = OrderedDict()
        self.trace_each_offset = trace_each_offset
        self.check_finite = check_finite
        self._structure: StructureWatch | None = None
        self._last: CompiledGraph | None = None
        self._arg_names = argument_names(model)
        self._cache_calls_traced: set[Any] = set()  # such calls, offsets blanked
        # the cache list the last call ran eagerly with (decoding): the same call on it runs
        # eagerly again without computing its keys, as the model itself would run it
        self._eager_cache: Any = None
        #: How calls ran: ``"compiled"`` (a graphkern compiled graph) or ``"eager"`` (a cache call at
        #: a new offset, see :func:`wrap`).
        self.calls: dict[str, int] = {"compiled": 0, "eager": 0}

    @property
    def graph(self) -> Graph | None:
        """The graph of the last call's signature."""
        return self._last.graph if self._last is not None else None

    def _compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CompiledGraph | None:
        """The compiled graph for these arguments' static part (tree structure, Python scalars,
        cache offsets); array shapes and dtypes are told apart inside it. None: run eagerly (a cache
        call traced before at another offset, unless ``trace_each_offset``)."""
        self._structure_changed()
        static = static_key(args, kwargs)
        compiled = self._graphs.get(static)
        if compiled is None:
            if "cache" in kwargs and not self.trace_each_offset:
                blanked = {**kwargs, "cache": _offsets_erased(kwargs["cache"])}
                family = static_key(args, blanked)
                if family in self._cache_calls_traced:
                    return None
                self._cache_calls_traced.add(family)
            compiled = self._new_compiled()
            self._graphs[static] = compiled
        else:
            self._graphs.move_to_end(static)
        self._last = compiled
        return compiled

    def _bound_traces(self) -> None:
        """Keep at most ``max_traces`` traces in all: the oldest trace of the compiled graph used
        longest ago goes first (that graph too once it keeps none); the current call's newest
        trace stays."""
        total = sum(c.trace_count() for c in self._graphs.values())
        while total > self.max_traces:
            static, victim = next(((k, c) for k, c in self._graphs.items() if c is not self._last),
                                  (None, self._last))
            if victim is None:
                return
            if victim.trace_count() == 0:  # a graph whose only call failed before it traced
                del self._graphs[static]
                continue
            victim.forget_oldest_trace()
            total -= 1
            if victim.trace_count() == 0 and static is not None:
                del self._graphs[static]

    def _structure_changed(self) -> bool:
        """Whether modules were swapped (patch, unpatch) or parameters reshaped since the last
        call; if so every trace is forgotten."""
        if self._structure is None:
            self._structure = StructureWatch(self.model)
            return False
        if self._structure.changed():
            self.clear()
            return True
        return False

    def _eager(self, args: tuple[Any, ...], cache: Any, kwargs: dict[str, Any]) -> Any:
        """The model itself on the caller's cache, its outputs scheduled as a steady compiled
        call's are; if it fails, the cache is put back as it was (a compiled call writes nothing
        then either)."""
        self.calls["eager"] += 1
        kwargs = {k: v for k, v in kwargs.items() if k != "cache"}
        before = snapshot(cache)
        try:
            with backends.using_backend(self.backend):
                out = self.model(*args, cache=cache, **kwargs)
            if self._sync is not None and self._sync.job is not None:
                # a watchdog (timeout=) must see the collectives finish
                self._sync.evaluate(out, call=f"{type(self.model).__name__} (eager)")
            else:
                # scheduled as a steady compiled call is: MLX compiles and encodes the kernels
                # here, so a failure still raises in this call, while the GPU runs as the caller
                # goes on
                mx.async_eval(out)
            if self.check_finite and not all_finite(out):  # (waits for the outputs)
                write_back(cache, before)  # the values trace runs on the cache as it was
                forward = Traceable(_forward(self.model))
                flat = Flat.of(args, {**kwargs, "cache": cache_states(cache)}, forward.arg_names)
                raise non_finite_error(forward, flat, self.backend)
        except BaseException:
            write_back(cache, before)
            raise
        return out

    def _prepare(self, args: tuple[Any, ...], cache: Any,
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """Take the cache out of the arguments (also when given positionally, as the model's
        ``cache`` parameter) and put its state trees in; arguments after it become keywords."""
        names = self._arg_names
        if cache is None and "cache" in names and len(args) > names.index("cache"):
            at = names.index("cache")
            cache = args[at]
            kwargs = {**dict(zip(names[at + 1:], args[at + 1:])), **kwargs}
            args = args[:at]
        if cache is not None:
            kwargs = {**kwargs, "cache": cache_states(cache)}
        return args, kwargs, cache

    def __call__(self, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        """Run the forward pass; with ``cache`` (mlx-lm cache objects), update them as the model would."""
        if (cache is not None and cache is self._eager_cache and not kwargs
                and not self._structure_changed()):
            return self._eager(args, cache, kwargs)  # the next token of an eager decode
        args, kwargs, cache = self._prepare(args, cache, kwargs)
        compiled = self._compiled(args, kwargs)
        if compiled is None:
            self._eager_cache = cache if len(kwargs) == 1 else None
            return self._eager(args, cache, kwargs)
        self._eager_cache = None
        self.calls["compiled"] += 1
        traces = compiled.trace_count()
        try:
            out = compiled(*args, **kwargs)
        finally:
            if compiled.trace_count() != traces:
                self._bound_traces()
        if cache is None:
            return out
        logits, states = out
        write_back(cache, states)
        return logits

    def call_with_status(self, *args: Any, cache: Any = None, **kwargs: Any) -> tuple[Any, Status]:
        """``(outputs, Status.OK)``, or ``(None, status)`` when a node failed (nothing ran)."""
        args, kwargs, cache = self._prepare(args, cache, kwargs)
        compiled = self._compiled(args, kwargs)
        if compiled is None:
            try:
                return self._eager(args, cache, kwargs), Status.OK
            except KernelError as exc:  # a launch refused before anything ran
                return None, exc.status
        self.calls["compiled"] += 1
        traces = compiled.trace_count()
        out, status = compiled.call_with_status(*args, **kwargs)
        if compiled.trace_count() != traces:
            self._bound_traces()
        if out is None or cache is None:
            return out, status
        write_back(cache, out[1])
        return out[0], status

    def trace(self, *args: Any, cache: Any = None, **kwargs: Any) -> Graph:
        """The graph for these arguments, traced but not run (the cache is left untouched)."""
        args, kwargs, _ = self._prepare(args, cache, kwargs)
        compiled = self._compiled(args, kwargs)
        if compiled is None:  # a call that runs eagerly is still traced when asked for
            return self._new_compiled().trace(*args, **kwargs)
        graph = compiled.trace(*args, **kwargs)
        self._bound_traces()
        return graph

    def _new_compiled(self) -> CompiledGraph:
        return compile_graph(_forward(self.model), backend=self.backend, check_finite=self.check_finite,
                             group=self._group, timeout=self.timeout)

    def stats(self) -> dict[str, int]:
        """What the wrapper holds: ``graphs``, the compiled graphs (one per static part of the
        arguments: tree, Python values, cache offsets when ``trace_each_offset``); ``traces``,
        the traces they keep in all (at most ``max_traces``: :meth:`signatures`); ``compiled``
        and ``eager``, the calls run each way (``.calls``).

        >>> import mlx.core as mx, mlx.nn as nn
        >>> wrapped = wrap(nn.Linear(4, 4))
        >>> _ = wrapped(mx.ones((1, 4))); _ = wrapped(mx.ones((2, 4)))
        >>> wrapped.stats()
        {'graphs': 1, 'traces': 2, 'compiled': 2, 'eager': 0}
        """
        traces = sum(compiled.trace_count() for compiled in self._graphs.values())
        return {"graphs": len(self._graphs), "traces": traces, **self.calls}

    def signatures(self) -> list[TracedSignature]:
        """The signatures traced and kept, over every compiled graph (see
        ``CompiledGraph.signatures``), the graph used longest ago first."""
        return [s for compiled in self._graphs.values() for s in compiled.signatures()]

    def clear(self) -> None:
        """Forget every trace."""
        self._graphs.clear()
        self._cache_calls_traced.clear()
        self._eager_cache = None
        self._last = None

    def __getattr__(self, name: str) -> Any:
        """The model's own attributes (``layers``, ``make_cache``, ``args``...), so mlx-lm's
        generators (``generate_step``, ``BatchGenerator``) take a wrapped model as they take the
        model."""
        if name.startswith("__") or name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"WrappedModel({type(self.model).__name__}, traces={len(self._graphs)})"


# a wrapped model runs a compiled graph, which evaluates inside MLX's capture: a trace of one says
# what to trace instead
refuse_tracing(WrappedModel, "this is a gk.wrap()ped model, which runs a compiled graph that cannot be "
               "traced again: trace the model itself (gk.trace(wrapped.model, ...)), or read the graph the "
               "wrapper traced: wrapped.graph")


def wrap(model: nn.Module, *, backend: str | None = None, max_traces: int = 16,
         trace_each_offset: bool = False, check_finite: bool = False, group: Any = None,
         timeout: float | None = None) -> WrappedModel:
    """Run ``model``'s forward pass as a graphkern compiled graph (``gk.compile`` of its call).

    Parameters are passed to the compiled function as state, so ``model.update(...)`` and
    optimizer steps are seen by the next call. A new input shape or dtype traces again, and so
    does swapping modules (``patch``/``unpatch``); ``.graph`` is the last trace, ``.signatures()``
    and ``.stats()`` say what is kept.

    mlx-lm models take their KV cache as usual, ``wrapped(tokens, cache=cache)``, and the cache
    objects are updated in place. A cache offset is static (mlx-lm slices the cache with it): the
    first call of a kind (prefill, then the first decode step) is traced and compiled, and the
    same call at a new offset runs the model eagerly on the caller's cache (``.calls`` counts
    both), as torch.compile falls back to eager past its recompile limit: tracing every token
    would cost more than running it. An eager call that fails raises what failed and leaves the
    cache as it was.

    A sharded model (``model.shard(group)``) runs on every rank as ``gk.compile`` runs it there:
    the ranks agree before a new signature runs (see ``graphkern.distributed``).

    Args:
        model: the ``nn.Module`` to run.
        backend: the kernel backend (``"metal"``, ``"cuda"``, ``"reference"``); None: graphkern's
            choice (``GRAPHKERN_BACKEND``, else the device's).
        max_traces: the most traces kept in all (one per input signature: each prompt length is
            one), the one used longest ago dropped first.
        trace_each_offset: trace and compile every cache offset instead of running calls at a new
            offset eagerly.
        check_finite: check each call's logits for NaN/Inf and raise ``GraphError`` naming the
            node where they started (see ``gk.compile``); the cache is then left as it was.
        group: the ``mx.distributed.Group`` whose ranks agree; None: the one the sharded layers
            hold, if any.
        timeout: seconds a call may spend in its collectives before the watchdog turns it into
            an error on every rank; None: no watchdog.

    Returns:
        A :class:`WrappedModel`, called as the model is; the model's other attributes (``layers``,
        ``make_cache``...) read through, so mlx-lm's generators take it as they take the model.

    Raises:
        ModelError: ``model`` is not an ``nn.Module`` or ``max_traces`` not a positive int
            (``Status.INVALID_INPUT``); at a call, a cache whose state is not arrays and Python
            scalars.
        KernelError: a bad ``group`` or ``timeout``.
        GraphError: at a call, a node of its trace failed (nothing ran), or with
            ``check_finite``, the outputs held NaN or Inf.

    >>> import mlx.core as mx, mlx.nn as nn
    >>> model = nn.Linear(2, 2)
    >>> wrapped = wrap(model)
    >>> model.weight = mx.zeros((2, 2)); model.bias = mx.ones((2,))
    >>> wrapped(mx.ones((1, 2))).tolist()
    [[1.0, 1.0]]
    """
    return WrappedModel(model, backend=backend, max_traces=max_traces, trace_each_offset=trace_each_offset,
                        check_finite=check_finite, group=group, timeout=timeout)
