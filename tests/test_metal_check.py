"""The Metal check: MLX's generated text reproduced exactly, the front end calibrated on MLX's own
examples and on planted mistakes, every library source passing, and the four Metal defects it found
fixed (each with its own test)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

import graphkern as gk
from graphkern.kernels import LIBRARY
from graphkern.kernels.base import THREADGROUP_MEMORY
from graphkern.launching.backends import using_backend
from graphkern.launching.mlx_kernels import build_mlx_kernel
from graphkern.launching.source_text import for_backend
from graphkern.metal_check import check_library_metal, check_metal, metal_source
from graphkern.metal_check.frontend import _THREAD_METHOD
from graphkern.metal_check.variants import library_variants
from graphkern.nodes import Kernel, KernelError, OutputSpec, Status, TemplateArg

pytest.importorskip("clang.cindex")

F32 = mx.float32


def _errors(kernel: Kernel, inputs: list[mx.array], outputs: list[OutputSpec],
            template: list[TemplateArg] | tuple[()] = ()) -> list[str]:
    return [str(d) for d in check_metal(kernel, inputs, outputs, template).checks[0].diagnostics]


# ----------------------------------------------------------------------------- MLX's text, exactly


def _mlx_generated(kernel: Kernel, inputs: tuple[mx.array, ...], specs: tuple[OutputSpec, ...],
                   template: tuple[TemplateArg, ...]) -> tuple[str, str]:
    """(name, source) of the CustomKernel primitive MLX records for this launch (export works
    without Metal)."""
    events: list[dict] = []

    def launch(*arrays: mx.array) -> list[mx.array]:
        mlx_kernel = build_mlx_kernel("metal", kernel)
        return mlx_kernel(inputs=list(arrays), output_shapes=[s.shape for s in specs],
                          output_dtypes=[s.dtype for s in specs], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                          template=[t.as_mlx() for t in template])

    arrays = tuple(a if isinstance(a, mx.array) else mx.array(a) for a in inputs)
    mx.export_function(events.append, launch, *arrays)
    primitive = next(e for e in events if e["type"] == "primitive" and e["name"] == "CustomKernel")
    return primitive["arguments"][0], primitive["arguments"][1]


def test_generated_text_is_mlxs_for_every_library_kernel() -> None:
    """One launch of every entry and option, tiny (constant-memory inputs) and large: the text and
    name equal what MLX's metal_kernel builds, compared through mx.export_function."""
    seen: set[tuple[str, int, bool]] = set()
    compared = 0
    for v in library_variants(dtypes=[mx.float16]):
        small = min(a.size if isinstance(a, mx.array) else 1 for a in v.plan.inputs) < 8
        if (v.entry, v.option, small) in seen:
            continue
        seen.add((v.entry, v.option, small))
        name, text = _mlx_generated(v.plan.kernel, v.plan.inputs, v.plan.output_specs, v.plan.template)
        assert (v.source.name, v.source.text) == (name, text), v.describe()
        compared += 1
    assert compared >= 2 * len(LIBRARY)


def test_generated_text_is_mlxs_for_shapes_scalars_and_atomics() -> None:
    k = Kernel("mixed", ["x", "w", "s"], ["y", "z"], atomic_outputs=True,
               metal="uint i = thread_position_in_grid.x; atomic_store_explicit(&y[i], x[i] * w[0], "
                     "memory_order_relaxed); atomic_store_explicit(&z[i], float(x_shape[0]) + s, "
                     "memory_order_relaxed);")
    inputs = (mx.zeros(16), mx.zeros(2, mx.float16), mx.array(2.0))
    specs = (OutputSpec((16,), F32), OutputSpec((16,), F32))
    template = (TemplateArg("T", mx.bfloat16), TemplateArg("N", 3), TemplateArg("B", True))
    source = metal_source(k, inputs, specs, template)
    assert (source.name, source.text) == _mlx_generated(k, inputs, specs, template)
    assert "const constant float16_t* w" in source.text and "const constant float& s" in source.text
    assert check_metal(k, list(inputs), list(specs), template).ok


# ----------------------------------------------------------------------------- calibration

