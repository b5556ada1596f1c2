"""Which backend a kernel runs on: detection, ``GRAPHKERN_BACKEND``, per-thread overrides, and the
names MLX gives a kernel.

``metal`` when ``mx.metal.is_available()``, ``cuda`` when ``mx.cuda.is_available()``, else
``reference`` (the kernel's pure-MLX reference); ``GRAPHKERN_BACKEND`` overrides the detection,
``using_backend`` overrides both for one thread.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ..errors import BackendError
from ..nodes import Kernel, Status
from .context import settings_changed, state
from .fastpaths import BACKEND_VARIABLE, environ_get

__all__ = [
    "BACKENDS",
    "active_backend",
    "backend_setting",
    "generated_name",
    "gpu_detected",
    "mlx_kernel_name",
    "resolve_backend",
    "using_backend",
]

BACKENDS = ("metal", "cuda", "reference")
APPLY = "apply a graphkern kernel"


@functools.cache
def _detected_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "reference"


def gpu_detected() -> bool:
    """Whether MLX has a GPU backend (Metal or CUDA) in this process: found once, since it cannot
    change while the process runs, and what a thread uses unless a backend is set for it."""
    return _detected_backend() != "reference"


def backend_setting() -> Any:
    """This thread's backend choice as launch caches key it: the ``using_backend`` override, else
    ``GRAPHKERN_BACKEND`` as the environment holds it (bytes on POSIX), or None."""
    return state.backend or environ_get(BACKEND_VARIABLE)


def _backend_variable() -> str | None:
    """``GRAPHKERN_BACKEND`` (or a thread's ``using_backend`` override) as a string, or None."""
    raw = backend_setting()
    return (raw.decode() if isinstance(raw, bytes) else raw) or None


@contextlib.contextmanager
def using_backend(backend: str | None) -> Iterator[None]:
    """Run this thread's kernels on ``backend`` for the duration (None: no change).

    >>> with using_backend("reference"):
    ...     active_backend()
    'reference'
    """
    previous = state.backend
    if backend is not None:
        if backend not in BACKENDS:
            raise BackendError("choose a graphkern backend",
                              f"{backend!r} is not one of {list(BACKENDS)}", Status.BACKEND_UNAVAILABLE)
        state.backend = backend
        settings_changed()
    try:
        yield
    finally:
        state.backend = previous
        settings_changed()


def active_backend() -> str:
    """The backend kernels run on: ``GRAPHKERN_BACKEND`` if set, else metal, cuda or reference.

    >>> active_backend() in BACKENDS
    True
    """
    forced = _backend_variable()
    if not forced:
        return _detected_backend()
    if forced not in BACKENDS:
        raise BackendError("choose a graphkern backend",
                          f"GRAPHKERN_BACKEND={forced!r} is not one of {list(BACKENDS)}",
                          Status.BACKEND_UNAVAILABLE)
    return forced


def on_gpu_backend() -> bool:
    """Whether kernels run on a GPU backend (metal or cuda) on this thread now: what
    :func:`active_backend` says, read cheaply enough for a patched layer's every call."""
    if not (state.backend or environ_get(BACKEND_VARIABLE)):
        return gpu_detected()
    return active_backend() != "reference"


def resolve_backend(kernel: Kernel, backend: str | None = None) -> str:
    """The backend ``kernel`` actually runs on: the active GPU backend if it has a source for it,
    else its reference. Raises ``KernelError(BACKEND_UNAVAILABLE)`` when it has neither."""
    wanted = backend or active_backend()
    if wanted not in BACKENDS:
        raise BackendError(APPLY, f"unknown backend {wanted!r}; use one of {list(BACKENDS)}",
                          Status.BACKEND_UNAVAILABLE)
    if kernel.has_source(wanted):
        return wanted
    if kernel.reference is not None:
        return "reference"
    raise BackendError(APPLY, f"kernel {kernel.name!r} has no {wanted} source and no reference",
                      Status.BACKEND_UNAVAILABLE)


def mlx_kernel_name(kernel: Kernel) -> str:
    """The name graphkern gives MLX: the kernel's name plus its source hash, so that two kernels
    with one name and different sources never share MLX's own per-name library cache."""
    return f"{kernel.name}_{kernel.source_hash}"


def generated_name(kernel: Kernel) -> str:
    """The prefix of the function name MLX generates for ``kernel`` (it appears in MLX's errors)."""
    return f"custom_kernel_{mlx_kernel_name(kernel)}"
