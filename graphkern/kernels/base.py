"""What every library kernel shares: launch plans, the library's one launch cache, argument checks,
launch sizes and registry entries.

A kernel's plan function (``plan_rms_norm`` ...) validates its arguments and builds a :class:`Plan`
(kernel, inputs, output specs, grid, threadgroup, template); its layer function (``rms_norm`` ...)
runs it with ``graphkern.runtime.launch``, kept per signature in :data:`LAUNCHES` (see
``graphkern.kernels.declaration``). ``check()`` and the tests build the same plan and run the
reference on it, so kernel and oracle see exactly the same inputs and template values
(``apply_plan(plan, backend="reference")``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from graphkern.launching.backends import active_backend
from graphkern.launching.launch_cache import memoized, track
from graphkern.nodes import (  # noqa: F401  (float_bits, float_from_bits: the ops import them from here)
    Kernel,
    KernelError,
    OutputSpec,
    Status,
    TemplateArg,
    dtype_name,
    float_bits,
    float_from_bits,
)
from graphkern.runtime import apply, launch

__all__ = [
    "FLOAT_DTYPES",
    "THREADGROUP_MEMORY",
    "check_threadgroup_memory",
    "threadgroup_backend",
    "LAUNCHES",
    "LibraryLaunches",
    "is_signature_constant",
    "signature_constant",
    "MAX_GRID",
    "Case",
    "LibraryEntry",
    "Plan",
    "check_dtype",
    "check_vector",
    "elementwise_config",
    "row_config",
    "apply_plan",
    "run",
]

#: The dtypes every library kernel supports (computing in float32 inside).
FLOAT_DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: MLX passes the grid as int32 threads.
MAX_GRID = 2**31 - 1
#: Most row elements one thread keeps in registers (reduction kernels; rows stay in their own dtype):
#: 128 bytes of float32, 64 of a 16-bit type. Longer rows are streamed from memory.
MAX_ROW_ITEMS = 32
#: Largest threadgroup the register-resident row kernels use. MLX compiles without
#: __launch_bounds__, so a 1024-thread block must fit in 64 registers a thread; 512 allows 128.
MAX_THREADS = 512


@dataclass(frozen=True)
class Plan:
    """One launch of a library kernel, fully decided: what ``launch`` gets.

    ``kwargs`` are the template values as the reference receives them (keyword arguments).
    """

    kernel: Kernel
    inputs: tuple[mx.array, ...]
    output_specs: tuple[OutputSpec, ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: tuple[TemplateArg, ...] = ()

    @property
    def template_values(self) -> dict[str, Any]:
        return {t.name: t.value for t in self.template}

    @property
    def empty(self) -> bool:
        """True when there is nothing to compute (a zero-size input): no launch is made."""
        return any(g == 0 for g in self.grid)


def run(plan: Plan) -> list[mx.array]:
    """Launch ``plan`` as layer code does, with ``graphkern.runtime.launch`` (in a trace or compiled
    graph a failure becomes the node's status; eagerly it raises ``KernelError``).

    Zero-size inputs need no launch (and a zero grid is invalid): their outputs are empty arrays.
    """
    if plan.empty:
        return [mx.zeros(spec.shape, spec.dtype) for spec in plan.output_specs]
    return launch(plan.kernel, list(plan.inputs), list(plan.output_specs), grid=plan.grid,
                  threadgroup=plan.threadgroup, template=list(plan.template))


class LibraryLaunches:
    """The library's one launch cache: per signature (kernel, backend setting, the signature of
    the arguments: ``graphkern.kernels.declaration``), the launch bound once (``gk.bind``) and
    where each of its inputs comes from; and the constant arrays plans take
    (:func:`signature_constant`).

    Bounded (``maxsize`` signatures) and reported whole by ``gk.cache_stats()["layer launches"]``;
    ``gk.clear_caches()`` empties it, with the constants. Every library call looks it up, so a hit
    is one dict lookup and a flag: past the bound, the oldest signature goes unless it was used
    since it last came round, which gives it another round (CLOCK, the second-chance
    approximation of least-recently-used, with no reordering on a hit).

    >>> cache = LibraryLaunches(maxsize=2, group=None)
    >>> cache.put("a", 1); cache.put("b", 2); cache.get("a")
    1
    >>> cache.put("c", 3)             # "b" was not used since it came in: evicted
    >>> sorted(cache), cache.stats()
    (['a', 'c'], {'hits': 1, 'misses': 0, 'size': 2})
    """

    MAX_ENTRIES = 4096

    def __init__(self, maxsize: int = MAX_ENTRIES, *, group: str | None = "layer launches") -> None:
        self.maxsize = maxsize
        #: signature -> [value, used since it last came round]
        self.entries: dict[Any, list[Any]] = {}
        self.hits = self.misses = 0
        #: arrays plans may take as constants of a signature, by id; held weakly: a constant lives
        #: while a kept launch or the function that made it (``unused_input``...) holds it
        self.constants: weakref.WeakValueDictionary[int, mx.array] = weakref.WeakValueDictionary()
        if group is not None:
            track(self, group)

    def get(self, key: Any, default: Any = None) -> Any:
        """The value kept under ``key`` (counted, and marked used), or ``default``."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return default
        entry[1] = True
        self.hits += 1
        return entry[0]

    def put(self, key: Any, value: Any) -> None:
        """Keep ``value`` under ``key``; past ``maxsize``, evict as the class says."""
        entries = self.entries
        entries[key] = [value, False]
        while len(entries) > self.maxsize:
            try:
                oldest = next(iter(entries))
                entry = entries.pop(oldest)
            except (StopIteration, RuntimeError, KeyError):  # changed by another thread meanwhile
                break
            if entry[1] and oldest is not key:  # used since it came round: to the back, once more
                entry[1] = False
                entries[oldest] = entry

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self.entries)}

    def clear(self) -> None:
        """Forget every launch and constant and reset the counts."""
        self.entries.clear()
        self.constants.clear()
        self.hits = self.misses = 0

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.entries))

    def __contains__(self, key: Any) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


