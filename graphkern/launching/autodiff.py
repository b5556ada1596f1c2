"""Gradients through kernels: a forward MLX cannot differentiate, with a backward it can.

MLX's ``CustomKernel`` primitive has no vjp, so ``mx.grad`` through a GPU kernel fails. ``with_vjp``
runs a kernel's forward inside ``mx.custom_function`` whose vjp is the kernel's own backward
(``Kernel.vjp``) when the user gave one, else the vjp of its pure-MLX reference. The runtime uses it
for every GPU launch (see ``launch_paths.differentiable_launch``); graphkern's inspection traces skip it,
because ``mx.export_function`` cannot export a custom function with a vjp. To export a function with
GPU kernels yourself, launch them inside ``without_vjp()``.

This module imports only ``graphkern.nodes`` and the thread's state (``graphkern.launching.context``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..nodes import KernelError, Status
from .context import state

__all__ = ["differentiable", "vjp_enabled", "with_vjp", "without_vjp"]

Forward = Callable[[list[Any]], list[mx.array]]
#: ``vjp(primals, cotangents, outputs) -> one cotangent (or None) per input``, as ``Kernel.vjp``.
Backward = Callable[[list[Any], list[mx.array], list[mx.array]], Sequence[Any]]

_VJP = "differentiate a graphkern kernel"


class without_vjp:  # noqa: N801 - used like a function, as contextlib's context managers are
    """Launch kernels plain on this thread for the duration: no custom vjp, so ``mx.export_function``
    can export them, ``mx.grad`` cannot differentiate through GPU kernels launched meanwhile, and
    an eager GPU launch is the bare ``mx.fast`` kernel call, replayed through ``mx.compile`` (no
    ``mx.custom_function`` around it): for export and for code that never differentiates, as
    ``torch.no_grad()`` is for PyTorch.

    >>> with without_vjp():
    ...     vjp_enabled()
    False
    """

    def __enter__(self) -> None:
        state.vjp_off += 1

    def __exit__(self, *exc: object) -> None:
        state.vjp_off -= 1


def vjp_enabled() -> bool:
    """False inside ``without_vjp()``."""
    return state.vjp_off == 0


def _merge(inputs: Sequence[Any], positions: list[int], arrays: Sequence[mx.array]) -> list[Any]:
    """``inputs`` with the arrays at ``positions`` replaced by ``arrays`` (scalars stay)."""
    merged = list(inputs)
    for position, array in zip(positions, arrays):
        merged[position] = array
    return merged


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _conform(grads: Sequence[Any], primals: Sequence[mx.array], name: str) -> list[mx.array]:
    """One cotangent per array primal, of its shape and dtype (None means zero)."""
    if len(grads) != len(primals):
        raise KernelError(_VJP, f"the vjp of {name} returned {len(grads)} cotangents for "
                          f"{len(primals)} array inputs", Status.REFERENCE_ERROR)
    out = []
    for grad, primal in zip(grads, primals):
        if grad is None:
            out.append(mx.zeros_like(primal))
            continue
        if not isinstance(grad, mx.array) or tuple(grad.shape) != tuple(primal.shape):
            shape = tuple(grad.shape) if isinstance(grad, mx.array) else type(grad).__name__
            raise KernelError(_VJP, f"the vjp of {name} returned a cotangent of {shape} for an "
                              f"input of shape {tuple(primal.shape)}", Status.REFERENCE_ERROR)
        out.append(grad if grad.dtype == primal.dtype else grad.astype(primal.dtype))
    return out


def with_vjp(forward: Forward, inputs: Sequence[Any], *, reference: Forward | None = None,
             vjp: Backward | None = None, name: str = "kernel") -> list[mx.array]:
    """``forward(inputs)``, differentiable: its vjp is ``vjp`` if given, else that of ``reference``.

    ``inputs`` may mix arrays and Python scalars; only arrays get cotangents. ``vjp`` receives all
    inputs (scalars included), the output cotangents and the outputs, and returns one cotangent per
    input (None for zero); its cotangents for scalar inputs are ignored.

    >>> double = lambda xs: [xs[0] * 2]          # stands in for a GPU launch
    >>> f = lambda x: with_vjp(double, [x], reference=double)[0].sum()
    >>> mx.grad(f)(mx.ones((2,))).tolist()
    [2.0, 2.0]
    >>> custom = lambda primals, cots, outs: [cots[0] * 10]
    >>> g = lambda x: with_vjp(double, [x], vjp=custom)[0].sum()
    >>> mx.grad(g)(mx.ones((2,))).tolist()
    [10.0, 10.0]
    """
    fn = differentiable(forward, inputs, reference=reference, vjp=vjp, name=name)
    return fn(*(value for value in inputs if isinstance(value, mx.array)))


def differentiable(forward: Forward, inputs: Sequence[Any], *, reference: Forward | None = None,
                   vjp: Backward | None = None, name: str = "kernel") -> Callable[..., list[mx.array]]:
    """The function ``with_vjp`` calls, built once: it takes the array inputs (in order) and keeps
    the scalar ones of ``inputs`` fixed. Building an ``mx.custom_function`` is costly in Python,
    so callers that launch the same kernel repeatedly keep the result.

    >>> scale = lambda xs: [xs[0] * xs[1]]
    >>> twice = differentiable(scale, [mx.ones(2), 2.0], reference=scale)
    >>> twice(mx.array([1.0, 3.0]))[0].tolist()
    [2.0, 6.0]
    """
    if vjp is None and reference is None:
        raise KernelError(_VJP, f"{name} has neither a vjp nor a reference to differentiate",
                          Status.BACKEND_UNAVAILABLE)
    positions = [i for i, value in enumerate(inputs) if isinstance(value, mx.array)]
    template = [None if isinstance(value, mx.array) else value for value in inputs]  # no array kept

    if len(positions) == len(template):  # arrays only: nothing to merge
        def primal(*arrays: mx.array) -> list[mx.array]:
            return forward(list(arrays))
    else:
        def primal(*arrays: mx.array) -> list[mx.array]:
            return forward(_merge(template, positions, arrays))

    fn = mx.custom_function(primal)

    @fn.vjp
    def backward(primals: Any, cotangents: Any, outputs: Any) -> Any:
        single = isinstance(primals, mx.array)  # MLX passes one primal bare, several as a tuple
        arrays = [primals] if single else list(primals)
        cots, outs = _as_list(cotangents), _as_list(outputs)
        if vjp is not None:
            grads = list(vjp(_merge(template, positions, arrays), cots, outs))
            if len(grads) == len(template) and len(positions) != len(template):
                grads = [grads[i] for i in positions]
        else:
            assert reference is not None

            # only floating outputs carry cotangents: given one for an integer output (indices),
            # mx.vjp returns zeros for every input
            carried = [i for i, c in enumerate(cots) if mx.issubdtype(c.dtype, mx.inexact)]

            def through_reference(*primal_arrays: mx.array) -> list[mx.array]:
                outputs = reference(_merge(template, positions, primal_arrays))
                return outputs if len(carried) == len(cots) else [outputs[i] for i in carried]

            if carried:
                _, grads = mx.vjp(through_reference, arrays, [cots[i] for i in carried])
            else:
                grads = [None] * len(arrays)
        conformed = _conform(grads, arrays, name)
        return conformed[0] if single else tuple(conformed)

    return fn  # type: ignore[return-value]  # MLX types the result as object; it is primal's list
