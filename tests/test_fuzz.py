"""Hypothesis fuzzing of kernel definitions and launches, valid and invalid.

Every generated case has an oracle written from the contract (the docstrings of
``graphkern.nodes``: what ``Kernel`` checks when built, what each ``Status`` means; the launch
checks ``gk.apply`` documents): which statuses its invalid parts may produce, or, when it is valid, the
outputs of the kernel's reference called directly. The properties hold graphkern to that: every
outcome is the right outputs or a ``KernelError``/status naming the operation, nothing else
escapes, nothing hangs, and MLX still computes afterwards.

The CI profile runs 60 examples per property; ``--hypothesis-profile=long`` runs 10,000
(figures in benchmarks/RESULTS_robustness.md).
"""

from __future__ import annotations

import functools
import inspect
import keyword
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import graphkern as gk
from graphkern.launching import backends, context, mlx_kernels, validation
from graphkern.nodes import dtype_name
from graphkern.tracing.recorder import TraceRecorder

S = gk.Status
KERNEL_OP = "create a graphkern kernel"
APPLY_OP = "apply a graphkern kernel"
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
VALIDATION = {S.INVALID_KERNEL, S.INVALID_LAUNCH, S.INVALID_OUTPUT_SPEC, S.INVALID_INPUT,
              S.INVALID_TEMPLATE}

# ----------------------------------------------------------------------------- fixed kernels

AXPY = gk.Kernel(
    "fuzz_axpy", ["x", "y"], ["out"],
    metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < out_shape[0]) out[i] = x[i] * 2 + y[i];",
    reference=lambda x, y: [x * 2 + y],
)
SPLIT = gk.Kernel(
    "fuzz_split", ["x"], ["pos", "neg"],
    metal="uint i = thread_position_in_grid.x; pos[i] = max(x[i], T(0)); neg[i] = min(x[i], T(0));",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < pos_shape[0]) "
         "{ pos[i] = x[i] > 0 ? x[i] : 0; neg[i] = x[i] < 0 ? x[i] : 0; }",
    reference=lambda x: [mx.maximum(x, 0), mx.minimum(x, 0)],
)


def _shift(x: Any, *, N: Any = 0) -> list[Any]:  # noqa: N803 - a template name
    return [x + N]


SHIFT = gk.Kernel("fuzz_shift", ["x"], ["out"],
                  metal="uint i = thread_position_in_grid.x; out[i] = x[i] + N;", reference=_shift)
KERNELS = (AXPY, SPLIT, SHIFT)


# ----------------------------------------------------------------------------- helpers


def assert_mlx_usable() -> None:
    """MLX and graphkern still work: a plain op and a valid kernel call give the right values."""
    assert (mx.arange(3) * 2).tolist() == [0, 2, 4]
    x = mx.arange(4, dtype=mx.float32)
    [out] = gk.apply(AXPY, [x, x], [gk.OutputSpec((4,), mx.float32)], grid=(4, 1, 1),
                     threadgroup=(4, 1, 1), backend="reference")
    assert out.tolist() == [0.0, 3.0, 6.0, 9.0]


