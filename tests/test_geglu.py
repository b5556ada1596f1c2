"""The GeGLU decoding kernels (``norm_geglu``, ``quantized_norm_geglu``: exact and tanh GELU) and the
Gemma blocks decoding through them. On the CPU the kernels run their references: the plain one
against stock MLX's norm, products and GELU (within two ulps in 16 bits, where stock rounds each
step of its GELU), the quantized one equal to stock's ops. Patched tiny Gemma, Gemma 2 and Gemma 3
models decode each token through one GeGLU launch a block and agree with the stock models."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from model_comparisons import ATOL, PROMPT, RTOL, eval_twins, greedy_logits  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.kernels as gkk  # noqa: E402
from graphkern.debugging.tolerance import worst_errors  # noqa: E402
from graphkern.kernels.ops.gelu import GELU_CUDA, GELU_METAL  # noqa: E402
from graphkern.kernels.ops.projections import (  # noqa: E402
    DECODING_SHAPES,
    NORM_GEGLU,
    NORM_SWIGLU,
    plan_norm_geglu,
    plan_norm_swiglu,
)
from graphkern.kernels.ops.quantized_projections import (  # noqa: E402
    QUANTIZED_NORM_GEGLU,
    QUANTIZED_NORM_SWIGLU,
    plan_quantized_norm_geglu,
    plan_quantized_norm_swiglu,
    random_quantized,
)
from graphkern.launching.context import state  # noqa: E402
from graphkern.models import MODEL_TOLERANCES, kernel_names  # noqa: E402
from graphkern.models.launch_count import decode_launches  # noqa: E402
from graphkern.models.tiny import tiny_model  # noqa: E402

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
ENTRIES = ["norm_geglu", "norm_geglu_approx", "quantized_norm_geglu", "quantized_norm_geglu_approx"]
#: The plain kernels against stock MLX: their GELU runs in float32 on the rounded products, where
#: stock's rounds every step of its formula to the dtype (tests/test_kernels.py's tolerance).
STOCK_TOL = {mx.float32: (2e-5, 2e-5), mx.float16: (4e-3, 2e-3), mx.bfloat16: (3e-2, 2e-2)}
#: Each Gemma's GELU: exact for Gemma, the tanh form for Gemma 2 and 3.
APPROX = {"gemma": False, "gemma2": True, "gemma3": True}


# ----------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", ENTRIES)
def test_the_kernels_give_stock_mlx_at_decoding_shapes(name: str, dtype: mx.Dtype) -> None:
    entry = gkk.LIBRARY[name]
    assert entry.shapes == DECODING_SHAPES
    for i, shape in enumerate(DECODING_SHAPES):
        case = entry.make_inputs(shape, dtype, mx.random.key(i))
        assert case.kwargs["approx"] is name.endswith("approx")
        ours, stock = entry(case), entry.stock_outputs(case)
        assert [(o.shape, o.dtype) for o in ours] == [(s.shape, s.dtype) for s in stock]
        assert ours[1].shape == (*shape[:-1], 80)
        assert mx.array_equal(ours[0], stock[0]).item()  # h = x + residual: the same add
        if name.startswith("quantized"):  # its reference is stock's ops: equal
            assert mx.array_equal(ours[1], stock[1]).item(), (name, shape)
        else:
            atol, rtol = STOCK_TOL[dtype]
            max_abs, max_rel, ok = worst_errors(ours, stock, rtol=rtol, atol=atol)
            assert ok, f"{name} {shape}: max abs err {max_abs}, max rel err {max_rel}"


@pytest.mark.parametrize("quantized", [False, True])
def test_each_gelu_is_the_one_asked_for(quantized: bool) -> None:
    """Without residual or norm weight: one output, ``nn.gelu``'s gating or ``nn.gelu_approx``'s,
    which differ by more than float32's rounding for gates near -2."""
    x = mx.random.normal((2, 128), key=mx.random.key(0))
    normed = mx.fast.rms_norm(x, None, 1e-5)
    if quantized:
        gate, up = (random_quantized(48, 128, mx.float32, mx.random.key(k), 64, 4, gain=2.0) for k in (1, 2))

        def call(approx: bool) -> mx.array:
            return gkk.quantized_norm_geglu(x, None, gate, up, approx=approx)  # type: ignore[no-any-return]

        g, u = (mx.quantized_matmul(normed, *w, transpose=True, group_size=64, bits=4) for w in (gate, up))
    else:
        gate, up = ((2.0 if k == 1 else 1.0) * mx.random.normal((48, 128), key=mx.random.key(k)) / 128**0.5
                    for k in (1, 2))

        def call(approx: bool) -> mx.array:
            return gkk.norm_geglu(x, None, gate, up, approx=approx)  # type: ignore[no-any-return]

        g, u = normed @ gate.T, normed @ up.T
    exact, tanh = call(False), call(True)
    assert exact.shape == tanh.shape == (2, 48)
    assert mx.allclose(exact, nn.gelu(g) * u, atol=1e-6, rtol=1e-5).item()
    assert mx.allclose(tanh, nn.gelu_approx(g) * u, atol=1e-6, rtol=1e-5).item()
    assert not mx.allclose(exact, tanh, atol=1e-5, rtol=0.0).item()


