"""Conformance with MLX's own custom-kernel tests (python/tests/test_fast.py), on the CUDA backend.

Every ``test_custom_kernel_*`` case of MLX that has a CUDA source is re-expressed as a graphkern
``Kernel`` and run four ways: ``gk.apply`` (eager), ``gk.apply_in_graph`` (eager), inside
``gk.trace`` (the graph must hold one OK kernel node on the cuda backend, with MLX's generated
name) and inside ``gk.compile`` (run twice). Each result is compared with the Kernel's pure-MLX
reference, and, where MLX's test asserts literal values, with those too.

Cases (MLX test -> here): basic -> ``basic``; args (bool/int/dtype templates, a bfloat16 input,
a scalar input, two outputs of mixed dtypes) -> ``args_*``; strides (ensure_row_contiguous on and
off, ``elem_to_loc``) -> ``strided_*``/``contig_*``; helper (header) -> ``helper``; attributes
(blockDim) and threadgroups larger than the grid -> ``launch_shape_*``/``copy_tg_gt_grid``;
init_value with atomic outputs -> ``scatter_add_init_*``; shared memory (dynamic, also over the
48 KB default) -> ``block_reverse_*``; same name with different sources and mixed dtypes -> the
tests at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import graphkern as gk
from graphkern.launching import backends, mlx_kernels
from graphkern.nodes import dtype_name

pytestmark = pytest.mark.gpu

CUDA = mx.cuda.is_available()
BACKEND = "cuda" if CUDA else "reference"
ELEM = "int64_t elem = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;\n"
TOL = {mx.float32: (2e-5, 1e-5), mx.float16: (2e-3, 2e-3), mx.bfloat16: (2e-2, 2e-2)}


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One launch: ``inputs`` holds arrays and Python scalars; ``views`` maps an input index to a
    function applied to that array at call time (inside the graph for trace and compile), so
    kernels see non-contiguous arrays."""

    id: str
    kernel: gk.Kernel
    inputs: list[Any]
    specs: list[gk.OutputSpec]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[Any] = field(default_factory=list)
    init_value: float | None = None
    views: dict[int, Callable[[mx.array], mx.array]] = field(default_factory=dict)
    expected: list[mx.array] | None = None  # literal values asserted by MLX's own test

    @property
    def arrays(self) -> list[mx.array]:
        return [v for v in self.inputs if isinstance(v, mx.array)]

    def call_inputs(self, arrays: tuple[mx.array, ...] | list[mx.array]) -> list[Any]:
        it = iter(arrays)
        out = []
        for i, v in enumerate(self.inputs):
            value = next(it) if isinstance(v, mx.array) else v
            out.append(self.views[i](value) if i in self.views else value)
        return out

    def launch_kwargs(self) -> dict[str, Any]:
        return dict(grid=self.grid, threadgroup=self.threadgroup, template=self.template,
                    init_value=self.init_value)


def _normal(shape: tuple[int, ...], seed: int = 7) -> mx.array:
    mx.random.seed(seed)
    return mx.random.normal(shape=shape)


BASIC = gk.Kernel(
    "basic", ["a"], ["out1"],
    cuda="auto elem = cooperative_groups::this_grid().thread_rank();\nout1[elem] = a[elem];",
    reference=lambda a: [a],
)

ARGS = gk.Kernel(
    "arg_test", ["a", "b", "c", "d"], ["out1", "out2"],
    cuda="""
        auto elem = cooperative_groups::this_grid().thread_rank();
        T tmp = a[0];
        if (e) {
            out1[elem] = a[1] + b[2] + static_cast<float>(c[3]) + d[0] + f;
        } else {
            out1[elem] = 1;
        }
        out2[elem] = a[1] + b[2] + static_cast<float>(c[1]) - d[0];
    """,
    reference=lambda a, b, c, d, e, f: _args_reference(a, b, c, d, e, f),
)