_MYEXP = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""
_MYEXP_STRIDED = """
    uint elem = thread_position_in_grid.x;
    // Utils from `mlx/backend/metal/kernels/utils.h` are automatically included
    uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
    T tmp = inp[loc];
    // Output arrays are always row contiguous
    out[elem] = metal::exp(tmp);
"""
_GRID_SAMPLE = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    int gH = grid_shape[1];
    int gW = grid_shape[2];
    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;
    uint grid_idx = elem / C * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;
    int ix_nw = floor(ix);
    int iy_nw = floor(iy);
    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;
    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;
    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;
    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);
    int batch_idx = elem / C / gH / gW * b_stride;
    int channel_idx = elem % C;
    int base_idx = batch_idx + channel_idx;
    T I_nw = x[base_idx + iy_nw * h_stride + ix_nw * w_stride];
    T I_ne = x[base_idx + iy_ne * h_stride + ix_ne * w_stride];
    T I_sw = x[base_idx + iy_sw * h_stride + ix_sw * w_stride];
    T I_se = x[base_idx + iy_se * h_stride + ix_se * w_stride];
    I_nw = iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1 ? I_nw : 0;
    I_ne = iy_ne >= 0 && iy_ne <= H - 1 && ix_ne >= 0 && ix_ne <= W - 1 ? I_ne : 0;
    I_sw = iy_sw >= 0 && iy_sw <= H - 1 && ix_sw >= 0 && ix_sw <= W - 1 ? I_sw : 0;
    I_se = iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1 ? I_se : 0;
    out[elem] = nw * I_nw + ne * I_ne + sw * I_sw + se * I_se;
"""
_GRID_SAMPLE_GRAD = """
    uint elem = thread_position_in_grid.x;
    int H = x_shape[1];
    int W = x_shape[2];
    int C = x_shape[3];
    // Pad C to the nearest larger simdgroup size multiple
    int C_padded = ceildiv(C, threads_per_simdgroup) * threads_per_simdgroup;
    int gH = grid_shape[1];
    int gW = grid_shape[2];
    int w_stride = C;
    int h_stride = W * w_stride;
    int b_stride = H * h_stride;
    uint grid_idx = elem / C_padded * 2;
    float ix = ((grid[grid_idx] + 1) * W - 1) / 2;
    float iy = ((grid[grid_idx + 1] + 1) * H - 1) / 2;
    int ix_nw = floor(ix);
    int iy_nw = floor(iy);
    int ix_ne = ix_nw + 1;
    int iy_ne = iy_nw;
    int ix_sw = ix_nw;
    int iy_sw = iy_nw + 1;
    int ix_se = ix_nw + 1;
    int iy_se = iy_nw + 1;
    T nw = (ix_se - ix)    * (iy_se - iy);
    T ne = (ix    - ix_sw) * (iy_sw - iy);
    T sw = (ix_ne - ix)    * (iy    - iy_ne);
    T se = (ix    - ix_nw) * (iy    - iy_nw);
    int batch_idx = elem / C_padded / gH / gW * b_stride;
    int channel_idx = elem % C_padded;
    int base_idx = batch_idx + channel_idx;
    T gix = T(0);
    T giy = T(0);
    if (channel_idx < C) {
        int cot_index = elem / C_padded * C + channel_idx;
        T cot = cotangent[cot_index];
        if (iy_nw >= 0 && iy_nw <= H - 1 && ix_nw >= 0 && ix_nw <= W - 1) {
            int offset = base_idx + iy_nw * h_stride + ix_nw * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], nw * cot, memory_order_relaxed);
            T I_nw = x[offset];
            gix -= I_nw * (iy_se - iy) * cot;
            giy -= I_nw * (ix_se - ix) * cot;
        }
        if (iy_se >= 0 && iy_se <= H - 1 && ix_se >= 0 && ix_se <= W - 1) {
            int offset = base_idx + iy_se * h_stride + ix_se * w_stride;
            atomic_fetch_add_explicit(&x_grad[offset], se * cot, memory_order_relaxed);
            T I_se = x[offset];
            gix += I_se * (iy - iy_nw) * cot;
            giy += I_se * (ix - ix_nw) * cot;
        }
    }
    T gix_mult = W / 2;
    T giy_mult = H / 2;
    // Reduce across each simdgroup first.
    gix = simd_sum(gix);
    giy = simd_sum(giy);
    if (thread_index_in_simdgroup == 0) {
        atomic_fetch_add_explicit(&grid_grad[grid_idx], gix * gix_mult, memory_order_relaxed);
        atomic_fetch_add_explicit(&grid_grad[grid_idx + 1], giy * giy_mult, memory_order_relaxed);
    }
