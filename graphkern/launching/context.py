"""A thread's state: everything graphkern keeps per thread, in one place.

What a thread's launches depend on beyond their arguments (the trace recording them, the backend
chosen for the thread, whether launches carry a custom vjp, how patched layers run a prompt) and
the thread's compiled launch forms. Every launch reads this state, so it lives in one
``threading.local`` whose class defaults make a read cheap. A trace runs its capture on a thread
of its own (a deep stack: see ``trace``): :func:`snapshot` and :func:`adopted` carry the
settings there and back as one piece. (What one object keeps per thread stays with that object:
a compiled graph's call in progress, ``compiled._CallState``, goes with its graph.)

A thread's end: MLX 0.32 keeps streams per thread, and a process whose threads ended with theirs
still there could abort at exit ("terminate called without an active exception"). A thread that
read this state releases them (:func:`release_streams`) when it ends and Python drops its state;
:func:`mlx_thread` does it for a thread that ran MLX without graphkern.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from .launch_cache import LaunchCache

__all__ = ["Recorder", "Settings", "adopted", "current_recorder", "inside_inspection_trace", "mlx_thread",
           "recording", "release_streams", "settings_changed", "snapshot", "state", "work_owner"]

#: The most compiled launch forms a thread keeps (each holds an ``mx.compile``d function).
THREAD_FORMS = 1024


_CLEAR_STREAMS = "_ZN3mlx4core13clear_streamsEv"  # mlx::core::clear_streams()


@functools.lru_cache(maxsize=1)
def _clear_streams_holding_gil() -> Callable[[], Any] | None:
    """MLX's C++ ``clear_streams``, called with the GIL held (``ctypes.PyDLL``); None where the
    library or the function cannot be found.

    Besides the streams it clears the thread's compile cache, whose entries hold Python objects.
    ``mx.clear_streams`` lets the GIL go first, so the clearing thread holds the cache's lock while
    it waits for the GIL to free them, while another thread holding the GIL frees a compiled
    function last called on the clearing thread (a garbage collection) and waits for that lock: a
    deadlock, seen about once in ten runs of eight threads. With the GIL held the two take turns."""
    folder = Path(mx.__file__).parent / "lib"
    for name in ("libmlx.so", "libmlx.dylib"):
        try:
            function = ctypes.PyDLL(str(folder / name))[_CLEAR_STREAMS]
        except (OSError, AttributeError):
            continue
        function.restype, function.argtypes = None, []
        return function  # type: ignore[no-any-return]
    return None


def release_streams() -> None:
    """Wait for this thread's MLX work, then destroy its MLX streams and what it keeps with them
    (its random key, its compile cache): ``mx.clear_streams``, the last MLX call of a thread, which
    can run none after it. Nothing on the main thread, whose streams the rest of the program uses."""
    if threading.current_thread() is threading.main_thread():
        return
    try:
        mx.synchronize()
    finally:
        holding_gil = _clear_streams_holding_gil()
        if holding_gil is not None:
            holding_gil()  # the compile cache first, safely (see there)
        mx.clear_streams()  # the thread's random key (a Python object), and what is left


@contextlib.contextmanager
def mlx_thread() -> Iterator[None]:
    """Run a thread's whole body inside it (``with``, or as a decorator of the thread's target):
    its MLX streams are released at the end (:func:`release_streams`), so the process exits
    cleanly after threads that ran MLX. A thread that used graphkern does this by itself when it
    ends; this is for threads that ran only MLX, or that must not wait for Python to drop them.

    >>> import threading, mlx.core as mx
    >>> @mlx_thread()
    ... def work():
    ...     mx.eval(mx.ones((2,)) * 2)
    >>> t = threading.Thread(target=work); t.start(); t.join()
    """
    try:
        yield
    finally:
        release_streams()


class _ThreadEnd:
    """Kept in a thread's state: when the thread ends, Python drops the state on that thread, and
    this releases the thread's MLX streams (:func:`release_streams`). Only for threads Python's
    ``threading`` started: a foreign thread's state may be dropped after each call into Python,
    while the thread goes on running MLX."""

    __slots__ = ("ident",)

    def __init__(self) -> None:
        thread = threading.current_thread()
        ordinary = thread is not threading.main_thread() and not isinstance(thread, threading._DummyThread)
        self.ident = thread.ident if ordinary else None

    def __del__(self) -> None:
        if self.ident is not None and self.ident == threading.get_ident():
            with contextlib.suppress(Exception):  # nothing may raise from a thread's end
                release_streams()


class _ThreadState(threading.local):
    """This thread's settings (class defaults until set) and its compiled launch forms."""

    #: the trace recording this thread's launches (``recording``)
    recorder: Any = None
    #: the ``using_backend`` override
    backend: str | None = None
    #: ``without_vjp`` nesting depth: launches carry a custom vjp at 0
    vjp_off: int = 0
    #: patched layers run the layers they replaced (``models.prefill.stock_layers``)
    stock_layers: bool = False
    #: patched decoder stacks run their kernels at every prompt length (``kernels_only``)
    kernels_only: bool = False
    #: this thread is a trace's deep-stack thread (not a setting: never carried)
    deep_stack: bool = False
    #: on a trace's deep-stack thread, the token of the thread waiting for it, whose work this is
    #: (:func:`work_owner`; not a setting)
    acting_for: object | None = None
    #: nesting depth of compiled segments being traced on this thread (``models.segments``;
    #: not a setting: a trace runs on the thread that calls it)
    segment_depth: int = 0
    #: while a compiled segment is traced, the row ranges of fused weights it was handed, by the
    #: id of the fused weight's tracer: ``(sizes, views)`` (``models.segments``; not a setting)
    row_views: dict[int, tuple[tuple[int, ...], list[Any]]] | None = None
    #: none of ``recorder``, ``backend``, ``stock_layers``, ``segment_depth`` is set: a patched
    #: standalone layer reads this one value on every call instead of the four. Whatever sets one
    #: of them calls :func:`settings_changed` after.
    plain: bool = True

    def __init__(self) -> None:  # runs once in each thread that reads the state
        # the thread's compiled forms: MLX keeps one compile cache a thread, so a compiled
        # function must stay on the thread that first called it (see
        # ``launch_paths.differentiable_launch``). They live and die with the thread; a new
        # thread never sees a dead one's, whatever id it is given.
        self.forms = LaunchCache("thread launch forms", THREAD_FORMS)
        #: this thread as a key of per-thread entries kept elsewhere (a layer's compiled
        #: segments): alive while an entry holds it, so never handed to another thread, as a
        #: thread id is once its thread ends
        self.token = object()
        self.plain_forms = LaunchCache("thread plain launch forms", THREAD_FORMS)
        self.end = _ThreadEnd()  # releases the thread's MLX streams when it ends


