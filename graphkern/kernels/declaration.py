"""One declaration per library kernel: its plan, its layer function and its registry entry, tied
together once, in the spirit of ``torch.library.custom_op``.

A library kernel is a :class:`~graphkern.Kernel`, a plan function (the call's arguments to a
validated :class:`~graphkern.kernels.base.Plan`) and a layer function. :func:`declare` turns the
plan function into a :class:`LibraryKernel`; its parts are attached to it:

    @declare(RMS_NORM, stock=..., make_inputs=..., shapes=..., description=...)
    def plan_rms_norm(x, weight=None, eps=1e-5) -> Plan:
        ...                               # checks the arguments, decides the launch

    @plan_rms_norm.layer                  # registers graphkern.kernels.LIBRARY["rms_norm"]
    def rms_norm(x, weight=None, eps=1e-5) -> mx.array:
        return plan_rms_norm.launch(x, weight, eps)[0]

That is all a new kernel needs: the registry (``graphkern.kernels.LIBRARY``) and the exports of
``graphkern.kernels`` (the kernel, by its name less ``gk_`` in capitals, and the layer function)
are derived from the declarations. ``variant`` registers more entries of the same kernel (other
inputs for ``check()``: ``gelu_approx``, ``rope_traditional``...).

``launch(*args, **kwargs)`` takes the plan function's arguments (positionally in the plan
function's order, keyword-only ones included, or by keyword) and runs the plan. Plans are kept per
signature, in one cache for the whole library (``graphkern.kernels.base.LAUNCHES``): the signature
of a call is :func:`signature` of its arguments, made one way for every kernel. A call at a signature seen
before costs one lookup and one launch; a new signature is planned, and so checked, first. A call
whose plan fails is never kept, so a bad input raises the same ``KernelError`` every time.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, TypeVar

import mlx.core as mx

from graphkern.kernels import registry
from graphkern.kernels.base import LAUNCHES, Case, LibraryEntry, Plan, is_signature_constant, run
from graphkern.launching.context import state
from graphkern.launching.fastpaths import BACKEND_VARIABLE, environ_get
from graphkern.launching.launch_paths import run_eager
from graphkern.nodes import Kernel, KernelError, Status
from graphkern.runtime import bind

__all__ = ["LibraryKernel", "declare", "signature"]

_ARRAY = mx.array
#: Argument types whose value (with the type) is their part of a signature.
_SCALARS = frozenset({int, bool, str, type(None)})
_copysign = math.copysign
#: The library's kept launches (``LAUNCHES.entries``), as the map ``launch`` reads on every call.
_KEPT = LAUNCHES.entries

Layer = TypeVar("Layer", bound=Callable[..., Any])


def signature(values: Sequence[Any], into: list[Any] | None = None) -> tuple[Any, ...]:
    """What a library launch depends on in ``values`` (a call's arguments), one way for every
    kernel, as one flat tuple (after the items of ``into``): an array is its shape and dtype; an
    int, a bool, a string or None its type and value; a float its type, value and sign (0.0 and
    -0.0 are equal keys, and a kernel's float template keeps the sign); a list or tuple its type,
    its length and the signatures of its items. Each part starts with a shape (an array) or a type
    (anything else), which says how long it is, so no two argument lists share a signature.
    Anything else raises TypeError: such a call is planned every time, and its plan says what is
    wrong.

    MLX's Python arrays show no strides: every library kernel asks MLX for row-contiguous inputs
    (``Kernel.ensure_row_contiguous``, which :func:`declare` requires), so a layout is never part
    of a signature.

    >>> signature((mx.ones((2, 3)), None, 1e-5))
    ((2, 3), mlx.core.float32, <class 'NoneType'>, None, <class 'float'>, 1e-05, 1.0)
    >>> signature((0.0,)) != signature((-0.0,)), signature((True,)) != signature((1,))
    (True, True)
    """
    parts = [] if into is None else into
    for v in values:
        c = v.__class__
        if c is _ARRAY:
            parts += (v.shape, v.dtype)
        elif c in _SCALARS:
            parts += (c, v)
        elif c is float or isinstance(v, float):
            parts += (c, v, _copysign(1.0, v))
        elif isinstance(v, (list, tuple)):
            parts += (c, len(v))
            signature(v, parts)
        elif isinstance(v, int):
            parts += (c, v)
        else:
            raise TypeError(f"{c.__name__} is not part of a launch signature")
    return tuple(parts)


def _array_paths(values: Sequence[Any]) -> dict[int, tuple[Any, Any]] | None:
    """Each array among ``values`` (and in their lists and tuples) by id: (the array, its index or
    path of indices). None when one array is there twice: which argument a plan input came from
    is then ambiguous, and the call is not kept."""
    found: dict[int, tuple[Any, Any]] = {}

    def walk(items: Sequence[Any], prefix: tuple[int, ...]) -> bool:
        for i, v in enumerate(items):
            where: Any = prefix + (i,) if prefix else i
            if v.__class__ is _ARRAY:
                if id(v) in found:
                    return False
                found[id(v)] = (v, where)
            elif isinstance(v, (list, tuple)) and not walk(v, where if prefix else (i,)):
                return False
        return True

    return found if walk(values, ()) else None


class _NotKept(Exception):
    """A plan input is neither one of the call's arrays nor a signature constant."""


def _picker(inputs: Sequence[Any], values: Sequence[Any]) -> Callable[[Sequence[Any]], Sequence[Any]] | None:
    """A function from a later call's arguments (of this signature) to its plan's inputs; None
    when the inputs are the arguments themselves. Raises ``_NotKept`` when some input is neither
    one of the call's arrays nor a signature constant, or one array is there twice."""
    paths = _array_paths(values)
    if paths is None:
        raise _NotKept
    sources: list[Any] = []
    constants: list[mx.array] = []
    for value in inputs:
        found = paths.get(id(value))
        if found is not None and found[0] is value:
            sources.append(found[1])
        elif is_signature_constant(value):
            sources.append(len(values) + len(constants))
            constants.append(value)
        else:
            raise _NotKept
    if all(s.__class__ is int for s in sources):
        if not constants and sources == list(range(len(values))):
            return None  # the call's arguments themselves
        getter = itemgetter(*sources) if len(sources) > 1 else _one(sources[0])
        if not constants:
            return getter
        extra = tuple(constants)
        return lambda v: getter(tuple(v) + extra)  # type: ignore[no-any-return]

    def pick(v: Sequence[Any]) -> list[Any]:
        picked = []
        for s in sources:
            if s.__class__ is int:
                picked.append(v[s] if s < len(v) else constants[s - len(v)])
            else:
                item: Any = v
                for i in s:
                    item = item[i]
                picked.append(item)
        return picked

    return pick


def _one(index: int) -> Callable[[Sequence[Any]], tuple[Any]]:
    return lambda v: (v[index],)


class LibraryKernel:
    """A declared library kernel (see :func:`declare`): called like its plan function it returns
    the plan; ``launch`` runs it, kept per signature; ``layer`` and ``variant`` register it."""

    def __init__(self, plan: Callable[..., Plan], kernel: Kernel, *, stock: Callable[..., Any],
                 make_inputs: Callable[[Sequence[int], mx.Dtype, mx.array], Case],
                 shapes: tuple[tuple[int, ...], ...], description: str, min_ndim: int = 1,
                 last_dim_multiple: int = 1,
                 tolerances: dict[mx.Dtype, tuple[float, float]] | None = None) -> None:
        if not kernel.ensure_row_contiguous:
            raise KernelError("declare a library kernel", f"kernel {kernel.name!r} reads its inputs' "
                              "strides, which MLX's Python arrays do not show: a launch signature could "
                              "not tell layouts apart", Status.INVALID_KERNEL)
        self.plan_function = plan
        self.kernel = kernel
        self.options: dict[str, Any] = dict(
            stock=stock, make_inputs=make_inputs, shapes=shapes, description=description,
            min_ndim=min_ndim, last_dim_multiple=last_dim_multiple, tolerances=dict(tolerances or {}))
        #: the registry entries of this kernel: the layer's first, then its variants
        self.entries: list[LibraryEntry] = []
        #: how many plans ``launch`` has built (a new signature, or a call it could not keep)
        self.plan_builds = 0
        names = [p.name for p in inspect.signature(plan).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        #: the plan function's parameters taken by keyword only: ``launch`` takes them by position
        self._keyword_only = tuple(p.name for p in inspect.signature(plan).parameters.values()
                                   if p.kind is p.KEYWORD_ONLY)
        self._positional = len(names) - len(self._keyword_only)
        self.__name__ = getattr(plan, "__name__", kernel.name)
        self.__doc__ = plan.__doc__
        self.__wrapped__ = plan

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan of these arguments, validated (``KernelError`` otherwise): what check(), the
        tests and ``launch`` run."""
        return self.plan_function(*args, **kwargs)

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        self.plan_builds += 1
        if self._keyword_only and len(args) > self._positional:  # keyword-only ones by position
            extra = args[self._positional:]
            if len(extra) > len(self._keyword_only):
                raise TypeError(f"{self.__name__} takes {self._positional + len(self._keyword_only)} "
                                f"arguments, {len(args)} were given")
            kwargs = {**dict(zip(self._keyword_only, extra)), **kwargs}
            args = args[:self._positional]
        return self.plan_function(*args, **kwargs)

    def launch(self, *args: Any, **kwargs: Any) -> list[mx.array]:
        """Run the plan of these arguments (the plan function's, keyword-only ones by position
        too) with ``graphkern.runtime.launch``: eagerly a ``KernelError`` raises, in a trace or a
        compiled graph it is the node's status. Kept per signature: a call at a signature seen
        before looks its bound launch up and runs it on the call's arrays."""
        values = args + tuple(kwargs.values()) if kwargs else args
        try:
            key = signature(values, [self, tuple(kwargs) if kwargs else None,
                                     state.backend or environ_get(BACKEND_VARIABLE)])  # backend_setting()
            entry = _KEPT.get(key)
        except TypeError:  # not a signature (an unhashable or unknown argument): the plan decides
            return run(self._plan(args, kwargs))
        if entry is not None:  # LAUNCHES.get, inline: on every call
            entry[1] = True
            LAUNCHES.hits += 1
            bound, pick = entry[0]
            inputs = values if pick is None else pick(values)
            if state.recorder is None:
                return run_eager(bound.launch, inputs)
            return bound(*inputs)
        LAUNCHES.misses += 1
        plan = self._plan(args, kwargs)  # checks the arguments: KernelError for a bad one
        if not plan.empty:
            try:
                pick = _picker(plan.inputs, values)
            except _NotKept:  # made from the call's values: planned again next time
                pass
            else:
                LAUNCHES.put(key, (bind(plan.kernel, plan.output_specs, grid=plan.grid,
                                        threadgroup=plan.threadgroup, template=plan.template), pick))
        return run(plan)

    def layer(self, fn: Layer) -> Layer:
        """Decorator: ``fn`` is this kernel's layer function; registers its library entry (named
        as ``fn``) and exports ``fn`` and the kernel from ``graphkern.kernels``. Returns ``fn``."""
        entry = LibraryEntry(name=fn.__name__, kernel=self.kernel, fn=fn, plan=self, **self.options)
        self.entries.append(entry)
        registry.register(entry, {registry.kernel_export_name(self.kernel): self.kernel, fn.__name__: fn})
        return fn

    def variant(self, name: str, **changes: Any) -> LibraryEntry:
        """Register another entry of this kernel for check(), the tests and the benchmarks: the
        layer's entry with ``changes`` (other ``make_inputs``, ``stock``, ``description``...)."""
        if not self.entries:
            raise KernelError("declare a library kernel variant",
                              f"{self.__name__} has no layer function yet (decorate it with .layer first)",
                              Status.INVALID_KERNEL)
        entry = dataclasses.replace(self.entries[0], name=name, **changes)
        self.entries.append(entry)
        registry.register(entry, {})
        return entry

    def __repr__(self) -> str:
        names = ", ".join(e.name for e in self.entries) or "no layer yet"
        return f"LibraryKernel({self.kernel.name!r}: {names})"


def declare(kernel: Kernel, *, stock: Callable[..., Any],
            make_inputs: Callable[[Sequence[int], mx.Dtype, mx.array], Case],
            shapes: tuple[tuple[int, ...], ...], description: str, min_ndim: int = 1,
            last_dim_multiple: int = 1,
            tolerances: dict[mx.Dtype, tuple[float, float]] | None = None,
            ) -> Callable[[Callable[..., Plan]], LibraryKernel]:
    """Decorator: the plan function of a library kernel becomes its :class:`LibraryKernel`.

    ``kernel`` is what the plans launch (or a variant of it, as a plan decides); ``stock`` the MLX
    equivalent with the layer function's signature; ``make_inputs(shape, dtype, key)`` random
    arguments with ``x`` of ``shape``; ``shapes`` check()'s defaults; ``min_ndim``,
    ``last_dim_multiple`` and ``tolerances`` what check() must respect (see ``LibraryEntry``).

    >>> from graphkern import Kernel, OutputSpec
    >>> twice = Kernel("gk_twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> @declare(twice, stock=lambda x: x * 2, make_inputs=lambda s, d, k: Case((mx.ones(s, d),)),
    ...          shapes=((4,),), description="x * 2")
    ... def plan_twice(x):
    ...     return Plan(twice, (x,), (OutputSpec(x.shape, x.dtype),), (x.size, 1, 1), (x.size, 1, 1))
    >>> plan_twice.launch(mx.ones((3,)))[0].tolist(), plan_twice.plan_builds
    ([2.0, 2.0, 2.0], 1)
    >>> plan_twice.launch(mx.full((3,), 2.0))[0].tolist(), plan_twice.plan_builds  # one signature
    ([4.0, 4.0, 4.0], 1)
    """
    def wrap(plan: Callable[..., Plan]) -> LibraryKernel:
        return LibraryKernel(plan, kernel, stock=stock, make_inputs=make_inputs, shapes=shapes,
                             description=description, min_ndim=min_ndim, last_dim_multiple=last_dim_multiple,
                             tolerances=tolerances)

    return wrap