@contextmanager
def backend_env(value: str) -> Iterator[None]:
    """GRAPHKERN_BACKEND set for the block (hypothesis tests cannot take function fixtures)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHKERN_BACKEND", value)
        yield


def same_values(out: mx.array, expected: mx.array) -> bool:
    return out.shape == expected.shape and out.dtype == expected.dtype and bool(
        mx.array_equal(out, expected, equal_nan=True).item())


def valid_identifier(value: object) -> bool:
    """A kernel, input or output name: ASCII identifier, not a Python keyword, no NUL."""
    return (isinstance(value, str) and value.isascii() and value.isidentifier()
            and not keyword.iskeyword(value))


def encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_text(value: object, optional: bool) -> bool:
    if value is None:
        return optional
    return isinstance(value, str) and "\x00" not in value and encodable(value)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- strategies

IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
ODD_NAMES = st.sampled_from(["", " ", "a b", "1x", "x-y", "class", "None", "lambda", "é", "naïve",
                             "x\x00", "\x00", "a\x00b", "\ud800", "k" * 300, "_", "__", "x", "out"])
NAMES = st.one_of(IDENTIFIERS, ODD_NAMES, st.text(max_size=6), st.integers(-3, 3), st.none(),
                  st.binary(max_size=3))
FEW_NAMES = st.sampled_from(["x", "y", "out", "pos"])  # small pool: duplicates are common
NAME_LISTS = st.one_of(
    st.lists(NAMES, max_size=4),
    st.lists(FEW_NAMES, min_size=1, max_size=4),
    st.lists(IDENTIFIERS, min_size=1, max_size=3, unique=True).map(tuple),
    NAMES,  # a bare string is not a list of names
)
SOURCES = st.one_of(
    st.none(), st.just("uint i = thread_position_in_grid.x; out[i] = x[i];"), st.text(max_size=24),
    st.sampled_from(["a\x00b", "ok // \ud800", 3, b"bytes", ["src"]]),
)
SHARED_MEMORY = st.one_of(st.just(0), st.integers(-2, 2**40), st.booleans(), st.floats(0, 10),
                          st.none())
FLAGS = st.one_of(st.booleans(), st.sampled_from([0, 1, None, "yes"]))


@dataclass
class Definition:
    """Keyword arguments for ``gk.Kernel``, with the contract's verdict on them."""

    kwargs: dict[str, Any]

    def valid(self) -> bool:
        k = self.kwargs
        ins, outs = k["input_names"], k["output_names"]
        if not valid_identifier(k["name"]):
            return False
        for names in (ins, outs):
            if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) or not names:
                return False
            if not all(valid_identifier(n) for n in names):
                return False
        everything = list(ins) + list(outs)
        if len(set(everything)) != len(everything):
            return False
        if not (valid_text(k["metal"], True) and valid_text(k["cuda"], True)
                and valid_text(k["header"], False)):
            return False
        ref = k["reference"]
        if ref is not None and not callable(ref):
            return False
        shm = k["shared_memory"]
        if not is_int(shm) or shm < 0:
            return False
        return all(isinstance(k[f], bool) for f in ("atomic_outputs", "ensure_row_contiguous"))


def summing_reference(n_outputs: int) -> Callable[..., list[mx.array]]:
    """A reference whose j-th output is ``(j + 1) * sum(inputs)``."""
    def reference(*xs: mx.array) -> list[mx.array]:
        total = functools.reduce(lambda a, b: a + b, xs)
        return [total * (j + 1) for j in range(n_outputs)]
    return reference


@st.composite
def definitions(draw: st.DrawFn) -> Definition:
    outputs = draw(NAME_LISTS)
    n_out = len(outputs) if isinstance(outputs, (list, tuple)) else 1
    ref_kind = draw(st.sampled_from(["sum", "sum", "sum", "none", "not callable"]))
    reference = {"sum": summing_reference(n_out), "none": None, "not callable": "x * 2"}[ref_kind]
    return Definition(dict(
        name=draw(NAMES), input_names=draw(NAME_LISTS), output_names=outputs,
        metal=draw(SOURCES), cuda=draw(SOURCES),
        header=draw(st.one_of(st.just(""), SOURCES)), reference=reference,
        shared_memory=draw(SHARED_MEMORY), atomic_outputs=draw(FLAGS),
        ensure_row_contiguous=draw(st.one_of(st.just(True), FLAGS)),
    ))


DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.int64, mx.uint8, mx.bool_, mx.complex64]
GPU_DTYPES = [mx.float32, mx.float16, mx.int32, mx.uint8]
BAD_DTYPES = st.sampled_from(["float32", None, np.float32, float, 4])
SHAPES = st.sampled_from([(4,), (4,), (0,), (1,), (), (2, 2)])


def make_array(shape: tuple[int, ...], dtype: mx.Dtype, offset: int) -> mx.array:
    return (mx.arange(math.prod(shape), dtype=mx.int32) - offset).reshape(shape).astype(dtype)


ARRAYS = st.builds(make_array, SHAPES, st.sampled_from(DTYPES), st.integers(-2, 3))
SCALARS = st.one_of(st.integers(-8, 8), st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.booleans(), st.integers(-(2**80), 2**80), st.just(np.float64(0.5)))
NOT_INPUTS = st.one_of(st.none(), st.text(max_size=2), st.lists(st.integers(), max_size=2),
                       st.just(np.ones(2, dtype=np.float32)), st.just(np.int64(1)), st.binary(max_size=2))
INPUT_VALUES = st.one_of(ARRAYS, ARRAYS, ARRAYS, SCALARS, NOT_INPUTS)

DIMS = st.one_of(st.integers(1, 64), st.integers(1, 64), st.integers(-(2**70), 2**70),
                 st.sampled_from([0, -1, 1024, 65535, 65536, INT32_MAX, 2**31, 2**32, 2**63, -(2**63)]),
                 st.floats(-4, 4), st.sampled_from([math.inf, math.nan]), st.booleans(), st.none(),
                 st.text(max_size=1))
