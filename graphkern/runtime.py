"""Backends, the kernel cache, launch validation, ``apply`` and ``apply_in_graph``.

``apply`` mirrors the seed's ``apply_metal_kernel`` (raises ``KernelError``); ``apply_in_graph``
mirrors ``apply_metal_kernel_in_graph`` (returns a ``KernelResult`` with a status, never raises).
Both validate what MLX does not: a zero threadgroup divides by zero in MLX's CUDA backend.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import keyword
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from threading import get_ident
from typing import Any, Protocol

import mlx.core as mx

from .autodiff import differentiable, vjp_enabled
from .nodes import Kernel, KernelError, KernelResult, OutputSpec, Status, TemplateArg, TemplateLike

__all__ = [
    "BACKENDS",
    "KernelCache",
    "Launch",
    "active_backend",
    "apply",
    "apply_in_graph",
    "kernel_cache",
    "launch",
    "resolve_backend",
]

BACKENDS = ("metal", "cuda", "reference")
class _ThreadState(threading.local):
    """This thread's trace recorder and backend override (class defaults make reads cheap), and
    the key of its launches' compiled forms for all-array inputs (see ``differentiable_launch``)."""

    recorder: Any = None
    backend: str | None = None

    def __init__(self) -> None:  # runs once in each thread that reads the state
        self.array_forms_key = (get_ident(), ())


_local = _ThreadState()
APPLY = "apply a graphkern kernel"
MAX_THREADS_PER_GROUP = 1024
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_CUDA_MAX_BLOCKS_YZ = 65535
_CUDA_MAX_BLOCK_Z = 64


# ----------------------------------------------------------------------------- backends


@functools.cache
def _detected_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "reference"


# CPython's raw environment dict on POSIX (bytes keys): a read costs 40 ns, not 400
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_BACKEND_KEY = b"GRAPHKERN_BACKEND" if _ENVIRON is not None else "GRAPHKERN_BACKEND"
#: The raw ``GRAPHKERN_BACKEND`` value (bytes on POSIX), read on every launch for its cache key.
_raw_backend_variable: Callable[[Any], Any] = (_ENVIRON if _ENVIRON is not None else os.environ).get


def backend_setting() -> Any:
    """This thread's backend choice as launch caches key it: the ``using_backend`` override, else
    ``GRAPHKERN_BACKEND`` as the environment holds it (bytes on POSIX), or None."""
    return _local.backend or _raw_backend_variable(_BACKEND_KEY)


def backend_override() -> str | None:
    """This thread's ``using_backend`` override, if any (a trace hands it to its own thread)."""
    return _local.backend


def _backend_variable() -> str | None:
    """``GRAPHKERN_BACKEND`` (or a thread's ``using_backend`` override) as a string, or None."""
    raw = backend_setting()
    return (raw.decode() if isinstance(raw, bytes) else raw) or None


@contextlib.contextmanager
def using_backend(backend: str | None) -> Iterator[None]:
    """Run this thread's kernels on ``backend`` for the duration (None: no change).

    >>> with using_backend("reference"):
    ...     active_backend()
    'reference'
    """
    previous = _local.backend
    if backend is not None:
        if backend not in BACKENDS:
            raise KernelError("choose a graphkern backend",
                              f"{backend!r} is not one of {list(BACKENDS)}", Status.BACKEND_UNAVAILABLE)
        _local.backend = backend
    try:
        yield
    finally:
        _local.backend = previous


def active_backend() -> str:
    """The backend kernels run on: ``GRAPHKERN_BACKEND`` if set, else metal, cuda or reference.

    >>> active_backend() in BACKENDS
    True
    """
    forced = _backend_variable()
    if not forced:
        return _detected_backend()
    if forced not in BACKENDS:
        raise KernelError("choose a graphkern backend",
                          f"GRAPHKERN_BACKEND={forced!r} is not one of {list(BACKENDS)}",
                          Status.BACKEND_UNAVAILABLE)
    return forced


