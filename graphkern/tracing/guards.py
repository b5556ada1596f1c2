"""Guards on the Python values a trace read besides its arrays, as torch.compile guards attributes.

A trace bakes in every Python value it reads: a norm's ``eps``, a head count, a module's training
mode, a scalar the function closes over, and the code of each module's class. :class:`AttributeGuard`
records them when a trace is made (the class and plain attributes of each module the trace could
read, the plain values at the places its function reaches by name) and tells, at each call, whether
one changed since: the owner then traces again. Plain values are ints, floats, bools, strings, None
and tuples of them. A module swapped for another is seen too: the modules are found again from
their roots, so a new one whose class or attributes differ is a change (one equal in both is the
same module to a trace, whose arrays come in as state).

The check must cost a host-bound decode step almost nothing, so it never walks a model: module
attributes are set through ``nn.Module.__setattr__`` (and removed through ``__delattr__``), which
count the writes (:func:`writes`, installed on the first guard); a guard compares that count with
the one it last saw, and only when it moved compares the modules' attributes with its record. The
values a function reaches by name (closure cells, globals) have no such hook: a guard reads those
few again at each call. Items set or removed (children, parameters) are counted as well
(:func:`item_writes`), for what a call found in a model's tree.

>>> import mlx.nn as nn
>>> model = nn.Sequential(nn.RMSNorm(4))
>>> guard = AttributeGuard(lambda: modules_under([model]), [])
>>> guard.changed()
False
>>> model.layers[0].eps = 0.5
>>> guard.changed()
True
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["AttributeGuard", "Place", "at_next_item_write", "item_writes", "modules_under", "plain",
           "plain_attributes", "reached_places", "same_items", "writes"]

#: A place a function reads by name: ``read(argument)`` gives what is there now.
Place = tuple[Callable[[Any], Any], Any]

_SCALARS = (bool, int, float, str)
#: graphkern's own attributes on patched layers (``_gk_offset``...), set once when built
_OWN = "_gk_"


def plain(value: Any) -> bool:
    """Whether ``value`` is a plain Python value a trace bakes in: a bool, int, float, str, None,
    or a tuple of them.

    >>> plain(1e-5), plain((2, "x", None)), plain([1]), plain((1, [2]))
    (True, True, False, False)
    """
    if value is None or isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and all(map(plain, value))


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """``module``'s plain attributes, by name: its instance attributes (``eps``, ``_training``)
    and its tuple items (``nn.Module`` keeps a tuple attribute among its items), but not
    graphkern's own ``_gk_`` ones.

    >>> sorted(plain_attributes(nn.RMSNorm(4)))
    ['_training', 'eps']
    """
    found = {k: v for k, v in vars(module).items() if not k.startswith(_OWN) and plain(v)}
    for key, value in module.items():
        if value.__class__ is not mx.array and isinstance(value, tuple) and plain(value):
            found[key] = value
    return found


def modules_under(roots: Iterable[Any]) -> list[nn.Module]:
    """Every module in the trees ``roots`` (modules, dicts, lists, tuples), each once, in an order
    that is the same for the same trees.

    >>> [type(m).__name__ for m in modules_under([nn.Sequential(nn.Linear(2, 2), nn.ReLU())])]
    ['Sequential', 'Linear', 'ReLU']
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(reversed(list(roots)))
    while stack:
        tree = stack.pop()
        if id(tree) in seen:
            continue
        seen.add(id(tree))
        if isinstance(tree, nn.Module):
            found.append(tree)
        values = list(tree.values() if isinstance(tree, dict) else tree)
        stack.extend(v for v in reversed(values) if isinstance(v, (dict, list, tuple)))
    return found


def _record(modules: Iterable[nn.Module]) -> list[tuple[type, dict[str, Any]]]:
    """Each module's class and plain attributes: what a trace of it bakes in besides arrays."""
    return [(type(module), plain_attributes(module)) for module in modules]


class _Writes:
    """Writes to modules since the hooks were installed: ``count``, attributes set to something
    other than an array or removed; ``items``, items set or removed (a child or a parameter,
    which ``nn.Module.__setattr__`` of an array or a module, ``update`` and ``load_weights`` set)."""

    count = 0
    items = 0

    def __init__(self) -> None:
        self.waiting: list[Callable[[], None]] = []  # for the next item write, each called once


_writes = _Writes()
_install_lock = threading.Lock()
_installed = False


def writes() -> int:
    """How many times a module attribute was set to something other than an array, or removed,
    since the first guard was made (0 before)."""
    return _writes.count


