"""Check, on any machine, that Metal kernels compile as MLX would hand them to Metal.

MLX builds a custom kernel's Metal text at launch time (its utils preamble, the header, a generated
signature, the body, an explicit instantiation); nothing of it is compiled until a Mac runs it.
This package writes that text exactly as MLX 0.32's ``mx.fast.metal_kernel`` does
(:mod:`graphkern.metal_check.source`) and parses it with clang's front end against declarations of
the Metal standard library (:mod:`graphkern.metal_check.frontend`), so a kernel's Metal body is
checked on Linux and in CI: syntax, types, overloads, address spaces (MLX passes inputs of fewer
than 8 elements in ``constant`` memory), implicit conversions to ``bfloat``, and threadgroup memory
against Apple GPUs' 32 KiB. It is a front-end check: code generation and the GPU itself are not
exercised.

    >>> import mlx.core as mx
    >>> from graphkern import Kernel, OutputSpec
    >>> k = Kernel("twice", ["x"], ["y"], metal="uint i = thread_position_in_grid.x; y[i] = x[i] * 2.0f;")
    >>> report = check_metal(k, [mx.zeros(16)], [OutputSpec((16,), mx.float32)])
    >>> report.ok
    True
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import mlx.core as mx
from tabulate import tabulate

from graphkern.metal_check.frontend import THREADGROUP_MEMORY_LIMIT, Diagnostic, parse_metal
from graphkern.metal_check.source import MetalSource, metal_source
from graphkern.nodes import Kernel, KernelError, OutputSpec, Status, TemplateArg

__all__ = ["THREADGROUP_MEMORY_LIMIT", "Diagnostic", "MetalCheck", "MetalReport", "MetalSource",
           "check_library_metal", "check_metal", "metal_source"]


@dataclass(frozen=True)
class MetalCheck:
    """One generated source and what the front end found in it (nothing when it compiles)."""

    kernel: str
    launch: str  # what launch made it: "float16 1x8x64", or "launch 1" for a user kernel
    name: str  # MLX's generated function name
    diagnostics: tuple[Diagnostic, ...]

    @property
    def ok(self) -> bool:
        return not self.diagnostics


@dataclass
class MetalReport:
    """The sources one check looked at; ``ok`` when every one compiles. ``str()`` is a table per
    kernel, then the first errors of each failing source, at the body's and header's own lines."""

    checks: list[MetalCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def failures(self) -> list[MetalCheck]:
        return [c for c in self.checks if not c.ok]

    def __str__(self) -> str:
        rows: dict[str, list[int]] = {}
        for c in self.checks:
            counts = rows.setdefault(c.kernel, [0, 0])
            counts[0] += 1
            counts[1] += 0 if c.ok else 1
        table = tabulate([[k, n, f, "yes" if not f else "NO"] for k, (n, f) in rows.items()],
                         headers=["kernel", "sources", "failing", "compiles"])
        lines = [table, "", f"{len(self.checks) - len(self.failures)} of {len(self.checks)} distinct Metal "
                 "sources pass the front-end check (clang, MLX's generated text; not run on an Apple GPU)"]
        for c in self.failures[:10]:
            lines.append(f"\n{c.kernel} ({c.launch}), {c.name}:")
            lines.extend(f"  {d}" for d in c.diagnostics[:5])
        return "\n".join(lines)


def check_metal(kernel: Kernel, inputs: Sequence[object], output_specs: Sequence[OutputSpec],
                template: Sequence[TemplateArg | tuple[str, object]] = ()) -> MetalReport:
    """Check ``kernel``'s Metal body for one launch: ``inputs`` (arrays or scalars; their dtypes,
    ranks and sizes decide the signature MLX writes), ``output_specs`` and ``template`` as given to
    :func:`graphkern.apply`. Errors name the body's and header's own line numbers."""
    if kernel.metal is None:
        raise KernelError("check a Metal kernel", f"kernel {kernel.name!r} has no Metal source",
                          Status.BACKEND_UNAVAILABLE)
    args = [t if isinstance(t, TemplateArg) else TemplateArg(*t) for t in template]  # type: ignore[arg-type]
    source = metal_source(kernel, inputs, output_specs, args)
    return MetalReport([MetalCheck(kernel.name, "launch", source.name, tuple(parse_metal(source)))])


def _parse_all(sources: list[MetalSource]) -> list[list[Diagnostic]]:
    return [parse_metal(s) for s in sources]


def check_library_metal(entries: Sequence[str] | None = None,
                        dtypes: Sequence[mx.Dtype] | None = None, jobs: int | None = None) -> MetalReport:
    """Check every distinct Metal source the kernel library can launch
    (:func:`graphkern.metal_check.variants.library_variants`), on ``jobs`` processes (default: the
    machine's cores)."""
    # lazy: the kernel library loads only when the library itself is checked, not for one source
    from graphkern.kernels.base import FLOAT_DTYPES
    from graphkern.metal_check.variants import library_variants

    distinct: dict[str, tuple[str, str, MetalSource]] = {}
    for v in library_variants(entries, dtypes or FLOAT_DTYPES):
        distinct.setdefault(v.source.text, (v.entry, v.describe(), v.source))
    items = list(distinct.values())
    sources = [s for _, _, s in items]
    workers = max(1, min(jobs or os.cpu_count() or 1, len(sources) // 50 or 1))
    if workers == 1:
        found = _parse_all(sources)
    else:  # libclang holds the GIL while it parses: processes, started clean (MLX does not fork)
        chunks = [sources[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_parse_all, chunks))
        found = [[] for _ in sources]
        for i, part in enumerate(parts):
            for j, diagnostics in enumerate(part):
                found[i + j * workers] = diagnostics
    return MetalReport([MetalCheck(entry, launch, source.name, tuple(d))
                        for (entry, launch, source), d in zip(items, found)])