"""


def test_mlx_documentation_examples_parse_without_errors() -> None:
    """MLX's custom Metal kernel guide, launched as it launches them: zero errors."""
    a = mx.zeros((4, 16), mx.float16)
    t32 = [TemplateArg("T", F32)]
    myexp = Kernel("myexp", ["inp"], ["out"], metal=_MYEXP)
    assert _errors(myexp, [a], [OutputSpec(a.shape, a.dtype)], t32) == []
    strided = Kernel("myexp_strided", ["inp"], ["out"], metal=_MYEXP_STRIDED, ensure_row_contiguous=False)
    assert _errors(strided, [a[::2]], [OutputSpec((2, 16), a.dtype)], t32) == []
    x, grid = mx.zeros((8, 32, 32, 64)), mx.zeros((8, 16, 16, 2))
    forward = Kernel("grid_sample", ["x", "grid"], ["out"], metal=_GRID_SAMPLE)
    assert _errors(forward, [x, grid], [OutputSpec((8, 16, 16, 64), F32)], t32) == []
    backward = Kernel("grid_sample_grad", ["x", "grid", "cotangent"], ["x_grad", "grid_grad"],
                      metal=_GRID_SAMPLE_GRAD, atomic_outputs=True)
    cot = mx.zeros((8, 16, 16, 64))
    specs = [OutputSpec(x.shape, F32), OutputSpec(grid.shape, F32)]
    assert _errors(backward, [x, grid, cot], specs, t32) == []


_ROW = [mx.zeros(64)]
_OUT = [OutputSpec((64,), F32)]
_PLANTED = {
    "device pointer where threadgroup is declared": (
        "inline float first(threadgroup float* p) { return p[0]; }",
        "uint i = thread_position_in_grid.x;\ny[i] = first(x);", _ROW, [], "no matching function"),
    "constant pointer where device is declared": (
        "inline float first(const device float* p) { return p[0]; }",
        "uint i = thread_position_in_grid.x;\ny[i] = first(x);", [mx.zeros(4)], [], "no matching function"),
    "half as a name": (
        "", "int half = 2;\ny[thread_position_in_grid.x] = x[0] * half;", _ROW, [], ""),
    "float to bfloat implicitly": (
        "", "uint i = thread_position_in_grid.x;\nT v = x[i] * 1.5f;\ny[i] = static_cast<float>(v);", _ROW,
        [TemplateArg("T", mx.bfloat16)], "bfloat"),
    "writing to constant memory": (
        "", "uint i = thread_position_in_grid.x;\nx[i] = 1.0f;\ny[i] = 0.0f;", [mx.zeros(4)], [], ""),
    "wrong vector arity": (
        "", "uint i = thread_position_in_grid.x;\nfloat4 v = float3(x[i]);\ny[i] = v.x;", _ROW, [], ""),
    "threadgroup memory over 32 KiB": (
        "", "threadgroup float big[8192];\nthreadgroup float red[32];\nuint i = thread_position_in_grid.x;\n"
            "big[i] = x[i];\ny[i] = big[i] + red[0];", _ROW, [], "threadgroup memory 32896 B"),
    "threadgroup memory over 32 KiB in a templated array": (  # its text has no space after the >
        "template <typename T, int N> struct Tile { T v[N]; };",
        "threadgroup Tile<float, 4096> big[3];\nuint i = thread_position_in_grid.x;\n"
        "big[0].v[i] = x[i];\ny[i] = big[0].v[i];", _ROW, [], "threadgroup memory 49152 B"),
    "pointer parameter without an address space": (
        "inline float first(const float* p) { return p[0]; }",
        "uint i = thread_position_in_grid.x;\nfloat v = x[i];\ny[i] = first(&v);", _ROW, [], "address space"),
}


@pytest.mark.parametrize("mistake", list(_PLANTED))
def test_planted_mistake_is_caught_at_its_line(mistake: str) -> None:
    header, body, inputs, template, words = _PLANTED[mistake]
    kernel = Kernel("planted", ["x"], ["y"], metal=body, header=header)
    found = check_metal(kernel, inputs, _OUT, template).checks[0].diagnostics
    assert found, f"{mistake}: not caught"
    assert words in " ".join(d.message for d in found)
    assert found[0].where in ("body", "header")
    assert found[0].where == "header" or found[0].line >= 1


def test_user_kernel_errors_name_the_body_line() -> None:
    body = "uint i = thread_position_in_grid.x;\nfloat v = x[i];\ny[i] = v + undefined_thing;"
    mine = Kernel("mine", ["x"], ["y"], metal=body)
    report = gk.check(mine, backend="metal", inputs=_ROW, output_specs=_OUT)
    (d,) = report.failures[0].diagnostics
    assert (d.where, d.line) == ("body", 3) and "undefined_thing" in d.message
    assert "body line 3" in str(report)
    with pytest.raises(KernelError, match="inputs="):
        gk.check(Kernel("mine", ["x"], ["y"], metal=body), backend="metal")


# ----------------------------------------------------------------------------- the library


@pytest.mark.slow
def test_every_library_metal_source_compiles() -> None:
    report = check_library_metal(jobs=2)
    assert len(report.checks) > 500
    assert report.ok, str(report)