def _args_reference(a: mx.array, b: mx.array, c: mx.array, d: float, e: bool, f: int) -> list[mx.array]:
    a1, b2 = a.reshape(-1)[1], b[2].astype(mx.float32)
    c1, c3 = c.reshape(-1)[1].astype(mx.float32), c.reshape(-1)[3].astype(mx.float32)
    out1 = (a1 + b2 + c3 + d + f) if e else mx.array(1.0)
    out2 = (a1 + b2 + c1 - d).astype(mx.int32)
    return [mx.broadcast_to(out1, (3, 2)), mx.broadcast_to(out2, (3, 2))]


def _args_case(style: str, e: bool) -> Case:
    mx.random.seed(7)
    a = mx.random.normal(shape=(3, 6))
    c = mx.random.normal(shape=(2, 2)).astype(mx.bfloat16)
    if style == "tuples":
        template: list[Any] = [("e", e), ("f", 3), ("T", mx.float16)]
    else:
        template = [gk.TemplateArg.bool("e", e), gk.TemplateArg.int("f", 3),
                    gk.TemplateArg.dtype("T", mx.float16)]
    expected = None
    if e:  # MLX's test_custom_kernel_args asserts these numbers for seed 7
        expected = [mx.full((3, 2), 14.0484), mx.full((3, 2), -2, dtype=mx.int32)]
    return Case(f"args_{style}_e{int(e)}", ARGS, [a, mx.array([3, 4, 5]), c, 7.3],
                [gk.OutputSpec((3, 2), mx.float32), gk.OutputSpec((3, 2), mx.int32)],
                (6, 1, 1), (2, 1, 1), template, expected=expected)


AFFINE = gk.Kernel(
    "dtype_affine", ["x"], ["out"],
    cuda=ELEM + "if (elem < N) out[elem] = static_cast<T>(static_cast<float>(x[elem]) * 2.0f + 1.0f);",
    reference=lambda x, T: [(x.astype(mx.float32) * 2 + 1).astype(T)],
)


def _affine_case(dtype: mx.Dtype) -> Case:
    x = (_normal((33, 17)) * 4).astype(dtype)
    return Case(f"dtype_{dtype_name(dtype)}", AFFINE, [x], [gk.OutputSpec(x.shape, dtype)],
                (x.size, 1, 1), (128, 1, 1), [("T", dtype), ("N", x.size)])


MYEXP_STRIDED = gk.Kernel(
    "myexp", ["inp"], ["out"], ensure_row_contiguous=False,
    cuda=ELEM + """
        if (elem >= N) return;
        int64_t loc = elem_to_loc(elem, inp_shape.data(), inp_strides.data(), inp_ndim);
        T tmp = inp[loc];
        out[elem] = exp(tmp) * WARP_SIZE;
    """,
    reference=lambda inp: [mx.exp(inp) * 32],
)
MYEXP_CONTIG = gk.Kernel(
    "myexp", ["inp"], ["out"], ensure_row_contiguous=True,
    cuda=ELEM + """
        if (elem >= N) return;
        T tmp = inp[elem];
        out[elem] = exp(tmp) * WARP_SIZE;
    """,
    reference=lambda inp: [mx.exp(inp) * 32],
)
VIEWS: dict[str, tuple[tuple[int, ...], Callable[[mx.array], mx.array] | None]] = {
    # MLX's own input: mx.tile(a[::2], [4, 1]) of a (3, 6) normal, made outside the graph
    "tile": ((3, 6), None),
    "transpose": ((6, 40), lambda a: a.T),
    "slice": ((9, 40), lambda a: a[::2, 3:]),
    "broadcast": ((1, 40), lambda a: mx.broadcast_to(a, (7, 40))),
    "reversed": ((5, 40), lambda a: a[::-1, ::-2]),
}


