"""Collectives stood in while graphkern traces, the real ones everywhere else.

``mx.export_function`` cannot record MLX's collectives (``AllReduce`` and ``AllGather`` have no
exportable state) nor the ``mx.custom_function`` of ``mlx.nn.layers.distributed.sum_gradients``.
While a trace runs, :func:`standing_in` puts a thin function in front of each collective of
``mx.distributed`` (mlx-lm's sharded layers call them as ``mx.distributed.all_sum(...)``) and of
each module-level binding of ``sum_gradients`` the traced code can reach. On a thread whose
recorder asks for it (``stands_in_collectives``), a call returns a stand-in of the right shape and
dtype, computed locally and without communication, and a recording recorder tags it as one
``collective`` node, as kernel launches are tagged; on any other thread the real function runs.
The functions go back when the last trace ends, so nothing is patched outside traces and calls
outside them are never slowed.

The stand-ins are exact in a group of one (MLX's collectives are the identity there); with more
ranks each gives this rank's own contribution (``all_sum``: the local partial sum; ``all_gather``:
the local array repeated), enough for a trace and for re-running a failed call to find its kernel
without sending anything from one rank alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as _mlx_distributed

from ..launching.context import current_recorder
from ..tracing.state import reach

__all__ = ["COLLECTIVE_OPS", "REAL", "run_again", "standing_in"]

#: the collectives of ``mx.distributed`` that graphkern stands in, with their leading parameters
_PARAMETERS: dict[str, tuple[str, ...]] = {
    "all_sum": ("x",), "all_max": ("x",), "all_min": ("x",), "all_gather": ("x",),
    "sum_scatter": ("x",), "send": ("x", "dst"), "recv": ("shape", "dtype", "src"),
    "recv_like": ("x", "src"),
}
#: MLX's own functions, as they were when graphkern was imported
REAL: dict[str, Callable[..., Any]] = {name: getattr(mx.distributed, name) for name in _PARAMETERS}
_REAL_SUM_GRADIENTS = _mlx_distributed.sum_gradients
#: the ``op`` each collective gets in the graph (``recv_like`` is a ``recv``)
COLLECTIVE_OPS = {name: "recv" if name == "recv_like" else name for name in _PARAMETERS}
_REDUCE = {"all_sum": "sum", "all_max": "max", "all_min": "min", "sum_scatter": "sum",
           "sum_gradients": "sum"}


def _group(group: Any) -> Any:
    return group if group is not None else mx.distributed.init()


def _stand_in(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> mx.array:
    """The local stand-in for one collective call, recorded when the thread's recorder records."""
    params = _PARAMETERS.get(name, ("x",))
    if len(args) > len(params):
        raise TypeError(f"{name}() takes {len(params)} positional arguments but {len(args)} were given")
    bound = dict(zip(params, args))
    for key, value in kwargs.items():
        if key in bound:
            raise TypeError(f"{name}() got multiple values for argument {key!r}")
        bound[key] = value
    missing = [p for p in params if p not in bound]
    if missing:
        raise TypeError(f"{name}() missing required argument {missing[0]!r}")
    group = _group(bound.get("group"))
    size, rank = group.size(), group.rank()
    peer = bound.get("dst", bound.get("src"))
    if peer is not None:
        where = "send to" if name == "send" else "recv from"
        if size == 1:
            raise ValueError(f"[{name}] Cannot {where} a singleton group")
        if not isinstance(peer, int) or not 0 <= peer < size or peer == rank:
            raise ValueError(f"[{name}] cannot {where} rank {peer!r} in a group of {size} as rank {rank}")
    x = bound.get("x")
    if x is not None and not isinstance(x, mx.array):
        x = mx.array(x)
    inputs = [x] if x is not None and name != "recv_like" else []
    if name == "recv":
        out = mx.broadcast_to(mx.zeros((), bound["dtype"]), tuple(bound["shape"]))
    elif name == "recv_like":
        assert x is not None
        out = mx.broadcast_to(mx.zeros((), x.dtype), x.shape)
    elif size > 1 and name in ("all_gather", "sum_scatter"):
        assert x is not None
        if x.ndim == 0 or (name == "sum_scatter" and x.shape[0] % size):
            raise ValueError(f"[{name}] an array of shape {x.shape} cannot be "
                             f"{'gathered' if name == 'all_gather' else 'split'} across {size} ranks")
        rows = x.shape[0] // size
        out = mx.concatenate([x] * size) if name == "all_gather" else \
            mx.stop_gradient(x[rank * rows:(rank + 1) * rows])
    else:  # all_sum, all_max, all_min, send, sum_gradients (and any in a group of one): its own array
        assert x is not None
        out = mx.stop_gradient(x)
    recorder = current_recorder()
    record = getattr(recorder, "collective_call", None)
    if record is None:
        return out
    attrs = {"reduce": _REDUCE.get(name), "group_size": size, "rank": rank,
             "peer": peer if isinstance(peer, int) else None}
    return record(COLLECTIVE_OPS.get(name, name), attrs, inputs, [out])[0]  # type: ignore[no-any-return]


