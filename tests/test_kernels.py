"""The kernel library on CPU: references against stock MLX, validation, launch plans, graphs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.debugging.kernel_checks import strided
from graphkern.debugging.tolerance import worst_errors
from graphkern.kernels import LIBRARY, apply_plan
from graphkern.kernels import base as kernels_base
from graphkern.kernels.base import MAX_ROW_ITEMS, Plan, row_config, runs_on_cuda
from graphkern.kernels.ops import softmax as softmax_module
from graphkern.kernels.ops.rope import (
    OFFSET_BIAS,
    ROWS_PER_THREAD,
    SHAPED_OFFSET_SIZE,
    _base_frequencies,
    _offset_array,
    plan_rope,
)
from graphkern.kernels.ops.softmax import plan_softmax
from graphkern.nodes import KernelError, Status

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Tolerances against stock MLX, which rounds intermediates to the dtype in places where the
# library computes in float32 (e.g. nn.silu(g) * u rounds twice): about two ulps of the dtype.
STOCK_TOL = {mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 2e-3), mx.bfloat16: (3e-2, 2e-2)}


def assert_close(out: list[mx.array] | mx.array, ref: list[mx.array] | mx.array, dtype: mx.Dtype) -> None:
    outs = out if isinstance(out, list) else [out]
    refs = ref if isinstance(ref, list) else [ref]
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
    atol, rtol = STOCK_TOL[dtype]
    max_abs, max_rel, ok = worst_errors(outs, refs, rtol=rtol, atol=atol)
    assert ok, f"max abs err {max_abs}, max rel err {max_rel} over atol={atol} rtol={rtol}"


# ----------------------------------------------------------------------------- against stock MLX


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_matches_stock_mlx(name: str, dtype: mx.Dtype) -> None:
    entry = LIBRARY[name]
    for i, shape in enumerate(entry.shapes):
        case = entry.make_inputs(shape, dtype, mx.random.key(i))
        assert_close(entry(case), entry.stock_outputs(case), dtype)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_strided_inputs_give_the_contiguous_result(name: str) -> None:
    entry = LIBRARY[name]
    case = entry.make_inputs(entry.shapes[1], mx.float32, mx.random.key(0))
    strided_case = gkk.Case(tuple(strided(a) for a in case.args), case.kwargs)
    for a, b in zip(entry(case), entry(strided_case)):
        assert mx.array_equal(a, b).item()


def test_hand_computed_values() -> None:
    x = mx.array([[3.0, 4.0], [1.0, -1.0]])
    # rms([3, 4]) = sqrt(12.5); rms([1, -1]) = 1
    y = gkk.rms_norm(x, mx.array([1.0, 2.0]), eps=0.0)
    assert mx.allclose(y, mx.array([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)], [1.0, -2.0]])).item()
    # mean 2, var 1: normalized [-1, 1]
    assert gkk.layer_norm(mx.array([[1.0, 3.0]]), eps=0.0).tolist() == [[-1.0, 1.0]]
    h, y = gkk.add_rms_norm(mx.array([[1.0, 2.0]]), mx.array([[2.0, 2.0]]), eps=0.0)
    assert h.tolist() == [[3.0, 4.0]]
    assert mx.allclose(y, mx.array([[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]])).item()
    assert mx.allclose(gkk.softmax(mx.array([[0.0, math.log(3.0)]])), mx.array([[0.25, 0.75]])).item()
    assert mx.allclose(gkk.swiglu(mx.array([0.0, 1.0]), mx.array([5.0, 2.0])),
                       mx.array([0.0, 2.0 / (1.0 + math.exp(-1.0))])).item()
    assert mx.allclose(gkk.gelu(mx.array([1.0])), mx.array([0.5 * (1 + math.erf(1 / math.sqrt(2)))])).item()
    # position 0 with offset 0: RoPE is the identity
    x = mx.random.normal((1, 1, 1, 8))
    assert mx.allclose(gkk.rope(x, 8), x).item()


def test_softmax_is_safe_for_huge_and_masked_logits() -> None:
    x = mx.array([[1e4, 1e4 - 1.0, -float("inf")], [-1e4, -1e4, -1e4]])
    y = gkk.softmax(x)
    e = 1.0 / (1.0 + math.exp(-1.0))
    assert mx.allclose(y, mx.array([[e, 1 - e, 0.0], [1 / 3, 1 / 3, 1 / 3]])).item()
    for dtype in (mx.float16, mx.bfloat16):
        assert not mx.any(mx.isnan(gkk.softmax(x.astype(dtype)))).item()


def test_rope_offsets_frequencies_and_partial_rotation_match_mx_fast() -> None:
    x = mx.random.normal((3, 2, 5, 32), key=mx.random.key(4))
    offsets = mx.array([0, 4, 9], dtype=mx.int32)
    for traditional in (False, True):
        for dims in (32, 16):
            kw: dict[str, Any] = {"traditional": traditional, "base": 500000.0, "scale": 0.25}
            assert_close(gkk.rope(x, dims, offset=offsets, **kw),
                         mx.fast.rope(x, dims, offset=offsets, **kw), mx.float32)
            assert_close(gkk.rope(x, dims, offset=11, **kw), mx.fast.rope(x, dims, offset=11, **kw),
                         mx.float32)
    freqs = mx.linspace(1.0, 50.0, 16)
    assert_close(gkk.rope(x, 32, base=None, freqs=freqs, offset=2),
                 mx.fast.rope(x, 32, traditional=False, base=None, scale=1.0, offset=2, freqs=freqs),
                 mx.float32)


def test_rope_frequencies_are_mx_fast_fallbacks() -> None:
    inv = _base_frequencies(64, 10000.0)
    assert inv.shape == (32,) and inv.dtype == mx.float32
    assert inv[0].item() == 1.0
    assert abs(inv[-1].item() - 10000.0 ** (-31 / 32)) < 1e-9


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1234.5678])
def test_rope_reference_equals_mx_fast_on_the_cpu_bit_for_bit(traditional: bool, base: float) -> None:
    # float32 at positions up to 32k: any difference in the frequencies would show here
    x = mx.random.normal((2, 3, 8, 128), key=mx.random.key(5))
    for offset in (0, 4093, 32760):
        kw: dict[str, Any] = {"traditional": traditional, "base": base, "scale": 1.0, "offset": offset}
        assert mx.array_equal(gkk.rope(x, 128, **kw), mx.fast.rope(x, 128, **kw)).item()
    freqs = mx.exp(mx.linspace(0.0, 9.0, 32))
    kw = {"traditional": traditional, "base": None, "scale": 0.5, "offset": 30000, "freqs": freqs}
    assert mx.array_equal(gkk.rope(x, 64, **kw), mx.fast.rope(x, 64, **kw)).item()


def template_of(plan: Plan) -> dict[str, object]:
    """A plan's template arguments by name."""
    return {t.name: t.value for t in plan.template}


