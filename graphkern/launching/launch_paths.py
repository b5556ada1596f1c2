"""Running a validated launch: the reference, the native kernel, and the forms an eager call replays.

A GPU launch runs inside ``mx.custom_function`` so ``mx.grad`` works through it (MLX's
``CustomKernel`` has no vjp), compiled with ``mx.compile`` so an eager call replays the recorded
primitives instead of building them again in Python. Inside inspection traces and
``without_vjp()`` it runs plain. :func:`run_eager` is the eager shortcut every launch API takes
(``apply``, a bound launch, a library layer): all inputs arrays, no trace recording.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..nodes import KernelError, Status
from . import mlx_kernels
from .autodiff import differentiable, vjp_enabled
from .context import inside_inspection_trace, state
from .mlx_kernels import status_of_mlx_error
from .validation import Launch

__all__ = ["differentiable_launch", "eager_form", "replayed", "run_eager", "run_launch", "run_native",
           "run_reference", "thread_forms"]


def run_reference(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    """Run the kernel's pure-MLX reference and hold it to the declared output specs."""
    kernel = launch.kernel
    assert kernel.reference is not None
    keywords = launch.reference_keywords
    try:
        result = kernel.reference(*inputs, **keywords) if keywords else kernel.reference(*inputs)
    except Exception as exc:  # the user's code: any failure becomes a status
        raise KernelError(f"run the reference of kernel {kernel.name!r}",
                          f"{type(exc).__name__}: {exc}", Status.REFERENCE_ERROR) from exc
    outputs = [result] if result.__class__ is mx.array else result  # exact class: cheaper than isinstance
    declared = launch.declared
    try:  # the common case, exactly what was declared
        if outputs.__class__ is list and len(outputs) == len(declared):
            if len(outputs) == 1:  # without a comprehension's frame: a third of the check's cost
                if outputs[0].shape == declared[0][0] and outputs[0].dtype == declared[0][1]:
                    return outputs
            elif [(o.shape, o.dtype) for o in outputs] == declared:
                return outputs
    except AttributeError:  # something that is not an array: the full check names it
        pass
    return _conform_reference_outputs(launch, result, outputs)


def _conform_reference_outputs(launch: Launch, result: Any, outputs: Any) -> list[mx.array]:
    kernel = launch.kernel
    operation = f"run the reference of kernel {kernel.name!r}"
    if not isinstance(outputs, (list, tuple)) or not all(isinstance(o, mx.array) for o in outputs):
        raise KernelError(operation, f"must return a list of mlx arrays, got {type(result).__name__}",
                          Status.REFERENCE_ERROR)
    if len(outputs) != len(launch.output_specs):
        raise KernelError(operation, f"returned {len(outputs)} outputs but "
                          f"{len(launch.output_specs)} were declared", Status.REFERENCE_ERROR)
    checked = []
    for name, out, spec in zip(kernel.output_names, outputs, launch.output_specs):
        if tuple(out.shape) != spec.shape:
            raise KernelError(operation, f"output {name!r} has shape {tuple(out.shape)} but "
                              f"{spec.shape} was declared", Status.REFERENCE_ERROR)
        checked.append(out if out.dtype == spec.dtype else out.astype(spec.dtype))
    return checked


