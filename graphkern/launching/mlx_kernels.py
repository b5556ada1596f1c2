"""MLX's kernel objects for graphkern kernels: built once per content, in a thread-safe cache.

The role of ``get_jit_module`` in MLX's CUDA backend: ``mx.fast.metal_kernel`` /
``mx.fast.cuda_kernel`` objects (or ``mx.fast.precompiled_cuda_kernel`` calls for PTX and cubins)
are built on first use and counted, and MLX's errors are mapped to status codes.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import mlx.core as mx

from ..nodes import Kernel, KernelError, Status
from .backends import mlx_kernel_name
from .context import inside_inspection_trace
from .launch_cache import track
from .source_text import for_backend

__all__ = ["KernelCache", "build_mlx_kernel", "kernel_cache", "status_of_mlx_error"]


class KernelCache:
    """A thread-safe cache of MLX kernel objects, one per (backend, name, source, header, options).

    The role of ``get_jit_module`` in MLX's CUDA backend: build once, count hits and misses. It
    holds what MLX compiled for the program's life (never evicted), and takes part in
    ``gk.cache_stats()`` and ``gk.clear_caches()`` under ``group`` (the library's own cache is
    ``"mlx kernels"``).

    >>> cache = KernelCache()
    >>> cache.stats()
    {'hits': 0, 'misses': 0, 'size': 0}
    """

    def __init__(self, group: str | None = None) -> None:
        self._lock = threading.Lock()  # held while building: each object is built once
        self._objects: dict[tuple[Any, ...], Any] = {}
        self._by_kernel: dict[tuple[str, Kernel], Any] = {}  # the same, by Kernel identity
        self.hits = self.misses = 0
        if group is not None:
            track(self, group)

    @staticmethod
    def key(backend: str, kernel: Kernel) -> tuple[Any, ...]:
        options = (kernel.input_names, kernel.output_names, kernel.ensure_row_contiguous,
                   kernel.atomic_outputs, kernel.shared_memory)
        source = kernel.source_for(backend) if backend != "cuda" or kernel.cuda else kernel.cuda_binary
        return (backend, mlx_kernel_name(kernel), source, kernel.header, options)

    def get(self, backend: str, kernel: Kernel) -> Any:
        """The MLX kernel object for ``kernel`` on ``backend``, built on first use.

        Looked up by the Kernel object first (a dict probe, without the lock), by content on its
        first sight. A hit is counted without the lock: one attribute increment, which no thread
        switch splits (see ``LaunchCache``)."""
        found = self._by_kernel.get((backend, kernel))
        if found is None:
            key = self.key(backend, kernel)
            with self._lock:
                found = self._objects.get(key)
                if found is None:
                    self.misses += 1
                    found = self._objects[key] = build_mlx_kernel(backend, kernel)
                    self._by_kernel[(backend, kernel)] = found
                    return found
                self._by_kernel[(backend, kernel)] = found
        self.hits += 1
        return found

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._objects)}

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._by_kernel.clear()
            self.hits = self.misses = 0


kernel_cache = KernelCache(group="mlx kernels")


def build_mlx_kernel(backend: str, kernel: Kernel) -> Any:
    name = mlx_kernel_name(kernel)
    try:
        if backend == "metal":
            return mx.fast.metal_kernel(
                name=name, input_names=list(kernel.input_names),
                output_names=list(kernel.output_names), source=for_backend(kernel.metal or "", backend),
                header=for_backend(kernel.header, backend),
                ensure_row_contiguous=kernel.ensure_row_contiguous,
                atomic_outputs=kernel.atomic_outputs)
        if kernel.cuda is not None:
            return mx.fast.cuda_kernel(
                name=name, input_names=list(kernel.input_names),
                output_names=list(kernel.output_names), source=for_backend(kernel.cuda, backend),
                header=for_backend(kernel.header, backend),
                ensure_row_contiguous=kernel.ensure_row_contiguous,
                shared_memory=kernel.shared_memory)
        return _PrecompiledCuda(kernel)
    except (RuntimeError, ValueError) as exc:
        raise KernelError(f"build the {backend} kernel {kernel.name!r}", str(exc),
                          status_of_mlx_error(str(exc))) from exc


class _PrecompiledCuda:
    """Calls ``mx.fast.precompiled_cuda_kernel`` with the kernel's PTX or cubin, in the same
    calling convention as the objects ``mx.fast.cuda_kernel`` returns. Template ints and bools
    become the kernel's scalar arguments, in order."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.name = kernel.name

    def __call__(self, *, inputs: list[Any], output_shapes: list[Any], output_dtypes: list[Any],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: list[tuple[str, Any]], init_value: float | None = None) -> Any:
        scalars = [value for _, value in template]
        binary = bytes(self.kernel.cuda_binary or b"")
        if inside_inspection_trace():
            binary = _recordable_binary(binary)
        return mx.fast.precompiled_cuda_kernel(
            name=self.name, compiled_source=binary, inputs=inputs,
            output_shapes=output_shapes, output_dtypes=output_dtypes, scalars=scalars, grid=grid,
            threadgroup=threadgroup, shared_memory=self.kernel.shared_memory,
            init_value=init_value, ensure_row_contiguous=self.kernel.ensure_row_contiguous)


def _recordable_binary(binary: bytes) -> bytes:
    """What an inspection trace records as a precompiled kernel's binary.

    ``mx.export_function`` hands each primitive's state to Python as ``str``, so a cubin (not
    UTF-8) makes the whole capture raise UnicodeDecodeError. Inspection traces only record, never
    run, so a cubin is recorded as a line of text naming it; PTX is text and is kept as it is.
    """
    try:
        binary.decode("utf-8")
    except UnicodeDecodeError:
        digest = hashlib.sha256(binary).hexdigest()[:16]
        return f"// graphkern: cubin, {len(binary)} bytes, sha256 {digest}".encode()
    return binary


_COMPILE_ERROR = re.compile(r"compile|nvrtc|error:|syntax", re.IGNORECASE)
_NO_BACKEND = re.compile(r"no (metal|cuda) back-?end", re.IGNORECASE)


def status_of_mlx_error(message: str) -> Status:
    """Map an MLX error message to a status code."""
    if _NO_BACKEND.search(message):
        return Status.BACKEND_UNAVAILABLE
    if _COMPILE_ERROR.search(message):
        return Status.COMPILE_ERROR
    return Status.RUNTIME_ERROR