def test_cached_float_templates_keep_the_sign_of_zero() -> None:
    # 0.0 == -0.0 and they hash alike: a cache keyed on the float alone handed -0.0 the bits of 0.0
    x = mx.zeros((1, 2, 4, 8))
    bits = [template_of(plan_rope(x, 8, scale=s))["SCALE"] for s in (0.0, -0.0, 0.0)]
    assert bits == [0, -(2**31), 0]


def test_rope_launch_shares_angles_across_rows_unless_offsets_are_per_batch() -> None:
    x = mx.zeros((2, 3, 16, 128), mx.bfloat16)  # 6 rows of 16 positions, 64 pairs in 8 vectors of 8
    shared = template_of(plan_rope(x, 128))
    assert shared["R"] == ROWS_PER_THREAD == 4 and shared["V"] == 8 and shared["TW"] == 1
    assert plan_rope(x, 128).grid == (2 * 16 * 8, 1, 1)  # ceil(6 / 4) row groups x 16 positions x 8
    per_batch = plan_rope(x, 128, offset=mx.array([0, 5]))
    assert template_of(per_batch)["R"] == 1 and per_batch.grid == (6 * 16 * 8, 1, 1)
    assert plan_rope(mx.zeros((1, 0, 64)), 64).grid == (0, 1, 1)


def test_rope_partial_rotation_keeps_threads_per_row_and_copies_the_rest_in_vectors() -> None:
    x = mx.zeros((1, 4, 16, 128), mx.bfloat16)
    partial = template_of(plan_rope(x, 64))  # 32 pairs: 8 threads of 4 pairs
    assert partial["V"] == 4 and partial["TW"] == 8
    assert template_of(plan_rope(x, 4))["V"] == 1  # 2 pairs: one a thread
    assert template_of(plan_rope(mx.zeros((1, 1, 2, 100)), 64))["TW"] == 4