def test_swiglu_and_geglu_share_one_source_with_the_activation_a_template_value() -> None:
    """One body and one header a weight kind, the GELU the gelu kernel's own device functions; the
    plans tell SiLU (0), exact GELU (1) and tanh GELU (2) apart by ``ACT``."""
    for swiglu, geglu in ((NORM_SWIGLU, NORM_GEGLU), (QUANTIZED_NORM_SWIGLU, QUANTIZED_NORM_GEGLU)):
        assert (geglu.cuda, geglu.metal, geglu.header) == (swiglu.cuda, swiglu.metal, swiglu.header)
        assert geglu.name != swiglu.name  # launches and traces name the kernel they ran
        assert GELU_CUDA in geglu.header and GELU_METAL in geglu.header
        assert geglu.header.count("float gelu(float x)") == 2  # once a backend: not copied
    x, w, m = mx.ones((1, 64)), mx.ones((64,)), mx.ones((8, 64)) / 64
    q = random_quantized(8, 64, mx.float32, mx.random.key(0), 64, 4)
    acts = [plan_norm_swiglu(x, w, m, m), plan_norm_geglu(x, w, m, m),
            plan_norm_geglu(x, w, m, m, approx=True), plan_quantized_norm_swiglu(x, w, q, q),
            plan_quantized_norm_geglu(x, w, q, q), plan_quantized_norm_geglu(x, w, q, q, approx=True)]
    assert [plan.template_values["ACT"] for plan in acts] == [0, 1, 2, 0, 1, 2]
    assert [plan.kernel.name for plan in acts[1:3]] == ["gk_norm_geglu"] * 2


def _quantized(n: int = 8) -> Any:
    return random_quantized(n, 64, mx.float32, mx.random.key(n), 64, 4)


@pytest.mark.parametrize("call, op, says", [
    (lambda x, w, m: gkk.norm_geglu(x, w, m, m[:4]), "norm_geglu", "up has shape"),
    (lambda x, w, m: gkk.norm_geglu(x, w, m, m, eps=-1.0), "norm_geglu", "eps must be"),
    (lambda x, w, m: gkk.norm_geglu(x, w, m.astype(mx.float16), m), "norm_geglu", "dtype mismatch"),
    (lambda x, w, m: gkk.norm_geglu(x, w, m.T, m.T, approx=True), "norm_geglu", "expected (N, 64)"),
    (lambda x, w, m: gkk.norm_geglu(mx.ones((9, 64)), w, m, m), "norm_geglu", "1 to 8 rows"),
    (lambda x, w, m: gkk.norm_geglu(x, w, m, m, residual=x[:, :8]), "norm_geglu", "residual is"),
    (lambda x, w, m: gkk.quantized_norm_geglu(x, w, _quantized(), _quantized(), bits=3),
     "quantized_norm_geglu", "bits is 3"),
    (lambda x, w, m: gkk.quantized_norm_geglu(x, w, _quantized(), _quantized(), group_size=16),
     "quantized_norm_geglu", "group_size is 16"),
    (lambda x, w, m: gkk.quantized_norm_geglu(x, w, _quantized(), _quantized(16), approx=True),
     "quantized_norm_geglu", "up has shape"),
    (lambda x, w, m: gkk.quantized_norm_geglu(x, w, _quantized(), m), "quantized_norm_geglu", "triple"),
    (lambda x, w, m: gkk.quantized_norm_geglu(x, w[:32], _quantized(), _quantized()),
     "quantized_norm_geglu", "weight has shape"),
])
def test_bad_arguments_are_refused_naming_the_kernel(call: Any, op: str, says: str) -> None:
    x, w, m = mx.ones((2, 64)), mx.ones((64,)), mx.ones((8, 64))
    with pytest.raises(gk.KernelError) as raised:
        call(x, w, m)
    assert raised.value.operation == op and says in str(raised.value), str(raised.value)
    assert gkk.norm_geglu(x, w, m / 64, m / 64).shape == (2, 8)  # MLX still usable


# ----------------------------------------------------------------------------- patched Gemmas


def _decode(model: nn.Module, steps: int = 6, follow: list[mx.array] | None = None) -> list[mx.array]:
    return greedy_logits(model, steps, follow=follow)


def _agree(patched: nn.Module, stock: nn.Module, dtype: mx.Dtype, steps: int = 6) -> bool:
    """Whether the patched model's logits are within ``_close`` of stock's at each of ``steps``
    greedy steps, both fed stock's tokens (in 16-bit a near tie may part their own choices)."""
    theirs = _decode(stock, steps)
    return _close(_decode(patched, steps, follow=theirs), theirs, dtype)