LAUNCH_DIMS = st.one_of(
    st.tuples(DIMS, DIMS, DIMS),
    st.tuples(st.integers(1, 1024), st.integers(1, 4), st.integers(1, 2)),
    st.lists(DIMS, max_size=5).map(tuple), st.lists(st.integers(1, 8), min_size=3, max_size=3),
    st.none(), st.integers(), st.text(max_size=3),
)

TEMPLATE_NAMES = st.one_of(st.just("T"), st.just("N"), IDENTIFIERS, ODD_NAMES, st.integers(0, 2),
                           st.none())
TEMPLATE_VALUES = st.one_of(st.sampled_from(DTYPES), st.integers(-8, 8), st.booleans(),
                            st.integers(-(2**40), 2**40),
                            st.sampled_from([INT32_MAX, 2**31, -(2**31), -(2**31) - 1]),
                            st.floats(), st.text(max_size=2), st.none(), st.just(np.int32(3)),
                            st.just([1]))
TEMPLATE_ENTRIES = st.one_of(
    st.builds(gk.TemplateArg, TEMPLATE_NAMES, TEMPLATE_VALUES),
    st.tuples(TEMPLATE_NAMES, TEMPLATE_VALUES),
    st.tuples(st.just("T"), st.sampled_from(DTYPES)),
    st.tuples(TEMPLATE_NAMES), st.tuples(TEMPLATE_NAMES, TEMPLATE_VALUES, st.integers()),
    st.text(max_size=2), st.none(), st.integers(),
)
TEMPLATES = st.one_of(st.lists(TEMPLATE_ENTRIES, max_size=3),
                      st.lists(TEMPLATE_ENTRIES, max_size=3).map(tuple), st.just(()), st.none(),
                      st.just({"T": mx.float32}), st.text(max_size=2))
INIT_VALUES = st.one_of(st.none(), st.none(), st.floats(allow_nan=True), st.integers(-5, 5),
                        st.just(2**1100), st.booleans(), st.text(max_size=1))
NOT_KERNELS = st.sampled_from(["fuzz_axpy", None, 3, object()])


@dataclass
class Case:
    """One launch: everything ``gk.apply`` takes."""

    kernel: Any
    inputs: Any
    specs: Any
    grid: Any
    threadgroup: Any
    template: Any
    init_value: Any
    backend: Any = None
    expected: list[mx.array] | None = field(default=None, repr=False)

    def call(self, fn: Callable[..., Any], inputs: Any = None) -> Any:
        return fn(self.kernel, self.inputs if inputs is None else inputs, self.specs,
                  grid=self.grid, threadgroup=self.threadgroup, template=self.template,
                  init_value=self.init_value, backend=self.backend)


# ----------------------------------------------------------------------------- the oracle


def spec_problem(kernel: gk.Kernel, specs: Any) -> bool:
    if not isinstance(specs, (list, tuple)) or len(specs) != len(kernel.output_names):
        return True
    for spec in specs:
        if isinstance(spec, tuple) and len(spec) == 2 and not isinstance(spec, gk.OutputSpec):
            spec = gk.OutputSpec(*spec)
        if not isinstance(spec, gk.OutputSpec):
            return True
        shape, dtype = spec.shape, spec.dtype
        if not isinstance(shape, tuple) or not all(is_int(d) and 0 <= d <= INT32_MAX for d in shape):
            return True
        if not isinstance(dtype, mx.Dtype):
            return True
        if math.prod(shape) * dtype.size > INT64_MAX:  # MLX's sizes would wrap around
            return True
    return False


def dims_ok(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 3
            and all(is_int(v) and 1 <= v <= INT32_MAX for v in value))


def launch_problem(grid: Any, threadgroup: Any, backend: str | None) -> bool:
    if not dims_ok(grid) or not dims_ok(threadgroup):
        return True
    if math.prod(threadgroup) > validation.MAX_THREADS_PER_GROUP:
        return True
    if backend == "cuda":
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
        return threadgroup[2] > 64 or blocks[1] > 65535 or blocks[2] > 65535
    return False


def template_problem(template: Any) -> tuple[bool, bool]:
    """(surely invalid, maybe invalid): names that are identifiers only outside ASCII or Python
    keywords are accepted today but could fairly be refused."""
    if template is None:
        return False, False
    if not isinstance(template, (list, tuple)):
        return True, False
    names, doubtful = [], False
    for item in template:
        if isinstance(item, tuple) and len(item) == 2:
            item = gk.TemplateArg(*item)
        if not isinstance(item, gk.TemplateArg):
            return True, False
        name, value = item.name, item.value
        if not isinstance(name, str) or not name.isidentifier() or "\x00" in name:
            return True, False
        doubtful |= not valid_identifier(name)
        if isinstance(value, (mx.Dtype, bool)):
            pass
        elif is_int(value):
            if not -(2**31) <= value <= INT32_MAX:
                return True, False
        else:
            return True, False
        names.append(name)
    return len(set(names)) != len(names), doubtful