@pytest.mark.parametrize("offset", [0, 7, -3, 123_456])
def test_rope_int_offset_carried_in_a_shape_gives_the_same_rotation(offset: int) -> None:
    # On CUDA an int offset travels as the shape of an empty array (no read of host-mapped memory).
    x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(1))
    plan = plan_rope(x, 64, offset=offset)
    carried = _offset_array(offset, True)
    assert carried.size == 0 and carried.shape == (0, offset + OFFSET_BIAS)
    shaped = replace(plan, inputs=(x, carried, plan.inputs[2]), template=tuple(
        replace(t, value=True) if t.name == "SHAPED_OFFSET" else t for t in plan.template))
    assert template_of(plan)["SHAPED_OFFSET"] is runs_on_cuda()  # on CUDA only
    assert_close(apply_plan(shaped, "reference"), mx.fast.rope(x, 64, traditional=False, base=10000.0,
                                                               scale=1.0, offset=offset), mx.float32)


def test_rope_refuses_an_offset_no_kernel_can_carry() -> None:
    with pytest.raises(KernelError, match=r"rope.*offset must be in"):
        plan_rope(mx.zeros((1, 2, 4)), 4, offset=2**30)


def test_softmax_streams_long_float32_rows_with_8_byte_accesses() -> None:
    def launch(n: int, dtype: mx.Dtype) -> dict[str, object]:
        return template_of(plan_softmax(mx.zeros((2, n), dtype)))

    assert launch(32768, mx.float32) == {"T": mx.float32, "NT": 1024, "V": 2, "CH": 0, "SHARED": False}
    assert launch(16384, mx.bfloat16)["V"] == 8


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[tuple[int, int]], None]]:
    """Plans as on a CUDA GPU of the given compute capability."""
    def use(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(kernels_base, "active_backend", lambda: "cuda")  # runs_on_cuda() reads it
        monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": capability[0],
                                                        "compute_capability_minor": capability[1]})
        softmax_module.shared_row_bytes.cache_clear()

    yield use
    softmax_module.shared_row_bytes.cache_clear()


