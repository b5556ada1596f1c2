"""``LIBRARY``: every library kernel by name, for check(), the tests and the benchmarks.

Derived, never listed by hand: each module of ``graphkern.kernels.ops`` declares its kernels
(``graphkern.kernels.declaration.declare``), and a declaration registers its entries here, with
the names ``graphkern.kernels`` exports (``EXPORTS``). Importing ``graphkern.kernels`` imports
every module of ``graphkern.kernels.ops`` (:func:`load_library`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from graphkern.kernels import ops
from graphkern.kernels.base import LibraryEntry
from graphkern.nodes import Kernel, KernelError, Status

__all__ = ["EXPORTS", "LIBRARY", "WORDS", "entries_for", "forget", "in_words", "kernel_export_name",
           "load_library", "register"]

#: Every library entry by name, in the order the modules of ``graphkern.kernels.ops`` declare them.
LIBRARY: dict[str, LibraryEntry] = {}
#: What ``graphkern.kernels`` exports of the library: each kernel (``RMS_NORM``) and layer
#: function (``rms_norm``), by name.
EXPORTS: dict[str, Any] = {}


def kernel_export_name(kernel: Kernel) -> str:
    """The name a library kernel is exported under: its name less ``gk_``, in capitals.

    >>> kernel_export_name(Kernel("gk_rms_norm", ["x"], ["out"], reference=lambda x: [x]))
    'RMS_NORM'
    """
    return kernel.name.removeprefix("gk_").upper()


def register(entry: LibraryEntry, exports: dict[str, Any]) -> None:
    """Add ``entry`` to ``LIBRARY`` and ``exports`` to ``EXPORTS``; a name already taken by
    something else is refused (KernelError)."""
    for name, value in ((entry.name, None), *exports.items()):
        taken = LIBRARY.get(name) if value is None else EXPORTS.get(name)
        if taken is not None and taken is not (value if value is not None else entry):
            raise KernelError("register a library kernel", f"the name {name!r} is taken by "
                              f"{taken!r:.80}", Status.INVALID_KERNEL)
    LIBRARY[entry.name] = entry
    EXPORTS.update(exports)


def forget(name: str) -> None:
    """Remove the entry ``name`` from ``LIBRARY``, and its layer function and kernel from
    ``EXPORTS`` when no other entry uses them (for a kernel declared by a test or a notebook)."""
    entry = LIBRARY.pop(name)
    for key, value in list(EXPORTS.items()):
        if (value is entry.fn or value is entry.kernel) and not any(
                value is e.fn or value is e.kernel for e in LIBRARY.values()):
            del EXPORTS[key]


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


def load_library() -> None:
    """Import every module of ``graphkern.kernels.ops``: their declarations fill ``LIBRARY``."""
    for info in sorted(pkgutil.iter_modules(ops.__path__), key=lambda i: i.name):
        importlib.import_module(f"{ops.__name__}.{info.name}")


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
    "norm_geglu": "an RMSNorm, an MLP's gate and up products and gelu(gate) * up",
    "quantized_norm_projections": "an RMSNorm and the quantized projections after it (q, k and v)",
    "quantized_norm_swiglu": "an RMSNorm, an MLP's quantized gate and up products and silu(gate) * up",
    "quantized_norm_geglu": "an RMSNorm, an MLP's quantized gate and up products and gelu(gate) * up",
    "quantized_norm_rope_projections":
        "an RMSNorm, the quantized q, k and v products and the RoPE of q and k",
    "quantized_matvec":
        "a quantized product of a few token rows (attention's output, the MLP's down, the logits)",
}


def in_words(name: str) -> str | None:
    """What the library kernel ``name`` computes (``"add_rms_norm"``, ``"gk_add_rms_norm"``), or
    None for a kernel that is not the library's.

    >>> in_words("gk_add_rms_norm")
    'a residual add and the RMSNorm after it'
    """
    return WORDS.get(name[3:] if name.startswith("gk_") else name)