def _strided_case(view: str, contiguous: bool) -> Case:
    shape, fn = VIEWS[view]
    base = _normal(shape)
    if view == "tile":
        base = mx.tile(base[::2], [4, 1])
    seen = fn(base) if fn else base
    views = {0: fn} if fn else {}
    kernel = MYEXP_CONTIG if contiguous else MYEXP_STRIDED
    return Case(f"{'contig' if contiguous else 'strided'}_{view}", kernel, [base],
                [gk.OutputSpec(seen.shape, seen.dtype)], (seen.size, 1, 1), (256, 1, 1),
                [("T", mx.float32), ("N", seen.size)], views=views)


HELPER = gk.Kernel(
    "helper", ["a"], ["out1"],
    header="""
        template <typename T>
        __device__ T do_exp(T x) {
            return exp(x);
        }
    """,
    cuda="auto elem = cooperative_groups::this_grid().thread_rank();\nout1[elem] = do_exp(a[elem]);",
    reference=lambda a: [mx.exp(a)],
)

LAUNCH_SHAPE = gk.Kernel(
    "launch_shape", ["a"], ["out"],
    cuda="if (blockIdx.x == 0 && threadIdx.x == 0) { out[0] = blockDim.x; out[1] = gridDim.x; }",
    # MLX's rule: grid is in threads, the block is min(threadgroup, grid), blocks round up
    reference=lambda a, G, TG: [mx.array([min(G, TG), math.ceil(G / min(G, TG))], dtype=mx.uint32)],
)


def _launch_shape_case(g: int, tg: int) -> Case:
    return Case(f"launch_shape_g{g}_tg{tg}", LAUNCH_SHAPE, [mx.zeros((1, 1))],
                [gk.OutputSpec((2,), mx.uint32)], (g, 1, 1), (tg, 1, 1), [("G", g), ("TG", tg)])


COPY_PLUS = gk.Kernel(
    "copy_plus", ["x"], ["out"],
    cuda=ELEM + "if (elem < N) out[elem] = x[elem] + 1;",
    reference=lambda x: [x + 1],
)

GRID_2D = gk.Kernel(
    "grid_2d", ["x"], ["out"],
    cuda="""
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        int j = blockIdx.y * blockDim.y + threadIdx.y;
        if (i < W && j < H) out[j * W + i] = x[j * W + i] + i + 100 * j;
    """,
    reference=lambda x: [x + mx.arange(x.shape[1])[None, :] + 100 * mx.arange(x.shape[0])[:, None]],
)


def scatter_add_kernel(init: float) -> gk.Kernel:
    """One source, so one MLX kernel, whatever ``init``; the reference knows the init value."""
    return gk.Kernel(
        "scatter_add", ["x", "idx"], ["out"], atomic_outputs=True,
        cuda=ELEM + "if (elem < N) atomicAdd(&out[idx[elem]], x[elem]);",
        reference=lambda x, idx: [mx.full((8,), init).at[idx].add(x)],
    )


def _scatter_case(init: float) -> Case:
    mx.random.seed(3)
    x = mx.random.randint(0, 4, (1000,)).astype(mx.float32)  # small integers: sums are exact
    idx = mx.random.randint(0, 6, (1000,)).astype(mx.int32)  # bins 6 and 7 keep init_value
    return Case(f"scatter_add_init_{init}", scatter_add_kernel(init), [x, idx],
                [gk.OutputSpec((8,), mx.float32)], (1000, 1, 1), (256, 1, 1), [("N", 1000)],
                init_value=init)


def block_reverse_kernel(chunk: int) -> gk.Kernel:
    """Reverses each ``chunk`` of the input through dynamic shared memory (chunk * 4 bytes)."""
    return gk.Kernel(
        "block_reverse", ["x"], ["out"], shared_memory=chunk * 4,
        cuda="""
            extern __shared__ float smem[];
            int64_t base = (int64_t)blockIdx.x * C;
            for (int j = threadIdx.x; j < C; j += blockDim.x) smem[j] = x[base + j];
            __syncthreads();
            for (int j = threadIdx.x; j < C; j += blockDim.x) out[base + j] = smem[C - 1 - j];
        """,
        reference=lambda x, C: [x.reshape(-1, C)[:, ::-1].reshape(-1)],
    )


