"""Arguments and state as flat lists of arrays.

``mx.export_function`` and ``mx.compile`` take arrays; users pass trees of arrays and scalars and
functions that close over weights. ``Flat`` turns a call's arguments into arrays plus a way back;
``State`` finds the arrays a function reads without taking them as arguments (the parameters of
an ``nn.Module``, arrays in closure cells) and swaps them for tracer arrays while tracing, so a
trace never bakes a weight in as a constant.

While a model's containers hold one trace's placeholders, another thread reading them would bake
those in (and fail evaluating them), and the two restores, interleaved, would leave placeholders
in the model: every such window is held under one lock (:data:`placeholder_window`).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from ..launching.context import work_owner

__all__ = ["Flat", "Reach", "Reached", "State", "argument_names", "flatten_outputs", "placeholder_window",
           "reach", "static_key", "unflatten_outputs"]


class _WorkLock:
    """A lock (``with lock:``) re-entered by the piece of work holding it
    (``context.work_owner``), on its own thread or on the deep-stack thread a trace inside it runs
    on while it waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: object | None = None
        self._depth = 0

    def __enter__(self) -> None:
        me = work_owner()
        if self._owner is not me:  # only the owner ever sets it to itself
            self._lock.acquire()
            self._owner = me
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
            self._lock.release()


#: Held while a state's containers hold placeholders: a trace's swap (``State.swapped``) and MLX's
#: trace of a compiled graph with state (``compiling.compiled``).
placeholder_window = _WorkLock()


class _Leaf:
    """Marks where an array sat in a flattened tree."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


_LEAF_KEY = ("leaf",)  # what a _Leaf contributes to a static key


def _flatten(tree: Any, path: str, arrays: list[mx.array], names: list[str]) -> Any:
    if isinstance(tree, mx.array):
        arrays.append(tree)
        names.append(path)
        return _Leaf(len(arrays) - 1)
    if isinstance(tree, (list, tuple)):
        items = [_flatten(v, f"{path}[{i}]", arrays, names) for i, v in enumerate(tree)]
        return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
    if isinstance(tree, dict) and not isinstance(tree, nn.Module):
        return {k: _flatten(v, f"{path}.{k}" if path else str(k), arrays, names)
                for k, v in tree.items()}
    return tree


def _unflatten(spec: Any, arrays: list[mx.array] | tuple[mx.array, ...]) -> Any:
    if isinstance(spec, _Leaf):
        return arrays[spec.index]
    if isinstance(spec, (list, tuple)):
        items = [_unflatten(v, arrays) for v in spec]
        return type(spec)(items) if not hasattr(spec, "_fields") else type(spec)(*items)
    if isinstance(spec, dict):
        return {k: _unflatten(v, arrays) for k, v in spec.items()}
    return spec


def _spec_key(spec: Any) -> Any:
    """A hashable description of a tree's structure and its non-array leaves."""
    if isinstance(spec, _Leaf):
        return _LEAF_KEY
    if isinstance(spec, (list, tuple)):
        return (type(spec).__name__, tuple(_spec_key(v) for v in spec))
    if isinstance(spec, dict):
        return ("dict", tuple((k, _spec_key(v)) for k, v in spec.items()))
    try:
        hash(spec)
        return spec
    except TypeError:
        return ("id", id(spec))