def init_problem(init_value: Any) -> bool:
    if init_value is None:
        return False
    if isinstance(init_value, bool) or not isinstance(init_value, (int, float)):
        return True
    try:
        float(init_value)
    except OverflowError:
        return True
    return False


def resolved_backend(kernel: gk.Kernel, backend: Any, active: str) -> str | None:
    wanted = backend or active
    if wanted not in backends.BACKENDS:
        return None
    if kernel.has_source(wanted):
        return wanted
    return "reference" if kernel.reference is not None else None


def reference_keywords(kernel: gk.Kernel, template: Any) -> dict[str, Any]:
    params = inspect.signature(kernel.reference).parameters
    entries = [t if isinstance(t, gk.TemplateArg) else gk.TemplateArg(*t) for t in template or ()]
    return {t.name: t.value for t in entries if t.name in params}


def expected_outcome(case: Case, active: str, traced: bool = False
                     ) -> tuple[set[gk.Status], list[mx.array] | None]:
    """The statuses the case may end with, and the outputs when it must succeed. ``traced``: the
    launch happens inside ``gk.trace``, where MLX builds and traces GPU kernels it cannot run."""
    kernel = case.kernel
    if not isinstance(kernel, gk.Kernel):
        return {S.INVALID_KERNEL}, None
    allowed: set[gk.Status] = set()
    inputs = case.inputs
    if (not isinstance(inputs, (list, tuple)) or len(inputs) != len(kernel.input_names)
            or not all(isinstance(v, (mx.array, bool, int, float)) for v in inputs)
            or any(is_int(v) and not -(2**63) <= v <= INT64_MAX for v in inputs)):
        allowed.add(S.INVALID_INPUT)
    if spec_problem(kernel, case.specs) or init_problem(case.init_value):
        allowed.add(S.INVALID_OUTPUT_SPEC)
    backend = resolved_backend(kernel, case.backend, active)
    if backend is None:
        allowed.add(S.BACKEND_UNAVAILABLE)
    if launch_problem(case.grid, case.threadgroup, backend):
        allowed.add(S.INVALID_LAUNCH)
    surely, doubtful = template_problem(case.template)
    if surely:
        allowed.add(S.INVALID_TEMPLATE)
    if allowed:
        return allowed, None
    if doubtful:
        allowed.add(S.INVALID_TEMPLATE)
    if backend == "cuda":  # validated, but this MLX build has no CUDA backend
        return allowed | {S.BACKEND_UNAVAILABLE}, None
    if backend == "metal" and traced:  # MLX traces the CustomKernel; it only refuses what it
        # cannot put in a Metal buffer: Python ints beyond int64
        too_big = any(is_int(v) and not -(2**63) <= v <= INT64_MAX for v in inputs)
        return allowed | ({S.RUNTIME_ERROR} if too_big else {S.OK}), None
    if backend == "metal":  # validated; Linux MLX builds Metal kernels but cannot run them
        return allowed | {S.BACKEND_UNAVAILABLE, S.RUNTIME_ERROR}, None
    try:  # the oracle: the reference called directly
        result = kernel.reference(*inputs, **reference_keywords(kernel, case.template))
        outs = [result] if isinstance(result, mx.array) else result
        specs = [s if isinstance(s, gk.OutputSpec) else gk.OutputSpec(*s) for s in case.specs]
        if not isinstance(outs, list) or not all(isinstance(o, mx.array) for o in outs) or len(
                outs) != len(specs) or any(o.shape != s.shape for o, s in zip(outs, specs)):
            return allowed | {S.REFERENCE_ERROR}, None
        expected = [o.astype(s.dtype) for o, s in zip(outs, specs)]
        mx.eval(expected)
    except Exception:
        return allowed | {S.REFERENCE_ERROR}, None
    return allowed | {S.OK}, expected


