"""Every distinct Metal source the kernel library can hand MLX: entries x dtypes x shapes x options.

A library kernel's Metal text depends on its template values (chosen by the launch plan from the
shapes and options), on the dtypes, and on which inputs are small enough to be passed in
``constant`` memory. The variants here cover each entry at its own test shapes, rows of real
models, the shapes whose threadgroup rows sit at Apple GPUs' 32 KiB edge, and inputs of fewer than
8 elements (a 4-wide row's weight, one-row inputs), under every option that changes the
source: optional weights and residuals absent, frequencies given, offsets as arrays, input scales.
Plans are made with the ``metal`` backend active, as a Mac would make them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from graphkern.kernels.base import FLOAT_DTYPES, Case, Plan
from graphkern.kernels.registry import LIBRARY
from graphkern.launching.backends import using_backend
from graphkern.metal_check.source import MetalSource, metal_source
from graphkern.nodes import KernelError, dtype_name

__all__ = ["Variant", "library_variants"]

#: Shapes every entry is tried at besides its own: constant-memory rows, the 32 KiB edge, real models.
EXTRA_SHAPES: tuple[tuple[int, ...], ...] = (
    (1, 4), (2, 4), (1, 8), (3, 2),
    (1, 8192), (2, 4096), (8, 1024), (1, 16384), (4, 4096), (8, 4096),
    (8192, 4096), (16384, 8192),
)


def _no_weight(case: Case) -> Case:
    return Case((case.args[0], None, *case.args[2:]), case.kwargs)


def _without(*names: str) -> Callable[[Case], Case]:
    def drop(case: Case) -> Case:
        return Case(case.args, {k: v for k, v in case.kwargs.items() if k not in names})
    return drop


def _with(**values: Any) -> Callable[[Case], Case]:
    def add(case: Case) -> Case:
        extra = {k: (v(case) if callable(v) else v) for k, v in values.items()}
        return Case(case.args, {**case.kwargs, **extra})
    return add


def _batch_offsets(case: Case) -> mx.array:
    return mx.arange(case.args[0].shape[0], dtype=mx.int32) + 3


def _rope_freqs(case: Case) -> mx.array:
    dims = case.args[1] if isinstance(case.args[1], int) else case.args[4]
    return mx.linspace(1.0, 100.0, dims // 2)


#: Options that change an entry's Metal source, applied one at a time to its inputs.
OPTIONS: dict[str, tuple[Callable[[Case], Case], ...]] = {
    "rms_norm": (_no_weight,),
    "layer_norm": (_no_weight,),
    "norm_projections": (_without("residual"), lambda c: _no_weight(_without("residual")(c))),
    "norm_swiglu": (_without("residual"), lambda c: _no_weight(_without("residual")(c))),
    "norm_geglu": (_without("residual"), lambda c: _no_weight(_without("residual")(c))),
    "norm_geglu_approx": (_without("residual"), lambda c: _no_weight(_without("residual")(c))),
    "rope": (_with(freqs=_rope_freqs, base=None), _with(offset=_batch_offsets), _with(input_scale=0.5),
             _with(offset=mx.array(5, dtype=mx.int32)), _with(offset=3 << 20)),
    "rope_traditional": (_with(freqs=_rope_freqs, base=None), _with(offset=_batch_offsets)),
    "rope_qk": (_with(freqs=_rope_freqs, base=None), _with(offset=_batch_offsets), _with(input_scale=0.5),
                _with(traditional=True)),
    "rope_qk_norm": (_with(freqs=_rope_freqs, base=None), _with(offset=_batch_offsets),
                     _with(traditional=True)),
}


@dataclass(frozen=True)
class Variant:
    """One library launch as Metal would compile it."""

    entry: str
    dtype: mx.Dtype
    shape: tuple[int, ...]
    option: int  # 0: the entry's own inputs; i: OPTIONS[entry][i - 1]
    plan: Plan
    source: MetalSource

    def describe(self) -> str:
        option = f" option {self.option}" if self.option else ""
        return f"{self.entry} {dtype_name(self.dtype)} {'x'.join(map(str, self.shape))}{option}"


def _shapes(name: str) -> list[tuple[int, ...]]:
    entry = LIBRARY[name]
    wanted: list[tuple[int, ...]] = []
    for shape in (*entry.shapes, *EXTRA_SHAPES):
        padded = (1,) * max(0, entry.min_ndim - len(shape)) + tuple(shape)
        if padded not in wanted:
            wanted.append(padded)
    return wanted


def library_variants(entries: Sequence[str] | None = None,
                     dtypes: Sequence[mx.Dtype] = FLOAT_DTYPES) -> Iterator[Variant]:
    """Each launch the library plans for Metal, over entries, dtypes, shapes and OPTIONS.

    A shape an entry does not take (a row past what the kernel plans for, an odd RoPE width) raises
    ``KernelError`` in its plan and is skipped: MLX never sees it.
    """
    key = mx.random.key(0)
    with using_backend("metal"):
        for name in entries or list(LIBRARY):
            entry = LIBRARY[name]
            for dtype in dtypes:
                for shape in _shapes(name):
                    try:
                        base = entry.make_inputs(shape, dtype, key)
                    except (ValueError, StopIteration, ZeroDivisionError):
                        continue  # the entry cannot build inputs of this shape
                    for option, change in enumerate((lambda c: c, *OPTIONS.get(name, ()))):
                        try:
                            case = change(base)
                            plan = entry.plan(*case.args, **case.kwargs)
                        except KernelError:
                            continue
                        if plan.empty:
                            continue
                        source = metal_source(plan.kernel, plan.inputs, plan.output_specs, plan.template)
                        yield Variant(name, dtype, shape, option, plan, source)
