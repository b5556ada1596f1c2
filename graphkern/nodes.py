"""The vocabulary of graphkern: kernels, launch arguments, status codes, errors and node kinds.

This module imports nothing else from graphkern; everything else imports it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import keyword
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import mlx.core as mx
import numpy as np

__all__ = [
    "GraphkernError",
    "Kernel",
    "KernelError",
    "KernelResult",
    "NodeKind",
    "OutputSpec",
    "Status",
    "TemplateArg",
    "TemplateLike",
    "dtype_name",
    "dtype_from_name",
    "float_bits",
    "float_from_bits",
]


class Status(enum.IntEnum):
    """Status code of a kernel launch or a graph node; 0 is success.

    A failed launch inside a trace returns one of these instead of raising, and the graph carries
    it to everything downstream (``UPSTREAM_FAILED``, with ``root_cause`` naming the node).
    """

    OK = 0
    #: The kernel definition is invalid (names, sources, NUL bytes).
    INVALID_KERNEL = 1
    #: Grid or threadgroup is not three positive int32 values, or exceeds the backend's limits.
    INVALID_LAUNCH = 2
    #: An output spec has a negative or non-integer dimension or is not an MLX dtype.
    INVALID_OUTPUT_SPEC = 3
    #: The inputs do not match ``input_names`` in count, or one is not an array or a scalar.
    INVALID_INPUT = 4
    #: A template argument has a bad name, a repeated name or a value of the wrong kind.
    INVALID_TEMPLATE = 5
    #: No backend can run the kernel: no source for the active GPU backend and no reference.
    BACKEND_UNAVAILABLE = 6
    #: The pure-MLX reference raised, or returned the wrong number or shapes of outputs.
    REFERENCE_ERROR = 7
    #: The GPU source failed to compile when MLX evaluated it (NVRTC or Metal log attached).
    COMPILE_ERROR = 8
    #: MLX raised while building or running the kernel for another reason.
    RUNTIME_ERROR = 9
    #: A node upstream of this one failed; ``root_cause`` names it.
    UPSTREAM_FAILED = 10
    #: Python code inside a traced module raised.
    MODULE_ERROR = 11
    #: The node's output holds NaN or Inf while its inputs were finite (``gk.inspect``,
    #: ``check_finite``).
    NON_FINITE = 12

    @property
    def ok(self) -> bool:
        return self is Status.OK


class GraphkernError(Exception):
    """Every error graphkern raises: ``operation`` says what was attempted, ``description`` what
    was wrong, ``status`` is the code the same failure gets on a node (``graphkern.errors`` lists
    the kinds).

    >>> err = GraphkernError("apply a graphkern kernel", "grid must be positive", Status.INVALID_LAUNCH)
    >>> str(err), err.status.name
    ('apply a graphkern kernel: grid must be positive', 'INVALID_LAUNCH')
    """

    def __init__(self, operation: str, description: str, status: Status = Status.RUNTIME_ERROR):
        super().__init__(f"{operation}: {description}")
        self.operation = operation
        self.description = description
        self.status = Status(status)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.operation, self.description, self.status))


class KernelError(GraphkernError):
    """A failed kernel operation (defining, launching, applying a kernel, running a graph).

    ``status`` is the code the same failure gets on its node inside a graph. The kinds of
    ``graphkern.errors`` are KernelErrors too, as they were before they had their own classes.

    >>> err = KernelError("apply a graphkern kernel", "grid must be positive", Status.INVALID_LAUNCH)
    >>> str(err)
    'apply a graphkern kernel: grid must be positive'
    """


class NodeKind(str, enum.Enum):
    """What a node of a traced graph stands for."""

    INPUT = "input"
    CONSTANT = "constant"
    OP = "op"
    KERNEL = "kernel"
    OUTPUT = "output"
    #: a collective of ``mx.distributed`` (``all_sum``, ``send``...) or the ``sum_gradients`` of a
    #: sharded layer, stood in by graphkern while tracing (see ``graphkern.distributed``)
    COLLECTIVE = "collective"

    def __str__(self) -> str:
        return self.value


# ----------------------------------------------------------------------------- dtypes

_DTYPES: dict[str, mx.Dtype] = {
    name: getattr(mx, name)
    for name in (
        "bool_", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
        "float16", "bfloat16", "float32", "float64", "complex64",
    )
    if hasattr(mx, name)
}
_DTYPE_NAMES: dict[mx.Dtype, str] = {dt: name.rstrip("_") for name, dt in _DTYPES.items()}


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float32`` -> ``"float32"`` (``mx.bool_`` -> ``"bool"``)."""
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> mx.Dtype:
    """``"float32"`` -> ``mx.float32``; raises KeyError for unknown names."""
    return _DTYPES["bool_" if name == "bool" else name]