#: The one cache of library launches.
LAUNCHES = LibraryLaunches()


def signature_constant(array: mx.array) -> mx.array:
    """Mark ``array`` as a constant a library plan may take for every call of one signature (a
    stand-in for an absent input, a table made from the arguments' values); returns it. A plan
    input that is neither one of the call's arrays nor such a constant keeps the call from being
    kept: its plan is made on every call."""
    LAUNCHES.constants[id(array)] = array
    return array


def is_signature_constant(value: Any) -> bool:
    """Whether ``value`` was marked by :func:`signature_constant` (and the cache kept since)."""
    return LAUNCHES.constants.get(id(value)) is value


def apply_plan(plan: Plan, backend: str | None = None) -> list[mx.array]:
    """Run ``plan`` eagerly on ``backend`` (None: the active one; "reference": the oracle), raising
    ``KernelError`` on failure. check() runs each plan twice this way."""
    if plan.empty:
        return [mx.zeros(spec.shape, spec.dtype) for spec in plan.output_specs]
    return apply(plan.kernel, list(plan.inputs), list(plan.output_specs), grid=plan.grid,
                 threadgroup=plan.threadgroup, template=list(plan.template), backend=backend)


# ----------------------------------------------------------------------------- validation


def check_dtype(op: str, x: mx.array, what: str = "x") -> None:
    """Raise KernelError unless ``x`` is an mx.array of float32, float16 or bfloat16."""
    if not isinstance(x, mx.array):
        raise KernelError(op, f"{what} must be an mx.array, got {type(x).__name__}", Status.INVALID_INPUT)
    if x.dtype not in FLOAT_DTYPES:
        raise KernelError(op, f"{what} has dtype {dtype_name(x.dtype)}; supported: float32, float16, "
                          "bfloat16", Status.INVALID_INPUT)
    if x.ndim == 0:
        raise KernelError(op, f"{what} must have at least one dimension", Status.INVALID_INPUT)


def check_vector(op: str, v: mx.array, x: mx.array, what: str) -> None:
    """Raise KernelError unless ``v`` is a 1-D array of x's last-dimension size and dtype."""
    if not isinstance(v, mx.array):
        raise KernelError(op, f"{what} must be an mx.array, got {type(v).__name__}", Status.INVALID_INPUT)
    if v.ndim != 1 or v.shape[0] != x.shape[-1]:
        raise KernelError(op, f"{what} has shape {tuple(v.shape)} but x's last dimension is "
                          f"{x.shape[-1]}: expected ({x.shape[-1]},)", Status.INVALID_INPUT)
    if v.dtype != x.dtype:
        raise KernelError(op, f"dtype mismatch: {what} is {dtype_name(v.dtype)} but x is "
                          f"{dtype_name(x.dtype)}", Status.INVALID_INPUT)


def check_grid(op: str, threads: int) -> None:
    if threads > MAX_GRID:
        raise KernelError(op, f"input too large: {threads} threads exceed MLX's int32 grid",
                          Status.INVALID_LAUNCH)


