"""The kernel library on the GPU: every CUDA kernel against its reference, all dtypes and layouts.

Runs where ``mx.cuda.is_available()`` (the ``gpu`` marker skips elsewhere); with
GRAPHKERN_GPU_DRYRUN=1 on a CPU machine the same tests run their references instead.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import pytest
from kernels_fixture import misaligned

import graphkern.kernels as gkk
from graphkern.debugging.kernel_checks import TOLERANCES, check_kernel
from graphkern.debugging.tolerance import worst_errors
from graphkern.kernels import LIBRARY, Case, LibraryEntry, apply_plan
from graphkern.kernels.ops.rope_qk import stock_prologue
from graphkern.models import patch

pytestmark = pytest.mark.gpu

CUDA = mx.cuda.is_available()
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# Every NVRTC compile costs seconds, so the shapes are chosen to cover each code path once per
# dtype: a warp-only row (4x64), vectorized rows in registers (64x4096), rows that fit no vector
# width (4097: scalar path), streamed rows (> 8192 elements), and odd elementwise sizes.
ROWS: list[tuple[int, ...]] = [(4, 64), (64, 4096), (3, 4097), (2, 20000)]
GPU_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "rms_norm": ROWS,
    "layer_norm": ROWS,
    "layer_norm_no_bias": [(64, 4096), (3, 4097)],
    "add_rms_norm": ROWS,
    # + rows kept in shared memory: float32 up to 16384 elements, 16-bit 16384-32768 (2x20000)
    "softmax": [(4, 64), (64, 4096), (3, 4097), (2, 20000), (2, 50000)],
    "rope": [(2, 8, 64, 128), (2, 2, 7, 100)],
    "rope_traditional": [(2, 8, 64, 128), (2, 2, 7, 100)],
    # (B, L, query features): 32 heads of 128 at one token and at 64; 4 heads of 128; heads of 32
    "rope_qk": [(1, 1, 4096), (2, 64, 4096), (3, 5, 96)],
    "rope_qk_norm": [(1, 1, 4096), (2, 64, 4096), (3, 5, 96)],
    "swiglu": [(64, 14336), (3, 1001)],
    "gelu": [(64, 4096), (3, 1001)],
    "gelu_approx": [(64, 4096)],
    # decoding rows: one token of 2048, 8 rows of 512 (16-byte vectors), 3 rows of 100 (8-byte), 99
    # (scalar)
    "norm_projections": [(1, 1, 2048), (8, 512), (3, 100), (2, 99)],
    "norm_swiglu": [(1, 1, 2048), (8, 512), (3, 100), (2, 99)],
    # the same body as norm_swiglu's, gating with the exact and the tanh GELU
    "norm_geglu": [(1, 1, 2048), (8, 512), (3, 100), (2, 99)],
    "norm_geglu_approx": [(1, 1, 2048), (8, 512), (2, 99)],
    # quantized weights (4-bit, groups of 64): one token of 2048, 8 rows of 1024 (of 512 on Metal,
    # whose 32 KB of threadgroup memory holds 8 float32 rows of 1024 but not the reduction's
    # scratch beside them), 3 rows of 256 (tests/gpu/test_quantized_gpu.py takes the rest)
    "quantized_norm_projections": [(1, 1, 2048), (8, 1024 if CUDA else 512), (3, 256)],
    "quantized_norm_swiglu": [(1, 1, 2048), (8, 1024 if CUDA else 512), (3, 256)],
    "quantized_norm_geglu": [(1, 1, 2048), (8, 1024 if CUDA else 512), (3, 256)],
    "quantized_norm_geglu_approx": [(1, 1, 2048), (8, 1024 if CUDA else 512), (3, 256)],
    # the same with the RoPE of queries and keys: one token, 2 sequences of 4 tokens, 8 tokens (Metal
    # as above)
    "quantized_norm_rope_projections": [(1, 1, 2048), (2, 4, 1024 if CUDA else 512), (1, 8, 256)],
    # the product alone: one token of 5120 (16 warps a block), 8 rows (Metal as above), 3 rows of 256
    "quantized_matvec": [(1, 1, 5120), (8, 1024 if CUDA else 512), (3, 256)],
    # router logits: Mixtral's 8 experts (top 2 of the logits) at one token and at 2x37 (a partial
    # last block); Qwen 3 MoE's 128 and 1000 experts (top 8 of the softmax, several per lane)
    "moe_route": [(1, 1, 8), (2, 37, 8), (5, 128), (3, 1000)],
}


def _assert_ran_natively(report_backends: list[str]) -> None:
    if CUDA:
        assert report_backends == ["cuda"], report_backends


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_kernel_matches_reference_all_dtypes_and_layouts(name: str) -> None:
    report = check_kernel(name, shapes=GPU_SHAPES[name], dtypes=DTYPES)
    print(report)
    _assert_ran_natively(report.backends)
    assert {c.layout for c in report.cases} == {"contiguous", "strided"}
    assert report.ok, "\n".join(map(str, report.failures))


@pytest.mark.parametrize("name", sorted(n for n in LIBRARY if not n.startswith("quantized")))
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_pointers_take_the_scalar_path(name: str, dtype: mx.Dtype) -> None:
    """Every array input one element past an aligned address: the narrow loads, the reference's
    result (on the aligned arrays). The quantized entries: test_quantized_gpu, at their tolerances."""
    entry = LIBRARY[name]
    shape = GPU_SHAPES[name][0]
    base = entry.make_inputs(shape, dtype, mx.random.key(3))
    case = Case(misaligned(base.args), base.kwargs)
    out = apply_plan(entry.plan(*case.args, **case.kwargs))
    ref = apply_plan(entry.plan(*base.args, **base.kwargs), "reference")
    atol, rtol = TOLERANCES[dtype]
    assert worst_errors(out, ref, rtol=rtol, atol=atol)[2]


# The stock MLX op on the same device: the library must agree with what it replaces.
STOCK_TOL = {mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 2e-3), mx.bfloat16: (3e-2, 2e-2)}


def _stock_agree(entry: LibraryEntry, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    case = entry.make_inputs(shape, dtype, mx.random.key(7))
    ours, stock = entry(case), entry.stock_outputs(case)
    atol, rtol = STOCK_TOL[dtype]
    max_abs, _, ok = worst_errors(ours, stock, rtol=rtol, atol=atol)
    assert ok, f"{entry.name} {shape} {dtype}: max abs err vs stock {max_abs}"


@pytest.mark.parametrize("name", sorted(LIBRARY))
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_agrees_with_stock_mlx_on_device(name: str, dtype: mx.Dtype) -> None:
    entry = LIBRARY[name]
    _stock_agree(entry, GPU_SHAPES[name][0], dtype)


@pytest.mark.parametrize("shape", [(1, 1, 2048), (8, 512)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_projections_biases_agree_with_stock_on_device(shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    """``norm_projections`` with Qwen 2's biases (one row streamed, eight staged) against stock's
    products plus their biases on the device."""
    entry = LIBRARY["norm_projections"]
    case = entry.make_inputs(shape, dtype, mx.random.key(7))
    biases = [mx.random.normal((m.shape[0],), key=mx.random.key(i)).astype(dtype)
              for i, m in enumerate(case.args[2])]
    biased = Case(case.args, {**case.kwargs, "biases": biases})
    atol, rtol = STOCK_TOL[dtype]
    # CUDA's float32 products of more than one row round in TF32 (MLX_ENABLE_TF32); the CPU's
    # are exact, and so are the kernel's
    with mx.stream(mx.cpu if dtype == mx.float32 else mx.default_device()):
        stock = entry.stock_outputs(biased)
        mx.eval(stock)
    max_abs, _, ok = worst_errors(entry(biased), stock, rtol=rtol, atol=atol)
    assert ok, f"{shape} {dtype}: max abs err vs stock {max_abs}"


def test_rope_per_batch_offsets_and_freqs_match_mx_fast() -> None:
    x = mx.random.normal((3, 2, 5, 64), key=mx.random.key(1))
    offset = mx.array([0, 5, 17], dtype=mx.int32)
    for traditional in (False, True):
        ours = gkk.rope(x, 64, traditional=traditional, base=500000.0, scale=1.0, offset=offset)
        stock = mx.fast.rope(x, 64, traditional=traditional, base=500000.0, scale=1.0, offset=offset)
        assert mx.allclose(ours, stock, atol=2e-5, rtol=2e-5).item()
    freqs = mx.linspace(1.0, 100.0, 32)
    ours = gkk.rope(x, 64, traditional=False, base=None, scale=1.0, offset=3, freqs=freqs)
    stock = mx.fast.rope(x, 64, traditional=False, base=None, scale=1.0, offset=3, freqs=freqs)
    assert mx.allclose(ours, stock, atol=2e-5, rtol=2e-5).item()


def test_compiled_function_with_kernels_equals_eager() -> None:
    w = mx.random.normal((512,)).astype(mx.bfloat16)

    def block(x: mx.array, r: mx.array) -> mx.array:
        h, y = gkk.add_rms_norm(x, r, w)
        return gkk.softmax(gkk.swiglu(y, gkk.gelu(h)))

    x, r = (mx.random.normal((8, 512), key=mx.random.key(i)).astype(mx.bfloat16) for i in (1, 2))
    eager = block(x, r)
    compiled: Callable[[mx.array, mx.array], mx.array] = mx.compile(block)
    assert mx.array_equal(compiled(x, r), eager).item()


def _max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "su_scaled", "proportional",
                                  "dynamic_ntk"])
def test_every_mlx_lm_rope_layer_patched_equals_stock_on_device(name: str, traditional: bool) -> None:
    """The kernel computes its frequencies as MLX's GPU RoPE does, so it agrees with mx.fast.rope at
    positions up to 32k (with host-side tables it differed by ulps, visible through MoE routing)."""
    pytest.importorskip("mlx_lm")
    from rope_layers import OFFSETS, ROPES

    stock = ROPES[name](traditional)
    model = nn.Sequential(stock)
    patch(model)
    fast = model.layers[0]
    worst = 0.0
    # one token (MLX's single-row kernel), several, a partial rotation
    for shape in ((1, 8, 1, 64), (2, 3, 5, 64), (2, 3, 5, 80)):
        x = mx.random.normal(shape, key=mx.random.key(shape[-1]))
        for offset in OFFSETS:
            worst = max(worst, _max_diff(fast(x, offset=offset), stock(x, offset=offset)))
        if name != "dynamic_ntk":
            per_batch = mx.array([5, 32000][:shape[0]], dtype=mx.int32)
            worst = max(worst, _max_diff(fast(x, offset=per_batch), stock(x, offset=per_batch)))
    print(f"{name} traditional={traditional}: max |patched - stock| = {worst:.3g}")
    assert worst <= 1e-5


PROLOGUES: list[dict[str, object]] = [
    {"offset": 5},
    {"traditional": True, "offset": 32760},
    {"dims": 64, "scale": 0.5, "offset": 4093},
    {"base": None, "freqs": mx.exp(mx.linspace(0.0, 9.0, 64)), "input_scale": 1.1386, "offset": 30000},
    {"norm": True, "base": 1e6, "offset": 17},
    {"norm": True, "dims": 96, "traditional": True, "offset": mx.array([3, 20000], dtype=mx.int32)},
]


# (tokens, KV heads): one warp a head when decoding; in longer calls a warp takes 2 or 4 heads
@pytest.mark.parametrize(("length", "kv_heads"), [(1, 2), (33, 2), (33, 4)])
@pytest.mark.parametrize("options", PROLOGUES, ids=lambda o: ",".join(o))
def test_rope_qk_equals_the_stock_prologue_on_device(options: dict[str, object], length: int,
                                                     kv_heads: int) -> None:
    options = dict(options)
    dims = options.pop("dims", 128)
    kq, kk, kw = mx.random.split(mx.random.key(length), 3)
    q = mx.random.normal((2, length, 8 * 128), key=kq)
    k = mx.random.normal((2, length, kv_heads * 128), key=kk)
    if options.pop("norm", False):
        weights = 1.0 + 0.5 * mx.random.normal((2, 128), key=kw)
        options.update(q_weight=weights[0], k_weight=weights[1], eps=1e-6)
    ours = gkk.rope_qk(q, k, 8, kv_heads, dims, **options)  # type: ignore[arg-type]
    stock = stock_prologue(q, k, 8, kv_heads, dims, **options)  # type: ignore[arg-type]
    worst = max(_max_diff(a, b) for a, b in zip(ours, stock))
    print(f"rope_qk {options} L={length} kv_heads={kv_heads}: max |fused - stock| = {worst:.3g}")
    assert worst <= 1e-5