def item_writes() -> int:
    """How many times an item of a module (a child, a parameter) was set or removed through
    ``module[key] = value`` or ``del module[key]`` (as ``setattr``, ``update`` and ``load_weights``
    set them) since the hooks were installed (by the first guard, or the first call of this).
    What was built from a model's tree (a decoding call's inputs, a stock forward) holds while
    this count stands."""
    if not _installed:
        _install()
    return _writes.items


def same_items(found: Sequence[Any], held: Sequence[Any]) -> bool:
    """Whether ``found`` holds the very objects of ``held``, as many and in order: what a call
    found in a list of a model's tree (a decoder's blocks), which no hook sees change.

    >>> blocks = [object(), object()]
    >>> same_items(blocks, list(blocks)), same_items(blocks, blocks[:1])
    (True, False)
    """
    return len(found) == len(held) and all(map(operator.is_, found, held))


def at_next_item_write(callback: Callable[[], None]) -> None:
    """Call ``callback`` once, at the next module item write (before the item is set or removed):
    for what holds arrays found in a model's tree to let them go as soon as the tree changes,
    rather than at its next use."""
    item_writes()  # the hooks that call it
    _writes.waiting.append(callback)


def _item_written() -> None:
    _writes.items += 1
    if _writes.waiting:
        waiting, _writes.waiting = _writes.waiting, []
        for callback in waiting:
            callback()


def _install() -> None:
    """Count writes in ``nn.Module.__setattr__``, ``__delattr__``, ``__setitem__`` and
    ``__delitem__`` (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        set_attribute, delete_attribute = nn.Module.__setattr__, nn.Module.__delattr__

        def __setattr__(self: nn.Module, key: str, val: Any) -> None:
            if val.__class__ is not mx.array:  # an array is a parameter: state, not baked in
                _writes.count += 1
            set_attribute(self, key, val)

        def __delattr__(self: nn.Module, name: str) -> None:
            _writes.count += 1
            delete_attribute(self, name)

        # nn.Module defines no item methods: these are dict's, which a subclass's own (a
        # patched layer's) reaches through super()
        set_item, delete_item = nn.Module.__setitem__, nn.Module.__delitem__

        def __setitem__(self: nn.Module, key: Any, val: Any) -> None:
            _item_written()
            set_item(self, key, val)

        def __delitem__(self: nn.Module, key: Any) -> None:
            _item_written()
            delete_item(self, key)

        __setattr__.__wrapped__ = set_attribute  # type: ignore[attr-defined]
        __delattr__.__wrapped__ = delete_attribute  # type: ignore[attr-defined]
        nn.Module.__setattr__ = __setattr__  # type: ignore[method-assign]
        nn.Module.__delattr__ = __delattr__  # type: ignore[method-assign]
        nn.Module.__setitem__ = __setitem__  # type: ignore[method-assign,assignment]
        nn.Module.__delitem__ = __delitem__  # type: ignore[method-assign,assignment]
        _installed = True


def reached_places(found: Iterable[Any]) -> list[Place]:
    """The places among ``found`` (``state.Reached`` items: closure cells, globals, attributes)
    that hold a plain value, as :data:`Place` readers."""
    places: list[Place] = []
    for item in found:
        if plain(item.value):
            read = operator.attrgetter(item.key) if item.attribute else operator.itemgetter(item.key)
            places.append((read, item.holder))
    return places


class AttributeGuard:
    """The plain values a trace read: the class and attributes (see :func:`plain_attributes`) of
    each module ``find()`` gives, and what sits at ``places``, as they were when the guard was
    made. :meth:`changed` tells whether one differs now. The guard holds no module: ``find`` is
    asked again (a layer's own guard must not keep it alive)."""

    __slots__ = ("_find", "_modules", "_places", "_values", "_seen")

    def __init__(self, find: Callable[[], Iterable[nn.Module]], places: list[Place]):
        _install()
        self._seen = _writes.count  # before the record: a write racing with it is looked at later
        self._find = find
        self._modules = _record(find())
        self._places = places
        self._values = [read(argument) for read, argument in places]

    def changed(self) -> bool:
        """Whether a recorded value changed: the places read again, the modules' attributes only
        when some module attribute was written since the last look."""
        if self._places and self._places_changed():
            return True
        if _writes.count == self._seen:
            return False
        seen = _writes.count
        if _record(self._find()) != self._modules:
            return True
        self._seen = seen  # written, but to the same values or to other modules
        return False

    def _places_changed(self) -> bool:
        try:
            for (read, argument), value in zip(self._places, self._values):
                now = read(argument)
                if now is not value and now != value:
                    return True
        except Exception:  # the place is gone (a global deleted, a cell emptied)
            return True
        return False