def _shared_case(chunk: int, tg: int, blocks: int = 6) -> Case:
    x = _normal((blocks * chunk,))
    return Case(f"block_reverse_{chunk * 4}B_tg{tg}", block_reverse_kernel(chunk), [x],
                [gk.OutputSpec(x.shape, x.dtype)], (blocks * tg, 1, 1), (tg, 1, 1), [("C", chunk)])


def _cases() -> list[Case]:
    cases = [Case("basic", BASIC, [_normal((2, 2))], [gk.OutputSpec((2, 2), mx.float32)],
                  (4, 1, 1), (2, 1, 1))]
    cases[0].expected = [cases[0].inputs[0]]
    cases += [_args_case(style, e) for style in ("tuples", "TemplateArg") for e in (True, False)]
    cases += [_affine_case(dt) for dt in (mx.float32, mx.float16, mx.bfloat16, mx.int32)]
    cases += [_strided_case(v, c) for v in VIEWS for c in (True, False)]
    a = _normal((2, 2))
    cases.append(Case("helper", HELPER, [a], [gk.OutputSpec((2, 2), mx.float32)], (4, 1, 1),
                      (2, 1, 1), expected=[mx.exp(a)]))
    cases.append(_launch_shape_case(2, 2))  # MLX's test_custom_kernel_attributes
    cases[-1].expected = [mx.array([2, 1], dtype=mx.uint32)]
    cases += [_launch_shape_case(2, 256), _launch_shape_case(1000, 256), _launch_shape_case(5, 1024)]
    x = _normal((5,))
    cases.append(Case("copy_tg_gt_grid", COPY_PLUS, [x], [gk.OutputSpec((5,), mx.float32)],
                      (5, 1, 1), (1024, 1, 1), [("N", 5)]))
    x2 = _normal((13, 37))
    cases.append(Case("grid_2d", GRID_2D, [x2], [gk.OutputSpec(x2.shape, x2.dtype)], (37, 13, 1),
                      (16, 8, 1), [("W", 37), ("H", 13)]))
    cases += [_scatter_case(v) for v in (0.0, 0.5, -3.0)]
    cases += [_shared_case(256, 256), _shared_case(256, 64), _shared_case(16384, 1024, blocks=4)]
    return cases


CASES = _cases()
MODES = ["apply", "apply_in_graph", "trace", "compile"]


# ----------------------------------------------------------------------------- helpers


def as_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def assert_close(got: list[mx.array], want: list[mx.array], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == tuple(w.shape), f"{what} output {i}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{what} output {i}: dtype {g.dtype} != {w.dtype}"
        if mx.issubdtype(g.dtype, mx.floating):
            rtol, atol = TOL.get(g.dtype, (1e-5, 1e-5))
            np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=rtol, atol=atol,
                                       err_msg=f"{what} output {i}")
        else:
            np.testing.assert_array_equal(as_numpy(g), as_numpy(w), err_msg=f"{what} output {i}")


def reference_of(case: Case) -> list[mx.array]:
    """The Kernel's reference for this launch (graphkern's reference backend, on the same inputs)."""
    return gk.apply(case.kernel, case.call_inputs(case.arrays), case.specs, backend="reference",
                    **case.launch_kwargs())


def graph_fn(case: Case) -> Callable[..., list[mx.array]]:
    def fn(*arrays: mx.array) -> list[mx.array]:
        res = gk.apply_in_graph(case.kernel, case.call_inputs(arrays), case.specs,
                                **case.launch_kwargs())
        assert res.ok, res.error
        return res.outputs
    fn.__name__ = f"conformance_{case.id}"
    return fn


