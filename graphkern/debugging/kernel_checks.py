"""``gk.check``: a kernel against its reference on random inputs, across dtypes and shapes.

For each library entry, dtype, shape and layout (contiguous, and strided: every float argument a
non-contiguous view), the same launch plan runs twice: on the active backend (the kernel's CUDA or
Metal source) and on the reference backend. The report gives the worst error of each case against
per-dtype tolerances; a NaN or Inf in the kernel's or the reference's outputs fails the case,
naming the output. Where no GPU backend exists the "kernel" run is the reference itself; the
report says so (backend ``reference``) instead of pretending a GPU comparison happened.

``check()`` dispatches on what it is given; kernels go to :func:`check_kernel` (models can get
their own checker beside it).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from tabulate import tabulate

from graphkern.debugging.tolerance import TOLERANCES, checked_errors
from graphkern.kernels import LIBRARY, entries_for
from graphkern.kernels.base import FLOAT_DTYPES, Case, LibraryEntry, apply_plan
from graphkern.launching.backends import resolve_backend
from graphkern.nodes import Kernel, KernelError, dtype_name

if TYPE_CHECKING:
    from graphkern.metal_check import MetalReport

__all__ = ["TOLERANCES", "CheckCase", "CheckReport", "check", "check_kernel", "check_metal_source", "strided"]

_NO_GPU_NOTE = ("backend 'reference': no GPU backend is active here, so each kernel ran its pure-MLX "
                "reference and was compared with itself; this checks launch plans, shapes and dtypes, "
                "not GPU numerics. Run on a CUDA or Metal machine for that.")


@dataclass(frozen=True)
class CheckCase:
    """One kernel run against its reference: the worst error over all outputs and elements."""

    kernel: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    backend: str
    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    passed: bool
    error: str | None = None

    @property
    def tolerance(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g}"

    def row(self) -> list[Any]:
        return [self.kernel, "x".join(map(str, self.shape)), self.dtype, self.layout, self.backend,
                self.max_abs_err, self.max_rel_err, self.tolerance,
                "yes" if self.passed else f"NO{': ' + self.error if self.error else ''}"]


@dataclass
class CheckReport:
    """The cases of one check() call; ``ok`` when all passed. ``str()`` is a table."""

    cases: list[CheckCase] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CheckCase]:
        return [c for c in self.cases if not c.passed]

    @property
    def backends(self) -> list[str]:
        return sorted({c.backend for c in self.cases})

    def __str__(self) -> str:
        headers = ["kernel", "shape", "dtype", "layout", "backend", "max abs err", "max rel err",
                   "tolerance", "passed"]
        table = tabulate([c.row() for c in self.cases], headers=headers, floatfmt=".2e")
        passed = len(self.cases) - len(self.failures)
        lines = [f"graphkern.check: {passed}/{len(self.cases)} cases passed "
                 f"(backend: {', '.join(self.backends) or 'none'})", table]
        if "reference" in self.backends:
            lines.append(_NO_GPU_NOTE)
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.ok



def strided(a: Any) -> Any:
    """A non-contiguous view of a float array with the same values (last-axis stride 2).

    >>> strided(mx.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    """
    if not isinstance(a, mx.array) or a.dtype not in FLOAT_DTYPES or a.ndim == 0:
        return a
    return mx.stack([a, mx.zeros_like(a)], axis=-1)[..., 0]


def _as_strided(case: Case) -> Case:
    return Case(tuple(strided(a) for a in case.args), dict(case.kwargs))


# ----------------------------------------------------------------------------- checking


def _fit_shape(shape: Sequence[int], entry: LibraryEntry) -> tuple[int, ...]:
    """Pad leading 1s so the shape has the entry's minimum rank (rope needs (B, *, L, D)), and round
    its last dimension up to the entry's ``last_dim_multiple``."""
    shape = tuple(int(s) for s in shape)
    if shape and entry.last_dim_multiple > 1:
        step = entry.last_dim_multiple
        shape = (*shape[:-1], max(step, -(-shape[-1] // step) * step))
    return (1,) * max(0, entry.min_ndim - len(shape)) + shape


def _run_case(entry: LibraryEntry, case: Case, backend: str, atol: float,
              rtol: float) -> tuple[float, float, bool, str | None]:
    plan = entry.plan(*case.args, **case.kwargs)
    try:
        out = apply_plan(plan, backend)
        ref = apply_plan(plan, "reference")
        mx.eval(out, ref)
    except KernelError as exc:
        first_line = (exc.description.splitlines() or [""])[0][:120]
        return float("nan"), float("nan"), False, f"{exc.status.name}: {first_line}"
    return checked_errors(out, ref, rtol=rtol, atol=atol, sides=("kernel", "reference"))


def check_kernel(kernel_or_name: Kernel | str | LibraryEntry | None = None,
                 shapes: Sequence[Sequence[int]] | None = None,
                 dtypes: Sequence[mx.Dtype] | None = None, seed: int = 0, *,
                 strided_inputs: bool = True, backend: str | None = None) -> CheckReport:
    """Check library kernels (all when None) against their references; see :func:`check`."""
    entries = list(LIBRARY.values()) if kernel_or_name is None else entries_for(kernel_or_name)
    dtypes = list(dtypes) if dtypes is not None else list(FLOAT_DTYPES)
    for dt in dtypes:
        if dt not in TOLERANCES:
            raise KernelError("check a graphkern kernel", f"unsupported dtype {dtype_name(dt)}; use "
                              "float32, float16 or bfloat16")
    layouts = ["contiguous", "strided"] if strided_inputs else ["contiguous"]
    report = CheckReport()
    for entry in entries:
        ran_on = resolve_backend(entry.kernel, backend)
        for shape in (shapes if shapes is not None else entry.shapes):
            fitted = _fit_shape(shape, entry)
            for dt in dtypes:
                atol, rtol = entry.tolerances.get(dt, TOLERANCES[dt])
                name = f"{entry.name}:{fitted}:{dtype_name(dt)}"
                key = mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32)
                base = entry.make_inputs(fitted, dt, key)
                for layout in layouts:
                    case = base if layout == "contiguous" else _as_strided(base)
                    max_abs, max_rel, passed, error = _run_case(entry, case, backend or ran_on, atol, rtol)
                    report.cases.append(CheckCase(entry.name, fitted, dtype_name(dt), layout, ran_on,
                                                  max_abs, max_rel, atol, rtol, passed, error))
    return report


def check_metal_source(target: Kernel | str | LibraryEntry | None = None,
                       dtypes: Sequence[mx.Dtype] | None = None, **launch: Any) -> MetalReport:
    """``check(target, backend="metal")`` on a machine without Metal: the front-end check of the
    Metal source MLX would compile (:mod:`graphkern.metal_check`). A library kernel (or None, the
    whole library) is checked at every launch the library plans; a kernel of your own at the launch
    given as ``inputs=``, ``output_specs=`` and ``template=``."""
    from graphkern.metal_check import check_library_metal, check_metal  # lazy: libclang, for Metal only

    if isinstance(target, Kernel) and not any(e.kernel is target for e in LIBRARY.values()):
        if "inputs" not in launch or "output_specs" not in launch:
            raise KernelError("check a Metal kernel", f"kernel {target.name!r} is not a library kernel: give "
                              "the launch to check as inputs=[...] and output_specs=[...] (and "
                              "template=[...])")
        return check_metal(target, launch["inputs"], launch["output_specs"], launch.get("template", ()))
    names = None if target is None else [e.name for e in entries_for(target)]
    return check_library_metal(names, dtypes)


def check(target: Kernel | str | LibraryEntry | None = None,
          shapes: Sequence[Sequence[int]] | None = None,
          dtypes: Sequence[mx.Dtype] | None = None, seed: int = 0,
          **options: Any) -> CheckReport | MetalReport:
    """Run kernels on the active backend and their references on random inputs; report worst errors.

    Each shape also runs with strided (non-contiguous) inputs unless ``strided_inputs=False``.
    Per-dtype tolerances: ``TOLERANCES`` (a library entry may allow more). ``backend="metal"`` on a
    machine without Metal checks the Metal sources instead: each is generated as MLX would and
    parsed by clang's front end (:func:`check_metal_source`).

    Args:
        target: a library kernel (``gk.kernels.RMS_NORM``), its name (``"rms_norm"``,
            ``"gk_gelu"``), a ``LibraryEntry``, or None for the whole library; with
            ``backend="metal"`` off a Mac also a kernel of your own, its launch given as
            ``inputs=``, ``output_specs=`` and ``template=`` in ``options``.
        shapes: shapes of the main input; None: each entry's own.
        dtypes: None: float32, float16 and bfloat16.
        seed: of the random inputs.
        **options: ``backend=`` (None: the active one) and ``strided_inputs=``.

    Returns:
        A ``CheckReport`` (``ok``, ``cases`` with each case's worst errors; ``str()`` is a table),
        or with ``backend="metal"`` off a Mac a :class:`~graphkern.metal_check.MetalReport`.

    Raises:
        KernelError: an unknown kernel name (``Status.INVALID_KERNEL``).
        TypeError: ``target`` is none of the above.

    >>> report = check("rms_norm", shapes=[(4, 64)], dtypes=[mx.float32])
    >>> report.ok, len(report.cases), report.cases[0].backend in ("reference", "cuda", "metal")
    (True, 2, True)
    """
    if options.get("backend") == "metal" and not mx.metal.is_available():
        return check_metal_source(target, dtypes, **{k: v for k, v in options.items() if k != "backend"})
    if target is None or isinstance(target, (Kernel, str, LibraryEntry)):
        return check_kernel(target, shapes, dtypes, seed, **options)
    raise TypeError(f"check() takes a library kernel or its name, got {type(target).__name__}")