def static_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Flat.of(args, kwargs, names).key()[0]`` without flattening: the tree structure and non-array
    values that set a call's trace apart (array shapes and dtypes aside).

    >>> x = mx.ones(2)
    >>> static_key((x, [x, 3]), {"y": x}) == Flat.of((x, [x, 3]), {"y": x}, ["x", "z"]).key()[0]
    True
    """
    return ("tuple", (("list", tuple(map(_tree_key, args))),
                      ("dict", tuple((k, _tree_key(v)) for k, v in kwargs.items()))))


def _tree_key(tree: Any) -> Any:
    """``_spec_key`` of the spec ``_flatten`` would make of ``tree``."""
    if isinstance(tree, mx.array):
        return _LEAF_KEY
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(map(_tree_key, tree)))
    if isinstance(tree, dict) and not isinstance(tree, nn.Module):
        return ("dict", tuple((k, _tree_key(v)) for k, v in tree.items()))
    return _spec_key(tree)


@dataclass
class Flat:
    """A call's ``args``/``kwargs`` as a flat list of arrays, with names and a way back.

    >>> flat = Flat.of((mx.ones(2), [mx.zeros(1), 3]), {"y": mx.ones(1)}, ["x", "z"])
    >>> flat.names
    ['x', 'z[0]', 'y']
    >>> args, kwargs = flat.rebuild(flat.arrays)
    >>> args[1][1], sorted(kwargs)
    (3, ['y'])
    """

    arrays: list[mx.array]
    names: list[str]
    spec: Any

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any], arg_names: list[str]) -> Flat:
        arrays: list[mx.array] = []
        names: list[str] = []
        spec_args = [_flatten(a, arg_names[i] if i < len(arg_names) else f"args[{i}]", arrays, names)
                     for i, a in enumerate(args)]
        spec_kwargs = {k: _flatten(v, k, arrays, names) for k, v in kwargs.items()}
        return cls(arrays, names, (spec_args, spec_kwargs))

    def rebuild(self, arrays: list[mx.array] | tuple[mx.array, ...]) -> tuple[list[Any], dict[str, Any]]:
        spec_args, spec_kwargs = self.spec
        return _unflatten(spec_args, arrays), _unflatten(spec_kwargs, arrays)

    def key(self) -> Any:
        """Structure, static values, shapes and dtypes: what forces a new trace when it changes."""
        return (_spec_key(self.spec), tuple((a.shape, a.dtype) for a in self.arrays))

    def untraceable(self, arg_names: list[str]) -> list[tuple[str, str, list[str]]]:
        """``(argument path, type, attributes)`` of each argument a trace cannot take: another
        library's array (a numpy array, a torch tensor...: no attributes listed), which would be
        baked into a trace as a constant or fail inside it, and an object holding MLX arrays in
        its attributes (an mlx-lm KV cache: the attributes that hold them), whose arrays MLX's
        capture cannot see.

        >>> import numpy as np
        >>> class Box:
        ...     def __init__(self): self.keys = mx.zeros(1)
        >>> Flat.of((mx.ones(2), [np.ones(2), Box()]), {}, ["x", "y"]).untraceable(["x", "y"])
        [('y[0]', 'numpy.ndarray', []), ('y[1]', 'Box', ['keys'])]
        """
        found: list[tuple[str, str, list[str]]] = []

        def walk(tree: Any, path: str) -> None:
            if isinstance(tree, (list, tuple)):
                for i, item in enumerate(tree):
                    walk(item, f"{path}[{i}]")
            elif isinstance(tree, dict):
                for key, item in tree.items():
                    walk(item, f"{path}.{key}" if path else str(key))
            elif isinstance(tree, (_Leaf, mx.array, numbers.Number, str, nn.Module, type)) or tree is None:
                return
            elif hasattr(tree, "__array__") or hasattr(tree, "__dlpack__"):
                found.append((path, f"{type(tree).__module__}.{type(tree).__qualname__}", []))
            else:
                attrs = [name for name, value in vars(tree).items() if _holds_arrays(value)] \
                    if hasattr(tree, "__dict__") else []
                if attrs:
                    found.append((path, type(tree).__qualname__, attrs))

        spec_args, spec_kwargs = self.spec
        for i, tree in enumerate(spec_args):
            walk(tree, arg_names[i] if i < len(arg_names) else f"args[{i}]")
        walk(spec_kwargs, "")
        return found


def _holds_arrays(value: Any) -> bool:
    """Whether ``value`` is an MLX array or a list, tuple or dict with one among its items."""
    if isinstance(value, mx.array):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_arrays(v) for v in value)
    if isinstance(value, dict) and not isinstance(value, nn.Module):
        return any(_holds_arrays(v) for v in value.values())
    return False


def flatten_outputs(out: Any) -> tuple[list[mx.array], Any]:
    """``fn``'s result as a list of arrays plus the tree to rebuild it with."""
    arrays: list[mx.array] = []
    spec = _flatten(out, "out", arrays, [])
    return arrays, spec


