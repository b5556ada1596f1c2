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

__all__ = ["LIBRARY", "WORDS", "entries_for", "in_words"]

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


#: What each kernel computes, in words, by library name (the ``kernel`` of a ``gk.patch`` record,
#: a kernel node's name without its ``gk_`` prefix).
WORDS: dict[str, str] = {
    "rms_norm": "an RMSNorm",
    "layer_norm": "a LayerNorm",
    "add_rms_norm": "a residual add and the RMSNorm after it",
    "rope": "a RoPE",
    "rope_qk": "the RoPE of an attention's queries and keys, in attention's layout",
    "swiglu": "an MLP's silu(gate) * up",
    "gelu": "a GELU",
    "softmax": "a softmax",
    "moe_route": "a mixture-of-experts router's top experts and their weights",
    "norm_projections": "an RMSNorm and the projections after it (an attention's q, k and v)",
    "norm_swiglu": "an RMSNorm, an MLP's gate and up products and silu(gate) * up",
    "quantized_norm_projections": "an RMSNorm and the quantized projections after it (q, k and v)",
    "quantized_norm_swiglu": "an RMSNorm, an MLP's quantized gate and up products and silu(gate) * up",
    "quantized_norm_rope_projections":
        "an RMSNorm, the quantized q, k and v products and the RoPE of q and k",
}


def in_words(name: str) -> str | None:
    """What the library kernel ``name`` computes (``"add_rms_norm"``, ``"gk_add_rms_norm"``), or
    None for a kernel that is not the library's.

    >>> in_words("gk_add_rms_norm")
    'a residual add and the RMSNorm after it'
    """
    return WORDS.get(name[3:] if name.startswith("gk_") else name)