def run_launch(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    """Run a validated launch on its backend; raises ``KernelError``. Differentiable: the
    reference as it is where MLX differentiates it itself (plain MLX ops, no user vjp), else
    through ``differentiable_launch``."""
    if launch.backend == "reference" and launch.kernel.vjp is None:
        return run_reference(launch, inputs)
    return differentiable_launch(launch, inputs)


def eager_form(launch: Launch) -> Callable[..., list[mx.array]] | None:
    """What an eager call of all-array inputs on this thread replays, outside traces: the
    compiled custom function (``differentiable_launch``) or, inside ``without_vjp``, the
    compiled plain launch (``replayed``); None until the first call built it."""
    if state.vjp_off == 0:
        return state.forms.get(launch)  # type: ignore[no-any-return]
    return replayed(launch)


def run_eager(launch: Launch, inputs: Sequence[mx.array]) -> list[mx.array]:
    """The eager shortcut: ``launch`` on ``inputs``, all ``mx.array``s, with no trace recording
    on this thread (the caller checked both). Replays the thread's compiled form of the launch,
    built by the first such call.

    >>> from graphkern import Kernel, OutputSpec
    >>> from graphkern.launching.validation import validated_launch
    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> launch = validated_launch(k, [OutputSpec((2,), mx.float32)], (2, 1, 1), (2, 1, 1))
    >>> run_eager(launch, [mx.ones((2,))])[0]
    array([2, 2], dtype=float32)
    """
    if launch.backend == "reference" and launch.kernel.vjp is None:  # nothing compiled to replay
        return run_reference(launch, inputs)  # type: ignore[arg-type]
    form = eager_form(launch)
    if form is not None:
        return form(*inputs)
    return run_launch(launch, list(inputs))


def replayed(launch: Launch) -> Callable[..., list[mx.array]] | None:
    """The plain launch of all-array inputs through ``mx.compile``, this thread's (see
    ``differentiable_launch`` for why one a thread), or None for the reference backend, whose
    ops ``mx.compile`` may fuse: an eager call replays the recorded kernel node, which costs less
    than MLX's own kernel call (that builds the kernel's source text anew each time)."""
    if launch.backend == "reference":
        return None
    forms = state.plain_forms
    fn = forms.get(launch)
    if fn is None:
        def plain(*arrays: mx.array) -> list[mx.array]:
            return run_native(launch, list(arrays))

        fn = mx.compile(plain)
        forms.put(launch, fn)
    return fn  # type: ignore[no-any-return]


def differentiable_launch(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    """Run ``launch`` inside ``mx.custom_function`` so ``mx.grad`` works through it: the backward
    is ``Kernel.vjp`` when given, else the vjp of the reference (MLX's CustomKernel has none).

    Inside graphkern's inspection traces and ``autodiff.without_vjp()`` the launch runs plain:
    ``mx.export_function`` cannot export a custom function with a vjp, and a trace only records.

    On a GPU backend the custom function goes through ``mx.compile`` too: an eager call replays
    the recorded kernel and custom-vjp nodes instead of running MLX's kernel call and custom
    function again in Python (most of an eager launch's cost); under a transformation
    (``mx.grad``, ``mx.compile``, ``mx.vmap``, an export) the inputs are tracers, and MLX calls the
    custom function itself, as it would without ``mx.compile``. The reference backend is left
    uncompiled, since ``mx.compile`` may fuse its ops. Each thread gets its own form, kept in its
    state (``context.state.forms``, keyed by the launch, and the scalar inputs when there are
    any): MLX keeps a compile cache per thread, and a compiled function erases its entries only
    from the cache of the thread that called it last, so one shared across threads would leave
    stale entries that a later function at the same address could be handed
    (ml-explore/mlx#3940, #4248).
    """
    native = launch.backend != "reference"
    forward = run_native if native else run_reference
    kernel = launch.kernel
    if (not vjp_enabled() or (kernel.vjp is None and kernel.reference is None)
            or inside_inspection_trace()):
        return forward(launch, inputs)
    arrays = [v for v in inputs if v.__class__ is mx.array]
    scalars = () if len(arrays) == len(inputs) else tuple(
        (i, v.__class__, v) for i, v in enumerate(inputs) if v.__class__ is not mx.array)
    key = launch if not scalars else (launch, scalars)
    forms = state.forms
    fn = forms.get(key)
    if fn is None:  # built on first use: a custom function is costly to build
        reference = functools.partial(run_reference, launch) if kernel.reference is not None else None
        fn = differentiable(functools.partial(forward, launch), inputs, reference=reference,
                            vjp=kernel.vjp, name=f"kernel {kernel.name!r}")
        fn = mx.compile(fn) if native else fn
        forms.put(key, fn)
    return fn(*arrays)  # type: ignore[no-any-return]


def thread_forms(launch: Launch) -> list[Callable[..., list[mx.array]]]:
    """This thread's compiled custom-function forms of ``launch``: one for all-array inputs, one
    per set of scalar input values (see ``differentiable_launch``)."""
    return [form for key, form in state.forms.items()
            if key is launch or (key.__class__ is tuple and key[0] is launch)]


def run_native(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    mlx_kernel = mlx_kernels.kernel_cache.get(launch.backend, launch.kernel)  # replaceable in tests
    shapes, dtypes = launch.mlx_outputs
    try:
        outputs = mlx_kernel(
            inputs=inputs,
            output_shapes=shapes,
            output_dtypes=dtypes,
            grid=launch.grid,
            threadgroup=launch.threadgroup,
            template=launch.mlx_template,
            init_value=launch.init_value,
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise KernelError(f"launch the {launch.backend} kernel {launch.kernel.name!r}", str(exc),
                          status_of_mlx_error(str(exc))) from exc
    return outputs if outputs.__class__ is list else list(outputs)  # type: ignore[no-any-return]