# ----------------------------------------------------------------------------- launch arguments


@dataclass(frozen=True)
class OutputSpec:
    """Shape and dtype of one kernel output.

    >>> OutputSpec((4, 8), mx.float16).shape
    (4, 8)
    """

    shape: tuple[int, ...]
    dtype: mx.Dtype
    #: ``(shape, dtype)`` for the cache of validated launches when every dim is exactly an int,
    #: else an unhashable list (so ``8.0`` never reuses the check of ``8``); set on creation.
    launch_key: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.shape, (list, tuple)):
            object.__setattr__(self, "shape", tuple(self.shape))
        plain = isinstance(self.shape, tuple) and all(d.__class__ is int for d in self.shape)
        object.__setattr__(self, "launch_key", (self.shape, self.dtype) if plain else [])


@dataclass(frozen=True)
class TemplateArg:
    """A compile-time template argument: a dtype, an int or a bool.

    >>> TemplateArg.dtype("T", mx.float32).as_mlx()
    ('T', mlx.core.float32)
    >>> TemplateArg.int("N", 4).value
    4
    """

    name: str
    value: Union[mx.Dtype, int, bool]
    #: What the cache of validated launches keys this argument by (its value's exact type
    #: included, so ``True`` never reuses the check of ``1``); set on creation.
    launch_key: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "launch_key", (self.name, self.value, self.value.__class__))

    @classmethod
    def dtype(cls, name: str, value: mx.Dtype) -> TemplateArg:
        return cls(name, value)

    @classmethod
    def int(cls, name: str, value: int) -> TemplateArg:
        return cls(name, value)

    @classmethod
    def bool(cls, name: str, value: bool) -> TemplateArg:
        return cls(name, value)

    @property
    def kind(self) -> str:
        """``"dtype"``, ``"bool"``, ``"int"`` or ``"invalid"``."""
        if isinstance(self.value, mx.Dtype):
            return "dtype"
        if isinstance(self.value, bool):
            return "bool"
        if isinstance(self.value, int):
            return "int"
        return "invalid"

    def as_mlx(self) -> tuple[str, Any]:
        return (self.name, self.value)

    def describe(self) -> str:
        value = dtype_name(self.value) if isinstance(self.value, mx.Dtype) else repr(self.value)
        return f"{self.name}={value}"


def float_bits(value: float) -> int:
    """The bits of ``value`` as a float32, as an int template argument (bodies read it back with
    ``__int_as_float`` / ``as_type<float>``): a compile-time constant instead of a scalar array that
    the GPU would have to fetch from host-written memory on every call.

    >>> float_bits(1.0), bool(float_from_bits(float_bits(1e-5)) == np.float32(1e-5))
    (1065353216, True)
    """
    return int(np.array(value, dtype=np.float32).view(np.int32))


def float_from_bits(bits: int) -> float:
    """The float32 whose bits :func:`float_bits` gave (the references read their template values
    back with it on every call: ``struct``, a third of numpy's cost)."""
    return _FLOAT32.unpack(_INT32.pack(bits))[0]  # type: ignore[no-any-return]


_INT32, _FLOAT32 = struct.Struct("=i"), struct.Struct("=f")


TemplateLike = Union[TemplateArg, tuple]


# ----------------------------------------------------------------------------- kernels

_KERNEL_OPERATION = "create a graphkern kernel"


def _kernel_error(description: str) -> KernelError:
    return KernelError(_KERNEL_OPERATION, description, Status.INVALID_KERNEL)


