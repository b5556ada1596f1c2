"""Compiled segments: the parts of a patched layer's forward between its KV-cache updates, replayed
through ``mx.compile`` while a model decodes.

Decoding a token is host-bound: each launch costs the host more time than the GPU spends on it,
and a Python layer call costs more than the launch. So in evaluation (no vjp), outside graphkern's
traces and for calls of a few tokens, a patched block runs what lies between two cache updates
(input norm, projections and ``rope_qk``; then ``o_proj``, the fused residual norm and the
feed-forward) as a compiled function of the layer's arrays: a call replays the recorded primitives
in C++ instead of running the layers' Python again. The cache update and attention itself run as
in the stock layer, between two segments. A decoder stack of such blocks runs one compiled call a
block: its ``link`` is one block's second segment and the next block's first.

The layer's arrays are the first argument of each compiled call, one flat tuple of them, so
replacing a weight (training, ``load_weights``, quantizing: each sets a module item) is seen at the
next call, and a changed structure traces anew. A
plain attribute of the layer or a module under it (a norm's ``eps``) is baked into the forms, and
so is each module's class: one changed since they were traced (a module swapped, an attribute set:
``graphkern.tracing.guards``) makes every form trace again. MLX
takes a call's arrays one by one, so a segment is handed only the subtrees it reads when the layer
names them (``segment_reads(name)``: paths of child names); one that reaches past them while it
is traced fails there and takes the whole layer from then on. A fused weight a segment takes in
row ranges (Phi-3's ``qkv_proj`` and ``gate_up_proj``) is handed in as ranges made once, where the
layer declares them (``segment_views(name)``: paths and sizes): slices made inside the segment
would be made again, and evaluated, at every call. What a call hands a segment is found once
and handed again while no module item was set anywhere since and the lists on its paths hold the
same items (a check of a few C calls; finding them again costs a call tens of microseconds). Each
thread has its own compiled forms (MLX keeps one compile cache a thread), and a layer holds its
forms while they hold only a weak reference back, so dropping a model frees its weights.

A segment traces on a copy of the layer's module tree holding the tracers, never on the layer
itself, so other threads calling the layer meanwhile see its own arrays.

>>> import mlx.nn as nn
>>> class Twice(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.weight = mx.ones((4,))
...     def scaled(self, x):
...         return x * self.weight * 2
>>> layer = Twice()
>>> segments = Segments(layer)
>>> segments("scaled", mx.ones((4,))).tolist()
[2.0, 2.0, 2.0, 2.0]
>>> layer.weight = mx.full((4,), 3.0)     # the next call reads the new weight
>>> segments("scaled", mx.ones((4,))).tolist()
[6.0, 6.0, 6.0, 6.0]
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from graphkern.launching.autodiff import vjp_enabled
from graphkern.launching.context import settings_changed, state
from graphkern.launching.launch_cache import LaunchCache
from graphkern.tracing.guards import (
    AttributeGuard,
    at_next_item_write,
    item_writes,
    modules_under,
    same_items,
)

__all__ = ["MAX_SEGMENT_TOKENS", "Segments", "decoding", "row_ranges", "segments_apply"]

#: Calls of at most this many tokens run compiled segments (decoding, speculative verification).
#: Longer ones (prefill) run layer by layer: each new prompt length would be a new trace.
MAX_SEGMENT_TOKENS = 16

#: Compiled forms a layer keeps, over all its segments and threads.
MAX_FORMS = 256

_NOT_A_TREE = "[compile] Function arguments must be trees"

#: What a layer's ``segment_views(name)`` declares: each fused weight a segment takes in row
#: ranges, as its path from the layer and the ranges' sizes in rows.
Views = tuple[tuple[tuple[Any, ...], tuple[int, ...]], ...]


def decoding(x: mx.array) -> bool:
    """Whether a layer called with ``x`` (``(B, L, D)``) decodes: no vjp (an evaluating model, or
    ``gk.without_vjp()``) and at most ``MAX_SEGMENT_TOKENS`` tokens. Such a call runs a block's
    segments, compiled, or eagerly inside a graphkern trace (which then records what runs)."""
    return not vjp_enabled() and x.ndim == 3 and x.shape[1] <= MAX_SEGMENT_TOKENS


def segments_apply(x: mx.array) -> bool:
    """Whether a layer called with ``x`` runs its compiled segments: it :func:`decodes <decoding>`
    and no graphkern trace is recording the launches."""
    return state.recorder is None and decoding(x)


class Segments:
    """One layer's compiled segments: ``segments(name, *args)`` is ``getattr(layer, name)(*args)``
    through ``mx.compile``, traced once per thread and per signature of the arguments (shapes,
    dtypes, the values of non-array arguments) and of the layer's arrays.

    Arguments are trees of arrays and constants (what ``mx.compile`` takes). A layer whose tree
    holds something else cannot be passed: :attr:`usable` turns False and :meth:`__call__` returns
    None, for the caller to run the layer's own forward.
    """

    __slots__ = ("layer", "_forms", "_whole", "usable", "_guard", "_views", "_plans", "_armed", "__weakref__")

    def __init__(self, layer: Any):
        self.layer = weakref.ref(layer)
        # (name, the thread's token) -> the compiled form: one a thread (MLX keeps a compile
        # cache a thread), a bounded LRU
        self._forms = LaunchCache("segment forms", MAX_FORMS)
        self._whole: set[Any] = set()  # segments that read past their declared subtrees
        self.usable = True
        # the plain attributes of the layer's modules the forms were traced with
        self._guard: AttributeGuard | None = None
        # segment name -> (the fused weights, their row ranges) handed to it (``segment_views``)
        self._views: dict[Any, tuple[list[mx.array], list[list[mx.array]]]] = {}
        # (name, the thread's token) -> what its calls hand the form, while the tree holds it
        self._plans: dict[Any, _Plan] = {}
        self._armed = False  # whether the next module item write lets the plans' arrays go

    def traced(self) -> list[Any]:
        """The names of the segments compiled so far, on any thread."""
        return sorted({key[0] for key in self._forms}, key=str)

    def __call__(self, name: str | tuple[Any, ...], *args: Any) -> Any:
        """``getattr(layer, name)(*args)``, compiled; a tuple ``name`` is ``(method, *constants)``
        and calls ``getattr(layer, method)(*constants, *args)``, one form for each."""
        layer = self.layer()
        guard = self._guard
        if guard is None or guard.changed():
            self._retrace(layer)
        key = (name, state.token)
        plan = self._plans.get(key)
        if plan is None or not plan.current():
            plan = self._plan(layer, name)
            if len(self._plans) >= MAX_FORMS:
                self._plans.clear()
            self._plans[key] = plan
            if not self._armed:
                self._armed = True
                at_next_item_write(functools.partial(_let_go, weakref.ref(self)))
        else:
            self._forms.hits += 1  # served by a form already made, as a lookup would count it
        try:
            return plan.form(plan.leaves, *args)
        except (AttributeError, KeyError):
            if plan.whole:
                raise
            # the segment reached past the subtrees it declared (only a trace runs Python, so
            # this is a form's first call): it takes the whole layer from now on
            self._whole.add(name)
            self._plans.pop(key, None)
            return self(name, *args)
        except ValueError as exc:
            if not str(exc).startswith(_NOT_A_TREE):
                raise
            self.usable = False
            return None

    def _plan(self, layer: Any, name: Any) -> _Plan:
        """What a call of segment ``name`` hands its compiled form, found by asking the layer
        (``segment_reads``, ``segment_views``) and walking its tree, and the places it was found
        at, so that later calls only check those places (:meth:`_Plan.current`)."""
        writes = item_writes()  # before looking: a write racing with the look is seen later
        declared = getattr(layer, "segment_reads", None)
        paths = None if declared is None or name in self._whole else declared(name)
        try:
            trees = layer if paths is None else [_at(layer, path) for path in paths]
        except (KeyError, IndexError):  # a layer without one of them: the whole layer
            self._whole.add(name)
            paths, trees = None, layer
        viewing = getattr(layer, "segment_views", None)
        wanted = viewing(name) if viewing is not None else ()
        leaves: list[Any] = []
        places: list[tuple[Any, ...]] = []
        lists: list[list[Any]] = []
        for index, tree in enumerate([trees] if paths is None else trees):
            if isinstance(tree, (dict, list)):
                _flatten(tree, leaves, places, () if paths is None else (index,), lists)
            else:
                leaves.append(tree)
                places.append((index,))
        for views in self._row_views(name, layer, wanted) if wanted else ():
            leaves += views
        # the places of the leaves are part of the form: MLX tells calls apart by their arrays'
        # shapes and dtypes only, and a form maps each leaf to the place it was traced at
        key = (name, paths is None, wanted, tuple(places), state.token)
        form = self._forms.get(key)
        if form is None:
            form = mx.compile(_traced(self.layer, name, paths, wanted))
            self._forms.put(key, form)
        return _Plan(form, tuple(leaves), paths is None, writes, layer,
                     (*(paths or ()), *(path for path, _ in wanted)), lists)

    def _row_views(self, name: Any, layer: Any, wanted: Views) -> list[list[mx.array]]:
        """The row ranges of the fused weights segment ``name`` slices (``wanted``: their paths
        and sizes), made once while the layer holds the same weights: as the segment's inputs
        they are arrays already made, where slices inside it would be made again at every call."""
        sources = [_at(layer, path) for path, _ in wanted]
        known = self._views.get(name)
        if known is not None and same_items(sources, known[0]):
            return known[1]
        views = [row_ranges(source, sizes) for source, (_, sizes) in zip(sources, wanted)]
        self._views[name] = (sources, views)
        return views

    def _retrace(self, layer: Any) -> None:
        """Forget every form (an attribute they baked in changed) and guard the layer's
        attributes as they are now."""
        self._forms.clear()
        self._views.clear()
        self._plans.clear()
        self._guard = AttributeGuard(functools.partial(_modules_of, self.layer), [])


def _let_go(segments_ref: weakref.ReferenceType[Segments]) -> None:
    """Drop a layer's plans and row ranges, and the arrays they hold: a module item is being
    written, so the next call finds them again anyway, and the arrays replaced go now rather
    than then (``load_weights`` into a model in place peaks at one copy of its weights)."""
    segments = segments_ref()
    if segments is not None:
        segments._armed = False
        segments._plans.clear()
        segments._views.clear()


class _Plan:
    """What the calls of one segment hand its compiled form: the leaves of the layer's subtrees it
    reads (of the whole layer, ``whole``), then the fused weights' row ranges, in one flat tuple
    (MLX flattens a call's arguments at every call, hashing each dict key through Python), good while
    the layer's tree holds what it held when they were found. Asking the layer and walking its
    paths again costs a decoding call tens of microseconds of Python; instead a plan holds while
    no module item was set or removed anywhere since (:func:`~graphkern.tracing.guards.item_writes`:
    a child or a weight put in place of another, as ``load_weights`` and ``update`` put them) and
    each list on its paths (a decoder's blocks, which no hook sees) holds the same items. (An
    array changed in place is the same array object: MLX reads it at each call. An attribute
    changed is the guard's to see.) A list inside the subtrees, whose items the plan hands one
    by one, must also hold the same items, no more and no fewer."""

    __slots__ = ("form", "leaves", "whole", "_writes", "_lists", "_indices", "_items", "_inner")

    def __init__(self, form: Callable[..., Any], leaves: tuple[Any, ...], whole: bool,
                 writes: int, layer: Any, paths: Sequence[tuple[Any, ...]], inner: Sequence[list[Any]] = ()):
        self.form, self.leaves, self.whole, self._writes = form, leaves, whole, writes
        self._inner = [(items, tuple(items)) for items in inner]
        edges: dict[tuple[int, Any], tuple[list[Any], int, Any]] = {}
        for path in paths:
            node = layer
            for key in path:
                child = node[key]
                if isinstance(node, list):
                    edges.setdefault((id(node), key), (node, key, child))
                node = child
        self._lists = [edge[0] for edge in edges.values()]
        self._indices = [edge[1] for edge in edges.values()]
        self._items = [edge[2] for edge in edges.values()]

    def current(self) -> bool:
        """Whether the layer's tree still holds what the plan found in it."""
        if item_writes() != self._writes:
            return False
        if self._inner and not all(same_items(items, held) for items, held in self._inner):
            return False
        try:
            return all(map(operator.is_, map(operator.getitem, self._lists, self._indices), self._items))
        except IndexError:  # a list grew shorter
            return False


def row_ranges(weight: mx.array, sizes: Sequence[int]) -> list[mx.array]:
    """``weight``'s consecutive ranges of ``sizes`` rows (views: contiguous row ranges), as a fused
    weight holds its parts: ``gate_up_proj``'s gate and up, ``qkv_proj``'s queries, keys and values.
    Inside a segment being traced that was handed them (``segment_views``), the ranges handed.

    >>> [r.shape for r in row_ranges(mx.zeros((6, 2)), (4, 2))]
    [(4, 2), (2, 2)]
    """
    handed = state.row_views
    if handed is not None:
        found = handed.get(id(weight))
        if found is not None and found[0] == tuple(sizes):
            return list(found[1])
    ends = list(itertools.accumulate(sizes))
    return [weight[end - size:end] for size, end in zip(sizes, ends)]


def _modules_of(layer_ref: weakref.ReferenceType[Any]) -> list[Any]:
    """The modules of the layer (none once it is gone)."""
    layer = layer_ref()
    return modules_under([layer]) if layer is not None else []


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The subtree of ``tree`` (a module tree) at ``path`` (names, and indices into lists)."""
    for key in path:
        tree = tree[key]
    return tree


def _traced(layer_ref: weakref.ReferenceType[Any], name: str | tuple[Any, ...],
            paths: tuple[tuple[Any, ...], ...] | None, wanted: Views) -> Callable[..., Any]:
    method, constants = (name, ()) if isinstance(name, str) else (name[0], name[1:])

    def traced(leaves: Sequence[Any], *args: Any) -> Any:
        live = layer_ref()
        handed_leaves = iter(leaves)  # in the order _flatten took them
        held = _holding(live, handed_leaves) if paths is None else _pruned(live, paths, handed_leaves)
        handed = state.row_views
        if wanted:  # row_ranges of these fused weights answers with the views handed in
            state.row_views = {id(_at(held, path)): (sizes, [next(handed_leaves) for _ in sizes])
                               for path, sizes in wanted}
        state.segment_depth += 1  # the layers it calls run their kernels: here they fuse
        settings_changed()
        try:
            return getattr(held, method)(*constants, *args)
        finally:
            state.segment_depth -= 1
            state.row_views = handed
            settings_changed()

    return traced


def _flatten(tree: Any, leaves: list[Any], places: list[tuple[Any, ...]], at: tuple[Any, ...],
             lists: list[list[Any]]) -> None:
    """Append the leaves of ``tree`` (a module tree: modules, dicts, lists) to ``leaves`` and their
    paths from it to ``places``, depth first in item order, as :func:`_holding` takes them back;
    and each list met to ``lists``."""
    if isinstance(tree, list):
        lists.append(tree)
    for key, value in enumerate(tree) if isinstance(tree, list) else tree.items():
        if isinstance(value, (dict, list)):
            _flatten(value, leaves, places, (*at, key), lists)
        else:
            leaves.append(value)
            places.append((*at, key))


def _pruned(live: Any, paths: tuple[tuple[Any, ...], ...], leaves: Iterator[Any]) -> Any:
    """A copy of ``live`` holding only its subtrees at ``paths``, each with its arrays taken from
    ``leaves`` (as :func:`_holding`), and the modules on the way to them: a segment that reaches
    for anything else fails there (AttributeError or KeyError)."""
    root = _emptied(live)
    for path in paths:
        source, held = live, root
        for key in path[:-1]:
            source = source[key]
            child = held[key] if isinstance(held, list) else held.get(key)
            if child is None:
                child = _emptied(source)
                _put(held, key, child)
            held = child
        value = source[path[-1]]
        _put(held, path[-1], _holding(value, leaves) if isinstance(value, (dict, list)) else next(leaves))
    return root


def _emptied(module: Any) -> Any:
    """A shallow copy of ``module`` (same class and attributes) with no items; for a list, a list
    of as many Nones. Made past ``nn.Module``'s item hooks, which count the item writes of a
    model's tree (:func:`~graphkern.tracing.guards.item_writes`): a trace's copies are no model's."""
    if isinstance(module, list):
        return [None] * len(module)
    held = dict.__new__(type(module))
    if hasattr(module, "__dict__"):
        held.__dict__.update(module.__dict__)
    return held


def _put(container: Any, key: Any, value: Any) -> None:
    """``container[key] = value`` on a trace's copy, past ``nn.Module``'s item hooks."""
    if isinstance(container, list):
        container[key] = value
    else:
        dict.__setitem__(container, key, value)


def _holding(live: Any, leaves: Iterator[Any]) -> Any:
    """A copy of ``live`` (a module tree: modules, dicts, lists) with the next of ``leaves`` (the
    tracers ``mx.compile`` made of what :func:`_flatten` found in it) at each leaf's place in place
    of its own. Modules are copied shallowly (their attributes shared), the containers anew; a
    tuple is a leaf, taken whole, being immutable."""
    if isinstance(live, list):
        return [_holding(v, leaves) if isinstance(v, (dict, list)) else next(leaves) for v in live]
    held = _emptied(live)  # a module: same class and attributes, its own item dict
    for key, value in live.items():
        _put(held, key, _holding(value, leaves) if isinstance(value, (dict, list)) else next(leaves))
    return held