def unflatten_outputs(spec: Any, arrays: list[mx.array]) -> Any:
    """The tree ``flatten_outputs`` took apart, rebuilt around ``arrays``.

    >>> arrays, spec = flatten_outputs({"a": mx.ones(1), "b": [mx.zeros(2), 3]})
    >>> out = unflatten_outputs(spec, arrays)
    >>> out["b"][0].shape, out["b"][1]
    ((2,), 3)
    """
    if spec.__class__ is _Leaf:  # a single array: the common case, on every compiled call
        return arrays[spec.index]
    return _unflatten(spec, arrays)


def argument_names(fn: Callable[..., Any]) -> list[str]:
    """Positional parameter names of ``fn`` (``x``, ``mask``...), for naming input nodes."""
    target = fn.__call__ if isinstance(fn, nn.Module) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]


@dataclass(frozen=True)
class Reached:
    """One value a function's code reaches by name, and where it sits: ``holder[key]`` (a globals
    dict) or ``getattr(holder, key)`` (``attribute``: a closure cell's ``cell_contents``, an
    imported module's attribute, an attribute of the object a method is bound to)."""

    name: str
    value: Any
    holder: Any
    key: str
    attribute: bool
    kind: Literal["cell", "global", "attribute"]


@dataclass(frozen=True)
class Reach:
    """What a function reaches besides its arguments (see :func:`reach`)."""

    #: the function under any bound method (``fn.__func__``), or ``fn`` itself
    function: Any
    #: the object a bound method is bound to, or None
    owner: Any
    #: the globals dict the function's code runs in, or None (a builtin, a callable object)
    namespace: dict[str, Any] | None
    #: closure cells first, then globals, then attributes of imported modules and of ``owner``
    found: list[Reached]


_MISSING = object()


def reach(fn: Any) -> Reach:
    """The values ``fn``'s code reaches by name: its closure cells (empty ones skipped), the
    globals it names, the attributes it names of imported Python modules among those globals
    (``mymodels.model(x)``) and of the object a method is bound to (``self.model(x)`` on a plain
    object). The one walker behind ``State`` (arrays and modules), the compiled graph's watch
    on kernels and the collectives' stand-ins (the namespaces to patch).

    >>> import math
    >>> w = mx.ones((2,))
    >>> found = reach(lambda x: math.pi * w * x).found
    >>> [(r.name, r.kind) for r in found]
    [('math', 'global'), ('w', 'global'), ('pi', 'attribute')]
    """
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    code = getattr(func, "__code__", None)
    found: list[Reached] = []
    closure = getattr(func, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars if code else (), closure):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        found.append(Reached(name, value, cell, "cell_contents", True, "cell"))
    names = getattr(code, "co_names", ())
    scope = getattr(func, "__globals__", None)
    namespace = scope if isinstance(scope, dict) else None
    holders: list[tuple[Any, bool]] = []  # (holder, read statically)
    if namespace is not None:
        for name in names:
            value = namespace.get(name, _MISSING)
            if value is _MISSING:
                continue
            found.append(Reached(name, value, namespace, name, False, "global"))
            if isinstance(value, types.ModuleType):
                holders.append((value, False))
    if owner is not None and not isinstance(owner, nn.Module):
        holders.append((owner, True))
    for holder, static in holders:
        for name in names:
            value = (inspect.getattr_static(holder, name, _MISSING) if static
                     else vars(holder).get(name, _MISSING))
            if value is not _MISSING:
                found.append(Reached(name, value, holder, name, True, "attribute"))
    return Reach(func, owner, namespace, found)


class _Cell:
    """A closure cell holding an array, addressed like a container slot."""

    def __init__(self, cell: Any):
        self.cell = cell

    def __getitem__(self, _: Any) -> Any:
        return self.cell.cell_contents

    def __setitem__(self, _: Any, value: Any) -> None:
        self.cell.cell_contents = value


