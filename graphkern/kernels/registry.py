"""``LIBRARY``: every library kernel by name, for check(), the tests and the benchmarks."""

from __future__ import annotations

from graphkern.kernels.base import LibraryEntry
from graphkern.kernels.ops import (
    add_rms_norm,
    gelu,
    layer_norm,
    moe_route,
    projections,
    quantized_projections,
    quantized_rope_projections,
    rms_norm,
    rope,
    rope_qk,
    softmax,
    swiglu,
)
from graphkern.nodes import Kernel, KernelError, Status

__all__ = ["LIBRARY", "entries_for"]

LIBRARY: dict[str, LibraryEntry] = {
    entry.name: entry
    for entry in (
        rms_norm.ENTRY,
        layer_norm.ENTRY,
        layer_norm.ENTRY_NO_BIAS,
        add_rms_norm.ENTRY,
        rope.ENTRY,
        rope.ENTRY_TRADITIONAL,
        rope_qk.ENTRY,
        rope_qk.ENTRY_NORM,
        swiglu.ENTRY,
        softmax.ENTRY,
        gelu.ENTRY,
        gelu.ENTRY_APPROX,
        projections.ENTRY,
        projections.ENTRY_SWIGLU,
        quantized_projections.ENTRY,
        quantized_projections.ENTRY_SWIGLU,
        quantized_rope_projections.ENTRY,
        moe_route.ENTRY,
    )
}


def entries_for(kernel_or_name: Kernel | str | LibraryEntry) -> list[LibraryEntry]:
    """The library entries a kernel, an entry name or a kernel name stands for.

    >>> [e.name for e in entries_for("gk_gelu")]
    ['gelu', 'gelu_approx']
    """
    if isinstance(kernel_or_name, LibraryEntry):
        return [kernel_or_name]
    if isinstance(kernel_or_name, str):
        if kernel_or_name in LIBRARY:
            return [LIBRARY[kernel_or_name]]
        found = [e for e in LIBRARY.values() if e.kernel.name == kernel_or_name]
    elif isinstance(kernel_or_name, Kernel):
        found = [e for e in LIBRARY.values() if e.kernel is kernel_or_name]
    else:
        found = []
    if not found:
        names = ", ".join(LIBRARY)
        raise KernelError("look up a library kernel",
                          f"{kernel_or_name!r} is not in graphkern.kernels.LIBRARY (names: {names})",
                          Status.INVALID_KERNEL)
    return found