@st.composite
def launches(draw: st.DrawFn, backends: st.SearchStrategy[Any]) -> Case:
    """A launch of a fixed kernel (or of something that is not one); mostly sensible, often not."""
    kernel = draw(st.one_of(st.sampled_from(KERNELS), st.sampled_from(KERNELS), NOT_KERNELS))
    n_in = len(kernel.input_names) if isinstance(kernel, gk.Kernel) else 1
    n_out = len(kernel.output_names) if isinstance(kernel, gk.Kernel) else 1
    count = draw(st.sampled_from([n_in] * 6 + [max(0, n_in - 1), n_in + 1]))
    inputs: Any = [draw(INPUT_VALUES) for _ in range(count)]
    inputs = draw(st.sampled_from([inputs] * 8 + [tuple(inputs), None, "x"]))
    template = draw(TEMPLATES)
    # output specs: the reference's own shapes most of the time, so valid launches are common
    shape = next((v.shape for v in inputs or () if isinstance(v, mx.array)), ())
    matching = [gk.OutputSpec(shape, draw(st.sampled_from(DTYPES))) for _ in range(n_out)]
    dims = st.one_of(st.integers(0, 4), st.sampled_from([-1, 65536, INT32_MAX, 2**31]),
                     st.floats(0, 2), st.sampled_from([math.inf, -math.inf, math.nan]), st.booleans())
    random_shape = st.one_of(st.lists(dims, max_size=5).map(tuple), st.lists(st.integers(0, 3), max_size=2),
                             st.sampled_from([None, 4, "ab", (65536,) * 4, (INT32_MAX, INT32_MAX)]))
    any_spec = st.one_of(
        st.builds(gk.OutputSpec, random_shape, st.one_of(st.sampled_from(DTYPES), BAD_DTYPES)),
        st.tuples(random_shape, st.sampled_from(DTYPES)), st.none(), st.integers(),
    )
    specs = draw(st.one_of(
        st.just(matching), st.just(matching), st.just(tuple(matching)),
        st.lists(any_spec, min_size=n_out, max_size=n_out), st.lists(any_spec, max_size=3), st.none(),
    ))
    grid = draw(st.one_of(st.just((max(1, math.prod(shape)), 1, 1)), LAUNCH_DIMS))
    threadgroup = draw(st.one_of(st.just((4, 1, 1)), st.just((256, 1, 1)), LAUNCH_DIMS))
    return Case(kernel, inputs, specs, grid, threadgroup, template, draw(INIT_VALUES),
                draw(backends))


def check_error(err: gk.KernelError | None, case: Case, allowed: set[gk.Status]) -> None:
    """A failure is a KernelError with an allowed status that names its operation."""
    assert isinstance(err, gk.KernelError), repr(err)
    assert err.status in allowed, f"{err.status.name} not in {sorted(s.name for s in allowed)}: {err}"
    assert err.description and str(err) == f"{err.operation}: {err.description}"
    if err.status in VALIDATION:
        assert err.operation == APPLY_OP
    elif err.status == S.REFERENCE_ERROR:
        assert err.operation == f"run the reference of kernel {case.kernel.name!r}"
    elif err.operation not in (APPLY_OP, "choose a graphkern backend"):
        assert repr(case.kernel.name) in err.operation, err.operation


# ----------------------------------------------------------------------------- properties


@given(defn=definitions())
def test_kernel_definitions_build_and_run_or_fail_naming_the_operation(defn: Definition) -> None:
    valid = defn.valid()
    note(f"valid by the contract: {valid}")
    try:
        kernel = gk.Kernel(**defn.kwargs)
    except gk.KernelError as exc:
        assert not valid, f"a valid definition was refused: {exc}"
        assert exc.operation == KERNEL_OP and exc.status == S.INVALID_KERNEL and exc.description
        assert_mlx_usable()
        return
    assert valid, "an invalid definition was accepted"
    assert kernel.input_names == tuple(defn.kwargs["input_names"])
    assert len(kernel.source_hash) == 12

    n_out = len(kernel.output_names)
    xs = [mx.arange(4, dtype=mx.float32) + i for i in range(len(kernel.input_names))]
    specs = [gk.OutputSpec((4,), mx.float32)] * n_out
    kw: dict[str, Any] = dict(grid=(4, 1, 1), threadgroup=(4, 1, 1))
    if kernel.reference is None:
        with pytest.raises(gk.KernelError) as info:
            gk.apply(kernel, xs, specs, **kw)
        assert info.value.status == S.BACKEND_UNAVAILABLE and kernel.name in info.value.description
    else:
        outs = gk.apply(kernel, xs, specs, **kw)
        total = sum(range(len(xs))) + len(xs) * mx.arange(4, dtype=mx.float32)
        assert [o.tolist() for o in outs] == [(total * (j + 1)).tolist() for j in range(n_out)]

    # On the metal path MLX builds the kernel with the fuzzed name, source and header and
    # traces its CustomKernel; graphkern folds it into one node.
    with backend_env("metal"):
        graph = gk.trace(lambda *a: gk.apply_in_graph(kernel, list(a), specs, **kw).outputs, *xs)
    [node_name] = graph.kernels()
    node = graph.node(node_name)
    assert node["kernel"] == kernel.name and node["source_hash"] == kernel.source_hash
    if kernel.metal is not None:
        assert node["status"] == S.OK and node["backend"] == "metal"
        # MLX's generated name; the cached MLX kernel may have been built for an earlier kernel
        # with the same name and Metal code (its hash then differs only in the CUDA source)
        assert node["generated_name"].startswith(f"custom_kernel_{kernel.name}_")
        assert node["source"] == kernel.metal
    elif kernel.reference is not None:
        assert node["status"] == S.OK and node["backend"] == "reference"
    else:
        assert node["status"] == S.BACKEND_UNAVAILABLE
    assert "CustomKernel" not in {graph.node(n)["op"] for n in graph.nodes("op")}
    assert_mlx_usable()


