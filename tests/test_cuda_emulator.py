"""scripts/cuda_emulate.py: the library's CUDA bodies, as MLX generates them, run on the CPU (every
thread a fiber) against the kernels' references. The only check of the CUDA bodies' arithmetic that
needs no GPU; it needs a host C++ compiler."""

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import cuda_emulate  # noqa: E402 - a script, not a package module

from graphkern.debugging.tolerance import TOLERANCES, worst_errors  # noqa: E402
from graphkern.kernels.base import Plan, apply_plan, output_spec  # noqa: E402
from graphkern.kernels.ops import quantized_matvec  # noqa: E402
from graphkern.kernels.ops.projections import ACTIVATIONS, activation_float32  # noqa: E402
from graphkern.kernels.ops.quantized_projections import quantized_case  # noqa: E402
from graphkern.kernels.ops.quantized_rope_projections import rotated_case  # noqa: E402
from graphkern.kernels.registry import LIBRARY  # noqa: E402
from graphkern.launching.backends import using_backend  # noqa: E402
from graphkern.nodes import Kernel  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cuda_emulate.compiler() is None, reason="no host C++ compiler")]


def test_a_row_kernel_matches_its_reference() -> None:
    assert cuda_emulate.compare("rms_norm", (3, 96), mx.float32)[2]


#: The gated quantized entries and the arguments each takes besides its gate and up.
GATED = {"quantized_norm_swiglu": {}, "quantized_norm_geglu": {"approx": False},
         "quantized_norm_geglu_approx": {"approx": True}}


@pytest.mark.parametrize("name", ["quantized_norm_projections", *GATED, "quantized_norm_rope_projections"])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_of_one_quantization_group_match_the_reference(name: str, bits: int) -> None:
    """Eight rows of 128 features in groups of 128, float32: where MLX's own CUDA product is wrong
    on Hopper, the kernels' bodies give the dequantized product."""
    key = mx.random.key(bits)
    if name == "quantized_norm_rope_projections":
        case = rotated_case((1, 8, 128), mx.float32, key, group_size=128, bits=bits)
    else:
        case = quantized_case((8, 128), mx.float32, key, gated=name in GATED, group_size=128, bits=bits,
                              **GATED.get(name, {}))
    with using_backend("cuda"):
        plan = LIBRARY[name].plan(*case.args, **case.kwargs)
    atol, rtol = TOLERANCES[mx.float32]
    assert worst_errors(cuda_emulate.emulate(plan), apply_plan(plan, "reference"), rtol=rtol, atol=atol)[2]


