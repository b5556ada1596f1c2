"""Traces run on a deep stack: MLX walks the captured graph recursively.

``on_deep_stack(work)`` runs ``work`` on one of a few long-lived daemon threads with a 1 GiB
stack, carrying the caller's context variables and graphkern's thread settings along.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ..launching.context import adopted, snapshot, state, work_owner

__all__ = ["on_deep_stack"]


_STACK_BYTES = 1 << 30
_MAX_TRACE_THREADS = 8
_stack_lock = threading.Lock()


class _DaemonPool:
    """Up to ``size`` daemon threads taking work from one queue, each made when no thread is idle.

    Daemon threads, unlike ``ThreadPoolExecutor``'s, which are joined at exit: a joined thread
    frees its MLX state (its compile cache, which holds Python objects once a model's
    ``mx.compile``d function ran on it, as after a failed trace) while the interpreter finalizes,
    and taking the GIL there aborts the process ("terminate called without an active
    exception"). A daemon thread waiting on the queue is simply gone at exit. Each thread reads
    graphkern's thread state, so one that ended would release its MLX streams
    (``context.release_streams``), as every thread that used graphkern does.
    """

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self.jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]]] = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def submit(self, work: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        self.jobs.put((future, work))
        with self.lock:
            if not self.idle.acquire(blocking=False) and len(self.threads) < self.size:
                thread = threading.Thread(target=self._serve, name=f"{self.name}_{len(self.threads)}",
                                          daemon=True)
                thread.start()
                self.threads.append(thread)
        return future

    def _serve(self) -> None:
        while True:
            future, work = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    work()
                    future.set_result(None)
                except BaseException as exc:  # the caller re-raises it
                    future.set_exception(exc)
            del future, work  # nothing of the finished call stays alive while waiting
            self.idle.release()


_pool: tuple[int, _DaemonPool] | None = None  # (pid that made it, pool)


def _trace_threads() -> _DaemonPool:
    """The long-lived deep-stack threads traces run on (made again in a forked child, which
    inherits the pool but not its threads)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), _DaemonPool(_MAX_TRACE_THREADS, "graphkern-trace"))
    return _pool[1]


@contextlib.contextmanager
def _ctrl_c_when_done() -> Iterator[None]:
    """Ctrl-C (SIGINT) while the block runs is raised as ``KeyboardInterrupt`` once it has ended.

    A trace's thread cannot be stopped, and an interpreter that exits while that thread is inside
    MLX dies of SIGSEGV: so the main thread, where Python raises it, waits for the trace first.
    Only where SIGINT has Python's own handler (another one is left alone).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def on_deep_stack(work: Callable[[], None]) -> None:
    """Run ``work`` on a thread with a 1 GiB stack (address space; pages are touched on use).

    MLX walks the graph recursively in ``export_function``: a chain of ~50,000 primitives
    overflows the default 8 MiB stack and kills the process. The caller's context variables and
    its thread's settings (``context.snapshot``: the backend override, ``without_vjp``, how patched
    layers run) go along; an exception is re-raised here.

    The threads are few and reused: MLX keeps state for every thread that ever ran MLX code (its
    per-thread streams, about 13 KiB) and never frees it, so a thread per trace leaked on every
    trace. A trace started on one of these threads (a trace inside a trace) runs in place: it has
    the deep stack already, and waiting for a free thread there could deadlock.
    """
    if state.deep_stack:
        work()
        return
    variables, settings, owner = contextvars.copy_context(), snapshot(), work_owner()

    def run() -> None:
        state.deep_stack, state.acting_for = True, owner
        try:
            with adopted(settings):
                variables.run(work)
        finally:
            state.deep_stack, state.acting_for = False, None

    with _ctrl_c_when_done():
        with _stack_lock:  # the pool starts its threads inside submit(): give them the big stack
            previous = threading.stack_size(_STACK_BYTES)
            try:
                future = _trace_threads().submit(run)
            finally:
                threading.stack_size(previous)
        error = future.exception()
    del future
    if error is not None:
        # no reference cycle (this frame -> error -> traceback -> this frame) keeps the failed
        # call's frames and MLX arrays alive until interpreter exit, where freeing them aborted
        # the process ("terminate called without an active exception")
        try:
            raise error
        finally:
            del error
