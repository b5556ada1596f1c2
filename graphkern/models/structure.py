"""Whether a model's structure changed since the last look: modules swapped, parameters reshaped.

A wrapped model asks on every call, so the common answer (nothing changed, or only parameter
values, as after an optimizer step) must cost far less than walking the module tree in Python.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["StructureWatch", "structure_of"]


def structure_of(model: nn.Module) -> list[Any]:
    """What invalidates a wrapped model's traces: which modules it holds, its parameters' shapes
    and dtypes (new values of the same shape are state, not structure).

    >>> structure_of(nn.Linear(2, 3))[1:]
    [(3, 2), mlx.core.float32, (3,), mlx.core.float32]
    """
    found: list[Any] = []
    stack: list[Any] = [model]
    while stack:
        tree = stack.pop()
        if isinstance(tree, nn.Module):
            found.append(id(tree))
        for value in tree.values() if isinstance(tree, dict) else tree:
            if value.__class__ is mx.array:
                found.append(value.shape)
                found.append(value.dtype)
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return found


class StructureWatch:
    """``structure_of(model)`` as last seen, and a fast way to tell that it still holds.

    Every module, array, dict and list under the model is recorded with the container and key it
    sits at. ``changed()`` reads them all again and compares their ``id``s with C-level ``map``
    calls, without the Python walk of the module tree that ``structure_of`` makes. Arrays and
    modules are held by weak reference (replaced weights are freed at once), whose callbacks tell
    that one died, so a new object at a dead one's address is never taken for it. Where something
    was replaced, an array of the same shape and dtype is a new value (an optimizer step: checked
    at about ``structure_of``'s cost), a module is a swap, and a dict or list is compared by
    ``structure_of``.

    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> watch = StructureWatch(model)
    >>> model.layers[0].weight = mx.zeros((2, 2)); watch.changed()  # a new value
    False
    >>> model.layers[0] = nn.Linear(2, 2); watch.changed()  # a module swapped
    True
    >>> watch.changed()
    False
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._died = False  # a watched array or module was freed since the last look
        self._look()

    def _on_death(self, _: Any) -> None:
        self._died = True

    def _look(self) -> None:
        self.structure = structure_of(self.model)
        self._died = False
        self._parents: list[Any] = []
        self._keys: list[Any] = []
        self._ids: list[int] = []
        self._refs: list[Any] = []  # weak references; dicts and lists themselves (not referable)
        self._specs: list[tuple[Any, Any] | None] = []  # (shape, dtype) of the arrays
        self._containers: list[Any] = []
        stack: list[Any] = [self.model]
        while stack:
            tree = stack.pop()
            self._containers.append(tree)
            for key, value in tree.items() if isinstance(tree, dict) else enumerate(tree):
                if value.__class__ is mx.array or isinstance(value, (dict, list)):
                    self._watch(tree, key, value)
                    if value.__class__ is not mx.array:
                        stack.append(value)
        self._sizes = list(map(len, self._containers))

    def _watch(self, parent: Any, key: Any, value: Any) -> None:
        self._parents.append(parent)
        self._keys.append(key)
        self._ids.append(id(value))
        array = value.__class__ is mx.array
        self._refs.append(weakref.ref(value, self._on_death) if array or isinstance(value, nn.Module)
                          else value)
        self._specs.append((value.shape, value.dtype) if array else None)

    def changed(self) -> bool:
        """Whether the structure differs from the last look (which this call then becomes)."""
        if list(map(len, self._containers)) == self._sizes:
            try:
                now: list[Any] | None = list(map(operator.getitem, self._parents, self._keys))
            except (KeyError, IndexError):
                now = None
            if now is not None:
                if not self._died and list(map(id, now)) == self._ids:  # nothing replaced
                    return False
                verdict = self._replaced(now)
                if verdict is not None:
                    return verdict
        before = self.structure
        self._look()
        return self.structure != before

    def _replaced(self, now: list[Any]) -> bool | None:
        """Look at what was replaced: False when only arrays got new values of the same shape and
        dtype (now watched instead), True when a module was swapped, None to compare structures."""
        died, ids, refs, specs, on_death = self._died, self._ids, self._refs, self._specs, self._on_death
        for i, new in enumerate(now):
            ref = refs[i]
            # the same object: its id, and (when something died, so an address may be reused) alive
            if id(new) == ids[i] and (not died or ref is new or ref() is new):
                continue
            spec = specs[i]
            if spec is not None and new.__class__ is mx.array and (new.shape, new.dtype) == spec:
                ids[i], refs[i] = id(new), weakref.ref(new, on_death)  # a new value: watch it
            elif isinstance(new, nn.Module) or isinstance(ref, weakref.ref):
                self._look()
                return True  # a module swapped, or an array for a module or the other way round
            else:
                return None
        self._died = False
        return False