def _check_text(value: object, what: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise _kernel_error(f"{what} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise _kernel_error(f"{what} contains an interior NUL byte at position {value.index(chr(0))}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: MLX and the source hash need UTF-8
        raise _kernel_error(f"{what} is not valid UTF-8 (lone surrogate at position {exc.start})") from None


def _check_identifier(value: object, what: str) -> None:
    _check_text(value, what, optional=False)
    assert isinstance(value, str)
    if not (value.isascii() and value.isidentifier()) or keyword.iskeyword(value):
        raise _kernel_error(f"{what} {value!r} is not a valid identifier")


@dataclass(frozen=True, eq=False)
class Kernel:
    """A custom GPU kernel with Metal source, CUDA source and a pure-MLX reference.

    One definition runs on a Mac (``metal``), on an NVIDIA GPU (``cuda``, or ``cuda_binary``
    holding PTX or a cubin) and on a CPU (``reference``); the reference is also the test oracle.
    ``metal``/``cuda`` are kernel *bodies*, as for ``mx.fast.metal_kernel``: MLX writes the
    signature from ``input_names``/``output_names``. The kernel is validated when built.

    ``vjp``, if given, is ``vjp(primals, cotangents, outputs) -> input cotangents``; without it
    gradients flow through the reference.

    >>> k = Kernel("scale_add", ["x", "y"], ["out"],
    ...            metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
    ...            reference=lambda x, y: [x * 2 + y])
    >>> k.input_names, k.has_source("metal"), k.has_source("cuda")
    (('x', 'y'), True, False)
    """

    name: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    metal: str | None = None
    cuda: str | None = None
    header: str = ""
    reference: Callable[..., Any] | None = None
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    shared_memory: int = 0
    cuda_binary: bytes | None = None
    vjp: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        _check_identifier(self.name, "kernel name")
        for attr in ("input_names", "output_names"):
            names = getattr(self, attr)
            if isinstance(names, str) or not isinstance(names, Sequence):
                raise _kernel_error(f"{attr} must be a list of strings, got {type(names).__name__}")
            object.__setattr__(self, attr, tuple(names))
        if not self.input_names or not self.output_names:
            raise _kernel_error("kernels must declare at least one input and one output")
        for what, names in (("input name", self.input_names), ("output name", self.output_names)):
            for name in names:
                _check_identifier(name, what)
        all_names = [*self.input_names, *self.output_names]
        duplicates = sorted({n for n in all_names if all_names.count(n) > 1})
        if duplicates:
            raise _kernel_error(f"input and output names must be unique, repeated: {duplicates}")
        _check_text(self.metal, "metal source", optional=True)
        _check_text(self.cuda, "cuda source", optional=True)
        _check_text(self.header, "header", optional=False)
        if self.cuda_binary is not None and not isinstance(self.cuda_binary, (bytes, bytearray)):
            raise _kernel_error("cuda_binary must be bytes (PTX or cubin)")
        for attr in ("reference", "vjp"):
            value = getattr(self, attr)
            if value is not None and not callable(value):
                raise _kernel_error(f"{attr} must be callable, got {type(value).__name__}")
        if isinstance(self.shared_memory, bool) or not isinstance(self.shared_memory, int):
            raise _kernel_error("shared_memory must be an int number of bytes")
        if self.shared_memory < 0:
            raise _kernel_error(f"shared_memory must be >= 0, got {self.shared_memory}")
        for flag in ("atomic_outputs", "ensure_row_contiguous"):
            if not isinstance(getattr(self, flag), bool):
                raise _kernel_error(f"{flag} must be a bool")

    def has_source(self, backend: str) -> bool:
        """Whether the kernel can run natively on ``backend`` ("metal", "cuda" or "reference")."""
        if backend == "metal":
            return self.metal is not None
        if backend == "cuda":
            return self.cuda is not None or self.cuda_binary is not None
        return self.reference is not None

    def source_for(self, backend: str) -> str | None:
        """The kernel body MLX compiles on ``backend`` (None for the reference)."""
        return {"metal": self.metal, "cuda": self.cuda}.get(backend)

    @functools.cached_property
    def source_hash(self) -> str:
        """A short hash of everything that changes the generated code (computed once: every GPU
        launch looks its MLX kernel object up by it)."""
        digest = hashlib.sha256()
        for part in (self.name, self.metal, self.cuda, self.header):
            digest.update(b"\x00" if part is None else part.encode() + b"\x01")
        digest.update(bytes(self.cuda_binary or b""))
        digest.update(repr((self.input_names, self.output_names, self.atomic_outputs,
                            self.ensure_row_contiguous, self.shared_memory)).encode())
        return digest.hexdigest()[:12]

    def __repr__(self) -> str:
        backends = [b for b in ("metal", "cuda", "reference") if self.has_source(b)]
        return (f"Kernel({self.name!r}, inputs={list(self.input_names)}, "
                f"outputs={list(self.output_names)}, backends={backends})")


@dataclass(slots=True)
class KernelResult:
    """What ``apply_in_graph`` returns: outputs, or placeholders and a non-zero status.

    Never raised; ``unwrap()`` turns a failure into a ``KernelError``.

    >>> r = KernelResult([mx.zeros((2,))], Status.INVALID_LAUNCH,
    ...                  KernelError("apply", "grid must be positive", Status.INVALID_LAUNCH))
    >>> r.ok, int(r.status)
    (False, 2)
    """

    outputs: list[mx.array]
    status: Status = Status.OK
    error: KernelError | None = None
    record: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def unwrap(self) -> list[mx.array]:
        """The outputs, or raise the ``KernelError`` behind the status."""
        if self.ok:
            return self.outputs
        if self.error is not None:
            raise self.error
        raise KernelError("apply a graphkern kernel in a graph", self.status.name, self.status)

    def __iter__(self) -> Any:
        return iter(self.outputs)

    def __getitem__(self, index: int) -> mx.array:
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)