def resolve_backend(kernel: Kernel, backend: str | None = None) -> str:
    """The backend ``kernel`` actually runs on: the active GPU backend if it has a source for it,
    else its reference. Raises ``KernelError(BACKEND_UNAVAILABLE)`` when it has neither."""
    wanted = backend or active_backend()
    if wanted not in BACKENDS:
        raise KernelError(APPLY, f"unknown backend {wanted!r}; use one of {list(BACKENDS)}",
                          Status.BACKEND_UNAVAILABLE)
    if kernel.has_source(wanted):
        return wanted
    if kernel.reference is not None:
        return "reference"
    raise KernelError(APPLY, f"kernel {kernel.name!r} has no {wanted} source and no reference",
                      Status.BACKEND_UNAVAILABLE)


def mlx_kernel_name(kernel: Kernel) -> str:
    """The name graphkern gives MLX: the kernel's name plus its source hash, so that two kernels
    with one name and different sources never share MLX's own per-name library cache."""
    return f"{kernel.name}_{kernel.source_hash}"


def generated_name(kernel: Kernel) -> str:
    """The prefix of the function name MLX generates for ``kernel`` (it appears in MLX's errors)."""
    return f"custom_kernel_{mlx_kernel_name(kernel)}"


# ----------------------------------------------------------------------------- kernel cache


class KernelCache:
    """A thread-safe cache of MLX kernel objects, one per (backend, name, source, header, options).

    The role of ``get_jit_module`` in MLX's CUDA backend: build once, count hits and misses.

    >>> cache = KernelCache()
    >>> cache.stats()
    {'hits': 0, 'misses': 0, 'size': 0}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[tuple[Any, ...], Any] = {}
        self._by_kernel: dict[tuple[str, Kernel], Any] = {}  # the same, by Kernel identity
        self._thread = threading.local()  # this thread's hit count: no lock on the hit path
        self._hit_counts: list[list[int]] = []  # every thread's, summed by stats()
        self.misses = 0

    @staticmethod
    def key(backend: str, kernel: Kernel) -> tuple[Any, ...]:
        options = (kernel.input_names, kernel.output_names, kernel.ensure_row_contiguous,
                   kernel.atomic_outputs, kernel.shared_memory)
        source = kernel.source_for(backend) if backend != "cuda" or kernel.cuda else kernel.cuda_binary
        return (backend, mlx_kernel_name(kernel), source, kernel.header, options)

    def get(self, backend: str, kernel: Kernel) -> Any:
        """The MLX kernel object for ``kernel`` on ``backend``, built on first use.

        Looked up by the Kernel object first (a dict probe, without the lock), by content on its
        first sight."""
        found = self._by_kernel.get((backend, kernel))
        if found is None:
            key = self.key(backend, kernel)
            with self._lock:
                found = self._objects.get(key)
                if found is None:
                    self.misses += 1
                    found = self._objects[key] = _build_mlx_kernel(backend, kernel)
                    self._by_kernel[(backend, kernel)] = found
                    return found
                self._by_kernel[(backend, kernel)] = found
        counter = getattr(self._thread, "hits", None)
        if counter is None:
            counter = self._thread.hits = [0]
            with self._lock:
                self._hit_counts.append(counter)
        counter[0] += 1
        return found

    def stats(self) -> dict[str, int]:
        with self._lock:
            hits = sum(count[0] for count in self._hit_counts)
            return {"hits": hits, "misses": self.misses, "size": len(self._objects)}

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._by_kernel.clear()
            for count in self._hit_counts:
                count[0] = 0
            self.misses = 0


kernel_cache = KernelCache()


def _build_mlx_kernel(backend: str, kernel: Kernel) -> Any:
    name = mlx_kernel_name(kernel)
    try:
        if backend == "metal":
            return mx.fast.metal_kernel(
                name=name, input_names=list(kernel.input_names),
                output_names=list(kernel.output_names), source=kernel.metal or "", header=kernel.header,
                ensure_row_contiguous=kernel.ensure_row_contiguous,
                atomic_outputs=kernel.atomic_outputs)
        if kernel.cuda is not None:
            return mx.fast.cuda_kernel(
                name=name, input_names=list(kernel.input_names),
                output_names=list(kernel.output_names), source=kernel.cuda, header=kernel.header,
                ensure_row_contiguous=kernel.ensure_row_contiguous,
                shared_memory=kernel.shared_memory)
        return _PrecompiledCuda(kernel)
    except (RuntimeError, ValueError) as exc:
        raise KernelError(f"build the {backend} kernel {kernel.name!r}", str(exc),
                          status_of_mlx_error(str(exc))) from exc


class _PrecompiledCuda:
    """Calls ``mx.fast.precompiled_cuda_kernel`` with the kernel's PTX or cubin, in the same
    calling convention as the objects ``mx.fast.cuda_kernel`` returns. Template ints and bools
    become the kernel's scalar arguments, in order."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.name = kernel.name

    def __call__(self, *, inputs: list[Any], output_shapes: list[Any], output_dtypes: list[Any],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: list[tuple[str, Any]], init_value: float | None = None) -> Any:
        scalars = [value for _, value in template]
        binary = bytes(self.kernel.cuda_binary or b"")
        if _inside_inspection_trace():
            binary = _recordable_binary(binary)
        return mx.fast.precompiled_cuda_kernel(
            name=self.name, compiled_source=binary, inputs=inputs,
            output_shapes=output_shapes, output_dtypes=output_dtypes, scalars=scalars, grid=grid,
            threadgroup=threadgroup, shared_memory=self.kernel.shared_memory,
            init_value=init_value, ensure_row_contiguous=self.kernel.ensure_row_contiguous)


