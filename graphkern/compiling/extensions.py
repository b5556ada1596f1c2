"""What compiled graphs take from the layers above them, handed in rather than imported.

Compiling sits below ``graphkern.debugging`` and ``graphkern.distributed`` and imports neither.
Where a compiled graph needs something of theirs, it declares a slot here and the package's facade
(``graphkern/__init__.py``) fills it, each loaded on first use:

- **the ranks** (:func:`use_rank_sync`): a function running over a group of several processes
  agrees with the other ranks before a new signature runs, and with ``timeout=`` is watched by a
  watchdog (``graphkern.distributed.sync.rank_sync``). Without it, every function runs as on one
  rank, and ``group=`` or ``timeout=`` is refused.
- **the value inspector** (:func:`use_value_inspector`): ``check_finite=True`` names the node where
  a NaN or Inf started by running the call's graph node by node (``gk.inspect``, in
  ``graphkern.debugging.values``). Without it, the error names no node.

>>> describe_call("f", [mx.zeros((2, 3)), mx.ones((4,), mx.int32)])
'f(float32[2, 3], int32[4])'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from ..nodes import KernelError, Status, dtype_name
from ..tracing.graph import Graph

if TYPE_CHECKING:
    from ..tracing.state import Flat
    from ..tracing.traceable import Traceable

__all__ = ["RankSync", "ValueInspector", "describe_call", "inspect_values", "rank_sync", "use_rank_sync",
           "use_value_inspector"]

_COMPILE = "compile a graphkern graph"


class RankSync(Protocol):
    """One compiled function's agreement and watchdog on its group of ranks."""

    #: the group the ranks run over
    group: Any
    #: the job the watchdog watches, or None without ``timeout=``
    job: Any

    def agree(self, key: Any, graph: Graph | None, error: KernelError | None, what: str) -> None:
        """Agree with the other ranks on signature ``key`` (its graph, or the error tracing it
        raised) before it runs; raises what every rank raises. ``what``: :func:`describe_call`."""
        ...

    def evaluate(self, outputs: Any, graph: Graph | None = None, call: str | None = None,
                 inputs: list[mx.array] | None = None) -> None:
        """Evaluate ``outputs`` as one watched call of ``graph``."""
        ...

    def failed(self, error: Exception) -> None:
        """This rank failed while running: the others must not wait for it."""
        ...

    def forget(self, graph: Graph) -> None:
        """The trace ``graph`` was dropped."""
        ...

    def clear(self) -> None:
        """Every trace was dropped."""
        ...


#: ``(modules, group, timeout) -> RankSync | None``: None for a function that runs on one rank.
RankSyncFactory = Callable[[Sequence[Any], Any, Any], "RankSync | None"]
#: ``(traceable, flat, backend) -> Graph``: the values graph of one call (``gk.inspect``'s).
ValueInspector = Callable[["Traceable", "Flat", "str | None"], Graph]


def _one_rank(modules: Sequence[Any], group: Any, timeout: Any) -> RankSync | None:
    if group is not None or timeout is not None:
        raise KernelError(_COMPILE, "group= and timeout= need the ranks' agreement, and none is installed "
                          "(graphkern.compiling.extensions.use_rank_sync)", Status.INVALID_INPUT)
    return None


_rank_sync: RankSyncFactory = _one_rank
_value_inspector: ValueInspector | None = None


def use_rank_sync(factory: RankSyncFactory) -> None:
    """Install what finds a compiled function's group and agrees with its other ranks."""
    global _rank_sync
    _rank_sync = factory


def rank_sync(modules: Sequence[Any], group: Any = None, timeout: Any = None) -> RankSync | None:
    """The ``RankSync`` of a function whose modules are ``modules`` (``group`` and ``timeout`` as
    ``gk.compile`` was given them), or None when it runs on one rank."""
    return _rank_sync(modules, group, timeout)


def use_value_inspector(inspector: ValueInspector) -> None:
    """Install what runs a call's graph node by node for ``check_finite``."""
    global _value_inspector
    _value_inspector = inspector


def inspect_values(traceable: Traceable, flat: Flat, backend: str | None) -> Graph | None:
    """The values graph of one call of ``traceable`` on ``flat``, or None with no inspector installed."""
    return None if _value_inspector is None else _value_inspector(traceable, flat, backend)


def describe_call(name: str, arrays: list[mx.array]) -> str:
    """``Model(int32[1, 3])``: a call as the ranks' messages and flight records name it."""
    return f"{name}({', '.join(f'{dtype_name(a.dtype)}{list(a.shape)}' for a in arrays)})"