def _standing_in() -> bool:
    return getattr(current_recorder(), "stands_in_collectives", False) is True


def _collective(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _standing_in():
            return real(*args, **kwargs)
        return _stand_in(name, args, kwargs)

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = real.__doc__
    collective.__wrapped__ = real  # type: ignore[attr-defined]
    return collective


def _sum_gradients(group: Any) -> Callable[[mx.array], mx.array]:
    if not _standing_in():
        return _REAL_SUM_GRADIENTS(group)  # type: ignore[no-any-return]

    def stand_in(x: mx.array) -> mx.array:
        return _stand_in("sum_gradients", (x,), {"group": group})

    return stand_in


_sum_gradients.__wrapped__ = _REAL_SUM_GRADIENTS  # type: ignore[attr-defined]
_sum_gradients.__doc__ = _REAL_SUM_GRADIENTS.__doc__
_FRONTS = {name: _collective(name, real) for name, real in REAL.items()}


class _Fronts:
    """The functions put in front of MLX's, reference-counted across concurrent traces.

    ``mx.distributed``'s attributes while any trace runs; each globals dict binding
    ``sum_gradients`` while a trace that reaches it runs.
    """

    lock = threading.Lock()
    traces = 0
    bindings: dict[tuple[int, str], tuple[dict[str, Any], int]] = {}

    @classmethod
    def install(cls, namespaces: Iterable[dict[str, Any]]) -> list[tuple[int, str]]:
        keys = []
        with cls.lock:
            if cls.traces == 0:
                for name, front in _FRONTS.items():
                    setattr(mx.distributed, name, front)
            cls.traces += 1
            for namespace in namespaces:
                for key, value in list(namespace.items()):
                    slot = (id(namespace), key)
                    if value is not _REAL_SUM_GRADIENTS and slot not in cls.bindings:
                        continue  # (a binding another trace put in front is counted again)
                    _, count = cls.bindings.get(slot, (namespace, 0))
                    namespace[key] = _sum_gradients
                    cls.bindings[slot] = (namespace, count + 1)
                    keys.append(slot)
        return keys

    @classmethod
    def remove(cls, keys: list[tuple[int, str]]) -> None:
        with cls.lock:
            for slot in keys:
                namespace, count = cls.bindings[slot]
                if count == 1:
                    namespace[slot[1]] = _REAL_SUM_GRADIENTS
                    del cls.bindings[slot]
                else:
                    cls.bindings[slot] = (namespace, count - 1)
            cls.traces -= 1
            if cls.traces == 0:
                for name, real in REAL.items():
                    setattr(mx.distributed, name, real)


def _namespaces(fn: Any, modules: Iterable[nn.Module]) -> list[dict[str, Any]]:
    """The globals of ``fn`` and of the ``__call__`` of each module class, where a module-level
    ``from mlx.nn.layers.distributed import sum_gradients`` binds the name."""
    found: dict[int, dict[str, Any]] = {id(vars(_mlx_distributed)): vars(_mlx_distributed)}
    functions = [fn]
    for klass in {type(m) for m in modules}:
        for owner in klass.__mro__:
            call = owner.__dict__.get("__call__")
            if call is not None and owner is not object:
                functions.append(getattr(call, "__wrapped__", call))
    for func in functions:
        namespace = reach(func).namespace
        if namespace is not None:
            found.setdefault(id(namespace), namespace)
    return list(found.values())


def run_again(data: dict[str, Any], inputs: list[mx.array]) -> list[mx.array] | str:
    """A collective node of a trace run again on ``inputs`` (``gk.inspect`` runs graphs node by
    node): ``sum_gradients`` is the identity, a group-wide collective runs for real over the
    global group, so every rank must run the same graph at the same time, as it runs the model;
    the outputs, or why the node cannot run (a point-to-point one, a group other than the global
    one).

    >>> run_again({"op": "all_sum", "group_size": 1}, [mx.ones((2,))])[0].tolist()
    [1.0, 1.0]
    """
    op = data.get("op")
    if op == "sum_gradients":
        return [inputs[0]]
    if op not in REAL or op in ("send", "recv"):
        return f"a {op} is not run again (its peer would have to run it at the same time)"
    group = mx.distributed.init()
    if group.size() != data.get("group_size"):
        return (f"it ran over a group of {data.get('group_size')} ranks, not the global group of "
                f"{group.size()}")
    return [REAL[op](inputs[0], group=group)]


@contextmanager
def standing_in(fn: Any = None, modules: Iterable[nn.Module] = ()) -> Iterator[None]:
    """Put the stand-ins in front of MLX's collectives for the duration (see the module's text).

    ``fn`` and ``modules`` say where to look for bindings of ``sum_gradients``. Only threads
    whose recorder has ``stands_in_collectives = True`` get stand-ins.

    >>> with standing_in():
    ...     mx.distributed.all_sum is REAL["all_sum"]
    False
    >>> mx.distributed.all_sum is REAL["all_sum"]
    True
    """
    keys = _Fronts.install(_namespaces(fn, modules))
    try:
        yield
    finally:
        _Fronts.remove(keys)