def _recordable_binary(binary: bytes) -> bytes:
    """What an inspection trace records as a precompiled kernel's binary.

    ``mx.export_function`` hands each primitive's state to Python as ``str``, so a cubin (not
    UTF-8) makes the whole capture raise UnicodeDecodeError. Inspection traces only record, never
    run, so a cubin is recorded as a line of text naming it; PTX is text and is kept as it is.
    """
    try:
        binary.decode("utf-8")
    except UnicodeDecodeError:
        digest = hashlib.sha256(binary).hexdigest()[:16]
        return f"// graphkern: cubin, {len(binary)} bytes, sha256 {digest}".encode()
    return binary


_COMPILE_ERROR = re.compile(r"compile|nvrtc|error:|syntax", re.IGNORECASE)
_NO_BACKEND = re.compile(r"no (metal|cuda) back-?end", re.IGNORECASE)


def status_of_mlx_error(message: str) -> Status:
    """Map an MLX error message to a status code."""
    if _NO_BACKEND.search(message):
        return Status.BACKEND_UNAVAILABLE
    if _COMPILE_ERROR.search(message):
        return Status.COMPILE_ERROR
    return Status.RUNTIME_ERROR


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Launch:
    """A validated launch: everything needed to run a kernel once, and to describe it on a node."""

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
    def differentiable_forms(self) -> dict[tuple[Any, ...], Callable[..., list[mx.array]]]:
        """This launch wrapped in ``mx.custom_function``, one per thread and set of scalar inputs,
        keyed ``(thread ident, scalars)`` (on a GPU backend, ``mx.compile``d: see
        ``differentiable_launch``)."""
        return {}

    @functools.cached_property
    def plain_forms(self) -> dict[int, Callable[..., list[mx.array]]]:
        """This launch's ``replayed`` forms, by thread ident."""
        return {}

    def eager_form(self) -> Callable[..., list[mx.array]] | None:
        """What an eager call of all-array inputs on this thread replays, outside traces: the
        compiled custom function (``differentiable_launch``) or, inside ``without_vjp``, the
        compiled plain launch; None until the first call built it."""
        if vjp_enabled():
            return self.differentiable_forms.get(_local.array_forms_key)
        return self.replayed()

    def replayed(self) -> Callable[..., list[mx.array]] | None:
        """The plain launch of all-array inputs through ``mx.compile``, this thread's (see
        ``differentiable_launch`` for why one a thread), or None for the reference backend, whose
        ops ``mx.compile`` may fuse: an eager call replays the recorded kernel node, cheaper than
        MLX's own kernel call (H200, quiet host: 1.5-1.8 us against 2.0-2.2)."""
        if self.backend == "reference":
            return None
        fn = self.plain_forms.get(get_ident())
        if fn is None:
            def plain(*arrays: mx.array) -> list[mx.array]:
                return _run_native(self, list(arrays))

            self.plain_forms[get_ident()] = fn = mx.compile(plain)
        return fn

    @functools.cached_property
    def declared(self) -> list[tuple[tuple[int, ...], mx.Dtype]]:
        """``(shape, dtype)`` of each output, for comparing what a reference returned."""
        return [(spec.shape, spec.dtype) for spec in self.output_specs]

    @functools.cached_property
    def mlx_template(self) -> list[tuple[str, Any]]:
        return [a.as_mlx() for a in self.template]

    @functools.cached_property
    def run(self) -> Callable[[list[Any]], list[mx.array]]:
        """``run(inputs)``: the reference as it is where MLX differentiates it itself (plain MLX
        ops, no user vjp), else a differentiable launch (``differentiable_launch``)."""
        if self.backend == "reference" and self.kernel.vjp is None:
            return functools.partial(run_reference, self)
        return functools.partial(_run_differentiable, self)

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


