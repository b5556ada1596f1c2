"""Launch validation: what MLX does not check before it launches a kernel.

A zero threadgroup divides by zero in MLX's CUDA backend, a negative output shape allocates
garbage, a template value of the wrong kind fails deep inside NVRTC. ``validate`` checks a launch
(configuration and inputs) and returns a :class:`Launch`; configurations that passed once are
remembered by their exact types, so a launch seen before costs a dictionary lookup.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..nodes import Kernel, KernelError, OutputSpec, Status, TemplateArg
from .backends import APPLY, backend_setting, resolve_backend
from .launch_cache import LaunchCache, memoized

__all__ = ["MAX_THREADS_PER_GROUP", "Launch", "check_inputs", "launch_key", "validate", "validated_launch"]

MAX_THREADS_PER_GROUP = 1024
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_CUDA_MAX_BLOCKS_YZ = 65535
_CUDA_MAX_BLOCK_Z = 64


@dataclass(frozen=True, eq=False)
class Launch:
    """A validated launch: everything needed to run a kernel once, and to describe it on a node.

    Besides the configuration it holds what is derived from it once (MLX's call arguments, the
    reference's keyword arguments). Compared and hashed by identity: it keys each thread's
    compiled forms (``context.state.forms``), looked up on every eager launch.
    """

    kernel: Kernel
    backend: str
    output_specs: tuple[OutputSpec, ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: tuple[TemplateArg, ...]
    init_value: float | None

    @functools.cached_property
    def reference_keywords(self) -> dict[str, Any]:
        """The template values the kernel's reference accepts as keyword arguments."""
        if self.kernel.reference is None:
            return {}
        named, takes_any = _reference_keywords(self.kernel.reference)
        return {a.name: a.value for a in self.template if takes_any or a.name in named}

    @functools.cached_property
    def declared(self) -> list[tuple[tuple[int, ...], mx.Dtype]]:
        """``(shape, dtype)`` of each output, for comparing what a reference returned."""
        return [(spec.shape, spec.dtype) for spec in self.output_specs]

    @functools.cached_property
    def mlx_template(self) -> list[tuple[str, Any]]:
        return [a.as_mlx() for a in self.template]

    @functools.cached_property
    def mlx_outputs(self) -> tuple[list[tuple[int, ...]], list[mx.Dtype]]:
        """``output_shapes`` and ``output_dtypes`` as MLX's kernel call takes them."""
        return [s.shape for s in self.output_specs], [s.dtype for s in self.output_specs]


def _fail(status: Status, description: str) -> KernelError:
    return KernelError(APPLY, description, status)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_dims(value: object, what: str) -> tuple[int, int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise _fail(Status.INVALID_LAUNCH, f"{what} must be a tuple of 3 ints, got {value!r}")
    if not all(_is_int(v) for v in value):
        raise _fail(Status.INVALID_LAUNCH, f"{what} entries must be ints, got {value!r}")
    if any(v <= 0 for v in value):
        raise _fail(Status.INVALID_LAUNCH, f"{what} entries must be positive, got {tuple(value)}")
    if any(v > _INT32_MAX for v in value):
        raise _fail(Status.INVALID_LAUNCH, f"{what} entries must fit in int32, got {tuple(value)}")
    return (value[0], value[1], value[2])


def _check_launch_dims(grid: object, threadgroup: object, backend: str) -> tuple[Any, Any]:
    g = _check_dims(grid, "grid")
    t = _check_dims(threadgroup, "threadgroup")
    threads = t[0] * t[1] * t[2]
    if threads > MAX_THREADS_PER_GROUP:
        raise _fail(Status.INVALID_LAUNCH,
                    f"threadgroup {t} has {threads} threads; the limit is {MAX_THREADS_PER_GROUP}")
    if backend == "cuda":
        if t[2] > _CUDA_MAX_BLOCK_Z:
            raise _fail(Status.INVALID_LAUNCH,
                        f"threadgroup z is {t[2]}; CUDA allows at most {_CUDA_MAX_BLOCK_Z}")
        blocks = [math.ceil(gi / ti) for gi, ti in zip(g, t)]
        if blocks[1] > _CUDA_MAX_BLOCKS_YZ or blocks[2] > _CUDA_MAX_BLOCKS_YZ:
            raise _fail(Status.INVALID_LAUNCH,
                        f"grid {g} over threadgroup {t} needs {tuple(blocks)} blocks; CUDA allows "
                        f"at most {_CUDA_MAX_BLOCKS_YZ} in y and z")
    return g, t


def _check_output_specs(kernel: Kernel, specs: object) -> tuple[OutputSpec, ...]:
    if not isinstance(specs, (list, tuple)):
        raise _fail(Status.INVALID_OUTPUT_SPEC,
                    f"output specs must be a list of OutputSpec, got {type(specs).__name__}")
    if len(specs) != len(kernel.output_names):
        raise _fail(Status.INVALID_OUTPUT_SPEC,
                    f"kernel {kernel.name!r} has {len(kernel.output_names)} outputs "
                    f"{list(kernel.output_names)} but {len(specs)} output specs were given")
    checked = []
    for name, spec in zip(kernel.output_names, specs):
        if isinstance(spec, tuple) and len(spec) == 2 and not isinstance(spec, OutputSpec):
            spec = OutputSpec(*spec)
        if not isinstance(spec, OutputSpec):
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: expected OutputSpec(shape, dtype), got {spec!r}")
        shape = spec.shape
        if not isinstance(shape, tuple) or not all(_is_int(d) for d in shape):
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: shape must be a tuple of ints, got {shape!r}")
        if any(d < 0 for d in shape):
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: shape {shape} has a negative dimension")
        if any(d > _INT32_MAX for d in shape):
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: shape {shape} has a dimension over int32")
        if not isinstance(spec.dtype, mx.Dtype):
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: dtype must be an mlx dtype, got {spec.dtype!r}")
        nbytes = math.prod(shape) * spec.dtype.size
        if nbytes > _INT64_MAX:  # MLX would wrap the size around and allocate too little
            raise _fail(Status.INVALID_OUTPUT_SPEC,
                        f"output {name!r}: shape {shape} needs {nbytes} bytes, which overflows "
                        f"MLX's 64-bit array sizes")
        checked.append(spec)
    return tuple(checked)


def check_inputs(kernel: Kernel, inputs: object) -> list[Any]:
    if inputs.__class__ is list and len(inputs) == len(kernel.input_names):  # type: ignore[arg-type]
        for value in inputs:  # type: ignore[attr-defined]
            if value.__class__ is not mx.array:
                break
        else:  # the common case: a list of arrays
            return inputs  # type: ignore[return-value]
    if not isinstance(inputs, (list, tuple)):
        raise _fail(Status.INVALID_INPUT, f"inputs must be a list, got {type(inputs).__name__}")
    if len(inputs) != len(kernel.input_names):
        raise _fail(Status.INVALID_INPUT,
                    f"kernel {kernel.name!r} takes {len(kernel.input_names)} inputs "
                    f"{list(kernel.input_names)} but {len(inputs)} were given")
    for name, value in zip(kernel.input_names, inputs):
        if value.__class__ is mx.array:
            continue
        if not isinstance(value, (mx.array, bool, int, float)):
            raise _fail(Status.INVALID_INPUT,
                        f"input {name!r} must be an mlx array or a Python scalar, "
                        f"got {type(value).__name__}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise _fail(Status.INVALID_INPUT, f"input {name!r} = {value} does not fit in int64")
    return list(inputs)


def _check_template(template: object) -> tuple[TemplateArg, ...]:
    if template is None:
        return ()
    if not isinstance(template, (list, tuple)):
        raise _fail(Status.INVALID_TEMPLATE,
                    f"template must be a list of TemplateArg or (name, value), got {template!r}")
    args: list[TemplateArg] = []
    for item in template:
        if isinstance(item, tuple) and len(item) == 2:
            item = TemplateArg(*item)
        if not isinstance(item, TemplateArg):
            raise _fail(Status.INVALID_TEMPLATE,
                        f"template entries must be TemplateArg or (name, value), got {item!r}")
        if not isinstance(item.name, str) or not (item.name.isascii() and item.name.isidentifier()) \
                or keyword.iskeyword(item.name):
            raise _fail(Status.INVALID_TEMPLATE,
                        f"template name {item.name!r} is not a valid identifier")
        if item.kind == "invalid":
            raise _fail(Status.INVALID_TEMPLATE,
                        f"template {item.name!r}: value must be an mlx dtype, int or bool, "
                        f"got {type(item.value).__name__}")
        if isinstance(item.value, int) and not -(2**31) <= item.value <= _INT32_MAX:
            raise _fail(Status.INVALID_TEMPLATE,
                        f"template {item.name!r}: value {item.value} does not fit in int32")
        args.append(item)
    names = [a.name for a in args]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise _fail(Status.INVALID_TEMPLATE, f"template names must be used once, repeated: {repeated}")
    return tuple(args)


def _check_init_value(init_value: object) -> float | None:
    if init_value is None:
        return None
    if isinstance(init_value, bool) or not isinstance(init_value, (int, float)):
        raise _fail(Status.INVALID_OUTPUT_SPEC,
                    f"init_value must be a float or None, got {type(init_value).__name__}")
    try:
        return float(init_value)
    except OverflowError:
        raise _fail(Status.INVALID_OUTPUT_SPEC,
                    f"init_value {init_value} is too large for a float") from None


#: Launch configurations checked before, by ``launch_key``.
VALIDATED = LaunchCache("validated launches", 4096)


def launch_key(kernel: Kernel, output_specs: Any, grid: Any, threadgroup: Any, template: Any,
                init_value: Any, backend: str | None) -> tuple[Any, ...] | None:
    """A key under which a validated launch can be reused, or None (or an unhashable key) when the
    arguments are not of the plain exact types: ints, not floats or bools that compare equal to
    them. Runs on every launch, so it only reads keys ``OutputSpec`` and ``TemplateArg`` made
    when they were created; anything unusual raises and takes the full check."""
    g0, g1, g2 = grid
    t0, t1, t2 = threadgroup
    if (g0.__class__ is not int or g1.__class__ is not int or g2.__class__ is not int
            or t0.__class__ is not int or t1.__class__ is not int or t2.__class__ is not int
            or grid.__class__ is not tuple or threadgroup.__class__ is not tuple
            or (output_specs.__class__ is not list and output_specs.__class__ is not tuple)):
        return None
    if len(output_specs) == 1:  # the common case, without a list comprehension's frame
        specs: tuple[Any, ...] = (output_specs[0].launch_key,)
    else:
        specs = tuple([spec.launch_key for spec in output_specs])
    return (kernel, backend or backend_setting(), grid, threadgroup,
            _template_key(template) if template else (), specs, init_value, init_value.__class__)


def _template_key(template: Any) -> tuple[Any, ...] | list[Any]:
    """The launch key of a template (an unhashable list when it is not a list of plain arguments)."""
    if template.__class__ is not list and template.__class__ is not tuple:
        return []
    keys = []
    for arg in template:
        if arg.__class__ is TemplateArg:
            keys.append(arg.launch_key)
        elif arg.__class__ is tuple and len(arg) == 2:
            keys.append((arg[0], arg[1], arg[1].__class__))
        else:
            return []
    return tuple(keys)


def validate(kernel: Kernel, inputs: object, output_specs: object, grid: object,
             threadgroup: object, template: object = (), init_value: object = None,
             backend: str | None = None) -> tuple[Launch, list[Any]]:
    """Check one launch; returns the normalised launch and inputs, or raises ``KernelError``.

    Launch configurations that passed once are remembered (keyed by exact types, so ``8.0``
    never reuses the check of ``8``); the inputs are checked on every call.
    """
    if not isinstance(kernel, Kernel):
        raise KernelError(APPLY, f"expected a graphkern Kernel, got {type(kernel).__name__}",
                          Status.INVALID_KERNEL)
    checked_inputs = check_inputs(kernel, inputs)
    return validated_launch(kernel, output_specs, grid, threadgroup, template, init_value,
                            backend), checked_inputs


def validated_launch(kernel: Kernel, output_specs: object, grid: object, threadgroup: object,
                     template: object = (), init_value: object = None,
                     backend: str | None = None) -> Launch:
    """The launch configuration checked (inputs aside), or ``KernelError``; remembered, as in
    ``validate``, so a configuration is checked once."""
    try:  # a launch seen before
        key = launch_key(kernel, output_specs, grid, threadgroup, template, init_value, backend)
        known = VALIDATED.get(key)
    except (TypeError, ValueError, AttributeError, LookupError):  # malformed: take the slow path
        key = known = None
    if known is not None:
        return known
    launch = _validate_launch(kernel, output_specs, grid, threadgroup, template, init_value, backend)
    if key is not None:
        VALIDATED.put(key, launch)
    return launch


def _validate_launch(kernel: Kernel, output_specs: object, grid: object, threadgroup: object,
                     template: object, init_value: object, backend: str | None) -> Launch:
    specs = _check_output_specs(kernel, output_specs)
    resolved = resolve_backend(kernel, backend)
    g, t = _check_launch_dims(grid, threadgroup, resolved)
    args = _check_template(template)
    if resolved == "cuda" and kernel.cuda is None and any(a.kind == "dtype" for a in args):
        raise _fail(Status.INVALID_TEMPLATE,
                    "precompiled CUDA kernels take int and bool scalars, not dtype templates")
    return Launch(kernel, resolved, specs, g, t, args, _check_init_value(init_value))


def _reference_keywords(reference: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    """The keyword names ``reference`` accepts, and whether it takes ``**kwargs``."""
    try:
        return _cached_reference_keywords(reference)
    except TypeError:  # unhashable: an nn.Module is a dict, yet a fine reference
        return _cached_reference_keywords.__wrapped__(reference)


@memoized("reference keywords")
def _cached_reference_keywords(reference: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    try:
        params = inspect.signature(reference).parameters.values()
    except (TypeError, ValueError):
        return frozenset(), False
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = frozenset(p.name for p in params
                      if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                    inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return named, takes_any