def run_case(case: Case, active: str) -> None:
    allowed, expected = expected_outcome(case, active)
    note(f"allowed: {sorted(s.name for s in allowed)}")
    try:
        outs = case.call(gk.apply)
    except gk.KernelError as exc:
        check_error(exc, case, allowed)
        status = exc.status
    else:
        assert S.OK in allowed, f"succeeded, expected one of {sorted(s.name for s in allowed)}"
        status = S.OK
        if expected is not None:
            assert len(outs) == len(expected)
            for out, exp in zip(outs, expected):
                assert same_values(out, exp), (out, exp)

    result = case.call(gk.apply_in_graph)  # never raises; the same verdict as a status
    assert isinstance(result, gk.KernelResult) and result.status == status
    if isinstance(case.kernel, gk.Kernel):
        assert len(result.outputs) == len(case.kernel.output_names)
    assert all(isinstance(o, mx.array) for o in result.outputs)
    if status == S.OK:
        assert result.error is None
        if expected is not None:
            assert all(same_values(o, e) for o, e in zip(result.outputs, expected))
    else:
        check_error(result.error, case, allowed)
        with pytest.raises(gk.KernelError):
            result.unwrap()
        if S.INVALID_OUTPUT_SPEC not in allowed and S.INVALID_KERNEL not in allowed:
            # placeholders of the declared specs, cheap to evaluate whatever their size
            for out, spec in zip(result.outputs, case.specs):
                shape, dtype = (spec.shape, spec.dtype) if isinstance(spec, gk.OutputSpec) else spec
                assert out.shape == tuple(shape) and out.dtype == dtype
            mx.eval(result.outputs)
    assert_mlx_usable()


@given(case=launches(st.sampled_from([None, None, None, "reference", "", "tpu", 3])))
def test_launches_give_reference_outputs_or_a_named_error(case: Case) -> None:
    run_case(case, backends.active_backend())


@given(case=launches(st.sampled_from(["cuda", "metal"])))
def test_launches_for_unavailable_gpu_backends_validate_then_fail_cleanly(case: Case) -> None:
    # CUDA's own limits are checked before MLX sees the launch; then this build has no such backend
    run_case(case, backends.active_backend())


def traced_case(case: Case) -> tuple[gk.Graph, gk.KernelResult, list[Any]]:
    """Trace one launch under the metal backend; arrays become traced inputs, scalars stay."""
    inputs = list(case.inputs) if isinstance(case.inputs, (list, tuple)) else case.inputs
    arrays = [v for v in inputs if isinstance(v, mx.array)] if isinstance(inputs, list) else []
    seen: dict[str, gk.KernelResult] = {}

    def fn(anchor: mx.array, *traced: mx.array) -> list[mx.array]:
        it = iter(traced)
        ins = [next(it) if isinstance(v, mx.array) else v for v in inputs] if isinstance(
            inputs, list) else inputs
        seen["result"] = case.call(gk.apply_in_graph, ins)
        return [*seen["result"].outputs, anchor + 1]

    events: list[dict[str, Any]] = []
    with backend_env("metal"):
        graph = gk.trace(fn, mx.zeros((2,)), *arrays)
        if seen["result"].ok:  # what MLX's own CustomKernel received, without graphkern's tags
            with context.recording(TraceRecorder(tag=False)):
                mx.export_function(events.append, fn, mx.zeros((2,)), *arrays)
    return graph, seen["result"], events


