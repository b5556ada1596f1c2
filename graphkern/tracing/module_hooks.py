"""Module scopes: while a trace runs, calls of the modules it knows are tagged with their path.

``ModuleHooks`` wraps ``__call__`` of the module classes in use; a wrapped call on a thread that
is tracing becomes a ``module`` node (``TraceRecorder.module_call``), and a module that raises
becomes a failed node, the trace going on with zeros standing in for its output.
``watch_modules`` notes an ``nn.Module`` that ran although the trace found none to scope.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..launching.context import current_recorder
from ..nodes import KernelError, Status
from .recorder import TraceRecorder, module_class_name
from .state import Flat, flatten_outputs, unflatten_outputs

__all__ = ["ModuleHooks", "watch_modules"]


class ModuleHooks:
    """Wraps ``__call__`` of the module classes in use so calls can be tagged with their path.

    Patches are reference-counted and thread-safe; a wrapper does nothing unless the calling
    thread is tracing and the module belongs to that trace.
    """

    _lock = threading.Lock()
    _patched: dict[type, tuple[Callable[..., Any], int]] = {}

    @classmethod
    def _owner(cls, module: nn.Module) -> type | None:
        for klass in type(module).__mro__:
            if "__call__" in klass.__dict__ and klass is not object:
                return klass
        return None

    @classmethod
    def install(cls, modules: list[nn.Module]) -> list[type]:
        owners = {o for o in map(cls._owner, modules) if o is not None and o is not nn.Module}
        with cls._lock:
            for owner in owners:
                original, count = cls._patched.get(owner, (owner.__dict__["__call__"], 0))
                if count == 0:
                    owner.__call__ = _hooked(original)  # type: ignore[method-assign]
                cls._patched[owner] = (original, count + 1)
        return list(owners)

    @classmethod
    def remove(cls, owners: list[type]) -> None:
        with cls._lock:
            for owner in owners:
                original, count = cls._patched[owner]
                if count == 1:
                    owner.__call__ = original  # type: ignore[method-assign]
                    del cls._patched[owner]
                else:
                    cls._patched[owner] = (original, count - 1)


def _hooked(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        recorder = current_recorder()
        if not isinstance(recorder, TraceRecorder):
            return original(self, *args, **kwargs)
        path = recorder.path_of(self)
        if path is None or (recorder.stack and recorder.stack[-1][0] == id(self)):
            return original(self, *args, **kwargs)
        inputs = Flat.of(args, kwargs, []).arrays
        recorder.stack.append((id(self), path))
        error = None
        try:
            out = original(self, *args, **kwargs)
        except Exception as exc:  # a failing module becomes a failed node, the trace goes on
            error = KernelError(f"call module {path!r} ({module_class_name(self)})",
                                f"{type(exc).__name__}: {exc}", Status.MODULE_ERROR)
            out = _stand_in(self, inputs, args, kwargs)
        finally:
            recorder.stack.pop()
        arrays, spec = flatten_outputs(out)
        tagged = recorder.module_call(path, self, inputs, arrays, error)
        return unflatten_outputs(spec, tagged)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    return __call__


def _stand_in(module: nn.Module, inputs: list[mx.array], args: Any, kwargs: Any) -> Any:
    """Zeros standing in for a failed module's output, so the trace goes on: what the module's
    ``failed_output(*args, **kwargs)`` gives, for a module whose output is not one array shaped
    like its first input (a pair, say); else zeros like its first input."""
    make = getattr(module, "failed_output", None)
    if callable(make):
        return make(*args, **kwargs)
    return mx.zeros_like(inputs[0]) if inputs else mx.zeros(())


@contextlib.contextmanager
def watch_modules(seen: list[str], enabled: bool) -> Iterator[None]:
    """While tracing a function in which no module was found, note the class of the first
    ``nn.Module`` whose ``__call__`` runs (a profile hook on this thread, removed at once).

    Best effort, for a message: CPython refuses ``sys.setprofile`` while it is still putting a
    profile function in place on the thread (``RuntimeError``), which threads tracing at once
    have met; the watch then does nothing, or its hook stays inert until it is replaced."""
    if not enabled:
        yield
        return
    previous = sys.getprofile()
    done = False

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal done
        if done or event != "call" or frame.f_code.co_name != "__call__":
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            seen.append(type(owner).__name__)
            done = True
            with contextlib.suppress(RuntimeError):
                sys.setprofile(previous)

    try:
        sys.setprofile(hook)
    except RuntimeError:
        done = True
    try:
        yield
    finally:
        done = True
        with contextlib.suppress(RuntimeError):
            sys.setprofile(previous)
