"""``apply``, ``apply_in_graph`` and ``launch``: a graphkern kernel launched once; ``bind``: a launch
configuration checked once and called many times.

``apply`` mirrors ``apply_metal_kernel`` of MLX's Rust binding (raises ``KernelError``); ``apply_in_graph``
mirrors ``apply_metal_kernel_in_graph`` (returns a ``KernelResult`` with a status, never raises);
``launch`` is what layer code calls. The pieces they are made of: ``backends`` (which backend runs
a kernel), ``validation`` (what MLX does not check), ``mlx_kernels`` (MLX's kernel objects, cached)
and ``launch_paths`` (the reference, the native kernel, the compiled forms an eager call replays).

``gk.apply`` checks the launch configuration (output specs, grid, threadgroup, template, init
value) on every call: it finds a configuration it has seen by building its key, which is most of
its cost. A ``BoundLaunch`` (``bind``) holds the checked configuration, so a call checks only its
inputs, as ``jax.jit(f).lower(...).compile()`` hands back a callable that skips the dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .launching.backends import APPLY, backend_setting
from .launching.context import current_recorder, state
from .launching.launch_paths import run_eager, run_launch
from .launching.validation import Launch, validate, validated_launch
from .nodes import Kernel, KernelError, KernelResult, OutputSpec, Status, TemplateLike

__all__ = ["BoundLaunch", "apply", "apply_in_graph", "bind", "launch", "placeholders"]

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def apply(kernel: Kernel, inputs: Sequence[Any], output_specs: Sequence[OutputSpec], *,
          grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
          template: Sequence[TemplateLike] = (), init_value: float | None = None,
          backend: str | None = None) -> list[mx.array]:
    """Run ``kernel`` once, eagerly (outputs are lazy MLX arrays); raises ``KernelError``.

    Mirrors ``apply_metal_kernel`` of MLX's Rust binding and, with ``init_value``,
    ``apply_metal_kernel_with_output_initialization``.

    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> x = mx.arange(4, dtype=mx.float32)
    >>> apply(k, [x], [OutputSpec(x.shape, x.dtype)], grid=(4, 1, 1), threadgroup=(4, 1, 1))[0]
    array([0, 2, 4, 6], dtype=float32)
    """
    launch, checked = validate(kernel, inputs, output_specs, grid, threadgroup, template,
                               init_value, backend)
    if checked is inputs and state.recorder is None:  # all arrays, outside traces
        return run_eager(launch, checked)
    return run_launch(launch, checked)


def placeholders(kernel: Any, output_specs: object) -> list[mx.array]:
    """Zeros of the declared output specs (made valid where they are not), so a trace goes on."""
    specs = output_specs if isinstance(output_specs, (list, tuple)) else []
    count = len(kernel.output_names) if isinstance(kernel, Kernel) else len(specs) or 1
    outputs = []
    for i in range(count):
        spec = specs[i] if i < len(specs) else None
        shape = getattr(spec, "shape", None)
        if isinstance(spec, tuple) and len(spec) == 2:
            shape = spec[0]
        dtype = getattr(spec, "dtype", None)
        if isinstance(spec, tuple) and len(spec) == 2:
            dtype = spec[1]
        outputs.append(_placeholder(shape, dtype if isinstance(dtype, mx.Dtype) else mx.float32))
    return outputs


def _placeholder(shape: Any, dtype: mx.Dtype) -> mx.array:
    """Zeros of ``shape`` as a broadcast scalar: the declared shape, so the ops after a failed
    launch still trace (a shape cut down to fit would fail to broadcast with its neighbours), at
    the cost of one element however large it is."""
    try:
        dims = tuple(max(0, min(int(d), _INT32_MAX)) for d in shape)
    except (TypeError, ValueError, OverflowError):  # not a shape at all, or inf/nan in it
        dims = (0,)
    if math.prod(dims) * dtype.size > _INT64_MAX:  # MLX's size would wrap around
        dims = (0,)
    return mx.broadcast_to(mx.zeros((), dtype), dims)


def apply_in_graph(kernel: Kernel, inputs: Sequence[Any], output_specs: Sequence[OutputSpec], *,
                   grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                   template: Sequence[TemplateLike] = (), init_value: float | None = None,
                   backend: str | None = None) -> KernelResult:
    """Run ``kernel`` as one node of a traced graph; never raises.

    The Python mirror of ``apply_metal_kernel_in_graph`` (MLX's Rust binding): a valid launch gives its
    outputs with status OK; an invalid one gives zeros of the declared specs and a non-zero
    status, so tracing continues and the graph shows what failed and what it affects.

    Args:
        kernel: the :class:`Kernel` to launch.
        inputs: its inputs, in the order of ``kernel.input_names`` (arrays, or Python scalars).
        output_specs: each output's shape and dtype (:class:`OutputSpec`).
        grid: the launch grid, in threads, three positive ints.
        threadgroup: the threadgroup size, three positive ints.
        template: template arguments (:class:`TemplateArg`, or ``(name, value)`` pairs).
        init_value: fill the outputs with this value before the kernel runs; None: uninitialized.
        backend: ``"metal"``, ``"cuda"`` or ``"reference"``; None: graphkern's choice.

    Returns:
        A :class:`KernelResult`: ``outputs``, ``status``, ``error`` (the ``KernelError`` a failed
        launch would have raised) and ``ok``. Failures never raise: they are the status.

    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> x = mx.ones((4,))
    >>> bad = apply_in_graph(k, [x], [OutputSpec((4,), mx.float32)], grid=(0, 1, 1),
    ...                      threadgroup=(4, 1, 1))
    >>> bad.ok, bad.status.name
    (False, 'INVALID_LAUNCH')
    """
    launch: Launch | None = None
    error: KernelError | None = None
    recorder = state.recorder
    try:
        if recorder is None:  # outside a trace nothing needs the Launch: apply's fast path
            outputs = apply(kernel, inputs, output_specs, grid=grid, threadgroup=threadgroup,
                            template=template, init_value=init_value, backend=backend)
        else:
            launch, checked = validate(kernel, inputs, output_specs, grid, threadgroup, template,
                                       init_value, backend)
            outputs = run_launch(launch, checked)
    except KernelError as exc:
        error = exc
    except Exception as exc:  # never raise from inside a graph: anything else is a runtime error
        error = KernelError(APPLY, f"{type(exc).__name__}: {exc}", Status.RUNTIME_ERROR)
    if error is not None:
        outputs = placeholders(kernel, output_specs)
    record = None
    if recorder is not None:
        arrays = [a for a in inputs if isinstance(a, mx.array)] if isinstance(inputs, (list, tuple)) else []
        request = None if launch is not None else {
            "grid": grid, "threadgroup": threadgroup, "template": template, "backend": backend}
        outputs = recorder.kernel_call(launch, kernel, arrays, outputs, error, request)
        record = getattr(recorder, "last_record", None)
    status = error.status if error is not None else Status.OK
    return KernelResult(outputs, status, error, record)


def launch(kernel: Kernel, inputs: Sequence[Any], output_specs: Sequence[OutputSpec], *,
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
           template: Sequence[TemplateLike] = (), init_value: float | None = None) -> list[mx.array]:
    """Call ``kernel`` the way layer code should: inside a trace or a compiled graph it is
    ``apply_in_graph`` (failures become node statuses, tracing goes on), outside it is ``apply``
    (failures raise). Library layers use this.

    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> launch(k, [mx.ones((2,))], [OutputSpec((2,), mx.float32)], grid=(2, 1, 1),
    ...        threadgroup=(2, 1, 1))[0]
    array([2, 2], dtype=float32)
    """
    if current_recorder() is not None:
        return apply_in_graph(kernel, inputs, output_specs, grid=grid, threadgroup=threadgroup,
                              template=template, init_value=init_value).outputs
    return apply(kernel, inputs, output_specs, grid=grid, threadgroup=threadgroup,
                 template=template, init_value=init_value)


class BoundLaunch:
    """A kernel launch whose configuration was checked once (see ``bind``); call it with the
    kernel's inputs. Outside a trace a call is ``gk.apply`` (failures raise ``KernelError``);
    inside a trace or a compiled graph it is ``gk.apply_in_graph`` (failures become the node's
    status), as ``gk.launch`` does. A change of backend (``GRAPHKERN_BACKEND``, ``using_backend``)
    after binding is seen: the call then takes ``gk.apply``'s way."""

    __slots__ = ("kernel", "output_specs", "grid", "threadgroup", "template", "init_value",
                 "backend", "launch", "_setting", "_arity")

    def __init__(self, kernel: Kernel, output_specs: Sequence[OutputSpec], *,
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Sequence[TemplateLike] = (), init_value: float | None = None,
                 backend: str | None = None):
        self.launch = validated_launch(kernel, output_specs, grid, threadgroup, template,
                                       init_value, backend)  # raises KernelError
        self.kernel, self.output_specs, self.backend = kernel, list(output_specs), backend
        self.grid, self.threadgroup = grid, threadgroup
        self.template, self.init_value = list(template), init_value
        self._setting = backend or backend_setting()
        self._arity = len(kernel.input_names)

    def __call__(self, *inputs: Any) -> list[mx.array]:
        if (len(inputs) == self._arity and state.recorder is None
                and (self.backend or backend_setting()) == self._setting):
            for value in inputs:
                if value.__class__ is not mx.array:
                    break
            else:  # all arrays, outside traces, on the backend it was bound for
                return run_eager(self.launch, inputs)
        return self._general(list(inputs))

    def _general(self, inputs: list[Any]) -> list[mx.array]:
        """Scalars among the inputs, a trace, a new backend: ``gk.apply``'s or
        ``gk.apply_in_graph``'s way, with every check."""
        keywords: dict[str, Any] = dict(grid=self.grid, threadgroup=self.threadgroup,
                                        template=self.template, init_value=self.init_value,
                                        backend=self.backend)
        if current_recorder() is not None:
            return apply_in_graph(self.kernel, inputs, self.output_specs, **keywords).outputs
        return apply(self.kernel, inputs, self.output_specs, **keywords)

    def __repr__(self) -> str:
        return (f"BoundLaunch({self.kernel.name!r}, backend={self.launch.backend!r}, "
                f"grid={self.launch.grid}, threadgroup={self.launch.threadgroup})")


def bind(kernel: Kernel, output_specs: Sequence[OutputSpec], *, grid: tuple[int, int, int],
         threadgroup: tuple[int, int, int], template: Sequence[TemplateLike] = (),
         init_value: float | None = None, backend: str | None = None) -> BoundLaunch:
    """Check a launch configuration now and return it as a callable: for a kernel launched many
    times with one configuration (a layer's forward, a loop), each call then checks only its
    inputs. Raises ``KernelError`` for a bad configuration, as ``gk.apply`` would.

    >>> import mlx.core as mx, graphkern as gk
    >>> k = gk.Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> twice = gk.bind(k, [gk.OutputSpec((3,), mx.float32)], grid=(3, 1, 1),
    ...                 threadgroup=(3, 1, 1))
    >>> twice(mx.ones((3,)))[0]
    array([2, 2, 2], dtype=float32)
    """
    return BoundLaunch(kernel, output_specs, grid=grid, threadgroup=threadgroup,
                       template=template, init_value=init_value, backend=backend)
