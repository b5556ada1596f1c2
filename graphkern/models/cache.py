"""mlx-lm KV caches through a compiled graph: cache state in as inputs, out as outputs.

An mlx-lm cache (``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``...) is a Python object whose
attributes hold arrays (keys, values) and Python scalars (offset, step...) that the model mutates
while it runs. A compiled graph cannot mutate Python objects, so the wrapped call passes each
cache's attributes as a tree: arrays become graph inputs, scalars are static (a new offset is a new
trace); inside, a stand-in object of the same class with those attributes is what the model
updates; its attributes after the call are graph outputs, written back into the caller's cache.

A cache whose attributes are anything else (other objects, callables, caches in caches) is refused
with a ``KernelError`` before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from graphkern.errors import ModelError
from graphkern.nodes import Status

__all__ = ["CACHE_OPERATION", "cache_states", "snapshot", "stand_ins", "states_of", "write_back"]

CACHE_OPERATION = "pass an mlx-lm cache through a graphkern compiled graph"
CLASS_KEY = "__class__"
_SCALARS = (bool, int, float, str, type(None))


def _plain(value: Any) -> str | None:
    """None if ``value`` is arrays and Python scalars in lists, tuples and dicts; else what is not."""
    if isinstance(value, (mx.array, *_SCALARS)):
        return None
    if isinstance(value, (list, tuple)):
        return next((bad for bad in map(_plain, value) if bad is not None), None)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return next((bad for bad in map(_plain, value.values()) if bad is not None), None)
    return type(value).__name__


def cache_states(caches: Sequence[Any]) -> list[dict[str, Any]]:
    """Each cache's attributes as a tree (plus its class under ``"__class__"``); refuses others."""
    if not isinstance(caches, (list, tuple)):
        raise ModelError(CACHE_OPERATION, f"cache must be a list of mlx-lm cache objects (one per "
                          f"layer), got {type(caches).__name__}", Status.INVALID_INPUT)
    states = []
    for index, cache in enumerate(caches):
        if cache is None:
            raise ModelError(CACHE_OPERATION, f"cache[{index}] is None; pass a cache for every layer "
                              "(mlx_lm.models.cache.make_prompt_cache) or none at all", Status.INVALID_INPUT)
        attributes = getattr(cache, "__dict__", None)
        if attributes is None or not hasattr(cache, "update_and_fetch") and not hasattr(cache, "state"):
            raise ModelError(CACHE_OPERATION, f"cache[{index}] ({type(cache).__name__}) is not an mlx-lm "
                              "cache object", Status.INVALID_INPUT)
        for name, value in attributes.items():
            bad = _plain(value)
            if bad is not None:
                raise ModelError(
                    CACHE_OPERATION,
                    f"cache[{index}] ({type(cache).__name__}) holds {name!r} as a {bad}; graphkern passes "
                    "cache state through a compiled graph only as arrays and Python scalars. Call the "
                    "model itself (unwrapped) with this cache.", Status.INVALID_INPUT)
        states.append({**attributes, CLASS_KEY: type(cache)})
    return states


def stand_ins(states: Sequence[dict[str, Any]]) -> list[Any]:
    """Cache objects of the original classes holding ``states`` (tracer arrays, inside a trace)."""
    caches = []
    for state in states:
        cache = object.__new__(state[CLASS_KEY])
        cache.__dict__.update({k: v for k, v in state.items() if k != CLASS_KEY})
        caches.append(cache)
    return caches


def states_of(caches: Sequence[Any]) -> list[dict[str, Any]]:
    """The stand-ins' attributes after the model ran: the graph's cache outputs."""
    return [{**vars(cache), CLASS_KEY: type(cache)} for cache in caches]


def write_back(caches: Sequence[Any], states: Sequence[dict[str, Any]]) -> None:
    """Put the updated state into the caller's cache objects."""
    for cache, state in zip(caches, states):
        attributes = {k: v for k, v in state.items() if k != CLASS_KEY}
        for name in [n for n in vars(cache) if n not in attributes]:
            delattr(cache, name)
        vars(cache).update(attributes)


def snapshot(caches: Sequence[Any]) -> list[dict[str, Any]]:
    """The caches' attributes with every array in a handle of its own, for ``write_back`` to restore
    after a failed eager call: mlx-lm updates a cache's arrays in place (``keys[..., a:b, :] = k``),
    which a shared handle would see."""
    def own(value: Any) -> Any:
        return mx.array(value) if isinstance(value, mx.array) else value

    return [tree_map(own, dict(vars(cache))) for cache in caches]
