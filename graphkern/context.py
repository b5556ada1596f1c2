"""What a thread's launches depend on beyond their arguments: the trace recording them, the
backend chosen for the thread, and the key of its compiled launch forms.

Every launch reads this state, so it lives in one ``threading.local`` whose class defaults make a
read cheap.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from threading import get_ident
from typing import Any, Protocol

import mlx.core as mx

__all__ = ["Recorder", "current_recorder", "inside_inspection_trace", "recording", "state"]


class _ThreadState(threading.local):
    """This thread's trace recorder and backend override, and the key of its launches' compiled
    forms for all-array inputs (see ``launch_paths.differentiable_launch``)."""

    recorder: Any = None
    backend: str | None = None

    def __init__(self) -> None:  # runs once in each thread that reads the state
        self.array_forms_key = (get_ident(), ())


state = _ThreadState()


class Recorder(Protocol):
    """What a tracer installs to see kernel calls (see ``graphkern.trace``). A recorder with
    ``inspects = True`` is an inspection trace: launches inside it run without a custom vjp."""

    def kernel_call(self, launch: Any, kernel: Any, inputs: list[Any],
                    outputs: list[mx.array], error: Any,
                    request: dict[str, Any] | None = None) -> list[mx.array]:
        """Record one call; returns the outputs the caller continues with. ``request`` is the
        configuration asked for (grid, threadgroup, template, backend) when no launch passed."""
        ...


def current_recorder() -> Recorder | None:
    """The recorder of the trace running on this thread, if any."""
    return state.recorder  # type: ignore[no-any-return]


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Route this thread's ``apply_in_graph`` calls to ``recorder`` for the duration."""
    previous = state.recorder
    state.recorder = recorder
    try:
        yield recorder
    finally:
        state.recorder = previous


def inside_inspection_trace() -> bool:
    """Whether this thread is inside a graphkern inspection trace (``mx.export_function``)."""
    return getattr(state.recorder, "inspects", False) is True