@given(case=launches(st.sampled_from([None, None, None, None, "reference"])))
def test_metal_launches_inside_a_trace_reach_mlx_validated_or_fail_on_their_node(case: Case) -> None:
    allowed, _ = expected_outcome(case, "metal", traced=True)
    note(f"allowed: {sorted(s.name for s in allowed)}")
    graph, result, events = traced_case(case)
    [node_name] = graph.kernels()
    node = graph.node(node_name)
    assert node["status"] == result.status
    n = len(result.outputs)
    kernel_outs, anchor_out = [f"output_{i}" for i in range(n)], f"output_{n}"
    assert graph.node(anchor_out)["status"] == S.OK  # not downstream of the kernel
    if result.ok:
        assert S.OK in allowed, f"succeeded, expected one of {sorted(s.name for s in allowed)}"
        kernel = case.kernel
        backend = resolved_backend(kernel, case.backend, "metal")
        specs = [s if isinstance(s, gk.OutputSpec) else gk.OutputSpec(*s) for s in case.specs]
        assert node["backend"] == backend
        assert node["grid"] == list(case.grid) and node["threadgroup"] == list(case.threadgroup)
        for out, spec in zip(kernel_outs, specs):
            [(_, _, data)] = graph.nx.in_edges(out, data=True)
            assert data["shape"] == spec.shape and data["dtype"] == dtype_name(spec.dtype)
        if backend == "metal":
            [custom] = [e for e in events if e["type"] == "primitive" and e["name"] == "CustomKernel"]
            assert custom["arguments"][0].startswith(backends.generated_name(kernel))
            assert list(custom["arguments"][2:8]) == [*case.grid, *case.threadgroup]
            assert [tuple(o[1]) for o in custom["outputs"]] == [s.shape for s in specs]
            assert [o[2] for o in custom["outputs"]] == [s.dtype for s in specs]
            assert node["generated_name"] == custom["arguments"][0]
    else:
        check_error(result.error, case, allowed)
        assert node["message"] == str(result.error)
        assert graph.status == result.status and graph.failures()[0].node == node_name
        for out in kernel_outs:
            assert graph.node(out)["status"] == S.UPSTREAM_FAILED
            assert graph.node(out)["root_cause"] == node_name
    assert_mlx_usable()


@given(
    picks=st.lists(st.tuples(st.sampled_from(["ka", "kb"]), st.integers(0, 2)), min_size=1, max_size=5),
)
def test_same_named_kernels_with_different_sources_stay_apart(picks: list[tuple[str, int]]) -> None:
    """Duplicate kernel names: each (name, source) is its own node, hash and cached MLX object."""
    body = "uint i = thread_position_in_grid.x; out[i] = x[i] + {};"
    kernels = [gk.Kernel(name, ["x"], ["out"], metal=body.format(v),
                         reference=functools.partial(lambda x, v: [x + v], v=v)) for name, v in picks]
    cache = mlx_kernels.KernelCache()
    x = mx.arange(4, dtype=mx.float32)
    spec = [gk.OutputSpec((4,), mx.float32)]

    def fn(x: mx.array) -> list[mx.array]:
        return [gk.apply_in_graph(k, [x], spec, grid=(4, 1, 1), threadgroup=(4, 1, 1)).outputs[0]
                for k in kernels]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlx_kernels, "kernel_cache", cache)
        mp.setenv("GRAPHKERN_BACKEND", "metal")
        graph = gk.trace(fn, x)
    nodes = graph.kernels()
    assert len(nodes) == len(kernels) and graph.ok
    assert sorted(graph.node(n)["source_hash"] for n in nodes) == sorted(k.source_hash for k in kernels)
    distinct = {(name, v) for name, v in picks}
    assert cache.stats()["misses"] == cache.stats()["size"] == len(distinct)
    assert len({graph.node(n)["generated_name"] for n in nodes}) == len(distinct)
    # on the reference path each runs its own reference
    outs = fn(x)
    assert [o.tolist() for o in outs] == [(x + v).tolist() for _, v in picks]


class _CallableObject:
    def __call__(self, x: mx.array) -> list[mx.array]:
        return [x * 3]


@pytest.mark.parametrize("reference", [
    lambda x: [x * 3],
    functools.partial(lambda x, k: [x * k], k=3),
    _CallableObject(),
    nn.Sequential(lambda x: x * 3),  # an nn.Module is a dict, so it is unhashable
], ids=["lambda", "partial", "callable-object", "nn-module"])
def test_any_callable_is_a_reference(reference: Callable[..., Any]) -> None:
    kernel = gk.Kernel("times_three", ["x"], ["out"], reference=reference)
    x = mx.arange(4, dtype=mx.float32)
    [out] = gk.apply(kernel, [x], [gk.OutputSpec((4,), mx.float32)], grid=(4, 1, 1), threadgroup=(4, 1, 1))
    assert out.tolist() == (x * 3).tolist()