def runs_on_cuda() -> bool:
    """Whether library launches now run CUDA kernels (the active backend): the plans that lay data
    out for CUDA alone ask this (RoPE's int offset in a shape, softmax's rows in shared memory);
    the references read either layout."""
    return active_backend() == "cuda"


#: Threadgroup (shared) memory one kernel may declare: Apple GPUs' 32 KiB (Metal refuses a pipeline
#: past it), and CUDA's 48 KiB of static shared memory a block (the CUDA programming guide's limit
#: for static allocations; more needs an opt-in that MLX's launches do not make).
THREADGROUP_MEMORY = {"metal": 32 * 1024, "cuda": 48 * 1024}


def threadgroup_backend() -> str:
    """The backend whose threadgroup limit a plan obeys: CUDA's on CUDA, else Metal's (the
    reference backend plans as a Mac would, so a plan checked on a CPU holds there)."""
    return "cuda" if runs_on_cuda() else "metal"


def check_threadgroup_memory(op: str, parts: dict[str, int], limit: int | None = None) -> None:
    """Raise INVALID_LAUNCH when ``parts`` (threadgroup array -> bytes) exceed the active backend's
    limit (or ``limit``: a kernel's own, for CUDA's dynamic shared memory), before MLX sees the launch.

    >>> try:
    ...     check_threadgroup_memory("demo", {"rows": 32768, "reduction": 128})
    ... except KernelError as err:
    ...     print(err.status.name, str(err).split("; ")[1])
    INVALID_LAUNCH metal allows 32768 B
    """
    backend = threadgroup_backend()
    allowed = THREADGROUP_MEMORY[backend] if limit is None else limit
    total = sum(parts.values())
    if total > allowed:
        detail = ", ".join(f"{name} {size} B" for name, size in parts.items())
        raise KernelError(op, f"the launch needs {total} B of threadgroup memory ({detail}); {backend} "
                          f"allows {allowed} B", Status.INVALID_LAUNCH)


# ----------------------------------------------------------------------------- plan parts
# A layer function builds its plan on every eager call; these immutable parts are made once.


@memoized("plan parts", typed=True)  # typed: True and 1 are different arguments
def template_arg(name: str, value: mx.Dtype | int | bool) -> TemplateArg:
    """``TemplateArg(name, value)``, made once per name and value.

    >>> template_arg("V", 4) is template_arg("V", 4)
    True
    >>> template_arg("B", True).value, template_arg("B", 1).value   # not one cache entry
    (True, 1)
    """
    return TemplateArg(name, value)


@memoized("plan parts")
def output_spec(shape: tuple[int, ...], dtype: mx.Dtype) -> OutputSpec:
    """``OutputSpec(shape, dtype)``, made once per shape and dtype."""
    return OutputSpec(shape, dtype)


# ----------------------------------------------------------------------------- launch sizes