def _check_inputs(kernel: Kernel, inputs: object) -> list[Any]:
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


_VALIDATED: dict[Any, Launch] = {}
_VALIDATED_MAX = 4096


def _launch_key(kernel: Kernel, output_specs: Any, grid: Any, threadgroup: Any, template: Any,
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
    # backend_setting(), inlined: this runs on every launch
    return (kernel, backend or _local.backend or _raw_backend_variable(_BACKEND_KEY), grid, threadgroup,
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
    checked_inputs = _check_inputs(kernel, inputs)
    return validated_launch(kernel, output_specs, grid, threadgroup, template, init_value,
                            backend), checked_inputs


def validated_launch(kernel: Kernel, output_specs: object, grid: object, threadgroup: object,
                     template: object = (), init_value: object = None,
                     backend: str | None = None) -> Launch:
    """The launch configuration checked (inputs aside), or ``KernelError``; remembered, as in
    ``validate``, so a configuration is checked once."""
    try:  # a launch seen before
        key = _launch_key(kernel, output_specs, grid, threadgroup, template, init_value, backend)
        known = _VALIDATED.get(key)
    except (TypeError, ValueError, AttributeError, LookupError):  # malformed: take the slow path
        key = known = None
    if known is not None:
        return known
    launch = _validate_launch(kernel, output_specs, grid, threadgroup, template, init_value, backend)
    if key is not None:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED[key] = launch
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


# ----------------------------------------------------------------------------- running


def _reference_keywords(reference: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    """The keyword names ``reference`` accepts, and whether it takes ``**kwargs``."""
    try:
        return _cached_reference_keywords(reference)
    except TypeError:  # unhashable: an nn.Module is a dict, yet a fine reference
        return _cached_reference_keywords.__wrapped__(reference)


@functools.lru_cache(maxsize=1024)
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
    outputs = [result] if result.__class__ is mx.array else result  # isinstance: 3x slower here
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
    """Run a validated launch on its backend; raises ``KernelError``. Differentiable (see
    ``differentiable_launch``)."""
    return launch.run(inputs)


def _run_differentiable(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    return differentiable_launch(launch, inputs)  # looked up per call: tests replace it


def _inside_inspection_trace() -> bool:
    """Whether this thread is inside a graphkern inspection trace (``mx.export_function``)."""
    return getattr(current_recorder(), "inspects", False) is True


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
    uncompiled, since ``mx.compile`` may fuse its ops. Each thread gets its own form: MLX keeps a
    compile cache per thread, and a compiled function erases its entries only from the cache of
    the thread that called it last, so one shared across threads would leave stale entries that
    a later function at the same address could be handed (ml-explore/mlx#3940, #4248).
    """
    native = launch.backend != "reference"
    forward = _run_native if native else run_reference
    kernel = launch.kernel
    if (not vjp_enabled() or (kernel.vjp is None and kernel.reference is None)
            or _inside_inspection_trace()):
        return forward(launch, inputs)
    arrays = [v for v in inputs if v.__class__ is mx.array]
    scalars = () if len(arrays) == len(inputs) else tuple(
        (i, v.__class__, v) for i, v in enumerate(inputs) if v.__class__ is not mx.array)
    key = _local.array_forms_key if not scalars else (get_ident(), scalars)
    fn = launch.differentiable_forms.get(key)
    if fn is None:  # built on first use (a custom function costs ~10 us to build)
        reference = functools.partial(run_reference, launch) if kernel.reference is not None else None
        fn = differentiable(functools.partial(forward, launch), inputs, reference=reference,
                            vjp=kernel.vjp, name=f"kernel {kernel.name!r}")
        launch.differentiable_forms[key] = fn = mx.compile(fn) if native else fn
    return fn(*arrays)


def _run_native(launch: Launch, inputs: list[Any]) -> list[mx.array]:
    mlx_kernel = kernel_cache.get(launch.backend, launch.kernel)
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


def apply(kernel: Kernel, inputs: Sequence[Any], output_specs: Sequence[OutputSpec], *,
          grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
          template: Sequence[TemplateLike] = (), init_value: float | None = None,
          backend: str | None = None) -> list[mx.array]:
    """Run ``kernel`` once, eagerly (outputs are lazy MLX arrays); raises ``KernelError``.

    Mirrors the seed's ``apply_metal_kernel`` and, with ``init_value``,
    ``apply_metal_kernel_with_output_initialization``.

    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> x = mx.arange(4, dtype=mx.float32)
    >>> apply(k, [x], [OutputSpec(x.shape, x.dtype)], grid=(4, 1, 1), threadgroup=(4, 1, 1))[0]
    array([0, 2, 4, 6], dtype=float32)
    """
    try:  # validated_launch's lookup, inlined: a call frame is a tenth of the overhead
        launch = _VALIDATED.get(_launch_key(kernel, output_specs, grid, threadgroup, template,
                                            init_value, backend))
    except (TypeError, ValueError, AttributeError, LookupError):
        launch = None
    if launch is None:
        launch, checked = validate(kernel, inputs, output_specs, grid, threadgroup, template,
                                   init_value, backend)
    else:
        checked = _check_inputs(kernel, inputs)
        # a launch run before with all-array inputs, outside traces: what differentiable_launch
        # would call, called without its frames (a third of the overhead); inside without_vjp,
        # the plain launch, compiled too
        if checked is inputs and _local.recorder is None:  # launch.eager_form(), inlined
            if vjp_enabled():
                replay = launch.differentiable_forms.get(_local.array_forms_key)
            else:
                replay = launch.replayed()
            if replay is not None:
                return replay(*checked)
    return launch.run(checked)


# ----------------------------------------------------------------------------- in-graph calls


class Recorder(Protocol):
    """What a tracer installs to see kernel calls (see ``graphkern.trace``). A recorder with
    ``inspects = True`` is an inspection trace: launches inside it run without a custom vjp."""

    def kernel_call(self, launch: Launch | None, kernel: Any, inputs: list[Any],
                    outputs: list[mx.array], error: KernelError | None) -> list[mx.array]:
        """Record one call; returns the outputs the caller continues with."""
        ...


def current_recorder() -> Recorder | None:
    """The recorder of the trace running on this thread, if any."""
    return _local.recorder  # type: ignore[no-any-return]


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Route this thread's ``apply_in_graph`` calls to ``recorder`` for the duration."""
    previous = current_recorder()
    _local.recorder = recorder
    try:
        yield recorder
    finally:
        _local.recorder = previous


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

    The Python mirror of the seed's ``apply_metal_kernel_in_graph``: a valid launch gives its
    outputs with status OK; an invalid one gives zeros of the declared specs and a non-zero
    status, so tracing continues and the graph shows what failed and what it affects.

    >>> k = Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> x = mx.ones((4,))
    >>> bad = apply_in_graph(k, [x], [OutputSpec((4,), mx.float32)], grid=(0, 1, 1),
    ...                      threadgroup=(4, 1, 1))
    >>> bad.ok, bad.status.name
    (False, 'INVALID_LAUNCH')
    """
    launch: Launch | None = None
    error: KernelError | None = None
    recorder = _local.recorder
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
        outputs = recorder.kernel_call(launch, kernel, arrays, outputs, error)
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