def test_a_launch_validated_once_does_not_vouch_for_a_malformed_one() -> None:
    """Entries that only look like a valid launch must be checked again, not reused."""
    x = mx.arange(4, dtype=mx.float32)
    spec = [gk.OutputSpec((4,), mx.float32)]
    kw: dict[str, Any] = dict(grid=(4, 1, 1), threadgroup=(4, 1, 1))
    assert gk.apply(SHIFT, [x], spec, template=[("N", 2)], **kw)[0].tolist() == (x + 2).tolist()
    for template in ([("N", 2, "extra")], [("N",)], ["N"], [("N", 2.0)], [("N", np.int32(2))]):
        with pytest.raises(gk.KernelError) as info:
            gk.apply(SHIFT, [x], spec, template=template, **kw)
        assert info.value.status == S.INVALID_TEMPLATE and info.value.operation == APPLY_OP
    for bad in (dict(grid=(4.0, 1, 1)), dict(grid=(True, 1, 1)), dict(threadgroup=[4, 1, 1, 1])):
        with pytest.raises(gk.KernelError) as info:
            gk.apply(SHIFT, [x], spec, **{**kw, **bad})
        assert info.value.status == S.INVALID_LAUNCH
    assert_mlx_usable()


def test_placeholders_keep_large_declared_shapes_so_tracing_goes_on() -> None:
    """A failed launch with a large (valid) output spec must not break the ops after it."""
    n = 100_000

    def fn(x: mx.array) -> mx.array:
        bad = gk.apply_in_graph(AXPY, [x, x], [gk.OutputSpec((n,), mx.float32)], grid=(0, 1, 1),
                                threadgroup=(4, 1, 1))
        return bad.outputs[0] + x

    graph = gk.trace(fn, mx.ones((n,)))
    assert graph.status == S.INVALID_LAUNCH and graph.failures()[0].affected_outputs == ("output_0",)
    huge = gk.apply_in_graph(AXPY, [mx.ones(2), mx.ones(2)], [gk.OutputSpec((INT32_MAX, 4), mx.float32)],
                             grid=(0, 1, 1), threadgroup=(1, 1, 1))
    assert huge.status == S.INVALID_LAUNCH and huge.outputs[0].shape == (INT32_MAX, 4)
    mx.eval(huge.outputs)  # a placeholder costs no memory to evaluate
    assert_mlx_usable()


@pytest.mark.parametrize("shape, dtype", [((65536,) * 4, mx.float32), ((INT32_MAX,) * 3, mx.uint8),
                                          ((2**31 - 1, 2**31 - 1, 2), mx.complex64)])
def test_output_specs_whose_size_overflows_are_refused(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    """MLX silently wraps such sizes (65536**4 elements reads as 0); a GPU kernel would then write
    far past its buffer. graphkern refuses them on every backend, traced or not."""
    x = mx.ones((4,))
    with pytest.raises(gk.KernelError) as info:
        gk.apply(AXPY, [x, x], [gk.OutputSpec(shape, dtype)], grid=(4, 1, 1), threadgroup=(4, 1, 1))
    assert info.value.status == S.INVALID_OUTPUT_SPEC and "overflow" in info.value.description
    with backend_env("metal"):
        graph = gk.trace(lambda x: gk.apply_in_graph(AXPY, [x, x], [gk.OutputSpec(shape, dtype)],
                                                     grid=(4, 1, 1), threadgroup=(4, 1, 1)).outputs, x)
    assert graph.status == S.INVALID_OUTPUT_SPEC
    assert_mlx_usable()


def test_text_that_is_not_utf8_is_refused_when_the_kernel_is_built() -> None:
    """A lone surrogate cannot reach MLX (or the source hash) as UTF-8: refuse it up front."""
    for field_name in ("metal", "cuda", "header"):
        with pytest.raises(gk.KernelError) as info:
            gk.Kernel("k", ["x"], ["out"], reference=lambda x: [x], **{field_name: "x // \ud800"})
        assert info.value.status == S.INVALID_KERNEL and "UTF-8" in info.value.description
    assert_mlx_usable()


def test_init_value_too_large_for_a_float_is_a_status() -> None:
    x = mx.ones((4,))
    with pytest.raises(gk.KernelError) as info:
        gk.apply(AXPY, [x, x], [gk.OutputSpec((4,), mx.float32)], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                 init_value=2**1100)
    assert info.value.status == S.INVALID_OUTPUT_SPEC and "init_value" in info.value.description