def test_large_rope_int_offsets_travel_in_a_shape_where_the_kernel_runs_on_cuda(on_cuda: Any) -> None:
    on_cuda((9, 0))
    small = plan_rope(mx.zeros((1, 2, 4, 64)), 64, offset=9)  # an int32 input: one launch for all offsets
    assert template_of(small)["SHAPED_OFFSET"] is False and small.inputs[1].tolist() == [9]
    assert small.inputs[1] is plan_rope(mx.zeros((1, 2, 4, 64)), 64, offset=9).inputs[1]  # made once
    big = mx.zeros((1, 8, SHAPED_OFFSET_SIZE // 8 // 128, 128))
    plan = plan_rope(big, 128, offset=9)
    assert template_of(plan)["SHAPED_OFFSET"] is True and plan.inputs[1].shape == (0, 9 + OFFSET_BIAS)
    per_batch = plan_rope(big, 128, offset=mx.array([9]))  # an array offset stays an array
    assert template_of(per_batch)["SHAPED_OFFSET"] is False and per_batch.inputs[1].shape == (1,)


def test_softmax_keeps_rows_up_to_64_kib_in_shared_memory_on_an_h200(on_cuda: Any) -> None:
    on_cuda((9, 0))

    def plan(n: int, dtype: mx.Dtype = mx.float32) -> Plan:
        return plan_softmax(mx.zeros((3, n), dtype))

    assert template_of(plan(16384)) == {"T": mx.float32, "NT": 512, "V": 4, "CH": 0, "SHARED": True}
    assert plan(16384).kernel.shared_memory == 64 * 1024
    assert plan(4097).kernel.shared_memory == 20480 and template_of(plan(4097))["V"] == 1
    assert plan(4096).threadgroup == (256, 1, 1) and plan(4096).grid == (3 * 256, 1, 1)
    assert plan(4096).kernel is plan(4000).kernel  # one kernel object per 4 KiB of row
    assert plan(32000, mx.bfloat16).kernel.shared_memory == 64 * 1024  # a 32000-token vocabulary
    assert plan(16384, mx.float16).kernel.shared_memory == 32 * 1024
    for streamed in (plan(16385), plan(4096, mx.bfloat16), plan(16383, mx.float16), plan(32769, mx.bfloat16)):
        assert streamed.kernel is softmax_module.SOFTMAX and template_of(streamed)["SHARED"] is False
    # the reference (the oracle) sees neither launch detail
    x = mx.random.normal((3, 4096), key=mx.random.key(0))
    assert mx.allclose(apply_plan(replace(plan(4096), inputs=(x,)))[0], mx.softmax(x, axis=-1), atol=1e-6)


def test_softmax_rows_in_shared_memory_fit_three_blocks_an_sm_on_every_gpu(on_cuda: Any) -> None:
    # sm_75 allows at most 64 KB a block: a 64 KiB row (plus the reduction's floats) would not launch
    for capability, limit in (((7, 5), 20 * 1024), ((8, 6), 32 * 1024), ((8, 0), 52 * 1024),
                              ((12, 0), 32 * 1024), ((9, 0), 64 * 1024)):
        on_cuda(capability)
        assert softmax_module.shared_row_bytes() == limit
        widest = plan_softmax(mx.zeros((2, limit // 4)))
        assert widest.kernel.shared_memory == limit and template_of(widest)["SHARED"] is True
        assert template_of(plan_softmax(mx.zeros((2, limit // 4 + 1))))["SHARED"] is False


def test_zero_size_inputs_give_empty_outputs() -> None:
    x = mx.zeros((0, 16))
    assert gkk.rms_norm(x, mx.ones((16,))).shape == (0, 16)
    assert gkk.softmax(x).shape == (0, 16)
    assert gkk.gelu(mx.zeros((0,))).shape == (0,)


# ----------------------------------------------------------------------------- property tests

leading = st.lists(st.integers(1, 4), min_size=0, max_size=3)


@given(lead=leading, n=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_row_kernels_match_stock_for_any_shape(lead: list[int], n: int, dtype: mx.Dtype, seed: int) -> None:
    shape = (*lead, n)
    for name in ("rms_norm", "layer_norm", "layer_norm_no_bias", "add_rms_norm", "softmax"):
        entry = LIBRARY[name]
        case = entry.make_inputs(shape, dtype, mx.random.key(seed))
        assert_close(entry(case), entry.stock_outputs(case), dtype)


@given(lead=leading, n=st.integers(1, 300), dtype=st.sampled_from(DTYPES), approx=st.booleans())
def test_elementwise_kernels_match_stock_for_any_shape(lead: list[int], n: int, dtype: mx.Dtype,
                                                       approx: bool) -> None:
    shape = (*lead, n)
    g = (3 * mx.random.normal(shape)).astype(dtype)
    u = mx.random.normal(shape).astype(dtype)
    assert_close(gkk.swiglu(g, u), nn.silu(g) * u, dtype)
    assert_close(gkk.gelu(g, approx=approx), (nn.gelu_approx if approx else nn.gelu)(g), dtype)


@given(b=st.integers(1, 3), h=st.integers(1, 3), seq=st.integers(1, 9), half=st.integers(1, 40),
       extra=st.integers(0, 5), traditional=st.booleans(), offset=st.integers(0, 100),
       dtype=st.sampled_from(DTYPES))
def test_rope_matches_mx_fast_for_any_shape(b: int, h: int, seq: int, half: int, extra: int,
                                            traditional: bool, offset: int, dtype: mx.Dtype) -> None:
    dims = 2 * half
    x = mx.random.normal((b, h, seq, dims + extra)).astype(dtype)
    kw: dict[str, Any] = {"traditional": traditional, "base": 10000.0, "scale": 1.0, "offset": offset}
    # mx.fast.rope's CPU fallback rounds cos and sin to the dtype; the library (like MLX's GPU
    # kernels) computes in float32, so the oracle is the float32 rotation rounded once
    exact = mx.fast.rope(x.astype(mx.float32), dims, **kw).astype(dtype)
    assert_close(gkk.rope(x, dims, **kw), exact, dtype)


@given(lead=leading, n=st.integers(1, 200), dtype=st.sampled_from(DTYPES))
def test_softmax_rows_are_distributions(lead: list[int], n: int, dtype: mx.Dtype) -> None:
    x = (5 * mx.random.normal((*lead, n))).astype(dtype)
    y = gkk.softmax(x).astype(mx.float32)
    assert mx.all(y >= 0).item()
    atol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(y.sum(axis=-1), mx.ones(y.shape[:-1]), atol=atol).item()
    shifted = gkk.softmax(x.astype(mx.float32) + 100.0)  # shift invariance, no overflow
    assert mx.allclose(shifted, gkk.softmax(x.astype(mx.float32)), atol=1e-6).item()


@given(n=st.integers(1, 100_000), dtype=st.sampled_from(DTYPES), items=st.sampled_from([8, 16, 32]),
       vector=st.sampled_from([1, 4, 8]), streamed=st.booleans(), max_threads=st.sampled_from([512, 1024]))
def test_row_config_covers_the_row_within_register_and_block_limits(
        n: int, dtype: mx.Dtype, items: int, vector: int, streamed: bool, max_threads: int) -> None:
    cfg = row_config(n, dtype, vector=vector, items=items, streamed=streamed, max_threads=max_threads)
    assert cfg.threads & (cfg.threads - 1) == 0 and 32 <= cfg.threads <= max_threads
    assert n % cfg.vector == 0 and cfg.vector <= vector and cfg.vector * dtype.size <= 16
    if cfg.chunks:
        assert not streamed
        assert cfg.threads * cfg.vector * cfg.chunks >= n  # the whole row fits in registers
        assert cfg.chunks * cfg.vector <= MAX_ROW_ITEMS
    else:
        assert streamed or n > max_threads * MAX_ROW_ITEMS // 2  # streamed only when asked or long


# ----------------------------------------------------------------------------- plans and validation


def test_plan_is_one_block_per_row_with_vector_loads() -> None:
    x, w = mx.zeros((3, 5, 4096)), mx.ones((4096,))
    plan = gkk.ops.rms_norm.plan_rms_norm(x, w)
    assert plan.grid == (15 * 256, 1, 1) and plan.threadgroup == (256, 1, 1)
    assert plan.template_values == {"T": mx.float32, "NT": 256, "V": 4, "CH": 4, "HAS_W": True,
                                    "EPS": 925353388}  # 1e-5's float32 bits: a compile-time constant
    assert len(plan.inputs) == 2  # no scalar array for the GPU to fetch
    assert [s.shape for s in plan.output_specs] == [(3, 5, 4096)]


def test_every_kernel_has_three_backends_and_a_dual_header() -> None:
    for entry in LIBRARY.values():
        k = entry.kernel
        assert k.has_source("metal") and k.has_source("cuda") and k.reference is not None
        assert "#if defined(__CUDACC__)" in k.header and "#else" in k.header
        assert k.ensure_row_contiguous


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gkk.rms_norm(mx.ones((2, 8)), mx.ones((4,))), "weight has shape (4,)"),
        (lambda: gkk.rms_norm(mx.ones((2, 8)), mx.ones((8,), dtype=mx.float16)), "dtype mismatch"),
        (lambda: gkk.rms_norm(mx.ones((2, 8), dtype=mx.int32)), "int32"),
        (lambda: gkk.rms_norm(mx.ones((2, 8)), eps=-1.0), "eps"),
        (lambda: gkk.layer_norm(mx.ones((2, 8)), mx.ones((8,)), mx.ones((2, 8))), "bias has shape"),
        (lambda: gkk.add_rms_norm(mx.ones((2, 8)), mx.ones((2, 4))), "residual has shape"),
        (lambda: gkk.add_rms_norm(mx.ones((2, 8)), mx.ones((2, 8), dtype=mx.bfloat16)), "dtype mismatch"),
        (lambda: gkk.swiglu(mx.ones((2, 8)), mx.ones((2, 9))), "gate has shape"),
        (lambda: gkk.softmax(mx.array(1.0)), "at least one dimension"),
        (lambda: gkk.rope(mx.ones((4, 8)), 8), "at least 3 dimensions"),
        (lambda: gkk.rope(mx.ones((1, 4, 8)), 7), "dims must be a positive even int"),
        (lambda: gkk.rope(mx.ones((2, 4, 8)), 8, offset=mx.array([1, 2, 3])), "offset must be"),
        (lambda: gkk.rope(mx.ones((2, 4, 8)), 8, base=None), "exactly one of base and freqs"),
    ],
)
def test_invalid_arguments_raise_kernel_errors_naming_the_operation(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KernelError) as info:
        call()
    assert message in info.value.description
    assert info.value.operation in {"rms_norm", "layer_norm", "add_rms_norm", "swiglu", "softmax", "rope"}
    assert info.value.status == Status.INVALID_INPUT


# ----------------------------------------------------------------------------- in graphs


def test_library_kernels_are_single_nodes_in_a_trace_and_compile() -> None:
    w = mx.ones((64,))

    def block(x: mx.array, r: mx.array) -> mx.array:
        h, y = gkk.add_rms_norm(x, r, w)
        return gkk.softmax(gkk.swiglu(y, gkk.gelu(h)))

    x, r = mx.random.normal((4, 64)), mx.random.normal((4, 64))
    graph = gk.trace(block, x, r)
    names = [str(graph.node(n).get("kernel")) for n in graph.kernels()]
    assert sorted(names) == ["gk_add_rms_norm", "gk_gelu", "gk_softmax", "gk_swiglu"]
    compiled = gk.compile(block)
    assert mx.allclose(compiled(x, r), block(x, r)).item()


def test_apply_plan_on_the_reference_backend_is_the_oracle() -> None:
    entry = LIBRARY["layer_norm"]
    case = entry.make_inputs((3, 33), mx.bfloat16, mx.random.key(2))
    plan = entry.plan(*case.args, **case.kwargs)
    ref = apply_plan(plan, "reference")
    assert mx.array_equal(ref[0], entry(case)[0]).item()