@pytest.mark.parametrize("name", ["norm_swiglu", "norm_geglu", "norm_geglu_approx", "quantized_norm_swiglu",
                                  "quantized_norm_geglu", "quantized_norm_geglu_approx"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_the_gated_bodies_gate_with_their_own_activation(name: str, dtype: mx.Dtype) -> None:
    """SiLU, exact and tanh GELU, plain and quantized weights, each dtype, at one token of 2048 and 8
    rows of 256: against the float32 truth of what the kernels compute, the products rounded to the
    dtype, the activation and gating in float32, rounded once. (The quantized references are
    stock's, whose CPU products of 16-bit rows sum in the dtype; the kernels sum in float32.)"""
    entry = LIBRARY[name]
    for shape in ((1, 1, 2048), (8, 256)):
        case = entry.make_inputs(shape, dtype, mx.random.key(len(shape)))
        with using_backend("cuda"):
            plan = entry.plan(*case.args, **case.kwargs)
        out = cuda_emulate.emulate(plan)
        expected = [apply_plan(plan, "reference")[0], _gated_truth(case, plan.template_values["ACT"])]
        atol, rtol = TOLERANCES[dtype]
        assert worst_errors(out, expected, rtol=rtol, atol=atol)[2], (name, shape)
        assert plan.template_values["ACT"] == ACTIVATIONS.index(
            "silu" if "swiglu" in name else "gelu_approx" if name.endswith("approx") else "gelu")


def _gated_truth(case: Any, act: int) -> mx.array:
    """A gated call's output from float32 products of its rows normalized as the kernels normalize
    them: the quantized kernels in the dtype (``mx.fast.rms_norm``), the plain ones in float32,
    never rounded."""
    x, w, gate, up = case.args
    dtype = x.dtype
    h = (x + case.kwargs["residual"]).astype(mx.float32)
    if "bits" in case.kwargs:
        normed = mx.fast.rms_norm(h.astype(dtype), w, case.kwargs["eps"]).astype(mx.float32)
        group_size, bits = case.kwargs["group_size"], case.kwargs["bits"]
        g, u = (mx.quantized_matmul(normed, q, s.astype(mx.float32), b.astype(mx.float32), transpose=True,
                                    group_size=group_size, bits=bits) for q, s, b in (gate, up))
    else:
        inv = mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + case.kwargs["eps"])
        normed = h * inv * w.astype(mx.float32)
        g, u = normed @ gate.astype(mx.float32).T, normed @ up.astype(mx.float32).T
    gated = activation_float32(g.astype(dtype), act) * u.astype(dtype).astype(mx.float32)
    return gated.astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_the_projection_body_matches_its_reference_in_both_forms(dtype: mx.Dtype) -> None:
    """``norm_projections`` at one and two token rows (each warp normalizing as it streams its
    weight rows, two a warp where every weight's rows are even), three and eight (the rows staged in
    shared memory once a block), and features that take the vector path (256; 2304, nine vectors a
    lane, four at a time and then one by one) and the scalar one (100): each form against the
    reference, the norm and products in float32, every output rounded once."""
    entry = LIBRARY["norm_projections"]
    atol, rtol = TOLERANCES[dtype]
    for shape in ((1, 1, 256), (2, 256), (3, 100), (8, 256), (2, 100), (1, 2304)):
        case = entry.make_inputs(shape, dtype, mx.random.key(shape[0]))
        with using_backend("cuda"):
            plan = entry.plan(*case.args, **case.kwargs)
        assert worst_errors(cuda_emulate.emulate(plan), apply_plan(plan, "reference"), rtol=rtol,
                            atol=atol)[2], shape
    # one row, each warp two weight rows (every weight's rows even), or one (an odd count)
    case = entry.make_inputs((1, 2304), dtype, mx.random.key(9))
    x, w, mats = case.args
    for counts, paired in (((96, 32, 32), True), ((33, 7, 9), False)):
        weights = [m[:n] for m, n in zip(mats, counts)]
        with using_backend("cuda"):
            plan = entry.plan(x, w, weights, **case.kwargs)
        assert dict((t.name, t.value) for t in plan.template)["PAIRED"] is paired
        assert worst_errors(cuda_emulate.emulate(plan), apply_plan(plan, "reference"), rtol=rtol,
                            atol=atol)[2], counts


@pytest.mark.parametrize("bits", [4, 8])
def test_the_rotated_prologue_adds_the_projections_biases_before_the_rope(bits: int) -> None:
    """``quantized_norm_rope_projections`` with Qwen 2's biases, float32, one token and two: each
    bias added to its product (the keys' rotated with it), as the reference adds it before the RoPE."""
    entry = LIBRARY["quantized_norm_rope_projections"]
    for shape in ((1, 1, 256), (1, 2, 128)):
        case = rotated_case(shape, mx.float32, mx.random.key(bits), bits=bits)
        mats = case.args[2]
        biases = [mx.random.normal((m[0].shape[0],), key=mx.random.key(i)) for i, m in enumerate(mats)]
        with using_backend("cuda"):
            plan = entry.plan(*case.args, **case.kwargs, biases=biases)
            unbiased = entry.plan(*case.args, **case.kwargs)
        atol, rtol = TOLERANCES[mx.float32]
        expected = apply_plan(plan, "reference")
        assert worst_errors(cuda_emulate.emulate(plan), expected, rtol=rtol, atol=atol)[2], shape
        assert not worst_errors(apply_plan(unbiased, "reference"), expected, rtol=rtol, atol=atol)[2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_the_projection_body_adds_each_projections_bias(dtype: mx.Dtype) -> None:
    """``norm_projections`` with a bias a weight (Qwen 2's), streamed (one row) and staged (eight):
    each product rounded, its bias added and the sum rounded, as ``nn.Linear`` adds it."""
    entry = LIBRARY["norm_projections"]
    for shape in ((1, 1, 256), (8, 256)):
        case = entry.make_inputs(shape, dtype, mx.random.key(shape[0]))
        biases = [mx.random.normal((m.shape[0],), key=mx.random.key(i)).astype(dtype)
                  for i, m in enumerate(case.args[2])]
        with using_backend("cuda"):
            plan = entry.plan(*case.args, **case.kwargs, biases=biases)
            unbiased = entry.plan(*case.args, **case.kwargs)
        atol, rtol = TOLERANCES[dtype]
        expected = apply_plan(plan, "reference")
        assert worst_errors(cuda_emulate.emulate(plan), expected, rtol=rtol, atol=atol)[2], shape
        assert not worst_errors(apply_plan(unbiased, "reference"), expected, rtol=rtol, atol=atol)[2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_the_quantized_matvec_body_gives_the_float32_product(dtype: mx.Dtype) -> None:
    """``quantized_matvec`` at one token row (8 warps a block; 16 past 4096 inputs) and at 3 and 8
    rows, 4 and 8 bits, groups of 32 to 128: exactly the float32 product of its rows and dequantized
    weights, rounded to the dtype once (stock's CPU reference sums 16-bit rows in the dtype, so the
    truth is computed from float32 copies)."""
    entry = LIBRARY["quantized_matvec"]
    for shape, group_size, bits in (((1, 1, 256), 64, 4), ((1, 1, 5120), 32, 4), ((3, 128), 128, 8),
                                    ((8, 256), 32, 8)):
        case = entry.make_inputs(shape, dtype, mx.random.key(shape[-1]), group_size=group_size, bits=bits)
        with using_backend("cuda"):
            plan = entry.plan(*case.args, **case.kwargs)
        x = case.args[0]
        assert plan.threadgroup[0] == (256 if x.size // shape[-1] <= 2 and shape[-1] <= 4096 else 512)
        atol, rtol = TOLERANCES[dtype]
        truth = cuda_emulate.float32_truth(plan)
        assert worst_errors(cuda_emulate.emulate(plan), truth, rtol=rtol, atol=atol)[2], shape


def test_past_max_warps_each_warp_takes_several_weight_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid capped at 16 warps (two blocks) for 96 weight rows: each warp takes six, every output
    written, equal to the float32 product."""
    monkeypatch.setattr(quantized_matvec, "MAX_WARPS", 16)
    entry = LIBRARY["quantized_matvec"]
    case = entry.make_inputs((2, 256), mx.bfloat16, mx.random.key(4))
    with using_backend("cuda"):
        plan = entry.plan(*case.args, **case.kwargs)
    assert plan.grid[0] == 2 * plan.threadgroup[0]
    atol, rtol = TOLERANCES[mx.bfloat16]
    assert worst_errors(cuda_emulate.emulate(plan), cuda_emulate.float32_truth(plan), rtol=rtol, atol=atol)[2]


#: Every library entry with a CUDA body.
CUDA_ENTRIES = sorted(name for name, entry in LIBRARY.items() if entry.kernel.cuda)


@pytest.mark.parametrize("name", CUDA_ENTRIES)
def test_inputs_off_their_vectors_alignment_take_the_narrow_path(name: str) -> None:
    """Every input one element past an aligned address, as a slice of a larger array arrives on a
    GPU: no vector load or store off its alignment (the emulator fails the launch on one, as the
    GPU faults), and the reference's result. float16, where a pair of elements is a 4-byte load."""
    entry = LIBRARY[name]
    err_abs, err_rel, ok = cuda_emulate.compare(name, entry.shapes[0], mx.float16, misaligned=True)
    assert ok, (err_abs, err_rel)


def test_the_emulator_fails_a_misaligned_vector_load() -> None:
    """The check the test above rests on: the fallback the interleaved RoPE once had (a pair of
    elements read as one vector off its alignment) fails the launch instead of reading."""
    entry = LIBRARY["rope_traditional"]
    case = entry.make_inputs((1, 4, 64), mx.float16, mx.random.key(0))
    with using_backend("cuda"):
        plan = entry.plan(*case.args, **case.kwargs)
    broken = plan.kernel.cuda.replace("rope_pairs<T, 1, TRADITIONAL, IN_SCALE, true>",
                                      "rope_pairs<T, 1, TRADITIONAL, IN_SCALE, false>")
    assert broken != plan.kernel.cuda
    kernel = dataclasses.replace(plan.kernel, cuda=broken)
    with pytest.raises(cuda_emulate.EmulationError, match="misaligned vector access"):
        cuda_emulate.emulate(dataclasses.replace(plan, kernel=kernel), misaligned=True)
    assert cuda_emulate.compare("rope_traditional", (1, 4, 64), mx.float16, misaligned=True)[2]


@pytest.mark.parametrize("body, where", [
    ("out[threadIdx.x + 1] = x[threadIdx.x];", "wrote outside its bounds at out"),
    ("out[threadIdx.x] = x[threadIdx.x]; const_cast<float*>(x)[threadIdx.x] = 0.0f;",
     "wrote into it (an input) at x")])
def test_a_write_outside_an_output_fails_the_launch(body: str, where: str) -> None:
    """Canary bytes around every buffer: a body writing one element past its output, or into its
    input, fails the launch where on a GPU it would change another array."""
    kernel = Kernel("gk_trespass", ["x"], ["out"], cuda=body, reference=lambda x: [x])
    plan = Plan(kernel, (mx.arange(4, dtype=mx.float32),), (output_spec((4,), mx.float32),), (4, 1, 1),
                (4, 1, 1))
    with pytest.raises(cuda_emulate.EmulationError, match=re.escape(where)):
        cuda_emulate.emulate(plan)


def test_a_16_bit_kernel_outside_its_references_rounding_is_held_to_the_float32_truth() -> None:
    """``compare``'s second reference: stock's CPU product of float16 rows sums in float16, so the
    kernel (float32 sums, one rounding) is outside the tolerance of that reference but within it of
    the float32 truth, which ``compare`` then judges it by."""
    entry = LIBRARY["quantized_matvec"]
    case = entry.make_inputs((8, 256), mx.float16, mx.random.key(0))
    with using_backend("cuda"):
        plan = entry.plan(*case.args, **case.kwargs)
    out = cuda_emulate.emulate(plan)
    atol, rtol = TOLERANCES[mx.float16]
    assert not worst_errors(out, apply_plan(plan, "reference"), rtol=rtol, atol=atol)[2]
    assert worst_errors(out, cuda_emulate.float32_truth(plan), rtol=rtol, atol=atol)[2]
    assert cuda_emulate.compare("quantized_matvec", (8, 256), mx.float16)[2]