def test_rope_metal_takes_freqs_and_offsets_in_constant_memory() -> None:
    """RoPE's Metal helpers named a parameter `half` and took only device pointers: every RoPE failed."""
    x = mx.zeros((1, 2, 3, 8), mx.float16)
    with using_backend("metal"):
        plan = LIBRARY["rope"].plan(x, 8, freqs=mx.array([1.0, 2.0, 3.0, 4.0]), base=None)
    assert any(isinstance(a, mx.array) and a.size < 8 and a.dtype == F32 for a in plan.inputs)
    assert check_metal(plan.kernel, plan.inputs, plan.output_specs, plan.template).ok
    text = metal_source(plan.kernel, plan.inputs, plan.output_specs, plan.template).text
    assert not re.search(r"\bhalf\b(?!_)\s*[,)=;]", text)


def test_rope_qk_metal_with_stand_in_norm_weights() -> None:
    q, k = mx.zeros((1, 1, 64), mx.bfloat16), mx.zeros((1, 1, 32), mx.bfloat16)
    with using_backend("metal"):
        plan = LIBRARY["rope_qk"].plan(q, k, 4, 2, 16, offset=3)
    assert check_metal(plan.kernel, plan.inputs, plan.output_specs, plan.template).ok


def test_zero_d_offset_array_runs_as_the_int_offset() -> None:
    """A 0-d offset would reach Metal as a reference the kernel cannot index: it travels as 1-d."""
    x = mx.random.normal((1, 2, 5, 8), key=mx.random.key(1))
    assert mx.array_equal(gk.kernels.rope(x, 8, offset=mx.array(6)), gk.kernels.rope(x, 8, offset=6))
    with using_backend("metal"):
        plan = LIBRARY["rope"].plan(x, 8, offset=mx.array(6))
    assert plan.inputs[1].ndim == 1
    assert check_metal(plan.kernel, plan.inputs, plan.output_specs, plan.template).ok


@pytest.mark.parametrize("name", ["norm_projections", "norm_swiglu"])
def test_projections_without_residual_compile_for_metal(name: str) -> None:
    """norm_rows took x and the residual as one pointer type: with no residual (a constant stand-in)
    its template could not be deduced."""
    case = LIBRARY[name].make_inputs((1, 1, 64), mx.float16, mx.random.key(0))
    with using_backend("metal"):
        plan = LIBRARY[name].plan(*case.args, **{**case.kwargs, "residual": None})
    assert check_metal(plan.kernel, plan.inputs, plan.output_specs, plan.template).ok


@pytest.mark.parametrize(("backend", "dtype", "k"), [("metal", F32, 8192), ("metal", mx.float16, 16384),
                                                     ("cuda", F32, 12288)])
def test_projection_plans_refuse_rows_past_threadgroup_memory(backend: str, dtype: mx.Dtype, k: int) -> None:
    """Rows of exactly the backend's limit plus the reduction scratch: refused before MLX sees them."""
    case = LIBRARY["norm_projections"].make_inputs((1, 1, k), dtype, mx.random.key(0))
    with using_backend(backend), pytest.raises(KernelError) as err:
        LIBRARY["norm_projections"].plan(*case.args, **case.kwargs)
    assert err.value.status == Status.INVALID_LAUNCH
    assert f"{backend} allows {THREADGROUP_MEMORY[backend]} B" in str(err.value)
    smaller = LIBRARY["norm_projections"].make_inputs((1, 1, k // 2), dtype, mx.random.key(0))
    with using_backend(backend):
        LIBRARY["norm_projections"].plan(*smaller.args, **smaller.kwargs)


def test_metal_check_command() -> None:
    from click.testing import CliRunner

    from graphkern.cli import main

    result = CliRunner().invoke(main, ["metal-check", "rms_norm", "-d", "float16", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert "rms_norm" in result.output and "pass the front-end check" in result.output
    result = CliRunner().invoke(main, ["metal-check", "no_such_kernel"])
    assert result.exit_code == 2 and "not library kernels" in result.output


def test_a_thread_qualified_method_in_a_user_header_parses() -> None:
    """Metal's ``thread``-qualified member functions, as MLX's complex type declares them, written
    in a user's header (whose text reaches MLX with no space before ``thread``)."""
    header = "struct Pair {\n  float a;\n  float first() const thread { return a; }\n};"
    body = "uint i = thread_position_in_grid.x;\nPair p{x[i]};\ny[i] = p.first();"
    assert _errors(Kernel("pair", ["x"], ["y"], metal=body, header=header), _ROW, _OUT) == []
    # the check's rewrite of the qualifier finds it in the text as MLX is handed it
    compact = for_backend(header.replace(" const", ""), "metal")
    assert "()thread{" in compact and "__generic" in _THREAD_METHOD.sub(r")\1 __generic", compact)