def check_kernel_node(g: gk.Graph, kernel: gk.Kernel, case: Case | None = None) -> dict[str, Any]:
    [name] = [n for n in g.kernels() if g.node(n)["kernel"] == kernel.name
              and g.node(n)["source_hash"] == kernel.source_hash]
    node = g.node(name)
    assert node["status"] == gk.Status.OK
    assert node["backend"] == BACKEND
    if case is not None:
        assert tuple(node["grid"]) == case.grid and tuple(node["threadgroup"]) == case.threadgroup
        assert [t[0] for t in node["template"]] == [gk.TemplateArg(*t).name if isinstance(t, tuple)
                                                    else t.name for t in case.template]
    if CUDA:  # the CustomKernel primitive folded into the node and named it
        assert node["generated_name"].startswith(backends.generated_name(kernel)), node["generated_name"]
        assert node["source"] == kernel.cuda
        assert not [n for n in g.nodes("op") if g.node(n)["op"] == "CustomKernel"]
    return node


# ----------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mlx_custom_kernel_case(case: Case, mode: str) -> None:
    want = reference_of(case)
    if case.expected is not None:  # the reference agrees with MLX's own expectations
        assert_close(want, case.expected, f"{case.id} reference vs MLX's expected values")
    if mode == "apply":
        got = gk.apply(case.kernel, case.call_inputs(case.arrays), case.specs, **case.launch_kwargs())
    elif mode == "apply_in_graph":
        res = gk.apply_in_graph(case.kernel, case.call_inputs(case.arrays), case.specs,
                                **case.launch_kwargs())
        assert res.ok and res.status == gk.Status.OK, res.error
        got = res.outputs
    elif mode == "trace":
        g = gk.trace(graph_fn(case), *case.arrays)
        assert g.status == gk.Status.OK and len(g.kernels()) == 1
        check_kernel_node(g, case.kernel, case)
        assert len(g.nodes("output")) == len(case.specs)
        got = graph_fn(case)(*case.arrays)
    else:
        cf = gk.compile(graph_fn(case))
        got = cf(*case.arrays)
        assert cf.graph is not None and cf.graph.status == gk.Status.OK
        check_kernel_node(cf.graph, case.kernel, case)
        assert_close(got, want, f"{case.id} [{mode}] first call")
        got = cf(*case.arrays)  # the mx.compile'd function, now cached
    mx.eval(got)
    assert_close(got, want, f"{case.id} [{mode}]")
    if case.expected is not None:
        assert_close(got, case.expected, f"{case.id} [{mode}] vs MLX's expected values")


# ----------------------------------------------------------------------------- beyond one launch


def test_non_contiguous_flag_reaches_mlx(cuda_only: None) -> None:
    """With ensure_row_contiguous=False MLX hands the kernel the strided view itself: a kernel that
    indexes linearly then reads the wrong elements, while the elem_to_loc kernel and the
    ensure_row_contiguous=True kernel are right. Proves the flag is passed through."""
    base = _normal((6, 40))
    view = base.T
    linear = gk.Kernel("linear_read", ["inp"], ["out"], ensure_row_contiguous=False,
                       cuda=ELEM + "if (elem < N) out[elem] = inp[elem];", reference=lambda inp: [inp])
    spec = [gk.OutputSpec(view.shape, view.dtype)]
    kw = dict(grid=(view.size, 1, 1), threadgroup=(256, 1, 1))
    [wrong] = gk.apply(linear, [view], spec, template=[("N", view.size)], **kw)
    assert not np.array_equal(np.array(wrong), np.array(view))
    assert np.array_equal(np.array(wrong).reshape(-1), np.array(base).reshape(-1))  # raw buffer order
    for kernel in (MYEXP_STRIDED, MYEXP_CONTIG):
        [good] = gk.apply(kernel, [view], spec, template=[("T", mx.float32), ("N", view.size)], **kw)
        np.testing.assert_allclose(np.array(good), np.array(mx.exp(view) * 32), rtol=2e-5)