class State:
    """The arrays ``fn`` reads besides its arguments: module parameters and closure arrays, in
    the modules it is, is bound to, closes over or names as globals.

    ``containers`` are what ``mx.compile(inputs=...)`` should capture (modules, dicts, lists and
    a list mirroring the closure cells); ``slots`` address every array for swapping by hand.

    >>> def scaled():
    ...     w = mx.ones((2,))
    ...     return lambda x: x * w
    >>> State.of(scaled()).names
    ['w']
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.slots: list[tuple[Any, Any]] = []
        self.modules: dict[int, tuple[str, nn.Module]] = {}
        self.roots: list[Any] = []
        self.cells: list[_Cell] = []
        self.cell_values: list[Any] = []
        self._seen: set[int] = set()

    @classmethod
    def of(cls, fn: Callable[..., Any], extra: Any = None) -> State:
        state = cls()
        if isinstance(fn, nn.Module):
            state._add_root("", fn)
        reached = reach(fn)
        if isinstance(reached.owner, nn.Module):
            state._add_root("", reached.owner)
        for item in reached.found:
            if item.kind == "cell":
                if isinstance(item.value, mx.array):
                    state._add_cell(item.name, item.holder)
                elif isinstance(item.value, (dict, list)):
                    state._add_root(item.name, item.value)
        for item in reached.found:
            if item.kind != "cell" and isinstance(item.value, nn.Module):
                state._add_root(item.name, item.value)
        if extra is not None:
            state._add_root("state", extra)
        return state

    def _add_cell(self, name: str, cell: Any) -> None:
        self.cells.append(_Cell(cell))
        self.cell_values.append(cell.cell_contents)
        self.names.append(name)
        self.slots.append((self.cells[-1], None))

    def _add_root(self, prefix: str, root: Any) -> None:
        if id(root) in self._seen:
            return
        self._seen.add(id(root))
        self.roots.append(root)
        self._walk(prefix, root)

    def _walk(self, path: str, tree: Any) -> None:
        if isinstance(tree, nn.Module) and id(tree) not in self.modules:
            self.modules[id(tree)] = (path, tree)
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for key, value in items:
            child = f"{path}.{key}" if path else str(key)
            if isinstance(value, mx.array):
                self.names.append(child)
                self.slots.append((tree, key))
            elif isinstance(value, (dict, list)):
                self._walk(child, value)

    @property
    def captured(self) -> bool:
        """Whether there is state to capture (a module, closure arrays): what ``mx.compile`` must
        take as ``inputs`` and fill with tracers while it traces."""
        return bool(self.roots or self.cells)

    @property
    def containers(self) -> list[Any]:
        """For ``mx.compile(inputs=...)``: MLX fills these with tracers while it traces."""
        return [*self.roots, self.cell_values]

    def arrays(self) -> list[mx.array]:
        return [container[key] for container, key in self.slots]

    def refresh_cells(self) -> None:
        """Copy the closure cells' current arrays into the list ``mx.compile`` captures."""
        for i, cell in enumerate(self.cells):
            self.cell_values[i] = cell[None]

    @contextlib.contextmanager
    def cells_from_captured(self) -> Iterator[None]:
        """Inside a compiled trace: point the closure cells at the tracers MLX put in the list."""
        saved = [cell[None] for cell in self.cells]
        for cell, value in zip(self.cells, self.cell_values):
            cell[None] = value
        try:
            yield
        finally:
            for cell, value in zip(self.cells, saved):
                cell[None] = value

    @contextlib.contextmanager
    def swapped(self, arrays: list[mx.array] | tuple[mx.array, ...]) -> Iterator[None]:
        """Put ``arrays`` in every slot for the duration, then restore the originals; no other
        piece of work swaps meanwhile (:data:`placeholder_window`)."""
        with placeholder_window:
            saved = self.arrays()
            for (container, key), value in zip(self.slots, arrays):
                container[key] = value
            try:
                yield
            finally:
                for (container, key), value in zip(self.slots, saved):
                    container[key] = value