def vector_width(n: int, dtype: mx.Dtype, most: int = 16) -> int:
    """Elements per vector access: ``most`` at most and 16 bytes at most, halved until it divides
    ``n``.

    >>> vector_width(4096, mx.bfloat16), vector_width(4096, mx.bfloat16, most=4), vector_width(6, mx.float32)
    (8, 4, 2)
    """
    v = min(most, 16 // dtype.size)
    while v > 1 and n % v:
        v //= 2
    return v


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of a one-block-per-row kernel: NT threads, V-wide vectors, CH slots per thread."""

    threads: int
    vector: int
    chunks: int  # 0: the row does not fit in registers and is streamed

    def template(self) -> tuple[TemplateArg, ...]:
        return (template_arg("NT", self.threads), template_arg("V", self.vector),
                template_arg("CH", self.chunks))


@memoized("plan parts")
def row_config(n: int, dtype: mx.Dtype, *, vector: int = 8, items: int = 16, streamed: bool = False,
               max_threads: int = MAX_THREADS) -> RowConfig:
    """How a one-block-per-row kernel spreads a row of ``n`` elements of ``dtype``: ``vector``-element
    accesses, about ``items`` elements a thread (so ``n / items`` threads, 32 to ``max_threads``), kept
    in registers up to ``MAX_ROW_ITEMS``, else (or when ``streamed``) read from memory in a loop
    (``chunks == 0``). The defaults are what the norms ran fastest with across float32 and 16-bit
    rows of 4096 and 16384 (``benchmarks/gpu_row_configs.py`` sweeps them): 16-byte vectors, which
    beat 8-byte ones once a vector is loaded whole (``gk::load_vec``).

    >>> row_config(4096, mx.float32)
    RowConfig(threads=256, vector=4, chunks=4)
    >>> row_config(4096, mx.bfloat16)   # 16-byte accesses: 8 elements
    RowConfig(threads=256, vector=8, chunks=2)
    >>> row_config(16384, mx.float16)   # 512 threads: 32 elements a thread
    RowConfig(threads=512, vector=8, chunks=4)
    >>> row_config(50000, mx.float16).chunks   # too long for registers: streamed
    0
    """
    v = vector_width(n, dtype, vector)
    threads = min(max_threads, max(32, _pow2_at_least(math.ceil(n / items))))
    chunks = math.ceil(math.ceil(n / v) / threads)
    if streamed or chunks * v > MAX_ROW_ITEMS:
        chunks = 0
    return RowConfig(threads, v, chunks)


def row_launch(op: str, x: mx.array, cfg: RowConfig) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and threadgroup for one block of ``cfg.threads`` per row of ``x``."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    check_grid(op, rows * cfg.threads)
    return (rows * cfg.threads, 1, 1), (cfg.threads, 1, 1)


def elementwise_config(op: str, n: int, dtype: mx.Dtype, block: int = 128) -> tuple[int, tuple[int, int, int],
                                                                                     tuple[int, int, int]]:
    """(V, grid, threadgroup) for an elementwise kernel: one thread per 16-byte vector, in blocks of
    ``block``: 128 ran GELU and 16-bit SwiGLU faster than 1024 (benchmarks/RESULTS_kernels.md)."""
    v = vector_width(n, dtype)
    threads = n // v
    check_grid(op, threads)
    return v, (threads, 1, 1), (block, 1, 1)


def eps_template(eps: float, op: str) -> TemplateArg:
    """``eps`` validated, as the ``EPS`` template argument (its float32 bits)."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise KernelError(op, f"eps must be a finite number >= 0, got {eps!r}", Status.INVALID_INPUT)
    return float_template("EPS", float(eps))


def float_template(name: str, value: float) -> TemplateArg:
    """An int template argument holding ``value``'s float32 bits, made once per value (a Python
    float: the callers check their numbers first). 0.0 and -0.0, one key to a cache, keep their
    own bits.

    >>> float_template("EPS", 1.0).value == float_bits(1.0)
    True
    >>> float_template("SCALE", -0.0).value == float_bits(-0.0) != float_template("SCALE", 0.0).value
    True
    """
    return _float_template(name, value, math.copysign(1.0, value))


@memoized("plan parts")
def _float_template(name: str, value: float, sign: float) -> TemplateArg:
    return template_arg(name, float_bits(value))


@memoized("plan parts", maxsize=16)
def unused_input(dtype: mx.Dtype) -> mx.array:
    """A one-element stand-in for an absent optional input (never read by the kernel), made once.

    Built from host data, so it has no primitive: MLX streams belong to the thread that made them,
    and a lazy array first made on a trace's worker thread could not be evaluated anywhere else."""
    return signature_constant(mx.array([0], dtype=dtype))


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Case:
    """Arguments of one call of a layer function."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LibraryEntry:
    """A library kernel as check(), the tests and the benchmarks see it.

    ``fn`` is the layer function, ``plan`` builds its launch from the same arguments, ``stock`` is
    the MLX equivalent (``mx.fast.rms_norm`` ...) with the same signature, ``make_inputs(shape,
    dtype, key)`` makes random arguments with ``x`` of ``shape``; ``shapes`` are check()'s defaults.
    """

    name: str
    kernel: Kernel
    fn: Callable[..., Any]
    plan: Callable[..., Plan]
    make_inputs: Callable[[Sequence[int], mx.Dtype, mx.array], Case]
    stock: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    min_ndim: int = 1
    #: check() rounds the last dimension of a shape up to a multiple of this (quantized weights
    #: come in groups of 64 inputs).
    last_dim_multiple: int = 1
    description: str = ""
    #: (atol, rtol) by dtype where check() must allow more than ``kernel_checks.TOLERANCES``.
    tolerances: dict[mx.Dtype, tuple[float, float]] = field(default_factory=dict)

    def __call__(self, case: Case) -> list[mx.array]:
        """The layer function's outputs as a list."""
        out = self.fn(*case.args, **case.kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def stock_outputs(self, case: Case) -> list[mx.array]:
        out = self.stock(*case.args, **case.kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]