state = _ThreadState()


def work_owner() -> object:
    """Whom the work running on this thread belongs to: a trace's deep-stack thread works for the
    thread waiting on it, any other thread for itself. A lock held for a piece of work
    (``tracing.state.placeholder_window``) is re-entered by that work on either thread."""
    return state.acting_for or state.token


def settings_changed() -> None:
    """Bring ``state.plain`` up to date with the settings it sums up, after one of them changed."""
    state.plain = (state.recorder is None and state.backend is None and not state.stock_layers
                   and not state.segment_depth)


#: The settings a snapshot carries (what a launch or a patched layer reads).
_SETTINGS = ("recorder", "backend", "vjp_off", "stock_layers", "kernels_only")
Settings = tuple[Any, ...]


def snapshot() -> Settings:
    """This thread's settings, to carry to another thread with :func:`adopted`.

    >>> from graphkern.launching.backends import using_backend
    >>> with using_backend("reference"):
    ...     settings = snapshot()
    >>> import threading; seen = []
    >>> def work():
    ...     with adopted(settings):
    ...         seen.append(state.backend)
    >>> t = threading.Thread(target=work); t.start(); t.join(); seen
    ['reference']
    """
    return tuple(getattr(state, name) for name in _SETTINGS)


@contextlib.contextmanager
def adopted(settings: Settings) -> Iterator[None]:
    """This thread runs with ``settings`` (a :func:`snapshot`) for the duration, then gets its
    own back."""
    previous = snapshot()
    for name, value in zip(_SETTINGS, settings):
        setattr(state, name, value)
    settings_changed()
    try:
        yield
    finally:
        for name, value in zip(_SETTINGS, previous):
            setattr(state, name, value)
        settings_changed()


class Recorder(Protocol):
    """What a tracer installs to see kernel calls (see ``graphkern.tracing.recorder``). A recorder with
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
    settings_changed()
    try:
        yield recorder
    finally:
        state.recorder = previous
        settings_changed()


def inside_inspection_trace() -> bool:
    """Whether this thread is inside a graphkern inspection trace (``mx.export_function``)."""
    return getattr(state.recorder, "inspects", False) is True