def test_kernel_objects_are_cached() -> None:
    """New launches of a kernel reuse its MLX kernel object (hits), whatever their template; a
    launch run before replays its recorded nodes without a lookup."""
    x = _normal((64,))
    spec = [gk.OutputSpec(x.shape, x.dtype)]
    gk.apply(COPY_PLUS, [x], spec, grid=(64, 1, 1), threadgroup=(32, 1, 1), template=[("N", 8)])
    before = gk.kernel_cache.stats()
    for n in (64, 32, 16):
        out = gk.apply(COPY_PLUS, [x], spec, grid=(64, 1, 1), threadgroup=(32, 1, 1),
                       template=[("N", n)])
        mx.eval(out)
        np.testing.assert_allclose(np.array(out[0])[:n], np.array(x + 1)[:n], rtol=1e-6)
    after = gk.kernel_cache.stats()
    if CUDA:
        assert after["size"] == before["size"]
        assert after["hits"] - before["hits"] == 3 and after["misses"] == before["misses"]


SAME_NAME_SOURCES = ("out[elem] = inp[elem] * 2.0f;", "out[elem] = inp[elem] + 100.0f;")


def _dup_kernels() -> list[gk.Kernel]:
    return [gk.Kernel("dup_name", ["inp"], ["out"], cuda=ELEM + f"if (elem < N) {{ {body} }}",
                      reference=ref)
            for body, ref in zip(SAME_NAME_SOURCES, (lambda inp: [inp * 2.0], lambda inp: [inp + 100.0]))]


def test_same_name_different_source_each_runs_its_own() -> None:
    """MLX's test_cuda_kernel_same_name_different_source, through graphkern: two kernels named
    ``dup_name`` with different bodies, evaluated in ONE batch, eagerly and in one compiled graph;
    graphkern gives MLX distinct names (name + source hash), so each runs its own source."""
    a = mx.arange(32, dtype=mx.float32)
    k1, k2 = _dup_kernels()
    assert backends.generated_name(k1) != backends.generated_name(k2)
    spec = [gk.OutputSpec(a.shape, a.dtype)]
    kw = dict(grid=(32, 1, 1), threadgroup=(32, 1, 1), template=[("N", 32)])
    [out_a] = gk.apply(k1, [a], spec, **kw)
    [out_b] = gk.apply(k2, [a], spec, **kw)
    mx.eval(out_a, out_b)  # one batch
    assert mx.array_equal(out_a, a * 2.0) and mx.array_equal(out_b, a + 100.0)

    def both(x: mx.array) -> list[mx.array]:
        return [gk.apply_in_graph(k, [x], spec, **kw).outputs[0] for k in (k1, k2)]

    cf = gk.compile(both)
    got = cf(a)
    assert mx.array_equal(got[0], a * 2.0) and mx.array_equal(got[1], a + 100.0)
    g = cf.graph
    assert len(g.kernels()) == 2
    nodes = [check_kernel_node(g, k) for k in (k1, k2)]
    if CUDA:
        assert nodes[0]["generated_name"] != nodes[1]["generated_name"]
        keys = {mlx_kernels.KernelCache.key("cuda", k) for k in (k1, k2)}
        assert len(keys) == 2


MIXED = gk.Kernel("mixed_dtypes", ["inp"], ["out"],
                  cuda=ELEM + "if (elem < N) out[elem] = inp[elem] + inp[elem];",
                  reference=lambda inp: [inp + inp])


def test_mixed_dtypes_in_one_graph() -> None:
    """MLX's test_custom_kernel_mixed_dtypes: one kernel called with float16 and float32 inputs in
    a single graph (MLX generates one source per input dtype), eagerly and compiled."""
    a = mx.full((32,), 1.5, dtype=mx.float16)
    b = mx.full((32,), 2.5, dtype=mx.float32)

    def call(x: mx.array) -> mx.array:
        return gk.apply_in_graph(MIXED, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(32, 1, 1),
                                 threadgroup=(32, 1, 1), template=[("N", 32)]).outputs[0]

    def fn(x: mx.array, y: mx.array) -> mx.array:
        return call(x).astype(mx.float32) + call(y)

    assert mx.allclose(fn(a, b), mx.full((32,), 8.0))
    cf = gk.compile(fn)
    assert mx.allclose(cf(a, b), mx.full((32,), 8.0))
    assert len(cf.graph.kernels()) == 2
    a2 = mx.arange(32).astype(mx.bfloat16)
    assert mx.allclose(call(a2).astype(mx.float32), mx.arange(32) * 2.0)


