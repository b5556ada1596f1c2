"""What tracing takes from the layers above it, handed in rather than imported.

Tracing sits below compiling, the models and ``graphkern.distributed``, and imports none of them.
Where it needs something of theirs, it declares a slot here and they fill it:

- **collectives** (:func:`use_collectives`): MLX's export cannot record ``mx.distributed``'s
  collectives, so while a trace runs something must stand in for them, and a collective node of a
  graph run again node by node must be run for real. ``graphkern.distributed.collectives`` does
  both; the package's facade (``graphkern/__init__.py``) installs it, loaded on the first trace.
  Without it, a trace runs the collectives as they are and a collective node is not run again.
- **untraceable types** (:func:`refuse_tracing`): a ``gk.compile``d function or a ``gk.wrap``ped
  model runs a compiled graph, which cannot run inside MLX's capture; their classes register
  here, with what to trace instead, as they are defined.

>>> class Runner:
...     def __call__(self, x):
...         return x
>>> refuse_tracing(Runner, "trace the function it runs instead")
>>> refusal(Runner())
'trace the function it runs instead'
>>> refusal(len) is None
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

__all__ = ["Collectives", "collectives", "refusal", "refuse_tracing", "use_collectives"]


class Collectives(Protocol):
    """Collectives as tracing needs them (``graphkern.distributed.collectives`` implements it)."""

    def standing_in(self, fn: Any, modules: Iterable[nn.Module]) -> AbstractContextManager[None]:
        """For the duration, calls of collectives on threads whose recorder has
        ``stands_in_collectives = True`` are local stand-ins, recorded as ``collective`` nodes;
        ``fn`` and ``modules`` say where the traced code binds collective functions."""
        ...

    def run_again(self, data: dict[str, Any], inputs: list[mx.array]) -> list[mx.array] | str:
        """A collective node of a trace (its node data) run again on ``inputs``: its outputs, or
        why it cannot run."""
        ...


class _NoCollectives:
    """What tracing does with no collectives installed: nothing stands in, nothing runs again."""

    def standing_in(self, fn: Any, modules: Iterable[nn.Module]) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def run_again(self, data: dict[str, Any], inputs: list[mx.array]) -> list[mx.array] | str:
        return "no collectives are installed (graphkern.tracing.extensions.use_collectives)"


_collectives: Collectives = _NoCollectives()
_untraceable: dict[type, str] = {}


def use_collectives(implementation: Collectives) -> None:
    """Install the collectives traces stand in for and graph runs run again."""
    global _collectives
    _collectives = implementation


def collectives() -> Collectives:
    """The installed collectives (see :func:`use_collectives`)."""
    return _collectives


def refuse_tracing(cls: type, why: str) -> None:
    """Instances of ``cls`` (and of its subclasses) cannot be traced; ``why`` says what to trace
    instead, in the ``KernelError`` a trace of one raises."""
    _untraceable[cls] = why


def refusal(fn: Any) -> str | None:
    """Why ``fn`` cannot be traced (see :func:`refuse_tracing`), or None."""
    for klass in type(fn).__mro__:
        why = _untraceable.get(klass)
        if why is not None:
            return why
    return None