def _spy_geglu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, bool]]:
    """Each call of ``norm_geglu`` and ``quantized_norm_geglu`` from now on: (name, its ``approx``,
    whether a compiled segment was tracing)."""
    calls: list[tuple[str, bool, bool]] = []
    for name in ("norm_geglu", "quantized_norm_geglu"):
        real = getattr(gkk, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, kwargs.get("approx", False), state.segment_depth > 0))
            return _real(*args, **kwargs)

        monkeypatch.setattr(gkk, name, spy)
    return calls


def _whole_segments(model: nn.Module) -> list[Any]:
    """The segments of ``model``'s blocks that reached past the subtrees they declare, and so read
    the whole block."""
    return [name for layer in model.model.layers for name in layer.segments()._whole]


def _close(ours: list[mx.array], theirs: list[mx.array], dtype: mx.Dtype) -> bool:
    atol, rtol = (ATOL, RTOL) if dtype == mx.float32 else MODEL_TOLERANCES[dtype]
    return all(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=atol, rtol=rtol).item()
               for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("arch", sorted(APPROX))
def test_a_patched_gemma_decodes_through_norm_geglu_as_stock(arch: str, dtype: mx.Dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block's feed-forward (its GELU the model's own) runs as one ``norm_geglu`` launch inside
    the block's compiled segments, which read only the subtrees they declare; logits agree with
    stock's (float32: within rounding; bfloat16: the model tolerance) and so do greedy tokens."""
    stock, patched = eval_twins(arch, dtype)
    calls = _spy_geglu(monkeypatch)
    assert _agree(patched, stock, dtype)
    assert calls and set(calls) == {("norm_geglu", APPROX[arch], True)}
    assert _whole_segments(patched) == []  # nothing read past segment_reads
    if dtype == mx.float32:
        steps = generate_step(PROMPT[0], patched, max_tokens=12)
        assert [t for t, _ in steps] == [t for t, _ in generate_step(PROMPT[0], stock, max_tokens=12)]


def test_a_block_with_post_norms_declares_what_its_leave_reads() -> None:
    _, patched = eval_twins("gemma2")
    block = patched.model.layers[0]
    assert block.segment_reads("leave") == (
        ("self_attn", "o_proj"), ("pre_feedforward_layernorm",), ("post_attention_layernorm",),
        ("post_feedforward_layernorm",), ("mlp",))
    _decode(patched, 2)
    assert patched.model.segments().traced() == [("link", 0)]
    assert not patched.model.segments()._whole and _whole_segments(patched) == []


@pytest.mark.parametrize("arch", sorted(APPROX))
def test_one_launch_a_block_replaces_the_norm_the_products_and_the_gelu(arch: str) -> None:
    """Per block and decoded token, ``norm_geglu`` stands for the feed-forward's ``add_rms_norm``,
    gate and up products, GELU and multiply: four launches fewer than the block with the GeGLU
    kernels left out of ``patch``."""
    _, fused = eval_twins(arch)
    _, apart = eval_twins(arch, kernels=[k for k in kernel_names() if k != "norm_geglu"])
    ours, theirs = decode_launches(fused), decode_launches(apart)
    layers = len(fused.model.layers)
    assert ours.kinds["gk_norm_geglu"] == layers and "gk_gelu" not in ours.kinds, str(ours)
    assert theirs.kinds["gk_gelu"] == layers and "gk_norm_geglu" not in theirs.kinds, str(theirs)
    assert theirs.kinds["gk_add_rms_norm"] - ours.kinds["gk_add_rms_norm"] == layers
    assert theirs.total - ours.total == 4 * layers, (str(ours), str(theirs))


def test_a_float16_gemma3_keeps_its_stock_blocks_and_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """clip_residual's float16 adds are not the kernels': a float16 Gemma 3 keeps stock blocks, and
    one patched in float32 and cast to float16 runs its fused blocks' stock calls, never norm_geglu."""
    calls = _spy_geglu(monkeypatch)
    stock, patched = eval_twins("gemma3", mx.float16)
    assert _agree(patched, stock, mx.float16, 3)
    stock, patched = eval_twins("gemma3")
    for model in (stock, patched):
        model.set_dtype(mx.float16)
    assert _agree(patched, stock, mx.float16, 3)
    assert calls == []
    _decode(eval_twins("gemma3")[1], 1)  # in float32 the same blocks fuse
    assert calls


def test_the_patch_summary_names_the_kernel_a_gemma_block_decodes_with() -> None:
    from graphkern.cli.model import patched_line

    summary = patched_line(gk.patch(tiny_model("gemma2")))
    assert "gk_norm_geglu (or gk_quantized_*) where the block's add_rms_norm and gelu were" in summary
    assert "gk_norm_swiglu (or gk_quantized_*)" in patched_line(gk.patch(tiny_model("llama")))
    assert {"norm_geglu", "quantized_norm_geglu"} <= set(kernel_names())