def test_chain_of_kernels_and_ops_compiled() -> None:
    """Kernels feeding MLX ops feeding kernels, in one compiled graph (several inputs/outputs)."""
    x, y = _normal((4096,)), _normal((4096,), seed=8)
    spec = [gk.OutputSpec(x.shape, x.dtype)]
    kw = dict(grid=(4096, 1, 1), threadgroup=(256, 1, 1))

    def fn(x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        a = gk.apply_in_graph(AFFINE, [x], spec, template=[("T", mx.float32), ("N", 4096)], **kw)[0]
        b = mx.sin(a) * y
        c = gk.apply_in_graph(COPY_PLUS, [b], spec, template=[("N", 4096)], **kw)[0]
        return c, a

    want = [mx.sin(x * 2 + 1) * y + 1, x * 2 + 1]
    cf = gk.compile(fn)
    for _ in range(2):
        got = cf(x, y)
        assert_close(list(got), want, "chain")
    g = cf.graph
    assert len(g.kernels()) == 2 and g.status == gk.Status.OK
    for k in (AFFINE, COPY_PLUS):
        check_kernel_node(g, k)


def test_eager_launches_from_several_threads(two_live_threads: Any) -> None:
    """The same launch from two live threads, eagerly and repeatedly: each thread replays its own
    compiled form (MLX's compile cache is per thread) and gets its own inputs' results. The
    threads take turns (the fixture's lock): this is about graphkern's forms, not MLX's
    concurrency."""
    seeds = iter((1, 2))

    def work() -> tuple[int, list[Any], Any]:
        seed = next(seeds)
        x = mx.arange(1024, dtype=mx.float32) * seed  # here: default streams are per thread
        spec = [gk.OutputSpec(x.shape, x.dtype)]
        outs = [gk.apply(COPY_PLUS, [x + i], spec, grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                         template=[("N", 1024)], backend=BACKEND)[0] for i in range(4)]
        return seed, [np.array(o) for o in outs], np.array(x)

    results, _ = two_live_threads(work)
    assert sorted(seed for seed, _, _ in results) == [1, 2]  # neither thread failed
    for seed, outs, x in results:
        for i, out in enumerate(outs):
            np.testing.assert_allclose(out, x + i + 1, rtol=1e-6, err_msg=f"thread {seed}, call {i}")


def test_a_bound_launch_replays_on_the_gpu_and_differentiates_through_the_reference() -> None:
    """``gk.bind``: the configuration checked once; eager calls replay the compiled launch on new
    inputs, ``mx.grad`` goes through the reference's vjp, ``without_vjp`` launches plain, and a
    trace records the kernel node."""
    spec = [gk.OutputSpec((4096,), mx.float32)]
    bound = gk.bind(AFFINE, spec, grid=(4096, 1, 1), threadgroup=(256, 1, 1),
                    template=[("T", mx.float32), ("N", 4096)], backend=BACKEND)
    assert bound.launch.backend == BACKEND
    xs = [_normal((4096,), seed=s) for s in range(3)]
    for x in xs:
        assert_close(bound(x), [x * 2 + 1], "bound launch")
    grad = mx.grad(lambda v: (bound(v)[0] * v).sum())(xs[0])  # d/dv (2v + 1) v = 4v + 1
    assert_close([grad], [xs[0] * 4 + 1], "gradient through a bound launch")
    with gk.without_vjp():
        for x in xs:
            assert_close(bound(x), [x * 2 + 1], "bound launch without vjp")
    graph = gk.trace(lambda v: bound(v)[0] + 1, xs[1])
    assert graph.ok
    check_kernel_node(graph, AFFINE)
