"""Every cache of launches in one place: a bounded LRU (``LaunchCache``), the registry that
``cache_stats()`` reads and ``clear_caches()`` empties, and adapters that put other caches
(``functools.lru_cache`` functions, MLX's kernel objects, compiled graphs) behind the same
two calls.

A cache is registered under a group name; several caches may share a group (one per library
layer, one per thread), and their figures are summed. Per-thread caches live in the thread's
state (``graphkern.launching.context``) and go with their thread: they are held weakly here.

>>> cache = LaunchCache("example", maxsize=2, group=None)
>>> cache.put("a", 1); cache.put("b", 2); cache.get("a")
1
>>> cache.put("c", 3)             # "b" was used least recently: evicted
>>> sorted(cache), cache.stats()
(['a', 'c'], {'hits': 1, 'misses': 0, 'size': 2})
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

__all__ = ["CacheLike", "LaunchCache", "cache_stats", "clear_caches", "memoized", "track", "track_function"]


class CacheLike(Protocol):
    """What the registry asks of a cache."""

    def stats(self) -> dict[str, int]: ...

    def clear(self) -> None: ...


_lock = threading.Lock()
#: group name -> the caches in it (held weakly: a layer's, a thread's or a graph's cache goes
#: with its owner)
_groups: dict[str, weakref.WeakSet[Any]] = {}
#: adapters of caches that live for the program (``lru_cache`` functions): held strongly
_kept: list[Any] = []


def track(cache: CacheLike, group: str) -> None:
    """Register ``cache`` (held weakly) under ``group`` for ``cache_stats`` and ``clear_caches``."""
    with _lock:
        _groups.setdefault(group, weakref.WeakSet()).add(cache)


class LaunchCache:
    """A bounded least-recently-used map with hit and miss counts (``maxsize=None``: unbounded).

    ``get`` is on every eager launch, so it is two C calls on an ``OrderedDict`` and a count.
    Safe to share between threads: each operation is one C call under the GIL, and a count is
    one attribute increment, which no thread switch splits (the interpreter switches threads
    only at calls into Python code and backward jumps).
    """

    __slots__ = ("name", "maxsize", "hits", "misses", "_data", "__weakref__")

    def __init__(self, name: str, maxsize: int | None = 4096, *, group: str | None = "") -> None:
        self.name, self.maxsize = name, maxsize
        self.hits = self.misses = 0
        self._data: OrderedDict[Any, Any] = OrderedDict()
        if group is not None:
            track(self, group or name)

    def get(self, key: Any, default: Any = None) -> Any:
        """The value under ``key`` (now the most recently used), or ``default``; counted."""
        data = self._data
        try:
            value = data[key]
        except KeyError:
            self.misses += 1
            return default
        try:  # noqa: SIM105 - contextlib.suppress costs a call on every hit
            data.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: the value is still good
            pass
        self.hits += 1
        return value

    def put(self, key: Any, value: Any) -> None:
        """Store ``value`` under ``key``, evicting the least recently used past ``maxsize``."""
        data = self._data
        data[key] = value
        data.move_to_end(key)
        if self.maxsize is not None:
            while len(data) > self.maxsize:
                try:
                    data.popitem(last=False)
                except KeyError:  # emptied by another thread
                    break

    __setitem__ = put

    def pop(self, key: Any, default: Any = None) -> Any:
        return self._data.pop(key, default)

    def oldest(self) -> Any:
        """The least recently used key (``StopIteration`` when empty)."""
        return next(iter(self._data))

    def values(self) -> list[Any]:
        return list(self._data.values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._data.items())

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._data)}

    def clear(self) -> None:
        """Forget every entry and reset the counts."""
        self._data.clear()
        self.hits = self.misses = 0

    def __repr__(self) -> str:
        return f"LaunchCache({self.name!r}, maxsize={self.maxsize}, {self.stats()})"


class _FunctionCache:
    """A ``functools.lru_cache``'d function seen as a cache."""

    def __init__(self, function: Any):
        self.function = function

    def stats(self) -> dict[str, int]:
        info = self.function.cache_info()
        return {"hits": info.hits, "misses": info.misses, "size": info.currsize}

    def clear(self) -> None:
        self.function.cache_clear()


def track_function(group: str) -> Callable[[Any], Any]:
    """Decorator: register a ``functools.lru_cache``'d function under ``group``; returns it."""
    def register(function: Any) -> Any:
        adapter = _FunctionCache(function)
        with _lock:
            _kept.append(adapter)
        track(adapter, group)
        return function

    return register


def memoized(group: str, maxsize: int | None = 1024, *,
             typed: bool = False) -> Callable[[Callable[..., T]], functools._lru_cache_wrapper[T]]:
    """Decorator: ``functools.lru_cache(maxsize, typed)`` registered under ``group``, so that
    ``cache_stats`` sees it and ``clear_caches`` empties it (the way every graphkern function
    cache is made).

    >>> @memoized("example", maxsize=8)
    ... def square(n):
    ...     return n * n
    >>> square(3), square(3), square.cache_info().hits, "example" in cache_stats()
    (9, 9, 1, True)
    """
    def wrap(function: Callable[..., T]) -> functools._lru_cache_wrapper[T]:
        cached = functools.lru_cache(maxsize=maxsize, typed=typed)(function)
        track_function(group)(cached)
        return cached

    return wrap


def _members() -> dict[str, list[Any]]:
    with _lock:
        return {group: list(caches) for group, caches in _groups.items()}


def cache_stats() -> dict[str, dict[str, int]]:
    """Hits, misses and size of every graphkern cache, by group (caches of one group summed).

    >>> import graphkern as gk
    >>> {"validated launches", "mlx kernels"} <= set(gk.cache_stats())
    True
    """
    report: dict[str, dict[str, int]] = {}
    for group, caches in sorted(_members().items()):
        total = {"hits": 0, "misses": 0, "size": 0}
        for cache in caches:
            for field, value in cache.stats().items():
                total[field] = total.get(field, 0) + value
        report[group] = total
    return report


def clear_caches() -> None:
    """Empty every graphkern cache (validated launches, compiled launch forms of every thread,
    MLX kernel objects, layers' launches, compiled graphs' traces, plan parts); the next call
    of each builds again. For tests, benchmarks of first calls, and freeing memory.

    >>> import graphkern as gk
    >>> gk.clear_caches()
    >>> gk.cache_stats()["validated launches"]["size"]
    0
    """
    for caches in _members().values():
        for cache in caches:
            cache.clear()
